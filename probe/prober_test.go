package probe

import (
	"context"
	"errors"
	"strconv"
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
	mu   sync.Mutex
	errs map[string]error
	hang map[string]bool
	// delay makes every statfs answer this late.
	delay   time.Duration
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
	hang, err, delay := f.hang[path], f.errs[path], f.delay
	f.mu.Unlock()
	c.Add(1)
	time.Sleep(delay)
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
		Statfs: f.statfs,
		StatxSync: func(string) error {
			f.mu.Lock()
			delay := f.delay
			f.mu.Unlock()
			time.Sleep(delay)
			return nil
		},
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
	// Past its deadline and not returned, the probe is Stuck: it holds
	// the filesystem, so a repair may abort its connection.
	if !p.Stuck(staging.Backend.Dev) {
		t.Errorf("Stuck(%s) = false while its probe is blocked past the deadline", staging.Backend.Dev)
	}
	if other := (Dev{Major: 0, Minor: 9999}); p.Stuck(other) {
		t.Errorf("Stuck(%s) = true for a device never probed", other)
	}
	// The stuck call returns: the next cycle takes its answer, healthy,
	// and the one after probes again.
	close(fs.release)
	deadline := time.Now().Add(10 * time.Second)
	for p.InFlight() != 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if p.Stuck(staging.Backend.Dev) {
		t.Errorf("Stuck(%s) = true after its probe returned", staging.Backend.Dev)
	}
	for i, want := range []int32{1, 2} {
		rep := p.Probe(context.Background(), inv)
		for _, r := range rep.Mounts {
			if r.State != Healthy {
				t.Errorf("cycle %d after release: %s: state %v, want Healthy", i, r.Mount.Path, r.State)
			}
		}
		if n := fs.count(staging.Path); n != want {
			t.Errorf("cycle %d after release: probed %d times in all, want %d", i, n, want)
		}
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

// TestWriteCheckOnlyWhenConfigured: the write check reaches a volume only
// when the agent asks for it (--write-check); by default a read-write
// block filesystem gets no write, and a shut-down one is found only then.
func TestWriteCheckOnlyWhenConfigured(t *testing.T) {
	b := &Backend{Kind: BackendBlock, FSType: "ext4", Device: "nbd0", Dev: Dev{43, 0}, SuperOptions: "rw"}
	m := &Mount{Path: "/var/lib/kubelet/plugins/x", Backend: b, Options: "rw"}
	b.Mounts = []*Mount{m}
	inv := &Inventory{Root: "/var/lib/kubelet", Mounts: []*Mount{m}, Backends: []*Backend{b}}
	for _, on := range []bool{false, true} {
		calls := 0
		sys := newFakeFS().syscalls()
		sys.ReadFile = func(string) ([]byte, error) { return []byte("0\n"), nil }
		sys.WriteCheck = func(string) (State, error) { calls++; return Shutdown, unix.EIO }
		st := NewProberWith(Config{Timeout: time.Minute, WriteCheck: on}, sys).Probe(context.Background(), inv).Mounts[0].State
		want, wantCalls := Healthy, 0
		if on {
			want, wantCalls = Shutdown, 1
		}
		if st != want || calls != wantCalls {
			t.Errorf("WriteCheck %v: state %v after %d write checks, want %v after %d", on, st, calls, want, wantCalls)
		}
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

// fuseInventory is a table of n FUSE backends, one staging mount each, at
// /staging/<i>.
func fuseInventory(n int) *Inventory {
	inv := &Inventory{Root: "/var/lib/kubelet"}
	for i := range n {
		b := &Backend{Kind: BackendFUSE, FSType: "fuse.faultfs", Dev: Dev{0, uint32(1000 + i)}}
		m := &Mount{Path: "/staging/" + strconv.Itoa(i), Backend: b, Options: "rw"}
		b.Mounts = []*Mount{m}
		inv.Mounts = append(inv.Mounts, m)
		inv.Backends = append(inv.Backends, b)
	}
	return inv
}

// TestManyHungBackendsDoNotStallACycle: a thousand backends hang at once,
// beside a healthy one. One Probe call starts a probe of every one of them
// (they do not queue behind each other for a deadline each) and says the
// healthy one is Healthy; the hung ones are Hung, or pending (Unknown,
// ErrPending) when their probe began late in the call; the next call finds
// every one Hung without probing any of them again.
func TestManyHungBackendsDoNotStallACycle(t *testing.T) {
	const n = 1000
	inv := fuseInventory(n + 1)
	fs := newFakeFS()
	for i := range n {
		fs.hang["/staging/"+strconv.Itoa(i)] = true
	}
	defer close(fs.release)
	p := NewProberWith(Config{Timeout: time.Second, Parallel: 4}, fs.syscalls())
	rep := p.Probe(context.Background(), inv)
	started, hung, pending := 0, 0, 0
	for i := range n {
		if fs.count("/staging/"+strconv.Itoa(i)) == 1 {
			started++
		}
		switch r := rep.Backends[i]; {
		case r.State == Hung && errors.Is(r.Err, ErrHung):
			hung++
		case r.State == Unknown && errors.Is(r.Err, ErrPending):
			pending++
		default:
			t.Fatalf("backend %d after one call: %v %v, want Hung or pending", i, r.State, r.Err)
		}
	}
	t.Logf("after one call: %d of %d hung probes started, %d Hung, %d pending, %d in flight", started, n, hung, pending, rep.InFlight)
	if started != n {
		t.Errorf("one call started %d of %d probes of hung backends, want all of them", started, n)
	}
	if r := rep.Backends[n]; r.State != Healthy {
		t.Errorf("healthy backend beside %d hung ones: %v %v, want Healthy", n, r.State, r.Err)
	}
	if rep.InFlight != n || rep.Pending > pending {
		t.Errorf("InFlight, Pending = %d, %d; want %d, at most %d", rep.InFlight, rep.Pending, n, pending)
	}
	time.Sleep(time.Second) // every probe is past its deadline now
	rep = p.Probe(context.Background(), inv)
	for i := range n {
		if r := rep.Backends[i]; r.State != Hung {
			t.Fatalf("backend %d after a second call: %v %v, want Hung", i, r.State, r.Err)
		}
		if c := fs.count("/staging/" + strconv.Itoa(i)); c != 1 {
			t.Fatalf("hung backend %d probed %d times, want once", i, c)
		}
	}
	if rep.Pending != 0 {
		t.Errorf("Pending = %d after every deadline passed, want 0", rep.Pending)
	}
}

// TestSlowAnswerWithinDeadlineIsNeverHung: backends whose daemon answers
// each request in 75 % of the deadline (1.5 s under a 2 s deadline) are
// never Hung, though a probe's two requests together take longer than the
// deadline: the deadline runs per call. A probe still running at the end of
// a call is pending, and Healthy at the next; however many answer slowly at
// once.
func TestSlowAnswerWithinDeadlineIsNeverHung(t *testing.T) {
	const n = 200
	inv := fuseInventory(n)
	fs := newFakeFS()
	fs.delay = 300 * time.Millisecond
	p := NewProberWith(Config{Timeout: 400 * time.Millisecond, Parallel: 4}, fs.syscalls())
	healthy := make([]bool, n)
	for cycle := range 4 {
		time.Sleep(200 * time.Millisecond) // the agent's probe interval
		rep := p.Probe(context.Background(), inv)
		for i, r := range rep.Backends {
			switch {
			case r.State == Healthy:
				healthy[i] = true
			case r.State == Unknown && errors.Is(r.Err, ErrPending):
			default:
				t.Fatalf("cycle %d: slow backend %d: %v %v, want Healthy or pending", cycle, i, r.State, r.Err)
			}
		}
	}
	for i, ok := range healthy {
		if !ok {
			t.Errorf("slow backend %d never found Healthy in 4 calls", i)
		}
	}
}

// TestFinishedFlightsOfGoneBackendsAreDropped: the prober forgets a backend
// that left the table once its probe returned, so that a node whose volumes
// come and go does not grow its memory.
func TestFinishedFlightsOfGoneBackendsAreDropped(t *testing.T) {
	fs := newFakeFS()
	p := NewProberWith(Config{Timeout: time.Minute}, fs.syscalls())
	p.Probe(context.Background(), fuseInventory(50))
	p.Probe(context.Background(), fuseInventory(5))
	p.mu.Lock()
	n := len(p.inflight)
	p.mu.Unlock()
	if n != 5 {
		t.Errorf("prober keeps %d flights after the table shrank to 5 backends, want 5", n)
	}
}

// TestFreedDeviceLendsNoAnswer: the kernel hands a freed device number to
// the next filesystem at once. A probe of an aborted FUSE connection that
// answered ECONNABORTED after its cycle ended must not become the answer
// for the next filesystem on that number (the e2e saw a new pod's healthy
// volume "repaired" for the last scenario's aborted connection); for the
// same mount it still is the answer.
func TestFreedDeviceLendsNoAnswer(t *testing.T) {
	fs := newFakeFS()
	one := func(path string, id int) *Inventory {
		inv := fuseInventory(1)
		inv.Mounts[0].Path, inv.Mounts[0].ID = path, id
		return inv
	}
	fs.hang["/old"] = true
	fs.errs["/old"] = unix.ECONNABORTED
	p := NewProberWith(Config{Timeout: 50 * time.Millisecond}, fs.syscalls())
	if rep := p.Probe(context.Background(), one("/old", 40)); rep.Mounts[0].State != Hung {
		t.Fatalf("hung connection: %v, want Hung", rep.Mounts[0].State)
	}
	close(fs.release) // the abort: the stuck call returns ECONNABORTED
	for deadline := time.Now().Add(10 * time.Second); p.InFlight() != 0 && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	rep := p.Probe(context.Background(), one("/new", 41))
	if r := rep.Mounts[0]; r.State != Healthy {
		t.Errorf("a new filesystem on the freed device: %v (%v), want Healthy: its own probe, not the old connection's answer", r.State, r.Err)
	}
	if n := fs.count("/new"); n != 1 {
		t.Errorf("the new filesystem was probed %d times, want 1", n)
	}

	// The same mount takes a late answer as its own.
	fs2 := newFakeFS()
	fs2.hang["/same"] = true
	fs2.errs["/same"] = unix.ECONNABORTED
	p = NewProberWith(Config{Timeout: 50 * time.Millisecond}, fs2.syscalls())
	p.Probe(context.Background(), one("/same", 40))
	close(fs2.release)
	for deadline := time.Now().Add(10 * time.Second); p.InFlight() != 0 && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	if r := p.Probe(context.Background(), one("/same", 40)).Mounts[0]; r.State != Disconnected || fs2.count("/same") != 1 {
		t.Errorf("the same mount after its late answer: %v, probed %d times; want Disconnected from that answer, probed once", r.State, fs2.count("/same"))
	}
}

// BenchmarkHungCycle: how long after a hung backend's deadline a probe
// cycle that started the probe reports it Hung (fake filesystem, 200 ms
// deadline). A cycle used to wait for a probe that had not started its
// first call when the cycle looked until its limit, a quarter deadline
// more.
//
//	go test -run '^$' -bench HungCycle ./probe
func BenchmarkHungCycle(b *testing.B) {
	const timeout = 200 * time.Millisecond
	inv := fuseInventory(1)
	var past time.Duration
	for range b.N {
		fs := newFakeFS()
		fs.hang["/staging/0"] = true
		p := NewProberWith(Config{Timeout: timeout, Parallel: 4}, fs.syscalls())
		start := time.Now()
		rep := p.Probe(context.Background(), inv)
		took := time.Since(start)
		close(fs.release)
		if r := rep.Backends[0]; r.State != Hung {
			b.Fatalf("hung backend: %v %v, want Hung", r.State, r.Err)
		}
		past += took - timeout
	}
	b.ReportMetric(float64(past.Microseconds())/1000/float64(b.N), "ms-past-deadline")
}
