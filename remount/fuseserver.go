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

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// opKillServer kills a process that served a FUSE connection the repair
// aborts.
const opKillServer Op = "kill-fuse-server"

// serverExitWait bounds the wait for killed servers to exit (and close
// their descriptors) before the repair goes on. It is a wait on the
// kernel, not on the daemon's good will: a process dies at its next
// return to user space, which a thread blocked in an uninterruptible call
// delays.
const serverExitWait = 2 * time.Second

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
// ptrace_scope of 3), when it also serves another connection that is up
// (a daemon of several volumes), when it is PID 1 or the agent, or when
// it is not where the volume's daemon lives (killable). On a kernel
// without the fdinfo line no process is found.
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
			// Checked while the pidfd holds the process: a PID reused
			// since cannot answer for it.
			if why := u.killable(filepath.Join(procDir, strconv.Itoa(pid))); why != "" {
				s.close()
				leave(why, nil)
				continue
			}
			servers = append(servers, s)
		case why != "":
			leave(why, err)
		}
	}
	return servers, notes
}

// killable says why the process at proc, found serving the aborted
// connection, is not the volume's daemon for certain ("" when it is):
// holding the connection's descriptor proves it can serve the volume,
// not that it is the daemon. A process of a pod that uses the volume
// (its cgroup names the pod) is the volume's user: a hostile user who
// was handed a copy of the descriptor, or an application-side daemon
// whose restart is the pod's. And the driver catalogue's DaemonHome says
// where the daemon lives: a daemon it puts in the application pod is
// left alone, and so is a holder in a pod when it puts the daemon on the
// host outside any pod.
func (u *Unmounter) killable(proc string) string {
	if u.Home == kubelet.DaemonAppSidecar {
		return "the driver catalogue puts this volume's daemon in the application pod (" + u.Home.String() + "): restarting that pod's container is its repair"
	}
	data, err := readProcHead(filepath.Join(proc, "cgroup"), maxCgroupFile+1)
	if err != nil || len(data) > maxCgroupFile {
		return "its cgroup cannot be read"
	}
	uid, _, inPod := podOfCgroup(data)
	switch {
	case inPod && slices.Contains(u.Users, uid):
		return "it runs in pod " + uid + ", which uses the volume: a user of the volume, not its daemon"
	case inPod && u.Home == kubelet.DaemonHostService:
		return "it runs in pod " + uid + ", but the driver catalogue puts this volume's daemon on the host, outside any pod"
	}
	return ""
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

// signalServers sends SIGKILL to each server, through its pidfd, and
// returns one action per server (its Err set when the kill was refused).
// A process with SIGKILL pending never returns to user space: whatever it
// is doing, it runs none of its own code again, so the abort that follows
// cannot wake it into its exit path (which unmounts its mountpoint by
// path). A server thread blocked in the kernel dies when its call
// returns.
func signalServers(ss []*fuseServer, conn uint32) []Action {
	out := make([]Action, 0, len(ss))
	for _, s := range ss {
		a := Action{Op: opKillServer, Path: "pid " + strconv.Itoa(s.pid),
			Detail: fmt.Sprintf("%s served fuse connection %d, aborted: killed", s, conn)}
		if err := unix.PidfdSendSignal(s.pidfd, unix.SIGKILL, nil, 0); err != nil && !errors.Is(err, unix.ESRCH) {
			a.Err = fmt.Errorf("kill pid %d (%s), which served fuse connection %d: %w", s.pid, s.comm, conn, err)
		}
		out = append(out, a)
	}
	return out
}

// waitServers waits, within serverExitWait in all, for each server killed
// (kills[i].Err nil) to exit and close its descriptors, and says so in its
// action.
func waitServers(ctx context.Context, ss []*fuseServer, kills []Action) {
	start := time.Now()
	deadline := start.Add(serverExitWait)
	for i, s := range ss {
		if kills[i].Err != nil {
			continue
		}
		if exited(ctx, s.pidfd, time.Until(deadline)) {
			kills[i].Detail += ", exited"
		} else {
			kills[i].Detail += fmt.Sprintf(", not exited within %s (a call of it is blocked in the kernel; it dies when the call returns, running nothing more)", serverExitWait)
		}
		kills[i].Took = time.Since(start)
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

// fdinfoNamesConn reports whether the running kernel names a /dev/fuse
// descriptor's connection in its fdinfo (Linux 6.16 and later), and the
// kernel's release.
var fdinfoNamesConn = sync.OnceValues(func() (bool, string) {
	var u unix.Utsname
	if err := unix.Uname(&u); err != nil {
		return true, "unknown"
	}
	release := unix.ByteSliceToString(u.Release[:])
	return kernelAtLeast(release, 6, 16), release
})

// kernelAtLeast reports whether a kernel release ("6.18.4-foo") is at
// least major.minor; an unreadable release counts as recent.
func kernelAtLeast(release string, major, minor int) bool {
	ma, rest, _ := strings.Cut(release, ".")
	mi, _, _ := strings.Cut(rest, ".")
	mi = strings.TrimRightFunc(mi, func(r rune) bool { return r < '0' || r > '9' })
	x, err1 := strconv.Atoi(ma)
	y, err2 := strconv.Atoi(mi)
	if err1 != nil || err2 != nil {
		return true
	}
	return x > major || x == major && y >= minor
}

// noServerReason says why no process was found serving a connection that
// is up: the kernel does not say which descriptor serves which connection,
// or the daemon is out of the agent's sight.
func noServerReason() string {
	if ok, release := fdinfoNamesConn(); !ok {
		return "kernel " + release + " does not name the connection in /dev/fuse fdinfo; 6.16 and later do"
	}
	return "its daemon runs in a PID namespace the agent does not see (the agent needs the host's: hostPID)"
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
