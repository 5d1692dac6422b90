package lab

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"
)

// readyTimeout bounds the wait for a daemon to report that it is ready. It is
// a safety net against a wedged start, not a timing assertion.
const readyTimeout = time.Minute

const (
	roleFaultFS   = "faultfs"
	roleContainer = "container"
)

// daemon is a copy of the test binary that Main turned into a lab daemon.
type daemon struct {
	cmd     *exec.Cmd
	done    chan struct{} // closed once the process is reaped
	waitErr error         // valid after done is closed
	output  *tailBuffer
}

// startDaemon re-executes the test binary as the daemon role with cfg and
// waits until the daemon reports that it is ready. cloneflags are added to
// the clone of the child (CLONE_NEWNS for a container).
func startDaemon(role string, cfg any, cloneflags uintptr) (*daemon, error) {
	data, err := json.Marshal(cfg)
	if err != nil {
		return nil, fmt.Errorf("encode %s daemon config: %w", role, err)
	}
	r, w, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("make readiness pipe: %w", err)
	}
	defer r.Close()

	// -test.run=^$ keeps a binary whose TestMain forgot lab.Main from
	// running the tests again: it exits at once and the start fails.
	cmd := exec.Command("/proc/self/exe", "-test.run=^$")
	cmd.Args[0] = os.Args[0]
	cmd.Env = append(daemonEnv(), envDaemon+"="+role, envConfig+"="+string(data))
	cmd.ExtraFiles = []*os.File{w} // fd 3
	out := &tailBuffer{max: 64 << 10}
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags: cloneflags,
		Pdeathsig:  syscall.SIGKILL,
	}
	err = StartProcess(cmd)
	w.Close()
	if err != nil {
		return nil, fmt.Errorf("start %s daemon: %w", role, err)
	}
	d := &daemon{cmd: cmd, done: make(chan struct{}), output: out}
	go func() {
		d.waitErr = cmd.Wait()
		close(d.done)
	}()

	if err := r.SetReadDeadline(time.Now().Add(readyTimeout)); err != nil {
		d.kill()
		return nil, fmt.Errorf("set deadline on readiness pipe: %w", err)
	}
	line, err := bufio.NewReader(r).ReadString('\n')
	switch {
	case err == nil && line == "ok\n":
		return d, nil
	case err == nil:
		d.kill()
		return nil, fmt.Errorf("%s daemon failed: %s", role, strings.TrimSpace(strings.TrimPrefix(line, "error: ")))
	default:
		d.kill()
		return nil, fmt.Errorf("%s daemon was not ready (does TestMain call lab.Main?): %w; output: %s", role, err, out.String())
	}
}

// daemonEnv is the environment without the lab's own daemon variables.
func daemonEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, envDaemon+"=") || strings.HasPrefix(kv, envConfig+"=") {
			continue
		}
		env = append(env, kv)
	}
	return env
}

func (d *daemon) pid() int { return d.cmd.Process.Pid }

// kill sends SIGKILL and waits until the process is reaped.
func (d *daemon) kill() {
	_ = d.cmd.Process.Signal(syscall.SIGKILL) // os.ErrProcessDone once reaped
	<-d.done
}

// exited reports whether the process is gone.
func (d *daemon) exited() bool {
	select {
	case <-d.done:
		return true
	default:
		return false
	}
}

// runDaemon runs the daemon a re-executed test binary was started as and
// returns its exit status. The daemon reports readiness on fd 3.
func runDaemon(role string) int {
	ready := &readiness{f: os.NewFile(3, "ready")}
	var err error
	switch role {
	case roleFaultFS:
		var cfg faultFSConfig
		if err = decodeConfig(&cfg); err == nil {
			err = runFaultFSDaemon(cfg, ready)
		}
	case roleContainer:
		var cfg containerConfig
		if err = decodeConfig(&cfg); err == nil {
			err = runContainerDaemon(cfg, ready)
		}
	default:
		err = fmt.Errorf("unknown lab daemon %q in %s", role, envDaemon)
	}
	if err != nil {
		ready.fail(err)
		fmt.Fprintf(os.Stderr, "lab %s daemon: %v\n", role, err)
		return 1
	}
	return 0
}

func decodeConfig(v any) error {
	if err := json.Unmarshal([]byte(os.Getenv(envConfig)), v); err != nil {
		return fmt.Errorf("decode %s: %w", envConfig, err)
	}
	return nil
}

// readiness reports once, on the pipe inherited as fd 3, whether a daemon
// came up.
type readiness struct {
	once sync.Once
	f    *os.File
}

func (r *readiness) ok() {
	r.once.Do(func() {
		_, _ = r.f.WriteString("ok\n")
		r.f.Close()
	})
}

func (r *readiness) fail(err error) {
	r.once.Do(func() {
		msg := strings.ReplaceAll(err.Error(), "\n", " ")
		_, _ = r.f.WriteString("error: " + msg + "\n")
		r.f.Close()
	})
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	max int
	buf []byte
}

func (b *tailBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = append(b.buf, p...)
	if len(b.buf) > b.max {
		b.buf = append([]byte(nil), b.buf[len(b.buf)-b.max:]...)
	}
	return len(p), nil
}

func (b *tailBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return string(b.buf)
}
