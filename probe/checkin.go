package probe

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// CheckIn probes path inside the directory root as if root were "/": the
// path is opened with openat2(RESOLVE_IN_ROOT|RESOLVE_NO_SYMLINKS|
// RESOLVE_NO_MAGICLINKS) from a descriptor of root, and the descriptor,
// never a name, is probed: fstatfs, then statx(AT_EMPTY_PATH|
// AT_STATX_FORCE_SYNC). For a container's view of a volume root is
// /proc/<pid>/root: a symlink the container planted on the way (an absolute
// one would resolve against our root, not the container's) fails the probe
// instead of leading it to a healthy place elsewhere, and ".." stays inside.
//
// The rules are CheckPath's: the open can block on a hung FUSE mount as
// much as the probes, so all of it runs on its own goroutine, at most one
// per root and path in flight, Hung (ErrHung) past the deadline and while an
// earlier probe of the same root and path has not returned; Unknown with
// the context's error when ctx ends first.
func (p *Prober) CheckIn(ctx context.Context, root, path string) (State, error) {
	key := inRootKey{p: p, root: root, path: path}
	label := filepath.Join(root, path)
	inRoot.mu.Lock()
	f := inRoot.flights[key]
	if f != nil {
		select {
		case <-f.done:
			delete(inRoot.flights, key)
			f = nil
		default:
		}
	}
	if f != nil {
		inRoot.mu.Unlock()
		return Hung, fmt.Errorf("an earlier probe of %s has not returned: %w", label, ErrHung)
	}
	f = &flight{start: time.Now(), done: make(chan struct{})}
	inRoot.flights[key] = f
	inRoot.mu.Unlock()

	go func() {
		f.res.State, f.res.Err = checkInRoot(root, path)
		close(f.done)
		// A probe that returns after its caller stopped waiting leaves no
		// entry behind (container roots come and go with their PIDs).
		inRoot.mu.Lock()
		if inRoot.flights[key] == f {
			delete(inRoot.flights, key)
		}
		inRoot.mu.Unlock()
	}()
	timer := time.NewTimer(p.cfg.Timeout)
	defer timer.Stop()
	select {
	case <-f.done:
		inRoot.mu.Lock()
		if inRoot.flights[key] == f {
			delete(inRoot.flights, key)
		}
		inRoot.mu.Unlock()
		return f.res.State, f.res.Err
	case <-timer.C:
		return Hung, fmt.Errorf("%s: no answer within %s: %w", label, p.cfg.Timeout, ErrHung)
	case <-ctx.Done():
		return Unknown, ctx.Err()
	}
}

// inRootKey keys CheckIn's flights: one Prober's probe of one path in one
// root.
type inRootKey struct {
	p          *Prober
	root, path string
}

// inRoot are CheckIn's probes in flight (kept beside the Prober's own, which
// are keyed by backend and by path).
var inRoot = struct {
	mu      sync.Mutex
	flights map[inRootKey]*flight
}{flights: map[inRootKey]*flight{}}

// ErrSymlinkInRoot marks a path that meets a symlink (or leaves the root)
// on its way inside the root: it is refused, never followed.
var ErrSymlinkInRoot = errors.New("symlink on the path inside the root")

func checkInRoot(root, path string) (State, error) {
	rootfd, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return StateOf(err), fmt.Errorf("open root %s: %w", root, err)
	}
	defer unix.Close(rootfd)
	rel := strings.TrimPrefix(filepath.Clean("/"+path), "/")
	if rel == "" {
		rel = "."
	}
	how := unix.OpenHow{
		// No O_NOFOLLOW: with O_PATH it would open a trailing symlink
		// itself (and fstatfs would answer for the directory holding
		// it); without it RESOLVE_NO_SYMLINKS refuses it with ELOOP.
		Flags:   unix.O_PATH | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	}
	var fd int
	for {
		fd, err = unix.Openat2(rootfd, rel, &how)
		if err != unix.EINTR && err != unix.EAGAIN {
			break
		}
	}
	switch {
	case errors.Is(err, unix.ELOOP), errors.Is(err, unix.EXDEV):
		return Unknown, fmt.Errorf("open %s in %s: %w: %w", path, root, ErrSymlinkInRoot, err)
	case err != nil:
		return StateOf(err), fmt.Errorf("open %s in %s: %w", path, root, err)
	}
	defer unix.Close(fd)
	var sfs unix.Statfs_t
	for {
		err = unix.Fstatfs(fd, &sfs)
		if err != unix.EINTR {
			break
		}
	}
	if err != nil {
		return StateOf(err), fmt.Errorf("fstatfs %s in %s: %w", path, root, err)
	}
	var stx unix.Statx_t
	for {
		err = unix.Statx(fd, "", unix.AT_EMPTY_PATH|unix.AT_STATX_FORCE_SYNC|unix.AT_NO_AUTOMOUNT,
			unix.STATX_TYPE|unix.STATX_MODE|unix.STATX_INO, &stx)
		if err != unix.EINTR {
			break
		}
	}
	if err != nil {
		return StateOf(err), fmt.Errorf("statx %s in %s: %w", path, root, err)
	}
	return Healthy, nil
}
