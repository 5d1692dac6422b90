package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/scripts/lab"
)

const (
	// envRunMain makes the test binary run the command (run) instead of
	// the tests: TestMain checks it.
	envRunMain = "MOUNTMEDIC_TEST_RUN_MAIN"
	// envBinary, when set, names a mountmedic binary the process tests
	// run instead of this test binary (to run them against another build).
	envBinary = "MOUNTMEDIC_TEST_BINARY"
	// hangGuard turns a command that never ends into a test failure. It is
	// no timing assertion: every command here ends at once when it works.
	hangGuard = time.Minute
)

// command is mountmedic as a real process: its own signals, exit status and
// memory.
type command struct {
	t      *testing.T
	cmd    *exec.Cmd
	stderr *bufio.Reader
	done   chan error
	lines  []string
}

func startCommand(t *testing.T, args ...string) *command {
	t.Helper()
	bin, env := os.Args[0], append(os.Environ(), envRunMain+"=1")
	if b := os.Getenv(envBinary); b != "" {
		bin = b
	}
	c := &command{t: t, cmd: exec.Command(bin, args...), done: make(chan error, 1)}
	c.cmd.Env = env
	c.cmd.Stdout = io.Discard
	pr, err := c.cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	c.stderr = bufio.NewReader(pr)
	if err := c.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	// Should anything go wrong, never leave the process behind.
	t.Cleanup(func() {
		_ = c.cmd.Process.Kill()
	})
	return c
}

// tail is the end of what the command wrote on stderr, for a failure
// message.
func (c *command) tail() string {
	s := strings.Join(c.lines, "")
	if len(s) > 2000 {
		s = "..." + s[len(s)-2000:]
	}
	return s
}

// waitStderr reads stderr until a line holds want, and fails the test if the
// process ends or stays silent past the hang guard first.
func (c *command) waitStderr(want string) {
	c.t.Helper()
	found := make(chan bool, 1)
	go func() {
		for {
			line, err := c.stderr.ReadString('\n')
			c.lines = append(c.lines, line)
			if strings.Contains(line, want) {
				found <- true
				return
			}
			if err != nil {
				found <- false
				return
			}
		}
	}()
	select {
	case ok := <-found:
		if !ok {
			c.t.Fatalf("%v: stderr ended without %q: %q", c.cmd.Args[1:], want, c.tail())
		}
	case <-time.After(hangGuard):
		c.t.Fatalf("%v: no %q on stderr within %s", c.cmd.Args[1:], want, hangGuard)
	}
}

// wait returns the exit status, failing the test if the process does not
// end within the hang guard.
func (c *command) wait() int {
	c.t.Helper()
	go func() {
		_, _ = io.Copy(io.Discard, c.stderr)
		c.done <- c.cmd.Wait()
	}()
	select {
	case err := <-c.done:
		var ee *exec.ExitError
		if err != nil && !errors.As(err, &ee) {
			c.t.Fatal(err)
		}
		return c.cmd.ProcessState.ExitCode()
	case <-time.After(hangGuard):
		c.t.Fatalf("%v never exited", c.cmd.Args[1:])
		return -1
	}
}

// TestScanRefusesFIFOAndDevZero: a FIFO blocked scan for good and /dev/zero
// grew it until the kernel killed it (23 GB). Each now ends at once with
// status 1 and an error naming the file and what to give instead. The
// process runs under a 2 GiB address-space limit so that a build that reads
// /dev/zero fails here instead of taking the machine's memory.
func TestScanRefusesFIFOAndDevZero(t *testing.T) {
	fifo := filepath.Join(t.TempDir(), "table")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	for name, path := range map[string]string{"fifo": fifo, "dev zero": "/dev/zero"} {
		t.Run(name, func(t *testing.T) {
			c := startCommand(t, "scan", "--mountinfo", path)
			lim := &unix.Rlimit{Cur: 2 << 30, Max: 2 << 30}
			if err := unix.Prlimit(c.cmd.Process.Pid, unix.RLIMIT_AS, lim, nil); err != nil {
				t.Fatal(err)
			}
			c.waitStderr(path)
			if code := c.wait(); code != exitError {
				t.Errorf("scan --mountinfo %s exit status = %d, want %d (stderr %q)", path, code, exitError, c.tail())
			}
			if got := c.tail(); !strings.Contains(got, "regular file") {
				t.Errorf("scan --mountinfo %s stderr = %q, want it to ask for a regular file", path, got)
			}
		})
	}
}

// TestScanStopsOnSignalWhileReading: scan of a table on a FUSE filesystem
// whose daemon hangs (a slow table at its worst: the read cannot be
// cancelled) ends on SIGINT and SIGTERM with the shell's status for each,
// instead of swallowing the signal and waiting for the file. The thread
// stuck in the kernel keeps the process from being reaped until the
// daemon answers; the test lets it answer once scan has said it stopped.
func TestScanStopsOnSignalWhileReading(t *testing.T) {
	lab.RequireRoot(t)
	for name, tc := range map[string]struct {
		sig  syscall.Signal
		code int
	}{"SIGINT": {syscall.SIGINT, 130}, "SIGTERM": {syscall.SIGTERM, 143}} {
		t.Run(name, func(t *testing.T) {
			// The table is in place before the mount, so that every FUSE
			// request waitFUSERequest sees is scan's (a close of the test's
			// own write sends one that could still wait there).
			backing := t.TempDir()
			data, err := os.ReadFile(filepath.Join("..", "..", "probe", "testdata", "s3fs-two-pods.mountinfo"))
			if err != nil {
				t.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(backing, "node.mountinfo"), data, 0o644); err != nil {
				t.Fatal(err)
			}
			mnt := filepath.Join(t.TempDir(), "slow")
			fs := lab.StartFaultFS(t, mnt, lab.WithBackingDir(backing))
			table := filepath.Join(mnt, "node.mountinfo")
			fs.Hang()
			released := false
			defer func() {
				if !released {
					fs.Release()
				}
			}()
			c := startCommand(t, "scan", "--mountinfo", table)
			waitFUSERequest(t, fs.Conn())
			waitSignalCaught(t, c.cmd.Process.Pid, tc.sig)
			if err := c.cmd.Process.Signal(tc.sig); err != nil {
				t.Fatal(err)
			}
			c.waitStderr("stopped by " + name)
			fs.Release()
			released = true
			if code := c.wait(); code != tc.code {
				t.Errorf("scan exit status after %s = %d, want %d (stderr %q)", name, code, tc.code, c.tail())
			}
		})
	}
}

// TestScanStopsOnSignalWhileProbing: a live scan probing a hung FUSE volume
// with a long --timeout ends on SIGTERM with status 143 and no report,
// rather than printing a report of probes the signal cut short.
func TestScanStopsOnSignalWhileProbing(t *testing.T) {
	lab.RequireRoot(t)
	k := lab.NewKubelet(t, filepath.Join(t.TempDir(), "kubelet"))
	const driver = "lab.csi.mountmedic.io"
	staging := k.StagingPath(driver, "hung")
	fs := lab.StartFaultFS(t, staging)
	k.Publish("pod-hung", "pv-hung", driver, "hung", staging, false)
	fs.Hang()
	defer fs.Abort()
	c := startCommand(t, "scan", "--kubelet-root", k.Root(), "--timeout", "10m")
	waitFUSERequest(t, fs.Conn())
	waitSignalCaught(t, c.cmd.Process.Pid, syscall.SIGTERM)
	if err := c.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	c.waitStderr("stopped by SIGTERM")
	fs.Abort()
	if code := c.wait(); code != 143 {
		t.Errorf("scan exit status after SIGTERM = %d, want 143 (stderr %q)", code, c.tail())
	}
}

// waitSignalCaught waits until process pid catches sig (its SigCgt mask in
// /proc/<pid>/status): the Go runtime catches every signal from its start,
// so a signal sent earlier (between the fork and the runtime's start) would
// meet the default action and kill the process silently.
func waitSignalCaught(t *testing.T, pid int, sig syscall.Signal) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	defer cancel()
	for ctx.Err() == nil {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
		if err != nil {
			t.Fatalf("status of %d: %v", pid, err)
		}
		for _, line := range strings.Split(string(b), "\n") {
			if hex, ok := strings.CutPrefix(line, "SigCgt:"); ok {
				if mask, err := strconv.ParseUint(strings.TrimSpace(hex), 16, 64); err == nil && mask&(1<<(uint(sig)-1)) != 0 {
					return
				}
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("process %d never caught %s", pid, sig)
}

// waitFUSERequest waits until a request waits on FUSE connection conn: the
// command is blocked in the filesystem.
func waitFUSERequest(t *testing.T, conn uint32) {
	t.Helper()
	p := filepath.Join("/sys/fs/fuse/connections", strconv.FormatUint(uint64(conn), 10), "waiting")
	ctx, cancel := context.WithTimeout(context.Background(), hangGuard)
	defer cancel()
	for ctx.Err() == nil {
		if b, err := os.ReadFile(p); err == nil && strings.TrimSpace(string(b)) != "0" {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("no request reached FUSE connection %d (%s)", conn, p)
}
