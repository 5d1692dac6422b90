package remount

import (
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// Per-path lookups.
//
// A repair looks only at its volume's own paths: the staging path, the
// pods' publish targets and their subPath binds. On kernels with unique
// mount IDs and a statmount(2) that reports mount sources
// (STATMOUNT_SB_SOURCE, added after 6.8; probe.StackFD) it reads the stack of mounts at each path, which
// costs the stack's depth and never the node's mount count, and names each
// mount by an ID the kernel never reuses (probe.Mount.UniqueID), which the
// destructive steps check again. On older kernels it reads the whole table
// (hostTable: the agent's shared reader).

// lookupMode is how a Repairer finds the mounts at a volume's paths.
type lookupMode int

const (
	lookupUnknown lookupMode = iota
	lookupPerPath            // statx + statmount at each path
	lookupTable              // the shared read of the whole table
)

// maxSubPathBinds bounds the subPath binds read for one pod's volume: one
// per container and volumeMount, made by kubelet.
const maxSubPathBinds = 4096

// stacksSupported reports whether per-path lookups work here: statmount
// names the mount of our procfs with its source ("proc"), which the guard's
// recognition needs.
func stacksSupported(procDir string) bool {
	s, err := probe.StackAt(procDir)
	return err == nil && len(s) > 0 && s[len(s)-1].HasSource
}

// lookups says, once, which lookup the Repairer uses.
type lookups struct {
	once sync.Once
	mode lookupMode
}

func (l *lookups) get(procDir string) lookupMode {
	l.once.Do(func() {
		if l.mode != lookupUnknown {
			return
		}
		l.mode = lookupTable
		if stacksSupported(procDir) {
			l.mode = lookupPerPath
		}
	})
	return l.mode
}

// readStacks returns the mounts stacked at paths (and the filesystems they
// show by device number): per path where the kernel allows it, else from
// the whole table, which also holds every other path.
func (r *Repairer) readStacks(paths []string) (*hostTable, error) {
	if r.lookup.get(r.procDir) != lookupPerPath {
		return r.hostTable()
	}
	t := &hostTable{stacks: map[string][]*probe.Mount{}, byDev: map[probe.Dev]*probe.Backend{}}
	for _, p := range paths {
		p = filepath.Clean(p)
		if _, ok := t.stacks[p]; ok {
			continue
		}
		stack, err := r.stackAt(p)
		switch {
		case errors.Is(err, errUnsafePath):
			// The table shows what is mounted at a refused path, and the
			// step that would act on it refuses it by name.
			return r.hostTable()
		case err != nil:
			return nil, err
		}
		t.stacks[p] = stack
		for _, m := range stack {
			b := t.byDev[m.Dev]
			if b == nil {
				b = &probe.Backend{Dev: m.Dev, FSType: m.FSType, Source: m.Source}
				t.byDev[m.Dev] = b
			}
			b.Mounts = append(b.Mounts, m)
			m.Backend = b
		}
	}
	return t, nil
}

// stackAt reads the mounts at path, bottom first, through a descriptor
// openSafe proved (below the kubelet root, no symlink, no call into the
// mounted filesystem). A missing path has none.
func (r *Repairer) stackAt(path string) ([]*probe.Mount, error) { return stackAt(r.root, path) }

func stackAt(root, path string) ([]*probe.Mount, error) {
	sp, err := openSafe(root, path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	defer sp.Close()
	if !sp.IsMountPoint() {
		return nil, nil
	}
	ms, err := probe.StackFD(sp.FD(), path)
	if err != nil {
		return nil, fmt.Errorf("read the mounts at %s: %w", path, err)
	}
	target, _ := kubelet.Classify(root, path)
	out := make([]*probe.Mount, 0, len(ms))
	for i, s := range ms {
		out = append(out, &probe.Mount{
			ID: s.OldID, ParentID: s.OldParentID, UniqueID: s.ID,
			Dev: s.Dev, Root: s.Root, Path: path, FSType: s.FSType, Source: s.Source,
			Target: target, Covered: i < len(ms)-1,
			Guard: probe.IsGuard(s.FSType, s.Source, target),
		})
	}
	return out, nil
}

// subPathBinds lists the subPath bind targets kubelet made for the volume
// published at target (<pods>/<uid>/volume-subpaths/<volume>/<container>/<index>),
// at most maxSubPathBinds; none when target is no CSI publish target.
// Directories are opened below the kubelet root without symlinks.
func (r *Repairer) subPathBinds(target string) ([]string, error) {
	t, ok := kubelet.Classify(r.root, target)
	if !ok || t.Kind != kubelet.KindPublish || t.Volume == "" || t.PodUID == "" {
		return nil, nil
	}
	dir := filepath.Join(r.root, "pods", t.PodUID, "volume-subpaths", t.Volume)
	containers, err := r.readDirSafe(dir)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, c := range containers {
		sub := filepath.Join(dir, c)
		idx, err := r.readDirSafe(sub)
		if err != nil {
			return nil, err
		}
		for _, i := range idx {
			if len(out) == maxSubPathBinds {
				return out, nil
			}
			out = append(out, filepath.Join(sub, i))
		}
	}
	return out, nil
}

// readDirSafe lists the names in dir, a directory of kubelet's below the
// root, opened without symlinks; a missing or non-directory dir has none.
func (r *Repairer) readDirSafe(dir string) ([]string, error) { return readDirSafe(r.root, dir) }

func readDirSafe(root, dir string) ([]string, error) {
	rel, err := filepath.Rel(root, dir)
	if err != nil || !kubelet.Under(root, dir) {
		return nil, &unsafePathError{Path: dir, Root: root, Reason: "not strictly below the kubelet root"}
	}
	rootFD, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open kubelet root %s: %w", root, err)
	}
	defer unix.Close(rootFD)
	fd, err := openat2(rootFD, rel, unix.O_RDONLY|unix.O_DIRECTORY, resolveSafe)
	switch {
	case errors.Is(err, unix.ENOENT), errors.Is(err, unix.ENOTDIR):
		return nil, nil
	case err != nil:
		return nil, resolveErr(root, dir, dir, err)
	}
	f := os.NewFile(uintptr(fd), dir)
	defer f.Close()
	names, err := f.Readdirnames(maxSubPathBinds)
	if err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("list %s: %w", dir, err)
	}
	return names, nil
}
