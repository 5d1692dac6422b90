package remount

import (
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"path/filepath"
	"slices"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// Per-path lookups of pods' volume mounts (the failover fence).
//
// Where the kernel reads the stack of mounts at a path by itself (PerPath),
// the mounts of a pod's volumes are found at the paths kubelet makes for
// them, listed from kubelet's directories below the root (opened without
// symlinks, as readDirSafe does), never from a mount table: the cost is the
// pods' paths, not the node's mount count. A path reached through a symlink
// is passed over, as a mount table never names one: the mount behind it,
// if any, is at the path the link points to.

// PerPath reports whether this kernel reads the mounts at a path by itself
// (statx STATX_MNT_ID_UNIQUE and statmount with mount sources). Where it
// does not, the caller reads the mount table.
func (u *Unmounter) PerPath() bool { return stacksSupported(u.procDir()) }

// PodMounts returns the mounts in our mount namespace at the volume paths
// of the pods podUIDs (every pod with a directory below the root when
// podUIDs is nil): their CSI and other plugins' publish targets
// (pods/<uid>/volumes/<plugin>/<volume>[/mount]), subPath binds
// (pods/<uid>/volume-subpaths/<volume>/<container>/<index>) and raw block
// binds (plugins/kubernetes.io/csi/volumeDevices/publish/<pv>/<uid> and
// .../volumeDevices/<pv>/dev/<uid>; the pod's own volumeDevices path is
// kubelet's symlink to the first), each stack bottom first, classified
// (Target) and with mountmedic's guard marked. Only for PerPath kernels.
func (u *Unmounter) PodMounts(podUIDs []string) ([]*probe.Mount, error) {
	byPod, err := u.podPaths(podUIDs)
	if err != nil {
		return nil, err
	}
	root := filepath.Clean(u.root())
	var out []*probe.Mount
	for _, uid := range slices.Sorted(maps.Keys(byPod)) {
		pp := byPod[uid]
		for _, p := range slices.Concat(pp.whole, pp.other) {
			stack, err := stackAt(root, p)
			if err != nil && !errors.Is(err, errUnsafePath) {
				return nil, err
			}
			out = append(out, stack...)
		}
	}
	return out, nil
}

// CSIPaths returns, for each pod of podUIDs, the paths where kubelet
// mounts a CSI volume of the pod whole, mounted or not: its CSI publish
// targets and raw block binds.
func (u *Unmounter) CSIPaths(podUIDs []string) (map[string][]string, error) {
	byPod, err := u.podPaths(podUIDs)
	if err != nil {
		return nil, err
	}
	out := make(map[string][]string, len(byPod))
	for uid, pp := range byPod {
		out[uid] = pp.whole
	}
	return out, nil
}

// volumePaths are a pod's volume paths: whole are its CSI publish targets
// and raw block binds, other its other plugins' volumes and subPath binds.
type volumePaths struct{ whole, other []string }

func (u *Unmounter) podPaths(podUIDs []string) (map[string]volumePaths, error) {
	root := filepath.Clean(u.root())
	pods := filepath.Join(root, "pods")
	if podUIDs == nil {
		names, err := readDirSafe(root, pods)
		if err != nil && !errors.Is(err, errUnsafePath) {
			return nil, err
		}
		podUIDs = names
	}
	blockDir := filepath.Join(root, "plugins", "kubernetes.io", "csi", "volumeDevices")
	blockPVs, err := readDirSafe(root, blockDir)
	if err != nil && !errors.Is(err, errUnsafePath) {
		return nil, err
	}
	published, err := readDirSafe(root, filepath.Join(blockDir, "publish"))
	if err != nil && !errors.Is(err, errUnsafePath) {
		return nil, err
	}
	out := make(map[string]volumePaths, len(podUIDs))
	for _, uid := range podUIDs {
		if uid == "" || strings.Contains(uid, "/") || uid == "." || uid == ".." {
			return nil, fmt.Errorf("pod UID %q: not a directory name below %s", uid, pods)
		}
		var pp volumePaths
		pod := filepath.Join(pods, uid)
		// volumes/<plugin>/<volume>, and its mount directory for CSI.
		vols, err := globSafe(root, filepath.Join(pod, "volumes"), 2)
		if err != nil {
			return nil, err
		}
		for _, v := range vols {
			if filepath.Base(filepath.Dir(v)) == kubelet.CSIPluginDir {
				pp.whole = append(pp.whole, filepath.Join(v, "mount"))
			}
			pp.other = append(pp.other, v)
		}
		subs, err := globSafe(root, filepath.Join(pod, "volume-subpaths"), 3)
		if err != nil {
			return nil, err
		}
		pp.other = append(pp.other, subs...)
		for _, pv := range blockPVs {
			if pv != "publish" && pv != "staging" {
				pp.whole = append(pp.whole, filepath.Join(blockDir, pv, "dev", uid))
			}
		}
		for _, pv := range published {
			pp.whole = append(pp.whole, filepath.Join(blockDir, "publish", pv, uid))
		}
		out[uid] = pp
	}
	return out, nil
}

// globSafe lists the paths depth directory levels below dir (a directory
// of kubelet's below root), each level read by readDirSafe, at most
// maxSubPathBinds names a level.
func globSafe(root, dir string, depth int) ([]string, error) {
	level := []string{dir}
	for range depth {
		var next []string
		for _, d := range level {
			names, err := readDirSafe(root, d)
			if errors.Is(err, errUnsafePath) {
				continue
			}
			if err != nil {
				return nil, err
			}
			for _, n := range names {
				next = append(next, filepath.Join(d, n))
			}
		}
		level = next
	}
	return level, nil
}

// pathState is what a mount namespace shows at a path: whether it is a
// mount point, and the device number (statx, without asking the
// filesystem) of what is on top there.
type pathState struct {
	mountPoint bool
	dev        probe.Dev
	// link: resolving the path meets a symlink, which is not followed.
	link bool
}

// DifferIn returns the paths (below the root, each opened without symlinks
// below it) at which the mount namespace of the process whose root is
// nsRoot (/proc/<pid>/root) shows something else than ours: a mount point
// where we have none, or one of another filesystem. After our unmounts
// (and guards) a difference means they did not reach that namespace. A
// path missing in both agrees.
func (u *Unmounter) DifferIn(nsRoot string, paths []string) ([]string, error) {
	root := filepath.Clean(u.root())
	nsfd, err := unix.Open(nsRoot, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open the namespace root %s: %w", nsRoot, err)
	}
	defer unix.Close(nsfd)
	// The kubelet root as that namespace resolves it, symlinks kept inside
	// that namespace's root.
	theirRoot, err := openat2(nsfd, strings.TrimPrefix(root, "/"), unix.O_PATH|unix.O_DIRECTORY, unix.RESOLVE_IN_ROOT|unix.RESOLVE_NO_MAGICLINKS)
	if err != nil {
		return nil, fmt.Errorf("open kubelet root %s in %s: %w", root, nsRoot, err)
	}
	defer unix.Close(theirRoot)
	ourRoot, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open kubelet root %s: %w", root, err)
	}
	defer unix.Close(ourRoot)
	var out []string
	for _, p := range paths {
		clean := filepath.Clean(p)
		if !kubelet.Under(root, clean) {
			return nil, &unsafePathError{Path: p, Root: root, Reason: "not strictly below the kubelet root"}
		}
		rel := strings.TrimPrefix(clean, root+"/")
		ours, err := stateAt(ourRoot, rel)
		if err != nil {
			return nil, resolveErr(root, clean, clean, err)
		}
		theirs, err := stateAt(theirRoot, rel)
		if err != nil {
			return nil, resolveErr(root, clean, clean+" in "+nsRoot, err)
		}
		if ours != theirs {
			out = append(out, clean)
		}
	}
	return out, nil
}

// stateAt resolves rel below the directory dirfd without symlinks and says
// what is there; a missing path is the zero state, a path through a
// symlink the link state. Nothing is asked of a filesystem mounted at rel.
func stateAt(dirfd int, rel string) (pathState, error) {
	st, err := resolveState(dirfd, rel)
	if errors.Is(err, unix.ELOOP) || errors.Is(err, unix.EXDEV) {
		return pathState{link: true}, nil
	}
	return st, err
}

func resolveState(dirfd int, rel string) (pathState, error) {
	dir, name := filepath.Split(rel)
	dir = strings.TrimSuffix(dir, "/")
	if dir == "" {
		dir = "."
	}
	parent, err := openat2(dirfd, dir, unix.O_PATH|unix.O_DIRECTORY, resolveSafe)
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, unix.ENOENT) {
		return pathState{}, nil
	}
	if err != nil {
		return pathState{}, err
	}
	defer unix.Close(parent)
	fd, err := openat2(parent, name, unix.O_PATH, resolveSafe)
	if errors.Is(err, unix.ENOENT) {
		return pathState{}, nil
	}
	if err != nil {
		return pathState{}, err
	}
	defer unix.Close(fd)
	pid, err := fdMountID(parent)
	if err != nil {
		return pathState{}, err
	}
	id, err := fdMountID(fd)
	if err != nil {
		return pathState{}, err
	}
	var stx unix.Statx_t
	if err := unix.Statx(fd, "", unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW|unix.AT_STATX_DONT_SYNC, 0, &stx); err != nil {
		return pathState{}, err
	}
	return pathState{mountPoint: id != pid, dev: probe.Dev{Major: stx.Dev_major, Minor: stx.Dev_minor}}, nil
}
