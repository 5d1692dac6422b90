package probe

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
)

// FusectlMagic is the f_type statfs reports for the fuse control
// filesystem.
const FusectlMagic = 0x65735543

// FusectlConn is the name of a FUSE connection's directory under the fuse
// control filesystem: the kernel's dev_t of the superblock printed in
// decimal, MKDEV(major, minor) = major<<20 | minor. For fuse mounts (major 0)
// it is the minor; fuseblk mounts carry their block device's number.
func FusectlConn(dev Dev) uint32 { return dev.Major<<20 | dev.Minor }

// DefaultStallPoll is how often WatchStalls reads the FUSE connections'
// waiting counters at the agent's defaults.
const DefaultStallPoll = 250 * time.Millisecond

// stallGap is the least time between two probes WatchStalls starts for
// one backend: a busy daemon, which always has requests waiting, gets at
// most one extra probe per stallGap.
const stallGap = 500 * time.Millisecond

// WatchStalls finds hung FUSE daemons between probe cycles, until ctx
// ends. Every poll it reads, for each FUSE backend of the inventory current
// returns, its connection's count of requests waiting for the daemon
// (<SysfsDir>/fs/fuse/connections/<conn>/waiting: a read of a counter that
// never asks the daemon). A backend with requests waiting and no probe
// running gets one now (at most one per stallGap), under the same rules as
// a cycle's: its own flight, a deadline per call. When a probe the watch
// sees running (its own or a cycle's) passes its deadline without an
// answer, hung is called (once per probe): the caller starts a probe
// cycle, which finds the probe past its deadline and reports the backend
// Hung at once.
//
// So a daemon that stops answering while a container waits on it is found
// one deadline (plus at most a poll) after the container's request, not
// after the next cycle's start plus a deadline. A slow daemon that answers
// within the deadline is never Hung, as in a cycle. Without the fuse
// control filesystem at the path (not mounted in this mount namespace),
// WatchStalls reads nothing and the cycles alone find hangs.
func (p *Prober) WatchStalls(ctx context.Context, poll time.Duration, current func() *Inventory, hung func()) {
	p.WatchStallsAt(ctx, "", poll, current, hung)
}

// WatchStallsAt is WatchStalls reading the fuse control filesystem at dir:
// a path, or /proc/self/fd/<n> of a detached fusectl mount that no mount
// table shows; <SysfsDir>/fs/fuse/connections when empty.
func (p *Prober) WatchStallsAt(ctx context.Context, dir string, poll time.Duration, current func() *Inventory, hung func()) {
	if poll <= 0 {
		return
	}
	if dir == "" {
		dir = filepath.Join(p.cfg.SysfsDir, "fs", "fuse", "connections")
	}
	w := &stallWatch{p: p, dir: dir, armed: make(map[*flight]bool), hung: hung}
	t := time.NewTimer(poll)
	defer t.Stop()
	logger := klog.FromContext(ctx)
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		// A node without FUSE volumes is looked at only every
		// idlePoll: each wakeup of the process costs CPU, whatever the
		// poll does. No inventory (one is being read again) comes back
		// within a cycle.
		next := poll
		if inv := current(); inv != nil {
			reads, fuse, err := w.poll(inv)
			if !fuse || err != nil {
				next = idlePoll
			}
			// At most maxStallReads a second: on a node with more FUSE
			// backends than a poll's share, the polls stretch.
			next = max(next, time.Duration(reads)*(time.Second/maxStallReads))
			if err != nil && !w.warned {
				w.warned = true
				logger.V(2).Info("Cannot read FUSE connections' waiting requests: hangs are found by the probe cycles only", "dir", w.dir, "err", err)
			}
		}
		t.Reset(max(next, poll))
	}
}

// maxStallReads bounds the waiting counters WatchStalls reads a second.
// Each read is an open, a read and a close of a fusectl file: at the
// default poll, more than 250 FUSE backends would cost more than the probe
// cycles do (at 1,000, over half the agent's CPU). Past that the poll
// stretches, and a hang is found up to a poll later: at 1,000 backends,
// one second after its deadline instead of a quarter, still before the
// next probe cycle would find it.
const maxStallReads = 1000

// idlePoll is how often WatchStalls looks for FUSE backends on a node that
// has none, or for the fuse control filesystem where it is missing.
const idlePoll = 2 * time.Second

// stallWatch is WatchStalls' state, owned by its goroutine.
type stallWatch struct {
	p   *Prober
	dir string
	// armed are the flights whose deadline a timer watches.
	armed  map[*flight]bool
	hung   func()
	warned bool
}

// errNoFusectl: the directory holds no fuse control filesystem.
var errNoFusectl = errors.New("the fuse control filesystem is not mounted there")

// poll reads the waiting count of every FUSE backend of inv that no probe
// runs for and none was asked for within stallGap (a busy daemon, which
// always has requests waiting, gets at most one extra probe per stallGap),
// and probes the ones with requests waiting. fuse: inv has a FUSE backend
// to probe; fusectl is opened only then.
func (w *stallWatch) poll(inv *Inventory) (reads int, fuse bool, err error) {
	dir := -1
	defer func() {
		if dir >= 0 {
			unix.Close(dir)
		}
	}()
	var name []byte
	for _, b := range inv.Backends {
		if b.Kind != BackendFUSE {
			continue
		}
		path := b.ProbePath()
		if path == "" {
			continue
		}
		if !fuse {
			fuse = true
			if dir, err = openFusectl(w.dir); err != nil {
				return 0, true, err
			}
		}
		f, running, recent := w.p.lastFlight(b.Dev)
		switch {
		case running:
			// A probe runs (its own request waits): watch its deadline.
			w.arm(f)
			continue
		case recent:
			continue
		}
		name = append(strconv.AppendUint(name[:0], uint64(b.Conn), 10), "/waiting"...)
		reads++
		if n, err := FusectlWaiting(dir, string(name)); err == nil && n > 0 {
			if sameDev(path, b.Dev) != nil {
				continue // the inventory is older than the table: the next cycle probes
			}
			// Not reused: a finished flight's answer is older than the
			// requests waiting now. The cycle takes this flight's
			// answer, or finds it past its deadline.
			f, fresh := w.p.launch(b.Dev, flightOf{path, b.probeMountID()}, false, func(mark func()) Result { return w.p.check(b, path, mark) })
			if fresh {
				w.p.stallProbes.Add(1)
			}
			w.arm(f)
		}
	}
	for f := range w.armed {
		select {
		case <-f.done:
			delete(w.armed, f)
		default:
		}
	}
	return reads, fuse, nil
}

// openFusectl opens the fuse control filesystem's directory dir (O_PATH),
// failing when another filesystem is there.
func openFusectl(dir string) (int, error) {
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	var st unix.Statfs_t
	if err := unix.Fstatfs(fd, &st); err != nil {
		unix.Close(fd)
		return -1, err
	}
	if st.Type != FusectlMagic {
		unix.Close(fd)
		return -1, errNoFusectl
	}
	return fd, nil
}

// errMountMoved: the inventory's filesystem is no longer at its path.
var errMountMoved = errors.New("the filesystem the inventory has there is gone")

// sameDev checks that path still holds a filesystem of device dev, before
// the stall watch probes it: the inventory may be older than the mount
// table (a change is read by the next cycle), and a path unmounted since
// could stand on another filesystem while dev names a new mount. Only the
// device is compared: mount IDs differ between the host's table and the
// agent's own mount namespace, device numbers do not. statx with
// AT_STATX_DONT_SYNC asks no daemon: a mount point's root is always in the
// dentry cache, and its parent is on the kubelet root's own filesystem.
func sameDev(path string, dev Dev) error {
	var st unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, path, unix.AT_STATX_DONT_SYNC|unix.AT_SYMLINK_NOFOLLOW|unix.AT_NO_AUTOMOUNT, 0, &st); err != nil {
		return fmt.Errorf("%s: %w", path, err)
	}
	if (Dev{Major: st.Dev_major, Minor: st.Dev_minor}) != dev {
		return fmt.Errorf("%s: not on %s: %w", path, dev, errMountMoved)
	}
	return nil
}

// FusectlWaiting reads a FUSE connection's count of requests waiting for
// its daemon from its fusectl file name (<conn>/waiting), relative to the
// directory dirfd (unix.AT_FDCWD: name is a path). The read asks no
// daemon. The file is opened for each read: fusectl files cannot seek (no
// pread), and a connection's number may be another connection's by the
// next read. A connection gone (no such file) reads as fs.ErrNotExist.
func FusectlWaiting(dirfd int, name string) (int, error) {
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return 0, &fs.PathError{Op: "open", Path: name, Err: err}
	}
	defer unix.Close(fd)
	var buf [24]byte
	n, err := unix.Read(fd, buf[:])
	if err != nil {
		return 0, &fs.PathError{Op: "read", Path: name, Err: err}
	}
	v, err := strconv.Atoi(string(bytes.TrimSpace(buf[:n])))
	if err != nil {
		return 0, fmt.Errorf("requests waiting in %s: %w", name, err)
	}
	return v, nil
}

// lastFlight is the last probe of the backend with device dev: whether it
// still runs, and whether it was asked for within stallGap (then neither
// a read of its waiting count nor a probe is due).
func (p *Prober) lastFlight(dev Dev) (f *flight, running, recent bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	f = p.inflight[dev]
	if f == nil {
		return nil, false, false
	}
	select {
	case <-f.done:
	default:
		running = true
	}
	return f, running, time.Since(f.queued) < stallGap
}

// arm watches f's deadline once: hung is called when f is still running a
// call past Config.Timeout.
func (w *stallWatch) arm(f *flight) {
	if w.armed[f] {
		return
	}
	w.armed[f] = true
	p := w.p
	var check func()
	check = func() {
		select {
		case <-f.done:
			return
		default:
		}
		wait := p.cfg.Timeout
		if start := p.started(f); !start.IsZero() {
			if wait = p.cfg.Timeout - time.Since(start); wait <= 0 {
				w.hung()
				return
			}
		}
		time.AfterFunc(wait, check)
	}
	check()
}

// StallProbes counts the probes WatchStalls started.
func (p *Prober) StallProbes() uint64 { return p.stallProbes.Load() }
