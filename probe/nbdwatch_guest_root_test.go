//go:build guest

package probe

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/scripts/csilab"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// envNBDMapper makes the test binary an rbd-nbd-shaped mapper (runMapper)
// instead of running tests.
const envNBDMapper = "MOUNTMEDIC_TEST_NBD_MAPPER"

func init() {
	if cfg := os.Getenv(envNBDMapper); cfg != "" {
		os.Exit(runMapper(cfg))
	}
}

// mapperConfig is what a mapper process is told.
type mapperConfig struct {
	Upstream, Listen string
	DeadConnSeconds  int
}

// runMapper is one process that both configures an nbd device and serves
// it, as rbd-nbd does: it listens on Listen, relays each connection to the
// daemon at Upstream (nbdkit), and connects a fresh /dev/nbdN to itself over
// the nbd netlink family; it prints N and serves until killed. Its death
// closes the device's socket, and the kernel's sysfs pid names it.
func runMapper(raw string) int {
	var c mapperConfig
	if err := json.Unmarshal([]byte(raw), &c); err != nil {
		fmt.Fprintln(os.Stderr, "mapper:", err)
		return 2
	}
	_ = os.Remove(c.Listen)
	ln, err := net.Listen("unix", c.Listen)
	if err != nil {
		fmt.Fprintln(os.Stderr, "mapper:", err)
		return 2
	}
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				up, err := net.Dial("unix", c.Upstream)
				if err != nil {
					conn.Close()
					return
				}
				go func() { _, _ = io.Copy(up, conn); up.Close() }()
				_, _ = io.Copy(conn, up)
				conn.Close()
			}()
		}
	}()
	idx, err := csilab.NBDMap(c.Listen, csilab.NBDOptions{DeadConnTimeout: time.Duration(c.DeadConnSeconds) * time.Second})
	if err != nil {
		fmt.Fprintln(os.Stderr, "mapper:", err)
		return 2
	}
	fmt.Println(idx)
	select {}
}

// startMapper maps v's daemon through a mapper process and returns the
// device's index and the process.
func startMapper(t *testing.T, v *nbdVolume, deadConn time.Duration) (int, *exec.Cmd, error) {
	raw, _ := json.Marshal(mapperConfig{Upstream: v.socket, Listen: filepath.Join(filepath.Dir(v.socket), "mapper.sock"), DeadConnSeconds: int(deadConn / time.Second)})
	cmd := exec.Command("/proc/self/exe")
	cmd.Env = append(os.Environ(), envNBDMapper+"="+string(raw))
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return -1, nil, err
	}
	if err := cmd.Start(); err != nil {
		return -1, nil, err
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	line := make(chan string, 1)
	go func() {
		s, _ := bufio.NewReader(out).ReadString('\n')
		line <- s
	}()
	select {
	case s := <-line:
		idx, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil {
			return -1, nil, fmt.Errorf("mapper printed %q: %w", s, err)
		}
		return idx, cmd, nil
	case <-time.After(time.Minute):
		return -1, nil, errors.New("the mapper mapped no device within a minute")
	}
}

// tgidOf is the thread group of task pid.
func tgidOf(t *testing.T, pid int) int {
	t.Helper()
	g, err := readTgid("/proc", pid)
	if err != nil {
		t.Fatalf("thread group of %d: %v", pid, err)
	}
	return g
}

// TestNBDDeadDaemonFoundWithoutIO: a daemon that configured its device and
// serves it (rbd-nbd's shape) is killed while the kernel holds the I/O (a
// dead-connection timeout): the next probe says Disconnected
// (ErrNBDDaemonGone) from the sysfs pid alone, without waiting for the
// device read's deadline. A stopped daemon is not dead; after a re-attach
// (which leaves the sysfs pid naming the dead daemon) the device is Healthy
// and stays so.
func TestNBDDeadDaemonFoundWithoutIO(t *testing.T) {
	lab.RequireRoot(t)
	k := lab.NewKubelet(t, t.TempDir())
	var mapper *exec.Cmd
	v := stageNBDVia(t, k, "0001-0009-rook-ceph-0000000000000001-w", "pod-w", func(v *nbdVolume) (int, error) {
		idx, cmd, err := startMapper(t, v, 90*time.Second)
		mapper = cmd
		return idx, err
	})
	sysPID := csilab.NBDDaemonPID(v.index)
	t.Logf("nbd facts: mapper process %d, sysfs pid of %s %d (thread group %d)", mapper.Process.Pid, v.device(), sysPID, tgidOf(t, sysPID))
	if tgidOf(t, sysPID) != mapper.Process.Pid {
		t.Fatalf("sysfs pid %d is not a thread of the mapper %d: the lab is not rbd-nbd's shape", sysPID, mapper.Process.Pid)
	}
	p := NewProber(Config{Timeout: 2 * time.Second, ReadDevice: true})
	if r := probeState(t, p, k.Root(), v.publish); r.State != Healthy {
		t.Fatalf("probe before the fault = %v (%v), want Healthy", r.State, r.Err)
	}

	// Stopped (SIGSTOP): alive, not dead. No I/O is asked of it.
	_ = mapper.Process.Signal(syscall.SIGSTOP)
	if p.NBDDaemonGone("nbd" + strconv.Itoa(v.index)) {
		t.Error("stopped daemon: NBDDaemonGone = true, want false")
	}
	_ = mapper.Process.Signal(syscall.SIGCONT)

	killed := time.Now()
	_ = mapper.Process.Kill()
	_ = mapper.Wait()
	r := probeState(t, p, k.Root(), v.publish)
	found := time.Since(killed)
	t.Logf("nbd facts: daemon killed, dead-conn timeout 90s: first probe %v (%v) after %v; sysfs pid now %d",
		r.State, r.Err, found.Round(time.Millisecond), csilab.NBDDaemonPID(v.index))
	if r.State != Disconnected || !errors.Is(r.Err, ErrNBDDaemonGone) {
		t.Errorf("first probe after the kill = %v (%v), want Disconnected with ErrNBDDaemonGone", r.State, r.Err)
	}

	if err := csilab.NBDReattach(v.index, v.socket); err != nil {
		t.Fatal(err)
	}
	t.Logf("nbd facts: after NBD_CMD_RECONFIGURE to a fresh connection, sysfs pid %d (the dead mapper was %d)", csilab.NBDDaemonPID(v.index), sysPID)
	var after Result
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		after = probeState(t, p, k.Root(), v.publish)
		if after.State == Healthy || time.Now().After(deadline) {
			break
		}
	}
	if after.State != Healthy {
		t.Fatalf("probe after the re-attach = %v (%v), want Healthy", after.State, after.Err)
	}
	for i := range 3 {
		if r := probeState(t, p, k.Root(), v.publish); r.State != Healthy || p.NBDDaemonGone("nbd"+strconv.Itoa(v.index)) {
			t.Errorf("probe %d after the re-attach = %v (%v), want Healthy", i, r.State, r.Err)
		}
	}
	v.checkAcked(t)
	t.Logf("nbd figures: dead daemon (sysfs pid): killed -> broken %v, probe deadline 2s", found.Round(time.Millisecond))
}

// TestNBDLinkDeadWakesWatcher: the kernel's NBD_CMD_LINK_DEAD reaches
// WatchNBD when a daemon dies (here nbdkit, while the process that
// configured the device lives on: the pid check cannot see this one), the
// watcher is woken, and the next probe says Disconnected at once; a
// re-attach makes the device Healthy again.
func TestNBDLinkDeadWakesWatcher(t *testing.T) {
	lab.RequireRoot(t)
	k := lab.NewKubelet(t, t.TempDir())
	p := NewProber(Config{Timeout: 2 * time.Second, ReadDevice: true})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	t.Cleanup(func() { cancel(); <-done })
	woke := make(chan time.Time, 16)
	go func() {
		defer close(done)
		p.WatchNBD(ctx, func() {
			select {
			case woke <- time.Now():
			default:
			}
		})
	}()
	v := stageNBD(t, k, "0001-0009-rook-ceph-0000000000000001-x", "pod-x", csilab.NBDOptions{DeadConnTimeout: 90 * time.Second})
	if r := probeState(t, p, k.Root(), v.publish); r.State != Healthy {
		t.Fatalf("probe before the fault = %v (%v), want Healthy", r.State, r.Err)
	}
	select {
	case <-woke:
		t.Fatal("woken before any daemon died")
	default:
	}
	killed := time.Now()
	v.daemon.Kill()
	var at time.Time
	select {
	case at = <-woke:
	case <-time.After(30 * time.Second):
		t.Fatal("no wake within 30 s of the daemon's death")
	}
	r := probeState(t, p, k.Root(), v.publish)
	found := time.Since(killed)
	t.Logf("nbd facts: nbdkit killed: LINK_DEAD woke the watcher %v after the kill; probe then %v (%v), %v after the kill",
		at.Sub(killed).Round(time.Millisecond), r.State, r.Err, found.Round(time.Millisecond))
	if r.State != Disconnected || !errors.Is(r.Err, ErrNBDDaemonGone) {
		t.Errorf("probe after the wake = %v (%v), want Disconnected with ErrNBDDaemonGone", r.State, r.Err)
	}
	csilab.StartNBDDaemon(t, v.image, v.socket)
	if err := csilab.NBDReattach(v.index, v.socket); err != nil {
		t.Fatal(err)
	}
	var after Result
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		after = probeState(t, p, k.Root(), v.publish)
		if after.State == Healthy || time.Now().After(deadline) {
			break
		}
	}
	if after.State != Healthy {
		t.Errorf("probe after the re-attach = %v (%v), want Healthy", after.State, after.Err)
	}
	v.checkAcked(t)
	t.Logf("nbd figures: link-dead event: killed -> woken %v, killed -> broken %v", at.Sub(killed).Round(time.Millisecond), found.Round(time.Millisecond))
}

// TestNBDWatchFromAnotherNetNamespace: in a network namespace of its own
// (a pod without hostNetwork) the nbd family is not there (it is not
// network-namespaced); openNBDWatch then opens its socket in /proc/1's
// namespace, and that socket hears a daemon's death.
func TestNBDWatchFromAnotherNetNamespace(t *testing.T) {
	lab.RequireRoot(t)
	type opened struct {
		w        *nbdWatch
		own, err error
	}
	ch := make(chan opened, 1)
	go func() {
		// Never unlocked: the thread, in a namespace of its own, ends
		// with this goroutine.
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			ch <- opened{err: fmt.Errorf("unshare the network namespace: %w", err)}
			return
		}
		var own error
		if fd, err := genlSocket(); err != nil {
			own = err
		} else {
			_, own = joinNBD(fd)
			unix.Close(fd)
		}
		w, err := openNBDWatch(initialNetNamespace)
		ch <- opened{w, own, err}
	}()
	o := <-ch
	t.Logf("nbd facts: nbd family from a new network namespace: %v", o.own)
	if !errors.Is(o.own, errNoNBDFamily) {
		t.Errorf("nbd family in a new network namespace: %v, want errNoNBDFamily", o.own)
	}
	if o.err != nil {
		t.Fatalf("open the watch through %s: %v", initialNetNamespace, o.err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	dead := make(chan uint32, 16)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_ = o.w.run(ctx, func(i uint32) { dead <- i }, func() {})
	}()
	t.Cleanup(func() { cancel(); <-done; o.w.close() })

	k := lab.NewKubelet(t, t.TempDir())
	v := stageNBD(t, k, "0001-0009-rook-ceph-0000000000000001-y", "pod-y", csilab.NBDOptions{DeadConnTimeout: 90 * time.Second})
	v.daemon.Kill()
	select {
	case i := <-dead:
		if int(i) != v.index {
			t.Errorf("link dead for nbd%d, want nbd%d", i, v.index)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("the watch opened through /proc/1 heard no link-dead within 30 s")
	}
	csilab.StartNBDDaemon(t, v.image, v.socket)
	if err := csilab.NBDReattach(v.index, v.socket); err != nil {
		t.Fatal(err)
	}
}
