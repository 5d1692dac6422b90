package lab

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"sync"
	"syscall"
	"testing"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// EnvRequireRoot names the environment variable that turns every skip of
// SkipOrFail (RequireRoot, RequireBinary, RequireTool, and the test support
// packages built on them) into a test failure. CI sets it to "1" so a run
// can never pass by skipping the root tests.
const EnvRequireRoot = "MOUNTMEDIC_REQUIRE_ROOT"

const (
	// envNamespace marks the re-executed test binary that runs inside the
	// private mount namespace.
	envNamespace = "MOUNTMEDIC_LAB_NAMESPACE"
	// envDaemon names the daemon a re-executed test binary must run
	// instead of the tests.
	envDaemon = "MOUNTMEDIC_LAB_DAEMON"
	// envConfig carries the daemon's configuration as JSON.
	envConfig = "MOUNTMEDIC_LAB_CONFIG"

	fusectlDir = "/sys/fs/fuse/connections"
)

var (
	// inNamespace is true in the test binary that Main re-executed into a
	// private mount namespace.
	inNamespace bool
	// namespaceErr says why the tests do not run in a private namespace.
	namespaceErr = errors.New("TestMain does not call lab.Main")
)

// Main runs the tests of a package inside a private mount namespace. Call it
// from TestMain:
//
//	func TestMain(m *testing.M) { lab.Main(m) }
//
// A re-executed copy of the test binary that the lab started as a daemon
// (FUSE server, container) runs that daemon instead of the tests. As root, the
// first call re-executes the test binary in a new mount namespace whose tree
// is recursively private, so every mount a test makes dies with it, and exits
// with the child's status. Inside the namespace it mounts fusectl and runs the
// tests. Not as root it only runs the tests; root tests then skip.
func Main(m *testing.M) {
	os.Exit(Run(m))
}

// Run is Main without the exit: it returns the exit status, so that a
// TestMain can remove what its package's tests shared before it exits:
//
//	func TestMain(m *testing.M) {
//		code := lab.Run(m)
//		removeShared()
//		os.Exit(code)
//	}
//
// In the process that re-executes the test binary into the namespace, Run
// returns that copy's status without running a test itself.
func Run(m *testing.M) int {
	if role := os.Getenv(envDaemon); role != "" {
		return runDaemon(role)
	}
	if os.Geteuid() != 0 {
		namespaceErr = errors.New("not running as root")
		return m.Run()
	}
	if os.Getenv(envNamespace) == "1" {
		inNamespace = true
		namespaceErr = nil
		if err := mountFusectl(); err != nil {
			fmt.Fprintf(os.Stderr, "lab: %v\n", err)
		}
		return m.Run()
	}
	code, err := reexecInNamespace()
	if err != nil {
		namespaceErr = fmt.Errorf("enter a private mount namespace: %w", err)
		fmt.Fprintf(os.Stderr, "lab: %v; root tests will skip\n", namespaceErr)
		return m.Run()
	}
	return code
}

// reexecInNamespace runs this test binary again in a new mount namespace and
// returns its exit status.
func reexecInNamespace() (int, error) {
	cmd := exec.Command("/proc/self/exe", os.Args[1:]...)
	cmd.Args[0] = os.Args[0]
	cmd.Env = append(os.Environ(), envNamespace+"=1")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	// Unshareflags (not Cloneflags) makes Go mark / recursively private in
	// the child before exec.
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Unshareflags: syscall.CLONE_NEWNS,
		Pdeathsig:    syscall.SIGKILL,
	}
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGQUIT)
	defer signal.Stop(sigs)
	if err := StartProcess(cmd); err != nil {
		return 0, err
	}
	done := make(chan struct{})
	defer close(done)
	go func() {
		for {
			select {
			case s := <-sigs:
				_ = cmd.Process.Signal(s)
			case <-done:
				return
			}
		}
	}()
	err := cmd.Wait()
	var exitErr *exec.ExitError
	switch {
	case err == nil:
		return 0, nil
	case errors.As(err, &exitErr):
		if ws, ok := exitErr.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
			fmt.Fprintf(os.Stderr, "lab: test binary in the private namespace died: %v\n", ws.Signal())
			return 128 + int(ws.Signal()), nil
		}
		return exitErr.ExitCode(), nil
	default:
		return 1, fmt.Errorf("wait for the test binary in the private namespace: %w", err)
	}
}

// mountFusectl mounts the fuse control filesystem, which holds the abort file
// of each FUSE connection, unless it is already mounted.
func mountFusectl() error {
	mounts, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(fusectlDir))
	if err != nil {
		return fmt.Errorf("read mount table: %w", err)
	}
	for _, m := range mounts {
		if m.FSType == "fusectl" {
			return nil
		}
	}
	if err := unix.Mount("none", fusectlDir, "fusectl", 0, ""); err != nil {
		return fmt.Errorf("mount fusectl at %s: %w", fusectlDir, err)
	}
	return nil
}

// spawners start processes, one OS thread per PID namespace ("" is the
// test's own); see StartProcess.
var spawners struct {
	mu   sync.Mutex
	reqs map[string]chan spawnRequest
}

type spawnRequest struct {
	cmd  *exec.Cmd
	errs chan error
}

// StartProcess starts cmd from one OS thread that never exits. Pdeathsig is
// tied to the thread that forked, not to the process: a child started from a
// thread that Go later retires (a goroutine that exits while locked to its
// thread, as a setns helper or a live swap does) would be killed with it.
// Every helper process a test starts with Pdeathsig goes through here (the
// lab's daemons, scripts/kubetest's control plane, scripts/csilab's driver).
func StartProcess(cmd *exec.Cmd) error { return StartProcessIn(cmd, "") }

// StartProcessIn is StartProcess with cmd started in the PID namespace
// pidNS names (a /proc/<pid>/ns/pid path; "" for the test's own), as a
// node's DaemonSet pods and plugins see each other: the thread that forks
// joins that namespace for its children (setns), and lives as long as the
// test binary.
func StartProcessIn(cmd *exec.Cmd, pidNS string) error {
	spawners.mu.Lock()
	if spawners.reqs == nil {
		spawners.reqs = map[string]chan spawnRequest{}
	}
	reqs, ok := spawners.reqs[pidNS]
	if !ok {
		ready := make(chan error, 1)
		reqs = make(chan spawnRequest)
		go func() {
			runtime.LockOSThread() // never unlocked: this thread must live
			if err := joinPIDNamespace(pidNS); err != nil {
				ready <- err
				return // nothing forked from it: the thread may go
			}
			ready <- nil
			for r := range reqs {
				r.errs <- r.cmd.Start()
			}
		}()
		if err := <-ready; err != nil {
			spawners.mu.Unlock()
			return err
		}
		spawners.reqs[pidNS] = reqs
	}
	spawners.mu.Unlock()
	errs := make(chan error, 1)
	reqs <- spawnRequest{cmd: cmd, errs: errs}
	return <-errs
}

// joinPIDNamespace makes the calling thread's children start in the PID
// namespace pidNS names ("": no change).
func joinPIDNamespace(pidNS string) error {
	if pidNS == "" {
		return nil
	}
	fd, err := unix.Open(pidNS, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open PID namespace: %w", err)
	}
	defer unix.Close(fd)
	if err := unix.Setns(fd, unix.CLONE_NEWPID); err != nil {
		return fmt.Errorf("join PID namespace %s for children: %w", pidNS, err)
	}
	return nil
}

// RequireRoot skips the test unless it runs as root, /dev/fuse exists and the
// test binary runs inside the private mount namespace that Main sets up. With
// MOUNTMEDIC_REQUIRE_ROOT=1 it fails the test instead of skipping it.
func RequireRoot(t testing.TB) {
	t.Helper()
	switch {
	case os.Geteuid() != 0:
		SkipOrFail(t, "needs root (uid %d)", os.Geteuid())
	case !inNamespace:
		SkipOrFail(t, "needs the private mount namespace of lab.Main: %v", namespaceErr)
	}
	if _, err := os.Stat("/dev/fuse"); err != nil {
		SkipOrFail(t, "needs /dev/fuse: %v", err)
	}
}

// RequireBinary returns the path of the external program name, looked up in
// PATH and in the sbin directories. When it is missing the test skips, or
// fails under MOUNTMEDIC_REQUIRE_ROOT=1.
func RequireBinary(t testing.TB, name string) string {
	t.Helper()
	if p, err := exec.LookPath(name); err == nil {
		return p
	}
	for _, dir := range []string{"/usr/local/sbin", "/usr/sbin", "/sbin"} {
		p := filepath.Join(dir, name)
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
			return p
		}
	}
	SkipOrFail(t, "needs the program %q in PATH: scripts/deps.sh installs the Debian packages the tests use", name)
	return ""
}

// RequireTool returns the path of name in BinDir, one of the programs that
// scripts/tools.sh builds (etcd, kube-apiserver, kubelet, kubectl, s3driver,
// versitygw...). When it is missing the test skips, or fails under
// MOUNTMEDIC_REQUIRE_ROOT=1.
func RequireTool(t testing.TB, name string) string {
	t.Helper()
	dir := BinDir()
	p := filepath.Join(dir, name)
	if fi, err := os.Stat(p); err != nil || !fi.Mode().IsRegular() || fi.Mode()&0o111 == 0 {
		SkipOrFail(t, "missing %s in %s: build it with scripts/tools.sh %s (or point MOUNTMEDIC_BIN at a directory holding it)", name, dir, name)
	}
	return p
}

// SkipOrFail skips the test with the message format, which says what is
// missing and how to get it, or fails it when MOUNTMEDIC_REQUIRE_ROOT=1.
func SkipOrFail(t testing.TB, format string, args ...any) {
	t.Helper()
	if os.Getenv(EnvRequireRoot) == "1" {
		t.Fatalf(format+" (%s=1 turns this skip into a failure)", append(args, EnvRequireRoot)...)
	}
	t.Skipf(format, args...)
}
