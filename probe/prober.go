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
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
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
	// Timeout is each probe's deadline; past it the backend is Hung.
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
}

// HostSyscalls are the real operations.
func HostSyscalls() Syscalls {
	return Syscalls{Statfs: statfs, StatxSync: statxSync, ReadDevice: readDevice, ReadFile: os.ReadFile}
}

// Prober checks backends and paths without ever wedging its caller: a probe
// runs on its own goroutine, at most one per backend (or per path, for
// CheckPath) at a time; the caller waits at most Timeout for it.
type Prober struct {
	cfg Config
	sys Syscalls

	mu sync.Mutex
	// inflight is keyed by a backend's Dev or by a CheckPath path.
	inflight map[any]*flight
	errCount map[string]uint64
}

type flight struct {
	start time.Time
	done  chan struct{}
	res   Result
}

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
	return &Prober{cfg: cfg, sys: sys, inflight: make(map[any]*flight), errCount: make(map[string]uint64)}
}

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

// Probe checks every backend of inv once (bounded by Config.Parallel and
// each by Config.Timeout) and derives the state of every mount.
func (p *Prober) Probe(ctx context.Context, inv *Inventory) *Report {
	rep := &Report{Backends: make([]Result, len(inv.Backends))}
	jobs := make(chan int)
	var wg sync.WaitGroup
	for w := 0; w < p.cfg.Parallel && w < len(inv.Backends); w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range jobs {
				rep.Backends[i] = p.probeBackend(ctx, inv.Backends[i])
			}
		}()
	}
	for i := range inv.Backends {
		jobs <- i
	}
	close(jobs)
	wg.Wait()

	byBackend := make(map[*Backend]Result, len(inv.Backends))
	for _, r := range rep.Backends {
		byBackend[r.Backend] = r
	}
	rep.Mounts = derive(inv, func(b *Backend) Result { return byBackend[b] })
	rep.InFlight = p.InFlight()
	return rep
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

// derive gives each mount its backend's result, then the per-mount checks:
// a deleted subPath root, a covered mount the probe could not reach.
func derive(inv *Inventory, of func(*Backend) Result) []Result {
	out := make([]Result, 0, len(inv.Mounts)+len(inv.Unmounted))
	for _, m := range inv.Mounts {
		r := of(m.Backend)
		r.Mount = m
		switch {
		case m.Deleted():
			r.State, r.Err = Deleted, errors.New("the directory this bind shows was deleted")
		case r.State == Unknown && m.Covered && r.Err == nil && m.Backend.ProbePath() == "":
			r.Err = errors.New("covered by another mount on the same path")
		}
		out = append(out, r)
	}
	for _, m := range inv.Unmounted {
		out = append(out, Result{Mount: m, State: Missing,
			Err: errors.New("kubelet set this volume up but it is not a mount point")})
	}
	return out
}

func (p *Prober) probeBackend(ctx context.Context, b *Backend) Result {
	path := b.ProbePath()
	if path == "" {
		st, err := TableState(b)
		return Result{Backend: b, State: st, Err: err}
	}
	r := p.once(ctx, b.Dev, path, func() Result { return p.check(b, path) })
	r.Backend = b
	return r
}

// CheckPath probes one path with statfs, then statx(AT_STATX_FORCE_SYNC),
// under the same rules as a backend: at most one probe of the path in flight,
// Hung (ErrHung) past Timeout and while an earlier probe of it has not
// returned. It gives the path's state and, when broken, the error behind it;
// Unknown with the context's error when ctx ends first. It reads no mount
// table: for a caller that knows which path to check, such as a container's
// view of a volume through /proc/<pid>/root.
func (p *Prober) CheckPath(ctx context.Context, path string) (State, error) {
	r := p.once(ctx, path, path, func() Result {
		var r Result
		r.State, r.Err = p.syscalls(path)
		return r
	})
	return r.State, r.Err
}

// once runs check on its own goroutine unless a probe under key is still in
// flight, and waits at most Timeout for it. check may block for good in a
// syscall: it then pins one thread, and every later call for key is Hung at
// once until it returns.
func (p *Prober) once(ctx context.Context, key any, path string, check func() Result) Result {
	logger := klog.FromContext(ctx)
	p.mu.Lock()
	f := p.inflight[key]
	if f != nil {
		select {
		case <-f.done:
			delete(p.inflight, key)
			f = nil
		default:
		}
	}
	if f != nil {
		// The last probe has not returned: do not start another one.
		p.mu.Unlock()
		return Result{State: Hung, Err: fmt.Errorf("an earlier probe of %s has not returned: %w", path, ErrHung), Took: time.Since(f.start)}
	}
	f = &flight{start: time.Now(), done: make(chan struct{})}
	p.inflight[key] = f
	p.mu.Unlock()

	go func() {
		f.res = check()
		f.res.Took = time.Since(f.start)
		close(f.done)
	}()

	timer := time.NewTimer(p.cfg.Timeout)
	defer timer.Stop()
	select {
	case <-f.done:
		p.mu.Lock()
		if p.inflight[key] == f {
			delete(p.inflight, key)
		}
		p.mu.Unlock()
		logger.V(4).Info("probed", "path", path, "key", key, "state", f.res.State, "took", f.res.Took, "err", f.res.Err)
		return f.res
	case <-timer.C:
	case <-ctx.Done():
		return Result{State: Unknown, Err: ctx.Err(), Took: time.Since(f.start)}
	}
	logger.V(4).Info("probe hung", "path", path, "key", key, "timeout", p.cfg.Timeout)
	return Result{State: Hung, Err: fmt.Errorf("%s: no answer within %s: %w", path, p.cfg.Timeout, ErrHung), Took: time.Since(f.start)}
}

// syscalls runs statfs, then statx(AT_STATX_FORCE_SYNC), on path: Healthy,
// or the state of the first error and the error.
func (p *Prober) syscalls(path string) (State, error) {
	if err := p.sys.Statfs(path); err != nil {
		return StateOf(err), fmt.Errorf("statfs %s: %w", path, err)
	}
	if err := p.sys.StatxSync(path); err != nil {
		return StateOf(err), fmt.Errorf("statx %s: %w", path, err)
	}
	return Healthy, nil
}

// check runs on its own goroutine; it may block for good in a syscall.
func (p *Prober) check(b *Backend, path string) Result {
	r := Result{Backend: b}
	if st, err := p.syscalls(path); err != nil {
		r.State, r.Err = st, err
		return r
	}
	if st, err := TableState(b); st != Unknown {
		r.State, r.Err = st, err
		return r
	}
	if b.Kind == BackendBlock && b.Device != "" {
		if st, err := p.checkDevice(b); st != Healthy {
			r.State, r.Err = st, err
			return r
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
		if err := p.sys.ReadDevice(dev); err != nil && !errors.Is(err, unix.ENOENT) {
			return StateOf(err), fmt.Errorf("read %s: %w", dev, err)
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
