package remount

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/mountmedic/mountmedic/probe"
	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
)

// overMounter puts a fresh mount on top of a dead one on the host, for
// containers that receive host mounts (mountPropagation HostToContainer or
// Bidirectional).
//
// The kernel behaviour it relies on (Linux 6.18):
//
//   - mount(2) with MS_BIND|MS_REC onto the path of a dead FUSE mount (daemon
//     killed: ENOTCONN) or a hung one (daemon blocked: statfs never returns)
//     succeeds at once, whether given the path string or the
//     /proc/self/fd/N magic link of an O_PATH descriptor of it. The target
//     lookup ends on the mount's root dentry, which is reached by crossing
//     the mount from the parent directory, not by asking the filesystem; the
//     kernel then mounts on the topmost mount there. fstatat of the same
//     path answers ENOTCONN: never stat the target.
//   - The new mount propagates like any mount on the dead mount's root: to
//     its peers (the publish target, a bind of the staging mount made under
//     the shared kubelet root) and to their slaves, which include the
//     volume binds of a container whose mounts are slaves (HostToContainer):
//     that container reads the fresh filesystem at once. A container whose
//     mounts are private (mountPropagation None, the default) keeps the dead
//     mount, and so does every subPath bind (its root is a subdirectory of
//     the volume, where nothing was mounted); those need a live swap or a
//     restart.
//   - The dead mount stays underneath (mounts stack); processes with files
//     or a working directory on it keep failing.
type overMounter struct {
	// Root is the kubelet root; probe.DefaultKubeletRoot when empty.
	Root string
	// DryRun resolves and checks both paths and returns the plan without
	// mounting.
	DryRun bool
	// Sys are the operations that change mounts; zero fields take the
	// host's.
	Sys Syscalls
}

// overMount binds the mount at source (a freshly staged or published mount
// below the kubelet root) recursively on top of dead, which must still be on
// top at its path: with dead.ID set, the mount on top there must have that
// ID (and dead.UniqueID, when set), or the action fails with
// ErrMountChanged. Both paths must pass
// openSafe.
func (o *overMounter) overMount(ctx context.Context, source string, dead *probe.Mount) ([]Action, error) {
	root := o.Root
	if root == "" {
		root = probe.DefaultKubeletRoot
	}
	logger := klog.FromContext(ctx).WithValues("source", source, "target", dead.Path)
	a := Action{Op: opOverMount, Path: dead.Path, DryRun: o.DryRun}
	fail := func(err error) ([]Action, error) {
		a.Err = fmt.Errorf("over-mount %s on %s: %w", source, dead.Path, err)
		if !errors.Is(err, ErrMountChanged) {
			logger.Error(err, "Over-mount refused or failed")
		}
		return []Action{a}, a.Err
	}
	if err := ctx.Err(); err != nil {
		return fail(err)
	}
	src, err := openSafe(root, source)
	if err != nil {
		return fail(err)
	}
	defer src.Close()
	if !src.IsMountPoint() {
		return fail(fmt.Errorf("source %s is not a mount point", source))
	}
	dst, err := openSafe(root, dead.Path)
	if err != nil {
		return fail(err)
	}
	defer dst.Close()
	switch {
	case !dst.IsMountPoint():
		return fail(fmt.Errorf("nothing is mounted at %s: %w", dead.Path, ErrMountChanged))
	case dead.ID != 0 && dst.isMount(dead) != nil:
		return fail(dst.isMount(dead))
	case src.MountID == dst.MountID:
		return fail(fmt.Errorf("source and target are the same mount %d", src.MountID))
	}
	a.Detail = fmt.Sprintf("bind mount %d over mount %d", src.MountID, dst.MountID)
	if o.DryRun {
		logger.V(2).Info("Would over-mount", "sourceMountID", src.MountID, "targetMountID", dst.MountID)
		return []Action{a}, nil
	}
	start := time.Now()
	err = o.Sys.orHost().Mount(src.FDPath(), dst.FDPath(), "", unix.MS_BIND|unix.MS_REC, "")
	a.Took = time.Since(start)
	if err != nil {
		return fail(err)
	}
	logger.V(2).Info("Over-mounted", "sourceMountID", src.MountID, "targetMountID", dst.MountID)
	return []Action{a}, nil
}
