package csilab

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/mountmedic/mountmedic/scripts/lab"
)

// DriverName is the name the s3driver reports in GetPluginInfo.
const DriverName = "ru.yandex.s3.csi"

// Driver is an s3driver node plugin running as PID 1 of its own PID namespace.
type Driver struct {
	t      testing.TB
	bin    string
	socket string
	nodeID string
	home   string
	env    []string
	pidNS  string
	// unshare is util-linux's unshare(1), with pidNS.
	unshare string

	mu   sync.Mutex
	proc *lab.Process
}

// StartDriver starts s3driver serving CSI on the unix socket socketPath as node
// nodeID. It needs root (a new PID namespace). The driver, and every s3fs it
// started, is killed when the test ends; the mounts it made stay (dead) for the
// test to clean up.
func StartDriver(t testing.TB, socketPath, nodeID string) *Driver {
	t.Helper()
	return StartDriverWith(t, socketPath, nodeID, DriverOptions{})
}

// DriverOptions are StartDriverWith's settings.
type DriverOptions struct {
	// PIDNamespace names (a /proc/<pid>/ns/pid path) the PID namespace the
	// driver's own namespace is made in: a node's, so that the node's
	// hostPID pods see the driver and its FUSE daemons as they see a node
	// plugin's pod on a real node. Empty: the test's.
	PIDNamespace string
}

// StartDriverWith is StartDriver with opts.
func StartDriverWith(t testing.TB, socketPath, nodeID string, opts DriverOptions) *Driver {
	t.Helper()
	if os.Geteuid() != 0 {
		lab.SkipOrFail(t, "the CSI driver lab needs root for a PID namespace (uid %d)", os.Geteuid())
	}
	bin := lab.RequireTool(t, "s3driver")
	s3fs := lab.RequireBinary(t, "s3fs")
	if !filepath.IsAbs(socketPath) {
		t.Fatalf("socket path %q must be absolute", socketPath)
	}
	home := t.TempDir()
	d := &Driver{t: t, bin: bin, socket: socketPath, nodeID: nodeID, home: home, env: driverEnv(home, filepath.Dir(s3fs)), pidNS: opts.PIDNamespace}
	if d.pidNS != "" {
		d.unshare = lab.RequireBinary(t, "unshare")
	}
	t.Cleanup(func() {
		d.mu.Lock()
		p := d.proc
		d.mu.Unlock()
		if p == nil {
			return
		}
		if t.Failed() {
			t.Logf("last lines of s3driver (%s):\n%s", p.Log, p.Tail(20))
		}
		p.Kill()
	})
	if err := d.start(); err != nil {
		t.Fatal(err)
	}
	return d
}

// driverEnv is the environment of the plugin: the caller's, without
// AWS_CA_BUNDLE (s3fs would try to load it), with HOME (s3fs reads
// ~/.passwd-s3fs, which the driver writes) and TMPDIR (glog's files) in a test
// directory and s3fs on PATH.
func driverEnv(home, s3fsDir string) []string {
	var env []string
	path := "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	for _, kv := range os.Environ() {
		switch k, v, _ := strings.Cut(kv, "="); k {
		case "AWS_CA_BUNDLE", "HOME", "TMPDIR":
		case "PATH":
			path = v
		default:
			env = append(env, kv)
		}
	}
	if !strings.Contains(":"+path+":", ":"+s3fsDir+":") {
		path = s3fsDir + ":" + path
	}
	return append(env, "HOME="+home, "TMPDIR="+home, "PATH="+path)
}

func (d *Driver) start() error {
	args := []string{"--endpoint", "unix://" + d.socket, "--nodeid", d.nodeID, "--logtostderr", "--v=4"}
	cmd := exec.Command(d.bin, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID}
	if d.pidNS != "" {
		// A thread that joined another PID namespace for its children
		// cannot clone a new one (copy_pid_ns: EINVAL); its child can.
		// unshare makes the namespace and forks the driver as its PID 1,
		// which dies with it (--kill-child).
		cmd = exec.Command(d.unshare, append([]string{"--pid", "--kill-child", "--", d.bin}, args...)...)
	}
	cmd.Env = d.env
	cmd.Dir = d.home
	p, err := lab.RunProcessIn("s3driver", cmd, filepath.Join(d.home, "s3driver.log"), d.pidNS)
	if err != nil {
		return err
	}
	d.mu.Lock()
	d.proc = p
	d.mu.Unlock()
	if err := p.WaitDial("unix", d.socket, 30*time.Second); err != nil {
		p.Kill()
		return err
	}
	return nil
}

// Kill kills the driver with SIGKILL and waits until it has gone. As PID 1 of its
// namespace its death takes every s3fs it started with it: their mounts answer
// ENOTCONN from then on.
func (d *Driver) Kill() {
	d.mu.Lock()
	p := d.proc
	d.mu.Unlock()
	if p != nil {
		p.Kill()
	}
}

// Restart kills the driver if it runs and starts it again on the same socket, as
// a DaemonSet restarts a crashed node plugin.
func (d *Driver) Restart() error {
	d.Kill()
	if err := d.start(); err != nil {
		return fmt.Errorf("restart s3driver: %w", err)
	}
	return nil
}

// Running reports whether the driver process is alive.
func (d *Driver) Running() bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.proc != nil && !d.proc.Exited()
}

// Socket is the path of the driver's CSI socket.
func (d *Driver) Socket() string { return d.socket }

// Pid is the driver's process id in the caller's PID namespace, or 0.
func (d *Driver) Pid() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.proc == nil {
		return 0
	}
	return d.proc.Pid()
}

// Node returns a CSI node client on a connection that lives until the test ends.
// The connection reconnects, so it survives Restart.
func (d *Driver) Node(t testing.TB) csi.NodeClient {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+d.socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatalf("connect to %s: %v", d.socket, err)
	}
	t.Cleanup(func() { conn.Close() })
	return csi.NewNodeClient(conn)
}
