package probe

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/scripts/lab"
)

// TestStallWatchFindsAHangBetweenCycles: no probe cycle runs. A real FUSE
// daemon that answers every request 150 ms late under a 400 ms deadline,
// with a reader waiting on it all the time (a pod's user can keep any
// volume that busy), is probed (it has requests waiting), never reported
// hung, and probed at most once per stallGap. Once it hangs under a
// reader, the stall watch probes it and calls hung when that probe passes
// its deadline, and the next cycle reports the backend Hung without
// waiting for it.
func TestStallWatchFindsAHangBetweenCycles(t *testing.T) {
	lab.RequireRoot(t)
	k := lab.NewKubelet(t, filepath.Join(t.TempDir(), "kubelet"))
	v := stageFaultFS(t, k, "stall", "pod")
	inv := liveInventory(t, k.Root())
	sys := HostSyscalls()
	var statfsCalls atomic.Int32
	realStatfs := sys.Statfs
	sys.Statfs = func(path string) error { statfsCalls.Add(1); return realStatfs(path) }
	p := NewProberWith(Config{Timeout: 400 * time.Millisecond}, sys)
	var hung atomic.Int32
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		p.WatchStalls(ctx, 20*time.Millisecond, func() *Inventory { return inv }, func() { hung.Add(1) })
	}()
	defer func() { cancel(); <-done }()
	file := filepath.Join(v.subPt, "hello")

	v.fs.Delay(150 * time.Millisecond)
	probed := false
	busy := time.Now()
	for end := busy.Add(3 * time.Second); time.Now().Before(end); {
		if _, err := os.ReadFile(file); err != nil {
			t.Fatalf("read on the slow daemon: %v", err)
		}
		probed = probed || p.InFlight() > 0 || p.lastQueued(inv.Backends[0]) != (time.Time{})
	}
	if n := hung.Load(); n != 0 {
		t.Fatalf("hung called %d times for a daemon answering every request within the deadline", n)
	}
	if !probed {
		t.Error("the stall watch never probed a backend with requests waiting")
	}
	if n, most := statfsCalls.Load(), int32(time.Since(busy)/stallGap)+1; n > most {
		t.Errorf("the stall watch probed a busy daemon %d times in %s, want at most %d (one per %s)", n, time.Since(busy).Round(time.Millisecond), most, stallGap)
	}

	v.fs.Delay(0)
	v.fs.Hang()
	defer v.fs.Abort()
	go func() { _, _ = os.ReadFile(filepath.Join(v.subPt, "hello")) }()
	for end := time.Now().Add(30 * time.Second); hung.Load() == 0; {
		if time.Now().After(end) {
			t.Fatal("hung not called 30 s after the daemon hung under a reader")
		}
		time.Sleep(10 * time.Millisecond)
	}
	rep := p.Probe(context.Background(), inv)
	if got := rep.Backends[0]; got.State != Hung || !errors.Is(got.Err, ErrHung) {
		t.Errorf("the cycle after hung: backend %s %v, want Hung", got.State, got.Err)
	}
}

// TestStallWatchWithoutFusectl: with no fuse control filesystem at the
// path, the watch reads nothing and calls nothing.
func TestStallWatchWithoutFusectl(t *testing.T) {
	p := NewProber(Config{SysfsDir: t.TempDir()})
	w := &stallWatch{p: p, dir: filepath.Join(p.cfg.SysfsDir, "fs", "fuse", "connections"), armed: map[*flight]bool{}, hung: func() { t.Error("hung called") }}
	inv := &Inventory{Backends: []*Backend{{Kind: BackendFUSE, Dev: Dev{Minor: 77}, Mounts: []*Mount{{Path: "/nonexistent", ID: 1}}}}}
	if _, _, err := w.poll(inv); err == nil {
		t.Fatal("poll without fusectl: no error")
	}
	if p.InFlight() != 0 {
		t.Errorf("poll without fusectl started %d probes", p.InFlight())
	}
}

// lastQueued is when the last probe of b was asked for (zero: never).
func (p *Prober) lastQueued(b *Backend) time.Time {
	p.mu.Lock()
	defer p.mu.Unlock()
	if f := p.inflight[b.Dev]; f != nil {
		return f.queued
	}
	return time.Time{}
}

// BenchmarkStallPoll is one stall-watch poll over 200 idle FUSE
// connections (one lab daemon serves them all): the watch's cost per poll,
// which --stall-poll multiplies.
//
//	go test -run '^$' -bench StallPoll ./probe
func BenchmarkStallPoll(b *testing.B) {
	lab.RequireRoot(b)
	k := lab.NewKubelet(b, filepath.Join(b.TempDir(), "kubelet"))
	const n = 200
	stagings := make([]string, n)
	for i := range stagings {
		stagings[i] = k.StagingPath(labDriver, "h"+strconv.Itoa(i))
	}
	lab.StartFaultFSMany(b, stagings)
	inv, err := ReadFile("/proc/self/mountinfo", Options{Root: k.Root(), Live: true})
	if err != nil {
		b.Fatal(err)
	}
	if len(inv.Backends) != n {
		b.Fatalf("%d backends, want %d", len(inv.Backends), n)
	}
	p := NewProber(Config{})
	w := &stallWatch{p: p, dir: filepath.Join(p.cfg.SysfsDir, "fs", "fuse", "connections"), armed: map[*flight]bool{}, hung: func() {}}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		reads, _, err := w.poll(inv)
		if err != nil {
			b.Fatal(err)
		}
		if reads != n {
			b.Fatalf("poll read %d waiting counters, want %d", reads, n)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N)/n, "µs/conn")

}

// TestSameDev: the stall watch's check, before it probes, that the
// inventory's filesystem is still at its path; an unmounted path (now a
// directory of the kubelet root's filesystem) is not probed for it.
func TestSameDev(t *testing.T) {
	lab.RequireRoot(t)
	k := lab.NewKubelet(t, filepath.Join(t.TempDir(), "kubelet"))
	v := stageFaultFS(t, k, "same", "pod")
	inv := liveInventory(t, k.Root())
	b := inv.Backends[0]
	if err := sameDev(b.ProbePath(), b.Dev); err != nil {
		t.Fatalf("the mount at its path: %v", err)
	}
	v.fs.Hang() // the check asks the daemon nothing
	if err := sameDev(b.ProbePath(), b.Dev); err != nil {
		t.Fatalf("the hung mount at its path: %v", err)
	}
	v.fs.Release()
	v.fs.Abort()
	if err := unix.Unmount(v.staging, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	if err := sameDev(b.ProbePath(), b.Dev); !errors.Is(err, errMountMoved) {
		t.Errorf("after the unmount: %v, want errMountMoved", err)
	}
}
