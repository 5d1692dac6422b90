package lab

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"
)

// BinDir is where the external programs the tests run are (etcd,
// kube-apiserver, s3driver, versitygw...): $MOUNTMEDIC_BIN, else
// $MOUNTMEDIC_CACHE/bin/current (default /var/cache/mountmedic/bin/current),
// where scripts/tools.sh builds them.
func BinDir() string {
	if dir := os.Getenv("MOUNTMEDIC_BIN"); dir != "" {
		return dir
	}
	cache := os.Getenv("MOUNTMEDIC_CACHE")
	if cache == "" {
		cache = "/var/cache/mountmedic"
	}
	return filepath.Join(cache, "bin", "current")
}

// Process is a helper program a test runs (a control-plane component, a
// CSI driver, an S3 server): its output goes to a log file, it is killed
// with the test binary (Pdeathsig, started through StartProcess), and its
// log's tail explains a failure.
type Process struct {
	// Name names the program in errors.
	Name string
	// Log is the file its output is appended to.
	Log  string
	cmd  *exec.Cmd
	done chan struct{} // closed once the process has been waited for
	err  error         // valid once done is closed
}

// RunProcess starts cmd, appending its output to logPath. It sets Pdeathsig
// (keeping the caller's other SysProcAttr settings, such as Setpgid or
// Cloneflags) and starts it from the spawner thread.
func RunProcess(name string, cmd *exec.Cmd, logPath string) (*Process, error) {
	return RunProcessIn(name, cmd, logPath, "")
}

// RunProcessIn is RunProcess in the PID namespace pidNS names
// (StartProcessIn). There it gets no Pdeathsig: its parent is outside its
// namespace (getppid says 0), which Go's fork takes for a parent already
// dead, and it would kill itself at once. It dies with that namespace's
// init instead, which the kernel takes every process of the namespace
// with.
func RunProcessIn(name string, cmd *exec.Cmd, logPath, pidNS string) (*Process, error) {
	f, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("open %s log: %w", name, err)
	}
	cmd.Stdout, cmd.Stderr = f, f
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	if pidNS == "" {
		cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
	}
	if err := StartProcessIn(cmd, pidNS); err != nil {
		f.Close()
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	p := &Process{Name: name, Log: logPath, cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		f.Close()
		close(p.done)
	}()
	return p, nil
}

// Pid is the process ID.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Exited reports whether the process has ended.
func (p *Process) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Kill sends SIGKILL (to its process group when it leads one) and waits
// until it is reaped.
func (p *Process) Kill() {
	if !p.Exited() {
		p.signal(syscall.SIGKILL)
	}
	<-p.done
}

// Stop sends SIGTERM, then SIGKILL after grace, and waits; with a process
// group, children that outlived their leader are killed too. It reports
// whether SIGTERM was not enough.
func (p *Process) Stop(grace time.Duration) (killed bool) {
	if !p.Exited() {
		p.signal(syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(grace):
			killed = true
			p.signal(syscall.SIGKILL)
			<-p.done
		}
	}
	if p.group() {
		_ = syscall.Kill(-p.Pid(), syscall.SIGKILL)
	}
	return killed
}

func (p *Process) group() bool {
	return p.cmd.SysProcAttr != nil && p.cmd.SysProcAttr.Setpgid
}

func (p *Process) signal(sig syscall.Signal) {
	if p.group() {
		_ = syscall.Kill(-p.Pid(), sig)
		return
	}
	_ = p.cmd.Process.Signal(sig)
}

// Tail returns the last n lines of the log.
func (p *Process) Tail(n int) string { return Tail(p.Log, n) }

// Tail returns the last n lines of the log file at path, or why it could
// not be read: for a failure message, also for logs of processes that a
// test did not start through RunProcess.
func Tail(path string, n int) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("read %s: %v", path, err)
	}
	lines := bytes.Split(bytes.TrimRight(data, "\n"), []byte("\n"))
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return string(bytes.Join(lines, []byte("\n")))
}

// ExitError says how the process ended, with the end of its log; call it
// once Exited.
func (p *Process) ExitError() error {
	err := p.err
	if err == nil {
		err = errors.New("exited with status 0")
	}
	return fmt.Errorf("%s exited early: %w\n%s", p.Name, err, p.Tail(30))
}

// WaitDial waits until network/address accepts a connection, the process
// exits, or timeout passes.
func (p *Process) WaitDial(network, address string, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		if p.Exited() {
			return p.ExitError()
		}
		c, err := net.DialTimeout(network, address, time.Second)
		if err == nil {
			c.Close()
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("wait for %s on %s: %w\n%s", p.Name, address, err, p.Tail(30))
		}
		time.Sleep(50 * time.Millisecond)
	}
}
