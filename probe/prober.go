package probe

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// Result is the health of one backend or one mount.
type Result struct {
	// Mount is set on per-mount results.
	Mount *Mount
	// Backend is the backend probed (nil for a mount without one, such as a
	// publish target that lost its mount).
	Backend *Backend
	State   State
	// Err is the error behind a broken state; errors.Is works on its errno.
	Err error
	// Took is how long the probe ran; for Hung, how long it has been
	// running.
	Took time.Duration
}

// Report is one probe cycle over an inventory.
type Report struct {
	// Backends has one result per backend of the inventory, in its order.
	Backends []Result
	// Mounts has one result per kubelet mount, then one per unmounted
	// publish target.
	Mounts []Result
	// InFlight counts probes still running from this or earlier cycles:
	// each holds an OS thread in a syscall that cannot be cancelled.
	InFlight int
	// Pending counts those of InFlight not yet past their deadline.
	Pending int
}

// Broken returns the per-mount results that need a repair.
func (r *Report) Broken() []Result {
	var out []Result
	for _, res := range r.Mounts {
		if res.State.Broken() {
			out = append(out, res)
		}
	}
	return out
}

// Config tunes a Prober.
type Config struct {
	// Timeout is the deadline of each call a probe makes (statfs, statx,
	// a device read): a call still running past it makes the backend
	// Hung. A daemon that answers every call within it is never Hung.
	Timeout time.Duration
	// Parallel bounds the probes run at once in a cycle.
	Parallel int
	// ReadDevice reads 4 KiB at offset 0 of a block backend's device with
	// O_DIRECT: a read-only check that reaches the device (a dead NBD or
	// loop backing) where stat and statfs answer from memory.
	ReadDevice bool
	// SysfsDir is where sysfs is mounted; "/sys" when empty.
	SysfsDir string
	// DevDir is where device nodes are; "/dev" when empty.
	DevDir string
	// ProcDir is where the host's procfs is mounted; "/proc" when empty.
	// The dead NBD daemon check reads it (needs ReadDevice, and the
	// initial PID namespace: hostPID).
	ProcDir string
	// WriteCheck runs WriteCheck on read-write block filesystems whose
	// mount table shows no fault: the only signal of a shut-down or
	// journal-aborted ext4 on kernels whose mount table does not show the
	// "shutdown" and "emergency_ro" super options (Linux 6.1). Off by
	// default: it costs a journal transaction per probe, and a frozen
	// filesystem (fsfreeze for a snapshot) would read as Hung.
	WriteCheck bool
}

// DefaultConfig is the configuration the agent and scan start from.
func DefaultConfig() Config {
	return Config{Timeout: 2 * time.Second, Parallel: 4, ReadDevice: true}
}

// Syscalls are the operations a probe makes, a seam for unit tests.
type Syscalls struct {
	Statfs     func(path string) error
	StatxSync  func(path string) error
	ReadDevice func(path string) error
	ReadFile   func(path string) ([]byte, error)
	// WriteCheck is WriteCheck; nil leaves the step out.
	WriteCheck func(path string) (State, error)
}

// HostSyscalls are the real operations.
func HostSyscalls() Syscalls {
	return Syscalls{Statfs: statfs, StatxSync: statxSync, ReadDevice: readDevice, ReadFile: os.ReadFile, WriteCheck: WriteCheck}
}

// Prober checks backends and paths without ever wedging its caller: a probe
// runs on its own goroutine, at most one per backend (or per path, for
// CheckPath) at a time, and a caller never waits more than one deadline for
// any number of them.
//
// A probe that blocks (a hung FUSE daemon: the syscall cannot be cancelled)
// parks its goroutine, and the OS thread under it, until the call returns;
// at most Config.Parallel probes run in the fast lane at once, and a probe
// that has not answered within slowAfter leaves the lane to wait on its own
// thread, so that a thousand newly hung backends neither queue behind each
// other nor start more threads than there are probes stuck in the kernel.
type Prober struct {
	cfg Config
	sys Syscalls
	// lane holds one token per probe running in the fast lane.
	lane chan struct{}
	// slowAfter is how long a probe may hold its lane token.
	slowAfter time.Duration

	mu sync.Mutex
	// inflight is keyed by a backend's Dev or by a CheckPath path.
	inflight map[any]*flight
	errCount map[string]uint64
	// stallProbes counts the probes WatchStalls started.
	stallProbes atomic.Uint64
	// nbd knows which nbd devices' daemons are gone (nbdGone).
	nbd *nbdDaemons
}

type flight struct {
	// queued is when the probe was asked for; start is set (under
	// Prober.mu) when its first syscall begins, after its wait for a lane.
	queued time.Time
	start  time.Time
	// began is closed when start is first set.
	began chan struct{}
	done  chan struct{}
	res   Result
	// seen marks the flights of backends of the last Probe call, so that
	// finished flights of vanished backends are dropped.
	seen bool
	// used: a Probe call took the answer (set under Prober.mu).
	used bool
	// of is what the flight probed: the path and the ID of the mount there
	// (flightOf). A finished flight answers only for the same mount: the
	// kernel hands a freed device number, a flight's key, to the next
	// filesystem at once, and a FUSE connection aborted in one cycle must
	// not lend its ECONNABORTED to the volume mounted on its number next.
	of flightOf
}

// flightOf names the mount a backend's flight probes.
type flightOf struct {
	path string
	id   int
}

// ErrPending is the error of a probe that has not answered yet but is not
// past its deadline either: the backend is neither healthy nor hung yet
// (State Unknown), and the next cycle judges it.
var ErrPending = errors.New("probe still running, not yet past its deadline")

// NewProber returns a Prober on the host's syscalls.
func NewProber(cfg Config) *Prober {
	return NewProberWith(cfg, HostSyscalls())
}

// NewProberWith returns a Prober on the given syscalls.
func NewProberWith(cfg Config, sys Syscalls) *Prober {
	d := DefaultConfig()
	if cfg.Timeout <= 0 {
		cfg.Timeout = d.Timeout
	}
	if cfg.Parallel <= 0 {
		cfg.Parallel = d.Parallel
	}
	if cfg.SysfsDir == "" {
		cfg.SysfsDir = "/sys"
	}
	if cfg.DevDir == "" {
		cfg.DevDir = "/dev"
	}
	if cfg.ProcDir == "" {
		cfg.ProcDir = "/proc"
	}
	return &Prober{cfg: cfg, sys: sys, lane: make(chan struct{}, cfg.Parallel),
		slowAfter: min(slowAfter, cfg.Timeout/4),
		inflight:  make(map[any]*flight), errCount: make(map[string]uint64),
		nbd: newNBDDaemons(cfg.SysfsDir, cfg.ProcDir)}
}

// slowAfter is how long a probe keeps its fast-lane slot: a statfs of a
// healthy FUSE mount takes 30-50 µs. With the default 4 slots, a thousand
// newly hung backends are all under probe within a quarter of a second.
const slowAfter = time.Millisecond

// InFlight counts probes still running, each pinning an OS thread.
func (p *Prober) InFlight() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	n := 0
	for _, f := range p.inflight {
		select {
		case <-f.done:
		default:
			n++
		}
	}
	return n
}

// Stuck reports whether a probe of the backend with device dev is still
// blocked in the kernel past its deadline. While it is, it holds the
// filesystem it walked into, so the device number cannot pass to another
// filesystem: a repair of a Hung backend asks this right before it aborts
// the connection (remount.Prober), and probes the mount again once it
// is false.
func (p *Prober) Stuck(dev Dev) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	f := p.inflight[dev]
	if f == nil || f.start.IsZero() {
		return false
	}
	select {
	case <-f.done:
		return false
	default:
	}
	return time.Since(f.start) >= p.cfg.Timeout
}

// Probe checks every backend of inv once and derives the state of every
// mount. It starts the probes of every backend that has none in flight and
// waits for all of them together: until each answered or passed its own
// deadline (Config.Timeout from the start of its current call), and never longer than
// one deadline and a quarter in all, whatever the number of backends or of
// hung ones. A backend whose probe is still running past its deadline is
// Hung; one whose probe is still running within it (it started late in a
// long queue) is Unknown with ErrPending, judged by the next call. A backend
// whose earlier probe is still blocked is Hung at once: no second probe
// starts for it.
func (p *Prober) Probe(ctx context.Context, inv *Inventory) *Report {
	begin := time.Now()
	rep := &Report{Backends: make([]Result, len(inv.Backends))}
	flights := make([]*flight, len(inv.Backends))
	fresh := make([]bool, len(inv.Backends))
	// gone: the backend's nbd daemon is known dead (nbdGone); its probe
	// is waited for only nbdGrace, to hear a re-attached device answer.
	gone := make([]string, len(inv.Backends))
	p.mu.Lock()
	for _, f := range p.inflight {
		f.seen = false
	}
	p.mu.Unlock()
	for i, b := range inv.Backends {
		path := b.ProbePath()
		if path == "" {
			st, err := TableState(b)
			rep.Backends[i] = Result{Backend: b, State: st, Err: err}
			continue
		}
		gone[i] = p.nbdGone(b, begin)
		flights[i], fresh[i] = p.launch(b.Dev, flightOf{path, b.probeMountID()}, true, func(mark func()) Result { return p.check(b, path, mark) })
	}

	// Wait for the fresh probes: each until it answers or its own deadline
	// passes, all of them within one deadline and a quarter of begin.
	limit := begin.Add(p.cfg.Timeout + p.cfg.Timeout/4)
	var timer *time.Timer
	for i, f := range flights {
		if f == nil || !fresh[i] {
			continue
		}
		for {
			select {
			case <-f.done:
			default:
				until := limit
				// A probe that has not started its first call yet (its
				// goroutine has not run, or it waits for a lane) is
				// waited for until it starts: its deadline runs from
				// then. Waiting for the limit instead held every cycle
				// over a hang a quarter deadline past the hang's own
				// deadline.
				began := f.began
				if gone[i] != "" {
					until, began = begin.Add(p.nbdGrace()), nil
				}
				if s := p.started(f); !s.IsZero() {
					began = nil
					if s.Add(p.cfg.Timeout).Before(until) {
						until = s.Add(p.cfg.Timeout)
					}
				}
				wait := time.Until(until)
				if wait <= 0 {
					break
				}
				if timer == nil {
					timer = time.NewTimer(wait)
				} else {
					timer.Reset(wait)
				}
				select {
				case <-f.done:
				case <-began:
					continue // its deadline runs from now
				case <-timer.C:
					continue // the probe may have started meanwhile
				case <-ctx.Done():
				}
			}
			break
		}
		if ctx.Err() != nil {
			break
		}
	}
	if timer != nil {
		timer.Stop()
	}

	logger := klog.FromContext(ctx)
	now := time.Now()
	for i, f := range flights {
		if f == nil {
			continue
		}
		b := inv.Backends[i]
		select {
		case <-f.done:
			p.mu.Lock()
			f.used = true
			p.mu.Unlock()
		default:
		}
		r := p.judge(ctx, f, fresh[i], b.ProbePath(), now)
		if gone[i] != "" && !(r.State == Healthy && fresh[i]) {
			// Not answered within the grace, or an answer older than the
			// verdict: the daemon is gone, whatever the read waits on.
			r = Result{State: Disconnected, Err: fmt.Errorf("/dev/%s: %s: %w", b.Device, gone[i], ErrNBDDaemonGone), Took: r.Took}
		}
		r.Backend = b
		rep.Backends[i] = r
		if logger.V(4).Enabled() {
			logger.V(4).Info("probed", "path", b.ProbePath(), "dev", b.Dev, "state", r.State, "took", r.Took, "err", r.Err)
		}
	}
	rep.InFlight, rep.Pending = p.sweep()
	byBackend := make(map[*Backend]Result, len(inv.Backends))
	for _, r := range rep.Backends {
		byBackend[r.Backend] = r
	}
	rep.Mounts = derive(inv, func(b *Backend) Result { return byBackend[b] })
	return rep
}

// launch starts a probe under key unless one is in flight, which it returns
// instead (fresh false). A finished flight is replaced, unless reuse is set
// and no caller has taken its answer yet.
func (p *Prober) launch(key any, of flightOf, reuse bool, check func(mark func()) Result) (f *flight, fresh bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if f = p.inflight[key]; f != nil {
		select {
		case <-f.done:
			if reuse && !f.used && f.of == of {
				// It answered after the last cycle ended: that answer is
				// this cycle's (a daemon slower than a cycle's wait, but
				// answering, is not probed again before it is heard).
				f.seen, f.used = true, true
				return f, false
			}
		default:
			f.seen = true
			return f, false
		}
	}
	// A flight still running holds its filesystem, so its device number
	// cannot have been reused: it is that backend's, whatever its path.
	f = &flight{queued: time.Now(), began: make(chan struct{}), done: make(chan struct{}), seen: true, of: of}
	p.inflight[key] = f
	go p.fly(f, check)
	return f, true
}

// fly runs one probe: it waits for a fast-lane slot, gives it back once the
// probe answered or slowAfter passed, whichever comes first, and records
// the result.
func (p *Prober) fly(f *flight, check func(mark func()) Result) {
	p.lane <- struct{}{}
	start := time.Now()
	var once sync.Once
	leave := func() { once.Do(func() { <-p.lane }) }
	t := time.AfterFunc(p.slowAfter, leave)
	res := check(func() {
		p.mu.Lock()
		if f.start.IsZero() {
			close(f.began)
		}
		f.start = time.Now()
		p.mu.Unlock()
	})
	t.Stop()
	leave()
	res.Took = time.Since(start)
	f.res = res
	close(f.done)
}

// started is when f's current syscall began, zero while it waits for a
// lane. The deadline runs per call: a daemon that answers each request
// within it is never Hung, however many requests a probe makes.
func (p *Prober) started(f *flight) time.Time {
	p.mu.Lock()
	defer p.mu.Unlock()
	return f.start
}

// judge turns a flight into a result at now: its answer when it returned
// (and was started by this call, else the answer is older than the call and
// the backend is probed afresh next time), Hung past its deadline, else
// pending.
func (p *Prober) judge(ctx context.Context, f *flight, fresh bool, path string, now time.Time) Result {
	select {
	case <-f.done:
		// A flight that was running at launch (not fresh) and answered
		// since: its answer is the latest word on the backend.
		return f.res
	default:
	}
	if ctx.Err() != nil {
		return Result{State: Unknown, Err: ctx.Err()}
	}
	start := p.started(f)
	switch {
	case start.IsZero():
		return Result{State: Unknown, Err: fmt.Errorf("%s: waiting for a probe slot: %w", path, ErrPending)}
	case now.Sub(start) < p.cfg.Timeout:
		return Result{State: Unknown, Err: fmt.Errorf("%s: %w", path, ErrPending), Took: now.Sub(start)}
	case fresh:
		return Result{State: Hung, Err: fmt.Errorf("%s: no answer within %s: %w", path, p.cfg.Timeout, ErrHung), Took: now.Sub(start)}
	}
	return Result{State: Hung, Err: fmt.Errorf("an earlier probe of %s has not returned: %w", path, ErrHung), Took: now.Sub(start)}
}

// sweep drops finished flights of keys the last Probe call did not see
// (backends gone from the table), and counts the flights still running and,
// of those, the ones not yet past their deadline.
func (p *Prober) sweep() (inFlight, pending int) {
	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	for key, f := range p.inflight {
		select {
		case <-f.done:
			if _, isPath := key.(string); !isPath && !f.seen {
				delete(p.inflight, key)
			}
			continue
		default:
		}
		inFlight++
		if f.start.IsZero() || now.Sub(f.start) < p.cfg.Timeout {
			pending++
		}
	}
	return inFlight, pending
}

// Assess is what the mount table alone says, touching no path: for an
// offline table captured on another machine.
func Assess(inv *Inventory) *Report {
	rep := &Report{}
	byBackend := make(map[*Backend]Result, len(inv.Backends))
	for _, b := range inv.Backends {
		st, err := TableState(b)
		r := Result{Backend: b, State: st, Err: err}
		rep.Backends = append(rep.Backends, r)
		byBackend[b] = r
	}
	rep.Mounts = derive(inv, func(b *Backend) Result { return byBackend[b] })
	return rep
}

// errReplacedByUpdate explains a subPath bind of a ConfigMap (or Secret,
// projected, downward API) file that an update replaced.
var errReplacedByUpdate = errors.New("not broken: an update of its ConfigMap/Secret replaced the file this subPath shows (kubernetes#68211); a subPath never sees updates: restart the container to bind the current file, or mount the volume without subPath")

// derive gives each mount its backend's result, then the per-mount checks:
// a deleted subPath root, a covered mount the probe could not reach.
func derive(inv *Inventory, of func(*Backend) Result) []Result {
	out := make([]Result, 0, len(inv.Mounts)+len(inv.Unmounted))
	for _, m := range inv.Mounts {
		r := of(m.Backend)
		r.Mount = m
		switch {
		case m.ReplacedByUpdate():
			// The bind works; it shows the file as it was before the update.
			r.Err = errReplacedByUpdate
		case m.Deleted():
			r.State, r.Err = Deleted, errors.New("the directory this bind shows was deleted")
		case m.Guard && !m.Covered:
			r.State, r.Err = Missing, errors.New("kubelet set this volume up but its mount went away: mountmedic's read-only guard stands there, so writes fail instead of landing on the node's disk, until the volume is repaired")
		case r.State == Unknown && m.Covered && r.Err == nil && m.Backend.ProbePath() == "":
			r.Err = errors.New("covered by another mount on the same path")
		}
		out = append(out, r)
	}
	for _, m := range inv.Unmounted {
		err := errors.New("kubelet set this volume up but it is not a mount point")
		if m.Target.Kind == kubelet.KindStaging {
			err = errors.New("the staging mount is gone while pods still use the volume: a pod published now would get the node's disk")
		}
		out = append(out, Result{Mount: m, State: Missing, Err: err})
	}
	return out
}

// CheckPath probes one path with statfs, then statx(AT_STATX_FORCE_SYNC),
// under the same rules as a backend: at most one probe of the path in flight,
// Hung (ErrHung) past Timeout and while an earlier probe of it has not
// returned. It gives the path's state and, when broken, the error behind it;
// Unknown with the context's error when ctx ends first. It reads no mount
// table: for a caller that knows which path to check, such as a container's
// view of a volume through /proc/<pid>/root.
func (p *Prober) CheckPath(ctx context.Context, path string) (State, error) {
	f, fresh := p.launch(path, flightOf{path: path}, false, func(mark func()) Result {
		var r Result
		r.State, r.Err = p.syscalls(path, mark)
		return r
	})
	if !fresh {
		r := p.judge(ctx, f, false, path, time.Now())
		if r.State == Unknown && errors.Is(r.Err, ErrPending) {
			// Another caller's probe of the path is under way: wait for it
			// as for our own.
			fresh = true
		} else {
			return r.State, r.Err
		}
	}
	timer := time.NewTimer(p.cfg.Timeout)
	defer timer.Stop()
	for {
		select {
		case <-f.done:
			klog.FromContext(ctx).V(4).Info("probed", "path", path, "state", f.res.State, "took", f.res.Took, "err", f.res.Err)
			return f.res.State, f.res.Err
		case <-ctx.Done():
			return Unknown, ctx.Err()
		case <-timer.C:
		}
		start := p.started(f)
		if !start.IsZero() && time.Since(start) >= p.cfg.Timeout {
			klog.FromContext(ctx).V(4).Info("probe hung", "path", path, "timeout", p.cfg.Timeout)
			return Hung, fmt.Errorf("%s: no answer within %s: %w", path, p.cfg.Timeout, ErrHung)
		}
		wait := p.cfg.Timeout
		if !start.IsZero() {
			wait = p.cfg.Timeout - time.Since(start)
		}
		timer.Reset(max(wait, time.Millisecond))
	}
}

// syscalls runs statfs, then statx(AT_STATX_FORCE_SYNC), on path: Healthy,
// or the state of the first error and the error.
func (p *Prober) syscalls(path string, mark func()) (State, error) {
	mark()
	if err := p.sys.Statfs(path); err != nil {
		return StateOf(err), fmt.Errorf("statfs %s: %w", path, err)
	}
	mark()
	if err := p.sys.StatxSync(path); err != nil {
		return StateOf(err), fmt.Errorf("statx %s: %w", path, err)
	}
	return Healthy, nil
}

// check runs on its own goroutine; it may block for good in a syscall.
func (p *Prober) check(b *Backend, path string, mark func()) Result {
	r := Result{Backend: b}
	if st, err := p.syscalls(path, mark); err != nil {
		r.State, r.Err = st, err
		return r
	}
	if st, err := TableState(b); st != Unknown {
		r.State, r.Err = st, err
		return r
	}
	if b.Kind == BackendBlock && b.Device != "" {
		mark()
		if st, err := p.checkDevice(b); st != Healthy {
			r.State, r.Err = st, err
			return r
		}
		if p.cfg.WriteCheck && p.sys.WriteCheck != nil && writable(b) {
			mark()
			if st, err := p.sys.WriteCheck(path); st != Healthy {
				r.State, r.Err = st, err
				return r
			}
		}
	}
	r.State = Healthy
	return r
}

// checkDevice reads the ext4 error counter and, when configured, one block
// of the device.
func (p *Prober) checkDevice(b *Backend) (State, error) {
	if strings.HasPrefix(b.FSType, "ext") {
		if raw, err := p.sys.ReadFile(filepath.Join(p.cfg.SysfsDir, "fs", "ext4", b.Device, "errors_count")); err == nil {
			n, _ := strconv.ParseUint(strings.TrimSpace(string(raw)), 10, 64)
			key := b.Dev.String() + "/" + b.Device
			p.mu.Lock()
			last, seen := p.errCount[key]
			p.errCount[key] = n
			p.mu.Unlock()
			if seen && n > last {
				return IOError, fmt.Errorf("ext4 errors_count of %s grew from %d to %d", b.Device, last, n)
			}
		}
	}
	if p.cfg.ReadDevice {
		dev := filepath.Join(p.cfg.DevDir, b.Device)
		start := time.Now()
		if err := p.sys.ReadDevice(dev); err != nil && !errors.Is(err, unix.ENOENT) {
			return StateOf(err), fmt.Errorf("read %s: %w", dev, err)
		}
		if b.Dev.Major == NBDMajor {
			p.nbd.answered(b.Device, start)
		}
	}
	return Healthy, nil
}

func statfs(path string) error {
	var st unix.Statfs_t
	for {
		err := unix.Statfs(path, &st)
		if err != unix.EINTR {
			return err
		}
	}
}

func statxSync(path string) error {
	var st unix.Statx_t
	for {
		err := unix.Statx(unix.AT_FDCWD, path, unix.AT_STATX_FORCE_SYNC|unix.AT_SYMLINK_NOFOLLOW|unix.AT_NO_AUTOMOUNT,
			unix.STATX_TYPE|unix.STATX_MODE|unix.STATX_INO, &st)
		if err != unix.EINTR {
			return err
		}
	}
}

// readDevice reads the first 4 KiB of a block device with O_DIRECT, so the
// read reaches the device instead of the page cache.
func readDevice(path string) error {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECT|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	buf := alignedBlock()
	_, err = unix.Pread(fd, buf, 0)
	runtime.KeepAlive(buf)
	return err
}

func alignedBlock() []byte {
	const size, align = 4096, 4096
	raw := make([]byte, size+align)
	off := int(uintptr(unsafe.Pointer(&raw[0])) & (align - 1))
	if off != 0 {
		off = align - off
	}
	return raw[off : off+size]
}
