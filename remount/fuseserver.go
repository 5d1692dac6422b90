package remount

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
)

// opKillServer stops, then kills, a process that served a FUSE connection
// the repair aborted.
const opKillServer Op = "kill-fuse-server"

// Bounds of the kill around an abort. Both are waits on the kernel, not on
// the daemon's good will: a process stops or dies at its next return to
// user space, which a thread blocked in an uninterruptible call delays.
const (
	// serverStopWait bounds the wait for every thread of a server to stop
	// before the abort is written.
	serverStopWait = 500 * time.Millisecond
	// serverExitWait bounds the wait for a killed server to exit (and
	// close its descriptors) before the repair goes on.
	serverExitWait = 2 * time.Second
)

// fuseServer is a process found to serve one FUSE connection: it holds a
// descriptor of /dev/fuse attached to that connection while the
// connection is up.
type fuseServer struct {
	pid   int
	comm  string
	pidfd int
	fds   []int
}

func (s *fuseServer) String() string {
	fds := make([]string, len(s.fds))
	for i, fd := range s.fds {
		fds[i] = strconv.Itoa(fd)
	}
	return fmt.Sprintf("pid %d (%s), /dev/fuse descriptors %s", s.pid, s.comm, strings.Join(fds, ","))
}

func (s *fuseServer) close() {
	if s.pidfd >= 0 {
		unix.Close(s.pidfd)
		s.pidfd = -1
	}
}

func closeServers(ss []*fuseServer) {
	for _, s := range ss {
		s.close()
	}
}

// findServers finds the processes that serve FUSE connection conn, which
// the caller keeps alive (it holds a descriptor of one of its mounts), so
// no other filesystem can hold the number conn while it looks.
//
// The kernel names a /dev/fuse descriptor's connection in its fdinfo
// ("fuse_connection:", the connection's device number, fs/fuse/dev.c
// fuse_dev_show_fdinfo, Linux 6.16 and later). A number is handed out
// again once its filesystem is gone, and a daemon of that earlier
// connection can still hold its descriptor: that connection is aborted
// (its superblock's end aborted it). So a process serves conn only when a
// descriptor it holds, taken into our process by pidfd_getfd(2) and read
// through our own fdinfo, names conn and polls without POLLERR (the
// connection is up; fs/fuse/dev.c fuse_dev_poll). The process is held by
// a pidfd from then on, so a PID reused meanwhile is never signalled.
//
// A process is left alone, with an action saying why, when the agent
// cannot tell for certain: pidfd_getfd refused (an LSM, a Yama
// ptrace_scope of 3), or when it also serves another connection that is
// up (a daemon of several volumes), or when it is PID 1 or the agent. On
// a kernel without the fdinfo line no process is found.
func (u *Unmounter) findServers(ctx context.Context, conn uint32) ([]*fuseServer, []Action) {
	procDir := u.procDir()
	idx := u.Servers
	if idx == nil {
		idx = &ServerIndex{}
	}
	holders, err := idx.holders(ctx, procDir)
	if err != nil {
		return nil, []Action{{Op: opSkip, Path: procDir, DryRun: u.DryRun,
			Err: fmt.Errorf("find the processes serving fuse connection %d: %w", conn, err)}}
	}
	self := os.Getpid()
	var servers []*fuseServer
	var notes []Action
	for _, h := range holders {
		if ctx.Err() != nil {
			break
		}
		pid, fds := h.pid, h.fds
		if !slices.ContainsFunc(fds, func(f fuseFD) bool { return f.conn == conn }) {
			continue
		}
		comm := readComm(filepath.Join(procDir, strconv.Itoa(pid)))
		// Left alone is not a failure of the repair: the action says why.
		leave := func(why string, err error) {
			if err != nil {
				why += ": " + err.Error()
			}
			notes = append(notes, Action{Op: opSkip, Path: "pid " + strconv.Itoa(pid), DryRun: u.DryRun,
				Detail: fmt.Sprintf("%s holds /dev/fuse of connection %d: %s; left alone", comm, conn, why)})
		}
		if pid == 1 || pid == self {
			leave("it is PID 1 or the agent itself", nil)
			continue
		}
		// The shared scan may be up to serverScanTTL old: the process's
		// descriptors are listed again, so that a connection it opened
		// since (a volume re-staged through it) keeps it alive.
		if now := fuseFDs(filepath.Join(procDir, strconv.Itoa(pid))); len(now) > 0 {
			fds = now
		}
		s, why, err := verifyServer(pid, comm, fds, conn)
		switch {
		case s != nil:
			servers = append(servers, s)
		case why != "":
			leave(why, err)
		}
	}
	return servers, notes
}

// ServerIndex is one scan of the processes' /dev/fuse descriptors, shared
// by the aborts of a burst: reading every descriptor link of every process
// costs about 20 ms per thousand descriptors, and a thousand volumes hung
// at once would read them a thousand times. A scan younger than
// serverScanTTL is reused; each process it names is verified anew through
// its pidfd before anything is signalled, so an old scan can only miss a
// server (which is then left alone), never name a wrong one. The zero
// value is ready to use.
type ServerIndex struct {
	mu   sync.Mutex
	at   time.Time
	scan []fuseHolder
}

// serverScanTTL is how long a scan of the /dev/fuse holders is reused.
const serverScanTTL = time.Second

// fuseHolder is a process and its /dev/fuse descriptors.
type fuseHolder struct {
	pid int
	fds []fuseFD
}

// holders returns the processes holding /dev/fuse descriptors, scanning
// procDir again when the last scan is older than serverScanTTL.
func (x *ServerIndex) holders(ctx context.Context, procDir string) ([]fuseHolder, error) {
	x.mu.Lock()
	defer x.mu.Unlock()
	if !x.at.IsZero() && time.Since(x.at) < serverScanTTL {
		return x.scan, nil
	}
	entries, err := os.ReadDir(procDir)
	if err != nil {
		return nil, err
	}
	var out []fuseHolder
	for _, e := range entries {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid <= 0 {
			continue
		}
		if fds := fuseFDs(filepath.Join(procDir, e.Name())); len(fds) > 0 {
			out = append(out, fuseHolder{pid: pid, fds: fds})
		}
	}
	x.at, x.scan = time.Now(), out
	return out, nil
}

// verifyServer checks, through a pidfd, which of pid's /dev/fuse
// descriptors are attached to conn with the connection up: the server
// (nil when none is), or why the process is left alone.
func verifyServer(pid int, comm string, fds []fuseFD, conn uint32) (*fuseServer, string, error) {
	pidfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return nil, "", nil // exited
	}
	s := &fuseServer{pid: pid, comm: comm, pidfd: pidfd}
	var others []string
	for _, f := range fds {
		got, up, err := probeFD(pidfd, f.fd)
		switch {
		case errors.Is(err, unix.EBADF):
			continue // closed since
		case err != nil:
			s.close()
			return nil, "its descriptors cannot be read (pidfd_getfd)", err
		case got == conn && up:
			s.fds = append(s.fds, f.fd)
		case got != conn && up:
			others = append(others, strconv.FormatUint(uint64(got), 10))
		}
	}
	switch {
	case len(s.fds) == 0:
		s.close()
		return nil, "", nil // an earlier connection that had the number
	case len(others) > 0:
		s.close()
		return nil, "it also serves fuse connection(s) " + strings.Join(others, ",") + ", which are up", nil
	}
	return s, "", nil
}

// probeFD takes descriptor fd of the process into ours and reads its
// connection (our own fdinfo of the copy) and whether it is up (poll
// without POLLERR). The copy is closed before returning.
func probeFD(pidfd, fd int) (conn uint32, up bool, err error) {
	dup, err := unix.PidfdGetfd(pidfd, fd, 0)
	if err != nil {
		return 0, false, err
	}
	defer unix.Close(dup)
	b, err := os.ReadFile("/proc/thread-self/fdinfo/" + strconv.Itoa(dup))
	if err != nil {
		return 0, false, err
	}
	c, ok := fdinfoConn(b)
	if !ok {
		return 0, false, unix.EBADF // not /dev/fuse any more
	}
	pfd := []unix.PollFd{{Fd: int32(dup), Events: unix.POLLIN}}
	if _, err := unix.Poll(pfd, 0); err != nil {
		return 0, false, fmt.Errorf("poll /dev/fuse: %w", err)
	}
	return c, pfd[0].Revents&unix.POLLERR == 0, nil
}

// fuseFD is a /dev/fuse descriptor of a process and the connection its
// fdinfo names.
type fuseFD struct {
	fd   int
	conn uint32
}

// fuseFDs lists the process's descriptors whose fdinfo names a FUSE
// connection. Only links and fdinfo are read (VFS data): nothing is
// stat'ed or opened, so a descriptor on a hung filesystem costs nothing.
// A descriptor is looked at only when its link ends in /fuse (the device
// node's usual name).
func fuseFDs(proc string) []fuseFD {
	d, err := os.Open(filepath.Join(proc, "fd"))
	if err != nil {
		return nil
	}
	defer d.Close()
	var out []fuseFD
	for {
		names, err := d.Readdirnames(1024)
		for _, n := range names {
			link, err := os.Readlink(filepath.Join(proc, "fd", n))
			if err != nil || !strings.HasSuffix(link, "/fuse") {
				continue
			}
			fd, err := strconv.Atoi(n)
			if err != nil {
				continue
			}
			b, err := os.ReadFile(filepath.Join(proc, "fdinfo", n))
			if err != nil {
				continue
			}
			if c, ok := fdinfoConn(b); ok {
				out = append(out, fuseFD{fd: fd, conn: c})
			}
		}
		if err != nil {
			return out
		}
	}
}

// fdinfoConn reads the "fuse_connection:" line of a /dev/fuse fdinfo.
func fdinfoConn(b []byte) (uint32, bool) {
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok || k != "fuse_connection" {
			continue
		}
		n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 32)
		return uint32(n), err == nil
	}
	return 0, false
}

// stopServers sends SIGSTOP to each server and waits, within
// serverStopWait, until every thread of each shows stopped: from then on
// none runs code of its own, so the abort cannot wake it into its exit
// path (which unmounts its mountpoint by path). A server whose thread is
// blocked in the kernel stops when the call returns, before it runs
// anything.
func stopServers(ctx context.Context, procDir string, ss []*fuseServer) {
	for _, s := range ss {
		_ = unix.PidfdSendSignal(s.pidfd, unix.SIGSTOP, nil, 0)
	}
	deadline := time.Now().Add(serverStopWait)
	for _, s := range ss {
		for !allStopped(procDir, s.pid) && time.Now().Before(deadline) && ctx.Err() == nil {
			time.Sleep(time.Millisecond)
		}
	}
}

// allStopped reports whether every thread of pid is stopped (T or t in
// /proc/<pid>/task/*/stat), or the process is gone.
func allStopped(procDir string, pid int) bool {
	dir := filepath.Join(procDir, strconv.Itoa(pid), "task")
	tasks, err := os.ReadDir(dir)
	if err != nil {
		return true
	}
	for _, t := range tasks {
		b, err := os.ReadFile(filepath.Join(dir, t.Name(), "stat"))
		if err != nil {
			continue
		}
		i := bytes.LastIndexByte(b, ')')
		if i < 0 || i+2 >= len(b) {
			continue
		}
		if st := b[i+2]; st != 'T' && st != 't' && st != 'Z' && st != 'X' {
			return false
		}
	}
	return true
}

// killServers sends SIGKILL to each server and waits, within
// serverExitWait, for it to exit; it returns one action per server.
// SIGKILL ends a stopped process too, and a process with SIGKILL pending
// never returns to user space: whatever its state, it can no longer act.
func killServers(ctx context.Context, ss []*fuseServer, conn uint32) []Action {
	var out []Action
	for _, s := range ss {
		a := Action{Op: opKillServer, Path: "pid " + strconv.Itoa(s.pid),
			Detail: fmt.Sprintf("%s served fuse connection %d, aborted: killed", s, conn)}
		start := time.Now()
		if err := unix.PidfdSendSignal(s.pidfd, unix.SIGKILL, nil, 0); err != nil && !errors.Is(err, unix.ESRCH) {
			a.Err = fmt.Errorf("kill pid %d (%s), which served fuse connection %d: %w", s.pid, s.comm, conn, err)
			out = append(out, a)
			continue
		}
		if exited(ctx, s.pidfd, serverExitWait) {
			a.Detail += ", exited"
		} else {
			a.Detail += fmt.Sprintf(", not exited within %s (a call of it is blocked in the kernel; it dies when the call returns, running nothing more)", serverExitWait)
		}
		a.Took = time.Since(start)
		out = append(out, a)
	}
	return out
}

// continueServers lets stopped servers go on: the abort they were stopped
// for did not happen.
func continueServers(ss []*fuseServer) {
	for _, s := range ss {
		_ = unix.PidfdSendSignal(s.pidfd, unix.SIGCONT, nil, 0)
	}
}

// exited waits up to d for the process of pidfd to exit (a pidfd polls
// readable once it has; a zombie counts).
func exited(ctx context.Context, pidfd int, d time.Duration) bool {
	deadline := time.Now().Add(d)
	for {
		wait := min(time.Until(deadline), 100*time.Millisecond)
		if wait <= 0 || ctx.Err() != nil {
			wait = 0
		}
		pfd := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
		n, err := unix.Poll(pfd, int(wait.Milliseconds()))
		if err == nil && n > 0 {
			return true
		}
		if (err != nil && !errors.Is(err, unix.EINTR)) || wait == 0 {
			return false
		}
	}
}

// logServers logs the servers found for conn and those left alone.
func logServers(logger klog.Logger, conn uint32, ss []*fuseServer, notes []Action) {
	for _, s := range ss {
		logger.V(2).Info("Found the process serving a hung FUSE connection", "conn", conn, "pid", s.pid, "comm", s.comm)
	}
	for _, n := range notes {
		logger.Info("Left a process holding a hung FUSE connection alone", "conn", conn, "process", n.Path, "why", n.Detail)
	}
}
