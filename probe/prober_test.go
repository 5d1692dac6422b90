package probe

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// fakeFS answers probes per path prefix; a path in hang blocks until
// release is closed.
type fakeFS struct {
	mu      sync.Mutex
	errs    map[string]error
	hang    map[string]bool
	release chan struct{}
	calls   map[string]*atomic.Int32
}

func newFakeFS() *fakeFS {
	return &fakeFS{errs: map[string]error{}, hang: map[string]bool{}, release: make(chan struct{}), calls: map[string]*atomic.Int32{}}
}

func (f *fakeFS) statfs(path string) error {
	f.mu.Lock()
	c := f.calls[path]
	if c == nil {
		c = new(atomic.Int32)
		f.calls[path] = c
	}
	hang, err := f.hang[path], f.errs[path]
	f.mu.Unlock()
	c.Add(1)
	if hang {
		<-f.release
	}
	return err
}

func (f *fakeFS) count(path string) int32 {
	f.mu.Lock()
	defer f.mu.Unlock()
	if c := f.calls[path]; c != nil {
		return c.Load()
	}
	return 0
}

func (f *fakeFS) syscalls() Syscalls {
	return Syscalls{
		Statfs:     f.statfs,
		StatxSync:  func(string) error { return nil },
		ReadDevice: func(string) error { return nil },
		ReadFile:   func(string) ([]byte, error) { return nil, unix.ENOENT },
	}
}

func TestStateOf(t *testing.T) {
	tests := map[string]struct {
		err  error
		want State
	}{
		"nil":          {nil, Healthy},
		"enotconn":     {unix.ENOTCONN, Disconnected},
		"econnaborted": {unix.ECONNABORTED, Disconnected},
		"eio wrapped":  {&wrapErr{unix.EIO}, IOError},
		"estale":       {unix.ESTALE, Stale},
		"erofs":        {unix.EROFS, ReadOnly},
		"enoent":       {unix.ENOENT, Missing},
		"eacces":       {unix.EACCES, Healthy},
		"hung":         {ErrHung, Hung},
		"other errno":  {unix.EINVAL, Failed},
		"not an errno": {errors.New("x"), Failed},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			if got := StateOf(tc.err); got != tc.want {
				t.Errorf("StateOf(%v) = %v, want %v", tc.err, got, tc.want)
			}
		})
	}
}

type wrapErr struct{ err error }

func (w *wrapErr) Error() string { return "wrapped: " + w.err.Error() }
func (w *wrapErr) Unwrap() error { return w.err }

func TestProbeDerivesFromBackends(t *testing.T) {
	inv := readTestdata(t, "s3fs-two-pods.mountinfo")
	fs := newFakeFS()
	staging := mountAt(t, inv, "/globalmount")
	fs.errs[staging.Path] = unix.ENOTCONN
	p := NewProberWith(Config{Timeout: time.Minute, Parallel: 2}, fs.syscalls())
	rep := p.Probe(context.Background(), inv)
	for _, r := range rep.Mounts {
		want := Disconnected
		if r.Mount.Backend != staging.Backend {
			want = Healthy
		}
		if r.State != want {
			t.Errorf("%s: state %v, want %v", r.Mount.Path, r.State, want)
		}
		if want == Disconnected && !errors.Is(r.Err, unix.ENOTCONN) {
			t.Errorf("%s: err %v, want ENOTCONN", r.Mount.Path, r.Err)
		}
	}
	for path := range fs.calls {
		if path != staging.Backend.ProbePath() && strings.Contains(path, "pvc-1b2c") {
			t.Errorf("probed bind %s: want one probe per backend, through the staging path", path)
		}
	}
	if n := fs.count(staging.Path); n != 1 {
		t.Errorf("staging probed %d times in one cycle, want 1", n)
	}
}

// The deadlines of these fake-FS tests are long enough that a healthy
// answer under -race on a busy machine is never taken for a hang; only the
// blocked call waits them out.

func TestHungProbeIsNeverStartedTwice(t *testing.T) {
	inv := readTestdata(t, "s3fs-two-pods.mountinfo")
	fs := newFakeFS()
	staging := mountAt(t, inv, "/globalmount")
	fs.hang[staging.Path] = true
	p := NewProberWith(Config{Timeout: 250 * time.Millisecond, Parallel: 1}, fs.syscalls())
	for cycle := 0; cycle < 3; cycle++ {
		rep := p.Probe(context.Background(), inv)
		for _, r := range rep.Mounts {
			if r.Mount.Backend == staging.Backend && (r.State != Hung || !errors.Is(r.Err, ErrHung)) {
				t.Errorf("cycle %d: %s: state %v err %v, want Hung", cycle, r.Mount.Path, r.State, r.Err)
			}
		}
		if rep.InFlight != 1 {
			t.Errorf("cycle %d: InFlight = %d, want 1", cycle, rep.InFlight)
		}
	}
	if n := fs.count(staging.Path); n != 1 {
		t.Errorf("hung backend probed %d times, want 1 (no second probe while the first is stuck)", n)
	}
	// The stuck call returns: the next cycle probes again and is healthy.
	close(fs.release)
	deadline := time.Now().Add(10 * time.Second)
	for p.InFlight() != 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	rep := p.Probe(context.Background(), inv)
	for _, r := range rep.Mounts {
		if r.State != Healthy {
			t.Errorf("after release: %s: state %v, want Healthy", r.Mount.Path, r.State)
		}
	}
	if n := fs.count(staging.Path); n != 2 {
		t.Errorf("after release: probed %d times in all, want 2", n)
	}
}

func TestTableStateBeatsASuccessfulStat(t *testing.T) {
	inv := readTestdata(t, "nbd-faults.mountinfo")
	p := NewProberWith(Config{Timeout: time.Minute}, newFakeFS().syscalls())
	rep := p.Probe(context.Background(), inv)
	if got := len(rep.Broken()); got != 7 {
		for _, r := range rep.Mounts {
			t.Logf("%s %v %v", r.Mount.Path, r.State, r.Err)
		}
		t.Errorf("broken = %d, want 7: shutdown and emergency_ro answer stat but are broken", got)
	}
}

func TestExt4ErrorCounterGrowth(t *testing.T) {
	b := &Backend{Kind: BackendBlock, FSType: "ext4", Device: "loop7", Dev: Dev{7, 7}}
	m := &Mount{Path: "/var/lib/kubelet/plugins/x", Backend: b, Options: "rw"}
	b.Mounts = []*Mount{m}
	inv := &Inventory{Root: "/var/lib/kubelet", Mounts: []*Mount{m}, Backends: []*Backend{b}}
	count := "0\n"
	sys := newFakeFS().syscalls()
	sys.ReadFile = func(path string) ([]byte, error) {
		if !strings.HasSuffix(path, "/fs/ext4/loop7/errors_count") {
			t.Errorf("read %s, want the ext4 errors_count of loop7", path)
		}
		return []byte(count), nil
	}
	p := NewProberWith(Config{Timeout: time.Minute}, sys)
	if st := p.Probe(context.Background(), inv).Mounts[0].State; st != Healthy {
		t.Errorf("first probe: %v, want Healthy", st)
	}
	count = "3\n"
	if st := p.Probe(context.Background(), inv).Mounts[0].State; st != IOError {
		t.Errorf("counter grew: %v, want IOError", st)
	}
}

func TestReadDeviceErrorIsIOError(t *testing.T) {
	b := &Backend{Kind: BackendBlock, FSType: "xfs", Device: "nbd0", Dev: Dev{43, 0}}
	m := &Mount{Path: "/var/lib/kubelet/plugins/x", Backend: b}
	b.Mounts = []*Mount{m}
	inv := &Inventory{Root: "/var/lib/kubelet", Mounts: []*Mount{m}, Backends: []*Backend{b}}
	sys := newFakeFS().syscalls()
	sys.ReadDevice = func(string) error { return unix.EIO }
	r := NewProberWith(Config{Timeout: time.Minute, ReadDevice: true}, sys).Probe(context.Background(), inv).Mounts[0]
	if r.State != IOError || !errors.Is(r.Err, unix.EIO) {
		t.Errorf("device read EIO: %v %v, want IOError wrapping EIO", r.State, r.Err)
	}
}

// TestCheckPath: a path is probed under a backend's rules: its errno
// classified, Hung past the deadline, and never a second probe while the
// first has not returned.
func TestCheckPath(t *testing.T) {
	fs := newFakeFS()
	fs.hang["/hung"] = true
	fs.errs["/dead"] = unix.ENOTCONN
	p := NewProberWith(Config{Timeout: 250 * time.Millisecond}, fs.syscalls())
	ctx := context.Background()
	for i := range 3 {
		if st, err := p.CheckPath(ctx, "/hung"); st != Hung || !errors.Is(err, ErrHung) {
			t.Errorf("CheckPath(/hung) call %d = %v, %v; want Hung, ErrHung", i, st, err)
		}
	}
	if n := fs.count("/hung"); n != 1 {
		t.Errorf("/hung probed %d times while the first probe was blocked, want 1", n)
	}
	if st, err := p.CheckPath(ctx, "/dead"); st != Disconnected || !errors.Is(err, unix.ENOTCONN) {
		t.Errorf("CheckPath(/dead) = %v, %v; want Disconnected, ENOTCONN", st, err)
	}
	if st, err := p.CheckPath(ctx, "/fine"); st != Healthy || err != nil {
		t.Errorf("CheckPath(/fine) = %v, %v; want Healthy", st, err)
	}
	close(fs.release)
	deadline := time.Now().Add(10 * time.Second)
	for p.InFlight() != 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if st, err := p.CheckPath(ctx, "/hung"); st != Healthy || err != nil {
		t.Errorf("CheckPath(/hung) once it answers = %v, %v; want Healthy", st, err)
	}
	if n := fs.count("/hung"); n != 2 {
		t.Errorf("/hung probed %d times in all, want 2", n)
	}
}
