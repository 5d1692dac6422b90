package probe

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// fakeHost is a sysfs and a procfs in a temporary directory: the nbd
// devices' pid files and the processes' stat and status files.
type fakeHost struct {
	t           *testing.T
	sysfs, proc string
}

func newFakeHost(t *testing.T, nspid string) *fakeHost {
	h := &fakeHost{t: t, sysfs: t.TempDir(), proc: t.TempDir()}
	h.write(filepath.Join(h.proc, "self", "status"), "Name:\tmountmedic\nNSpid:\t"+nspid+"\n")
	return h
}

func (h *fakeHost) write(path, text string) {
	h.t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		h.t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		h.t.Fatal(err)
	}
}

// device sets /sys/block/<dev>/pid; "" removes the file.
func (h *fakeHost) device(dev, pid string) {
	path := filepath.Join(h.sysfs, "block", dev, "pid")
	if pid == "" {
		_ = os.Remove(path)
		return
	}
	h.write(path, pid+"\n")
}

// process writes /proc/<pid>/stat and status: state, thread group,
// thread count and start time. The command name has a space and a ')'.
func (h *fakeHost) process(pid int, state byte, tgid, threads int, start uint64) {
	dir := filepath.Join(h.proc, strconv.Itoa(pid))
	// Fields 3.. of stat: state, ppid ... num_threads (20) ... starttime (22).
	h.write(filepath.Join(dir, "stat"), fmt.Sprintf("%d (rbd-nbd) x)) %c 1 %d %d 0 -1 4194560 0 0 0 0 1 2 0 0 20 0 %d 0 %d 100 200\n", pid, state, pid, pid, threads, start))
	h.write(filepath.Join(dir, "status"), fmt.Sprintf("Name:\trbd-nbd\nTgid:\t%d\nPid:\t%d\n", tgid, pid))
}

func (h *fakeHost) exit(pid int) { _ = os.RemoveAll(filepath.Join(h.proc, strconv.Itoa(pid))) }

func TestParseProcStat(t *testing.T) {
	raw := []byte("42 (a) b (c)) S 1 42 42 0 -1 4194560 0 0 0 0 1 2 0 0 20 0 7 0 12345 100 200\n")
	p, err := parseProcStat(raw)
	if err != nil || p.state != 'S' || p.threads != 7 || p.start != 12345 {
		t.Errorf("parseProcStat = %+v, %v; want state S, 7 threads, start 12345", p, err)
	}
	for _, bad := range []string{"", "42 (a", "42 (a) S 1 2", "42 (a) SS 1 42 42 0 -1 4194560 0 0 0 0 1 2 0 0 20 0 7 0 1 1 1"} {
		if _, err := parseProcStat([]byte(bad)); err == nil {
			t.Errorf("parseProcStat(%q): no error", bad)
		}
	}
}

// TestNBDDaemonGone: a device is dead only when the process the kernel
// names, seen alive before, is gone, a zombie, or another process under
// its number; every other case says nothing.
func TestNBDDaemonGone(t *testing.T) {
	now := time.Unix(1000, 0)
	type step struct {
		do   func(h *fakeHost)
		want bool
	}
	alive := func(h *fakeHost) { h.device("nbd0", "100"); h.process(100, 'S', 100, 3, 500) }
	tests := map[string][]step{
		"no pid file (not connected)": {{func(h *fakeHost) {}, false}},
		"pid 0 (not connected)":       {{func(h *fakeHost) { h.device("nbd0", "0") }, false}},
		"pid file not a number":       {{func(h *fakeHost) { h.device("nbd0", "x") }, false}},
		"alive":                       {{alive, false}, {func(h *fakeHost) {}, false}},
		"killed":                      {{alive, false}, {func(h *fakeHost) { h.exit(100) }, true}, {func(h *fakeHost) {}, true}},
		"zombie":                      {{alive, false}, {func(h *fakeHost) { h.process(100, 'Z', 100, 1, 500) }, true}},
		"dead (X)":                    {{alive, false}, {func(h *fakeHost) { h.process(100, 'X', 100, 1, 500) }, true}},
		"stopped (SIGSTOP)":           {{alive, false}, {func(h *fakeHost) { h.process(100, 'T', 100, 3, 500) }, false}},
		"traced":                      {{alive, false}, {func(h *fakeHost) { h.process(100, 't', 100, 3, 500) }, false}},
		"leader exited, threads run":  {{alive, false}, {func(h *fakeHost) { h.process(100, 'Z', 100, 2, 500) }, false}},
		"number reused by another process": {{alive, false}, {func(h *fakeHost) {
			h.exit(100)
			h.process(100, 'S', 100, 1, 900)
		}, true}},
		"never seen alive (mapper exited, e.g. nbd-client)": {{func(h *fakeHost) { h.device("nbd0", "100") }, false},
			// the number taken later by a process that then dies: still nothing
			{func(h *fakeHost) { h.process(100, 'S', 100, 1, 900) }, false},
			{func(h *fakeHost) { h.exit(100) }, false}},
		"never seen alive (zombie at first look)": {{func(h *fakeHost) { h.device("nbd0", "100"); h.process(100, 'Z', 100, 1, 500) }, false},
			{func(h *fakeHost) { h.exit(100) }, false}},
		"connected by a thread: its process is judged": {
			{func(h *fakeHost) {
				h.device("nbd0", "101")
				h.process(101, 'S', 100, 3, 500)
				h.process(100, 'S', 100, 3, 500)
			}, false},
			{func(h *fakeHost) { h.exit(101) }, false}, // the thread ended, the process serves on
			{func(h *fakeHost) { h.exit(100) }, true}},
		"disconnected after the kill": {{alive, false}, {func(h *fakeHost) { h.exit(100); h.device("nbd0", "") }, false}},
		"connected afresh by another daemon": {{alive, false}, {func(h *fakeHost) { h.exit(100) }, true},
			{func(h *fakeHost) { h.device("nbd0", "200"); h.process(200, 'S', 200, 3, 800) }, false},
			{func(h *fakeHost) { h.exit(200) }, true}},
	}
	for name, steps := range tests {
		t.Run(name, func(t *testing.T) {
			h := newFakeHost(t, "7")
			d := newNBDDaemons(h.sysfs, h.proc)
			for i, s := range steps {
				s.do(h)
				if got, why := d.gone("nbd0", now.Add(time.Duration(i)*time.Second)); got != s.want {
					t.Errorf("step %d: gone = %v (%s), want %v", i, got, why, s.want)
				}
			}
		})
	}
}

// TestNBDReattachedDeviceIsNotDead: NBD_CMD_RECONFIGURE leaves the sysfs pid
// naming the dead daemon; a read of the device begun after the verdict that
// answers ends it for good, and one begun before does not.
func TestNBDReattachedDeviceIsNotDead(t *testing.T) {
	h := newFakeHost(t, "7")
	d := newNBDDaemons(h.sysfs, h.proc)
	h.device("nbd0", "100")
	h.process(100, 'S', 100, 3, 500)
	t0 := time.Unix(1000, 0)
	d.gone("nbd0", t0)
	h.exit(100)
	if got, _ := d.gone("nbd0", t0.Add(time.Second)); !got {
		t.Fatal("killed daemon: not gone")
	}
	d.answered("nbd0", t0.Add(500*time.Millisecond)) // a read from before the verdict
	if got, _ := d.gone("nbd0", t0.Add(2*time.Second)); !got {
		t.Error("a read begun before the verdict ended it")
	}
	d.answered("nbd0", t0.Add(3*time.Second)) // re-attached: a read after it answers
	for i := range 3 {
		if got, why := d.gone("nbd0", t0.Add(time.Duration(4+i)*time.Second)); got {
			t.Errorf("re-attached device, look %d: gone (%s)", i, why)
		}
	}
	// The number reused since by a process that ends: the retired number
	// says nothing.
	h.process(100, 'S', 100, 1, 900)
	d.gone("nbd0", t0.Add(8*time.Second))
	h.exit(100)
	if got, why := d.gone("nbd0", t0.Add(9*time.Second)); got {
		t.Errorf("retired number reused and ended: gone (%s)", why)
	}
}

// TestNBDLinkDead: the kernel's link-dead event makes a device dead at once,
// with its daemon alive (a mapper that is not the server), until a read
// begun after it answers.
func TestNBDLinkDead(t *testing.T) {
	h := newFakeHost(t, "7")
	d := newNBDDaemons(h.sysfs, h.proc)
	h.device("nbd3", "100")
	h.process(100, 'S', 100, 3, 500)
	t0 := time.Unix(1000, 0)
	d.linkDead("nbd3", t0) // before the first look
	if got, _ := d.gone("nbd3", t0.Add(time.Second)); !got {
		t.Fatal("link dead: not gone")
	}
	d.answered("nbd3", t0.Add(2*time.Second))
	if got, why := d.gone("nbd3", t0.Add(3*time.Second)); got {
		t.Errorf("answered after the event: gone (%s)", why)
	}
	d.linkDead("nbd3", t0.Add(4*time.Second))
	if got, _ := d.gone("nbd3", t0.Add(5*time.Second)); !got {
		t.Error("second link dead: not gone")
	}
	h.device("nbd3", "")
	if got, _ := d.gone("nbd3", t0.Add(6*time.Second)); got {
		t.Error("disconnected device: gone")
	}
}

// TestNBDDaemonGoneNeedsHostPIDs: in a PID namespace of its own (no
// hostPID) /proc names other processes by sysfs's numbers: no verdict.
func TestNBDDaemonGoneNeedsHostPIDs(t *testing.T) {
	h := newFakeHost(t, "4242\t7")
	d := newNBDDaemons(h.sysfs, h.proc)
	h.device("nbd0", "100")
	h.process(100, 'S', 100, 3, 500)
	d.gone("nbd0", time.Unix(1, 0))
	h.exit(100)
	if got, why := d.gone("nbd0", time.Unix(2, 0)); got {
		t.Errorf("own PID namespace: gone (%s)", why)
	}
}

// TestProbeFindsDeadNBDDaemonAtOnce: a device whose daemon is gone is
// Disconnected (ErrNBDDaemonGone) within the grace, while its read hangs;
// once re-attached (the read answers) it is Healthy.
func TestProbeFindsDeadNBDDaemonAtOnce(t *testing.T) {
	h := newFakeHost(t, "7")
	h.device("nbd0", "100")
	h.process(100, 'S', 100, 3, 500)
	b := &Backend{Kind: BackendBlock, FSType: "ext4", Device: "nbd0", Dev: Dev{NBDMajor, 0}, SuperOptions: "rw"}
	m := &Mount{Path: "/var/lib/kubelet/plugins/x", Backend: b, Options: "rw"}
	b.Mounts = []*Mount{m}
	inv := &Inventory{Root: "/var/lib/kubelet", Mounts: []*Mount{m}, Backends: []*Backend{b}}
	held := make(chan struct{})
	var hold atomic.Bool
	sys := newFakeFS().syscalls()
	sys.ReadFile = func(string) ([]byte, error) { return nil, os.ErrNotExist }
	sys.ReadDevice = func(string) error {
		if hold.Load() {
			<-held
		}
		return nil
	}
	p := NewProberWith(Config{Timeout: time.Minute, ReadDevice: true, SysfsDir: h.sysfs, ProcDir: h.proc}, sys)
	ctx := context.Background()
	if r := p.Probe(ctx, inv).Mounts[0]; r.State != Healthy {
		t.Fatalf("daemon alive: %v %v", r.State, r.Err)
	}
	hold.Store(true)
	h.exit(100)
	start := time.Now()
	r := p.Probe(ctx, inv).Mounts[0]
	if r.State != Disconnected || !errors.Is(r.Err, ErrNBDDaemonGone) {
		t.Errorf("daemon killed: %v %v, want Disconnected with ErrNBDDaemonGone", r.State, r.Err)
	}
	t.Logf("found in %v with a one-minute deadline", time.Since(start))
	if !p.NBDDaemonGone("nbd0") {
		t.Error("NBDDaemonGone = false after the kill")
	}
	// Re-attached: the held read returns; the next cycle's read answers.
	hold.Store(false)
	close(held)
	deadline := time.Now().Add(10 * time.Second)
	for {
		r = p.Probe(ctx, inv).Mounts[0]
		if r.State == Healthy || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if r.State != Healthy || p.NBDDaemonGone("nbd0") {
		t.Errorf("re-attached: %v %v (gone %v), want Healthy", r.State, r.Err, p.NBDDaemonGone("nbd0"))
	}
}

func TestParseNBDFamily(t *testing.T) {
	attr := func(typ uint16, data []byte) []byte {
		b := binary.NativeEndian.AppendUint16(nil, uint16(4+len(data)))
		b = binary.NativeEndian.AppendUint16(b, typ)
		b = append(b, data...)
		for len(b)%4 != 0 {
			b = append(b, 0)
		}
		return b
	}
	msg := func(typ uint16, body []byte) []byte {
		b := binary.NativeEndian.AppendUint32(nil, uint32(unix.NLMSG_HDRLEN+len(body)))
		b = binary.NativeEndian.AppendUint16(b, typ)
		b = append(b, make([]byte, 10)...)
		return append(b, body...)
	}
	u16 := func(v uint16) []byte { return binary.NativeEndian.AppendUint16(nil, v) }
	u32 := func(v uint32) []byte { return binary.NativeEndian.AppendUint32(nil, v) }
	group := func(name string, id uint32) []byte {
		return attr(1, append(attr(ctrlAttrMcastGrpName, []byte(name+"\x00")), attr(ctrlAttrMcastGrpID, u32(id))...))
	}
	body := []byte{1, 2, 0, 0}
	body = append(body, attr(ctrlAttrFamilyName, []byte("nbd\x00"))...)
	body = append(body, attr(ctrlAttrFamilyID, u16(0x1f))...)
	body = append(body, attr(ctrlAttrMcastGroups|0x8000, append(group("other", 3), group(nbdMcastGroupName, 9)...))...)
	fam, grp, err := parseFamily(msg(genlCtrlID, body))
	if err != nil || fam != 0x1f || grp != 9 {
		t.Errorf("parseFamily = %#x, %d, %v; want 0x1f, 9", fam, grp, err)
	}
	code := -int32(unix.ENOENT)
	noent := msg(unix.NLMSG_ERROR, u32(uint32(code)))
	if _, _, err := parseFamily(noent); !errors.Is(err, errNoNBDFamily) {
		t.Errorf("ENOENT answer: %v, want errNoNBDFamily", err)
	}
	if _, _, err := parseFamily(msg(genlCtrlID, append([]byte{1, 2, 0, 0}, attr(ctrlAttrFamilyID, u16(0x1f))...))); err == nil {
		t.Error("family without the multicast group: no error")
	}

	dead := func(family uint16, cmd byte, index uint32) []byte {
		return msg(family, append([]byte{cmd, 1, 0, 0}, attr(nbdAttrIndex, u32(index))...))
	}
	dgram := append(append(dead(0x1f, nbdCmdLinkDead, 2), dead(0x1f, 1, 5)...), dead(0x20, nbdCmdLinkDead, 6)...)
	dgram = append(dgram, dead(0x1f, nbdCmdLinkDead, 7)...)
	if got := linkDeadIndexes(dgram, 0x1f); len(got) != 2 || got[0] != 2 || got[1] != 7 {
		t.Errorf("linkDeadIndexes = %v, want [2 7]: only the family's LINK_DEAD", got)
	}
	if got := linkDeadIndexes(dgram[:10], 0x1f); len(got) != 0 {
		t.Errorf("truncated datagram: %v", got)
	}
}
