package remount

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// opGuard mounts the guard over a publish target or staging path that
// lost its mount.
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
	// ProcDir is where procfs is mounted, for our own mount table; "/proc"
	// when empty.
	ProcDir string
}

// Guard is the Repairer's Guarder.Guard, under its kubelet root and
// dry-run setting.
func (r *Repairer) Guard(ctx context.Context, target string) Action {
	return (&Guarder{Root: r.root, DryRun: r.cfg.DryRun, Sys: r.cfg.Sys, ProcDir: r.procDir}).Guard(ctx, target)
}

// guardTries bounds Guard's attempts when a mount comes on the target
// between its check and its attach.
const guardTries = 3

// Guard mounts mountmedic's guard (probe.GuardSource: an empty tmpfs whose
// superblock is read-only, mounted nosuid, nodev, noexec) over a pod's CSI
// publish target, or a volume's CSI staging path, that kubelet set up but
// that is no longer a mount point. Until the volume is published (or
// staged) there again, a container started or restarted on the volume, a
// pod published from the staging path, or a container that receives host
// mounts (HostToContainer), sees the guard: its writes fail with EROFS
// instead of landing, silently, in the directory on the node's disk. The
// guard is lifted like a dead mount: the repair unmounts it before it
// stages or publishes, the Unmount tier at pod teardown, and, when no
// agent runs any more, the driver's NodeUnpublishVolume (or
// NodeUnstageVolume), which unmounts whatever is mounted at the path,
// before kubelet removes the directory.
//
// Only a directory strictly below the kubelet root, reached without a
// symlink, that is a publish target (pods/<uid>/volumes/kubernetes.io~csi/
// <volume>/mount) or a staging path (plugins/kubernetes.io/csi/<driver>/
// <hash>/globalmount) and is not a mount point is guarded; the mount is
// attached to the directory opened then, never to a path resolved again.
// The kernel attaches a mount on top of whatever is mounted at the
// directory by then: a publish between the check and the attach would
// put the guard over the live volume. So the guard's parent is checked
// after the attach; a guard whose parent is not the mount the directory
// was checked on is detached at once and the target checked again (at
// most guardTries times). In dry-run the action is planned, not taken.
func (g *Guarder) Guard(ctx context.Context, target string) Action {
	root := filepath.Clean(g.Root)
	a := Action{Op: opGuard, Path: target, DryRun: g.DryRun}
	start := time.Now()
	defer func() {
		if !a.DryRun {
			a.Took = time.Since(start)
		}
	}()
	t, ok := kubelet.Classify(root, target)
	if !ok || !(t.Kind == kubelet.KindPublish && t.Plugin == kubelet.CSIPluginDir || t.Kind == kubelet.KindStaging) {
		a.Err = fmt.Errorf("%s is neither a CSI publish target nor a CSI staging path below %s: not guarded", target, root)
		return a
	}
	for try := 1; ; try++ {
		landed, err := g.attach(target, &a)
		if err != nil || landed {
			a.Err = err
			break
		}
		if try == guardTries {
			a.Err = fmt.Errorf("guard %s: a mount came there during each of %d attempts: %w", target, guardTries, ErrMountChanged)
			break
		}
	}
	if a.Err == nil && !a.DryRun {
		what := "publish target"
		if t.Kind == kubelet.KindStaging {
			what = "staging path"
		}
		klog.FromContext(ctx).V(2).Info("Guarded a "+what+" that lost its mount", "path", target)
	}
	return a
}

// attach checks target once and attaches the guard there: landed is false
// when the guard came on top of a mount made since the check, and was
// detached again.
func (g *Guarder) attach(target string, a *Action) (landed bool, err error) {
	root := filepath.Clean(g.Root)
	p, err := openSafe(root, target)
	if err != nil {
		return false, err
	}
	defer p.Close()
	var st unix.Stat_t
	if err := unix.Fstat(p.FD(), &st); err != nil {
		return false, fmt.Errorf("stat %s: %w", target, err)
	}
	switch {
	case st.Mode&unix.S_IFMT != unix.S_IFDIR:
		return false, fmt.Errorf("%s is not a directory: not guarded", target)
	case p.IsMountPoint():
		a.Detail = "a mount point again: not guarded"
		return false, ErrMountChanged
	}
	if g.DryRun {
		a.Detail = "would mount an empty read-only tmpfs (" + probe.GuardSource + ") so that writes fail instead of reaching the node's disk"
		return true, nil
	}
	mfd, err := guardMount()
	if err != nil {
		return false, err
	}
	defer unix.Close(mfd)
	sys := g.Sys.orHost()
	if err := sys.MoveMount(mfd, "", p.FD(), "", unix.MOVE_MOUNT_F_EMPTY_PATH|unix.MOVE_MOUNT_T_EMPTY_PATH); err != nil {
		return false, fmt.Errorf("attach the guard at %s: %w", target, err)
	}
	id, parent, err := g.guardParent(mfd)
	if err != nil {
		// Where it landed is unknown: it goes again.
		return false, errors.Join(fmt.Errorf("guard at %s: %w", target, err), g.detach(mfd, id, target))
	}
	if parent != p.MountID {
		if err := g.detach(mfd, id, target); err != nil {
			return false, err
		}
		a.Detail = fmt.Sprintf("came on top of mount %d, made at %s since the check: detached", parent, target)
		return false, nil
	}
	a.Detail = "mounted an empty read-only tmpfs (" + probe.GuardSource + "): writes fail until the volume is there again"
	return true, nil
}

// guardParent reads the attached guard's mount ID (statx of its root
// descriptor) and its parent's: statmount of the guard's unique ID, or our
// mount table's line for it on kernels before 6.8.
func (g *Guarder) guardParent(mfd int) (id, parent int, err error) {
	var stx unix.Statx_t
	if err := unix.Statx(mfd, "", unix.AT_EMPTY_PATH|unix.AT_STATX_DONT_SYNC, unix.STATX_MNT_ID, &stx); err != nil {
		return 0, 0, fmt.Errorf("mount ID of the guard: %w", err)
	}
	id = int(stx.Mnt_id)
	if uid, err := probe.UniqueMountID(mfd); err == nil {
		if s, err := probe.Statmount(uid); err == nil && s.OldID == id {
			return id, s.OldParentID, nil
		}
	}
	parent, err = mountParent(g.procDir(), id)
	return id, parent, err
}

func (g *Guarder) procDir() string {
	if g.ProcDir == "" {
		return "/proc"
	}
	return g.ProcDir
}

// detach lazily unmounts the guard that mfd holds the root of, while the
// mount there is still the guard (mount ID id; 0: not known).
func (g *Guarder) detach(mfd, id int, target string) error {
	at := "/proc/self/fd/" + strconv.Itoa(mfd)
	fd, err := unix.Open(at, unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("detach the guard from %s: %w", target, err)
	}
	defer unix.Close(fd)
	got, err := fdMountID(fd)
	if err != nil {
		return fmt.Errorf("detach the guard from %s: %w", target, err)
	}
	if id != 0 && got != id {
		return fmt.Errorf("detach the guard from %s: mount %d is there, not the guard %d: %w", target, got, id, ErrMountChanged)
	}
	if err := g.Sys.orHost().Unmount("/proc/self/fd/"+strconv.Itoa(fd), unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach the guard from %s: %w", target, err)
	}
	return nil
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
