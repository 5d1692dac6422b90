package e2e

import (
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/signal"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/scripts/lab"
)

// envNodeInit marks a copy of the test binary that runs as the init of a
// node (PID 1 of the node's PID namespace) instead of the tests; its value
// is the JSON initSpec.
const envNodeInit = "MOUNTMEDIC_E2E_NODE_INIT"

// Main runs the package's tests inside the fault lab's private mount
// namespace (lab.Run), or, in a copy of the test binary started by
// StartNode, the node's init. It removes the image the tests shared
// (AgentImage) before it exits. Call it from TestMain.
func Main(m *testing.M) {
	if spec := os.Getenv(envNodeInit); spec != "" {
		os.Exit(runInit(spec))
	}
	code := lab.Run(m)
	removeAgentImage()
	os.Exit(code)
}

// initSpec is what a node init runs: daemons started in order, each waited
// for (its socket answering) before the next starts.
type initSpec struct {
	Procs []initProc
}

type initProc struct {
	Name string
	Argv []string
	Env  []string
	Log  string
	// Socket, when set, is a unix socket the daemon serves: the next daemon
	// starts once it accepts connections.
	Socket string
}

// runInit is PID 1 of a node: a new PID namespace and a new mount namespace
// (a copy of the test's, so the shared binds of the node's directories stay
// peers of the test's). It makes its mounts shared, as on a systemd host,
// mounts a /proc of its own PID namespace, starts
// the daemons, reaps every orphan (containerd's shims re-parent to it) and
// exits when a daemon exits, which ends the whole namespace: the kernel
// kills every process left in it, containers included.
func runInit(raw string) int {
	logf := func(format string, args ...any) {
		fmt.Fprintf(os.Stderr, "%s node-init: %s\n", time.Now().Format("15:04:05.000"), fmt.Sprintf(format, args...))
	}
	var spec initSpec
	if err := json.Unmarshal([]byte(raw), &spec); err != nil {
		logf("bad %s: %v", envNodeInit, err)
		return 2
	}
	if os.Getpid() != 1 {
		logf("not PID 1 of a new PID namespace (pid %d)", os.Getpid())
		return 2
	}
	// A node booted by systemd has every mount shared; the DaemonSet's
	// HostToContainer mount of /dev needs that. The test's tree is private,
	// so this makes peer groups of the node's own.
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_SHARED, ""); err != nil {
		logf("make / rshared: %v", err)
		return 2
	}
	if err := unix.Mount("proc", "/proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		logf("mount /proc: %v", err)
		return 2
	}
	signal.Ignore(syscall.SIGHUP, syscall.SIGPIPE)
	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM, syscall.SIGINT)

	var mu sync.Mutex
	daemons := map[int]string{}
	exited := make(chan string, len(spec.Procs)+1)
	go reap(func(pid int, ws syscall.WaitStatus) {
		mu.Lock()
		name, ok := daemons[pid]
		mu.Unlock()
		if ok {
			exited <- fmt.Sprintf("%s (pid %d) exited: %s", name, pid, waitText(ws))
		}
	})
	for _, p := range spec.Procs {
		f, err := os.OpenFile(p.Log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
		if err != nil {
			logf("open %s log: %v", p.Name, err)
			return 1
		}
		bin, err := exec.LookPath(p.Argv[0])
		if err != nil {
			logf("%s: %v", p.Name, err)
			return 1
		}
		// The reaper waits for mu before it looks a PID up: a daemon that
		// exits at once is still reported as one.
		mu.Lock()
		proc, err := os.StartProcess(bin, p.Argv, &os.ProcAttr{
			Env:   p.Env,
			Files: []*os.File{nil, f, f},
			Sys:   &syscall.SysProcAttr{Setsid: true},
		})
		if err == nil {
			daemons[proc.Pid] = p.Name
		}
		mu.Unlock()
		f.Close()
		if err != nil {
			logf("start %s: %v", p.Name, err)
			return 1
		}
		logf("started %s (pid %d)", p.Name, proc.Pid)
		if p.Socket != "" {
			if err := waitSocket(p.Socket, time.Minute, exited); err != nil {
				logf("%s: %v", p.Name, err)
				return 1
			}
		}
	}
	select {
	case msg := <-exited:
		logf("%s; ending the node", msg)
		return 1
	case s := <-term:
		logf("%v; ending the node", s)
		return 0
	}
}

// reap waits for every child of PID 1, known or orphaned, and reports each.
func reap(report func(pid int, ws syscall.WaitStatus)) {
	runtime.LockOSThread()
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, 0, nil)
		switch {
		case errors.Is(err, syscall.ECHILD):
			time.Sleep(100 * time.Millisecond)
		case errors.Is(err, syscall.EINTR):
		case err != nil:
			time.Sleep(100 * time.Millisecond)
		default:
			report(pid, ws)
		}
	}
}

func waitText(ws syscall.WaitStatus) string {
	if ws.Signaled() {
		return "killed by " + ws.Signal().String()
	}
	return fmt.Sprintf("status %d", ws.ExitStatus())
}

// waitSocket waits until a unix socket accepts a connection.
func waitSocket(path string, timeout time.Duration, exited <-chan string) error {
	deadline := time.Now().Add(timeout)
	for {
		c, err := net.DialTimeout("unix", path, time.Second)
		if err == nil {
			c.Close()
			return nil
		}
		select {
		case msg := <-exited:
			return errors.New(msg)
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("socket %s did not answer within %s: %w", path, timeout, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
