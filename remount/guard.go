package remount

import (
	"context"
	"fmt"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// opGuard mounts the guard over a publish target that lost its mount.
const opGuard Op = "guard"

// Guarder mounts mountmedic's guard. The Repairer has one (Repairer.Guard),
// and the failover fence guards the publish targets it unmounted.
type Guarder struct {
	// Root is the kubelet root; nothing outside it is guarded.
	Root string
	// DryRun plans the guard without mounting it.
	DryRun bool
	// Sys replaces move_mount in unit tests; the host's when nil.
	Sys Syscalls
}

// Guard is the Repairer's Guarder.Guard, under its kubelet root and
// dry-run setting.
func (r *Repairer) Guard(ctx context.Context, target string) Action {
	return (&Guarder{Root: r.root, DryRun: r.cfg.DryRun, Sys: r.cfg.Sys}).Guard(ctx, target)
}

// Guard mounts mountmedic's guard (probe.GuardSource: an empty tmpfs whose
// superblock is read-only, mounted nosuid, nodev, noexec) over a pod's CSI publish target that
// kubelet set up but that is no longer a mount point. Until the volume is
// published there again, a container started or restarted on the volume,
// or one that receives host mounts (HostToContainer), sees the guard: its
// writes fail with EROFS instead of landing, silently, in the directory on
// the node's disk. The guard is lifted like a dead mount: the repair
// unmounts it before it publishes, the Unmount tier at pod teardown, and,
// when no agent runs any more, the driver's NodeUnpublishVolume, which
// unmounts whatever is mounted at the target, before kubelet removes the
// directory.
//
// Only a directory strictly below the kubelet root, reached without a
// symlink, that is a publish target (pods/<uid>/volumes/kubernetes.io~csi/
// <volume>/mount) and is not a mount point is guarded; the mount is attached
// to the directory opened then, never to a path resolved again. In dry-run
// the action is planned, not taken.
func (g *Guarder) Guard(ctx context.Context, target string) Action {
	root := filepath.Clean(g.Root)
	a := Action{Op: opGuard, Path: target, DryRun: g.DryRun}
	start := time.Now()
	defer func() {
		if !a.DryRun {
			a.Took = time.Since(start)
		}
	}()
	if t, ok := kubelet.Classify(root, target); !ok || t.Kind != kubelet.KindPublish || t.Plugin != kubelet.CSIPluginDir {
		a.Err = fmt.Errorf("%s is not a CSI publish target below %s: not guarded", target, root)
		return a
	}
	p, err := openSafe(root, target)
	if err != nil {
		a.Err = err
		return a
	}
	defer p.Close()
	var st unix.Stat_t
	if err := unix.Fstat(p.FD(), &st); err != nil {
		a.Err = fmt.Errorf("stat %s: %w", target, err)
		return a
	}
	switch {
	case st.Mode&unix.S_IFMT != unix.S_IFDIR:
		a.Err = fmt.Errorf("%s is not a directory: not guarded", target)
		return a
	case p.IsMountPoint():
		a.Detail = "a mount point again: not guarded"
		a.Err = ErrMountChanged
		return a
	}
	if g.DryRun {
		a.Detail = "would mount an empty read-only tmpfs (" + probe.GuardSource + ") so that writes fail instead of reaching the node's disk"
		return a
	}
	mfd, err := guardMount()
	if err != nil {
		a.Err = err
		return a
	}
	defer unix.Close(mfd)
	if err := g.Sys.orHost().MoveMount(mfd, "", p.FD(), "", unix.MOVE_MOUNT_F_EMPTY_PATH|unix.MOVE_MOUNT_T_EMPTY_PATH); err != nil {
		a.Err = fmt.Errorf("attach the guard at %s: %w", target, err)
		return a
	}
	a.Detail = "mounted an empty read-only tmpfs (" + probe.GuardSource + "): writes fail until the volume is published again"
	klog.FromContext(ctx).V(2).Info("Guarded a publish target that lost its mount", "path", target)
	return a
}

// guardMount makes the guard, a detached mount, with the new mount API (no
// path is involved until it is attached): an empty tmpfs, read-only, that
// no one can create anything in. A write, a mkdir or kubelet's preparation
// of a subPath there fails with EROFS.
func guardMount() (int, error) {
	fsfd, err := unix.Fsopen("tmpfs", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("fsopen tmpfs: %w", err)
	}
	defer unix.Close(fsfd)
	if err := unix.FsconfigSetString(fsfd, "source", probe.GuardSource); err != nil {
		return -1, fmt.Errorf("guard source: %w", err)
	}
	for _, kv := range [][2]string{{"size", "4k"}, {"nr_inodes", "16"}, {"mode", "0555"}} {
		if err := unix.FsconfigSetString(fsfd, kv[0], kv[1]); err != nil {
			return -1, fmt.Errorf("guard option %s=%s: %w", kv[0], kv[1], err)
		}
	}
	if err := unix.FsconfigSetFlag(fsfd, "ro"); err != nil {
		return -1, fmt.Errorf("guard read-only: %w", err)
	}
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return -1, fmt.Errorf("create the guard tmpfs: %w", err)
	}
	// Read-only is the superblock's, not the mount's: a container's bind of
	// the guard then carries only the container's own read-only flag, which
	// the live swap keeps when it replaces the guard with the fresh volume.
	mfd, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV|unix.MOUNT_ATTR_NOEXEC)
	if err != nil {
		return -1, fmt.Errorf("fsmount the guard: %w", err)
	}
	return mfd, nil
}
