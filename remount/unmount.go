package remount

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/moby/sys/mountinfo"
	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/probe/kubelet"
	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
)

// defaultFusectlDir is where the fuse control filesystem is mounted.
const defaultFusectlDir = "/sys/fs/fuse/connections"

// Unmounter lazily unmounts dead mounts below the kubelet root, aborting
// their FUSE connections first when asked. It never stats a mount point and
// never runs umount(8) or mount-utils (both stat the target first and hang on
// a hung FUSE daemon): unmounting is umount2(MNT_DETACH) on the descriptor
// of a safe path (see openSafe), which returns at once even on a hung mount.
type Unmounter struct {
	// Root is the kubelet root; probe.DefaultKubeletRoot when empty.
	Root string
	// DryRun resolves and checks every path and returns the plan, without
	// unmounting, mounting or aborting anything.
	DryRun bool
	// FusectlDir is where the fuse control filesystem is mounted;
	// defaultFusectlDir when empty. Where it is not, a detached mount is
	// read instead (MountFusectl): the agent never mounts it on the host.
	FusectlDir string
	// Sys are the operations that change mounts; zero fields take the
	// host's.
	Sys Syscalls
	// ProcDir is where procfs is mounted, for our own mount table
	// (<ProcDir>/thread-self/mountinfo); "/proc" when empty.
	ProcDir string
	// Servers shares one scan of the processes' /dev/fuse descriptors
	// among aborts (findServers); nil scans for each abort.
	Servers *ServerIndex
	// Users are the UIDs of the pods that use the volume whose connection
	// AbortFUSE aborts: a process in one of their cgroups holding the
	// connection is the volume's user, and is never killed as its daemon.
	Users []string
	// Home is where the driver catalogue puts that volume's daemon
	// (kubelet.DaemonUnknown when not catalogued); a holder where the
	// catalogue says the daemon does not live is left alone (killable).
	Home kubelet.DaemonHome
}

func (u *Unmounter) procDir() string {
	if u.ProcDir == "" {
		return "/proc"
	}
	return u.ProcDir
}

func (u *Unmounter) root() string {
	if u.Root == "" {
		return probe.DefaultKubeletRoot
	}
	return u.Root
}

func (u *Unmounter) fusectlDir() string {
	if u.FusectlDir == "" {
		return defaultFusectlDir
	}
	return u.FusectlDir
}

// Unmount lazily unmounts the top mount at each path, deepest paths first
// (a subPath bind before the publish target before the staging mount), each
// path once. A path that is not a mount point, or is gone, counts as done: a
// second call does nothing. Each path must pass openSafe; a refused path is
// an action whose error satisfies errors.Is(err, errUnsafePath), and the
// other paths are still unmounted. The error joins the actions' errors.
//
// Unmount removes whatever mount is on top at the path. When the caller read
// the mounts from a mount table, UnmountMounts is safer: it leaves a path
// alone when another mount has come on top since.
func (u *Unmounter) Unmount(ctx context.Context, paths []string) ([]Action, error) {
	targets := make([]unmountTarget, 0, len(paths))
	for _, p := range paths {
		targets = append(targets, unmountTarget{path: p})
	}
	return u.unmountAll(ctx, targets)
}

// UnmountMounts lazily unmounts mounts read from our own mount table
// (<ProcDir>/thread-self/mountinfo), deepest first. It unmounts a path only
// while the mount on top there is the one the table named (same mount ID);
// otherwise the action fails with ErrMountChanged and nothing is unmounted
// there. Mount IDs belong to one mount namespace: the same mount has another
// ID in every other one, so mounts read from another namespace's table
// (--host-table=/proc/1/mountinfo) go to UnmountFromTable.
func (u *Unmounter) UnmountMounts(ctx context.Context, mounts []*probe.Mount) ([]Action, error) {
	targets := make([]unmountTarget, 0, len(mounts))
	for _, m := range mounts {
		targets = append(targets, unmountTarget{path: m.Path, id: m.ID, uid: m.UniqueID})
	}
	return u.unmountAll(ctx, targets)
}

// UnmountFromTable lazily unmounts mounts read from the mount table of any
// mount namespace, ours or another (the host's /proc/1/mountinfo seen from a
// hostPID container), deepest path first; on each path every mount named
// there, from the top down.
//
// Their mount IDs are not used: a mount copied or propagated into another
// namespace is another mount with another ID. Each is found in our own
// mount namespace, read per path where the kernel allows it (PerPath) and
// else from our mount table, read once here, as the mount at the same path
// on the same device with the same root (mountinfo's fourth field). On each
// path the mounts of our stack are unmounted from the top down while the
// one on top is one the table named, each checked by its ID in our namespace when the
// path is opened (openSafe: below the kubelet root, no symlink); a mount on
// top here that the table does not name stops that path with
// ErrMountChanged, and nothing below it is touched. A path with no mount
// here counts as not mounted.
//
// Our unmounts reach the table's namespace only through mount propagation
// (the DaemonSet's Bidirectional kubelet root); the caller checks that by
// reading its table again.
func (u *Unmounter) UnmountFromTable(ctx context.Context, mounts []*probe.Mount) ([]Action, error) {
	// Our stacks: per path where the kernel allows it (stackAt), else from
	// our whole table.
	perPath := u.PerPath()
	var table *hostTable
	if !perPath {
		own, err := probe.ReadFile(filepath.Join(u.procDir(), "thread-self", "mountinfo"), probe.Options{Root: u.root()})
		if err != nil {
			return nil, fmt.Errorf("read our own mount table: %w", err)
		}
		table = buildHostTable(own)
	}
	named := map[string]map[mountKey]bool{}
	var paths []string
	for _, m := range mounts {
		p := filepath.Clean(m.Path)
		if named[p] == nil {
			named[p] = map[mountKey]bool{}
			paths = append(paths, p)
		}
		named[p][keyOf(m)] = true
	}
	slices.SortStableFunc(paths, func(a, b string) int {
		if d := depth(b) - depth(a); d != 0 {
			return d
		}
		return strings.Compare(b, a)
	})
	sys := u.Sys.orHost()
	var actions []Action
	for _, path := range paths {
		if err := ctx.Err(); err != nil {
			actions = append(actions, Action{Op: opUnmount, Path: path, DryRun: u.DryRun,
				Err: fmt.Errorf("unmount %s: %w", path, err)})
			continue
		}
		var stack []*probe.Mount
		if perPath {
			var err error
			if stack, err = stackAt(u.root(), path); err != nil {
				actions = append(actions, Action{Op: opUnmount, Path: path, DryRun: u.DryRun,
					Err: fmt.Errorf("unmount %s: %w", path, err)})
				continue
			}
		} else {
			stack = table.stack(path)
		}
		actions = append(actions, u.unmountNamed(ctx, sys, path, stack, named[path])...)
	}
	return actions, actionsErr(actions)
}

// mountKey names a mount across mount namespaces: device and root (the
// path is the caller's key).
type mountKey struct {
	dev  probe.Dev
	root string
}

func keyOf(m *probe.Mount) mountKey { return mountKey{m.Dev, m.Root} }

// unmountNamed unmounts our stack at path (bottom first) from the top down
// while the top is named; it stops at the first failure.
func (u *Unmounter) unmountNamed(ctx context.Context, sys Syscalls, path string, stack []*probe.Mount, named map[mountKey]bool) []Action {
	if len(stack) == 0 {
		// Not a mount point here: gone since the table was read, or never
		// propagated here. unmountOne says which path it saw.
		return []Action{u.unmountOne(ctx, sys, unmountTarget{path: path, id: -1})}
	}
	var out []Action
	// mountmedic's guard over a named mount came there by propagation: it
	// was attached at a staging path (or a directory above), and this
	// path is a bind of that bare directory, a peer that receives every
	// mount made there. It is ours and hides the named mount: it goes
	// first (and, by the same propagation, the guard it came from).
	for len(stack) > 1 && stack[len(stack)-1].Guard && named[keyOf(stack[len(stack)-2])] {
		g := stack[len(stack)-1]
		a := u.unmountOne(ctx, sys, unmountTarget{path: path, id: g.ID, uid: g.UniqueID})
		a.Detail = "mountmedic's guard, propagated over the mount to unmount: " + a.Detail
		out = append(out, a)
		if a.Err != nil {
			return out
		}
		stack = stack[:len(stack)-1]
	}
	top := stack[len(stack)-1]
	if !named[keyOf(top)] {
		err := fmt.Errorf("unmount %s: mount %d (device %s, root %s) is on top there in our mount namespace, not a mount the table named: %w",
			path, top.ID, top.Dev, top.Root, ErrMountChanged)
		klog.FromContext(ctx).V(2).Info("Left a mount the table does not name alone", "path", path, "mountID", top.ID, "dev", top.Dev.String())
		return append(out, Action{Op: opUnmount, Path: path, DryRun: u.DryRun, Err: err})
	}
	for i := len(stack) - 1; i >= 0 && named[keyOf(stack[i])]; i-- {
		m := stack[i]
		if u.DryRun && i < len(stack)-1 {
			out = append(out, Action{Op: opUnmount, Path: path, DryRun: true, Detail: "mount " + strconv.Itoa(m.ID) + ", below the one above"})
			continue
		}
		a := u.unmountOne(ctx, sys, unmountTarget{path: path, id: m.ID, uid: m.UniqueID})
		out = append(out, a)
		if a.Err != nil || strings.HasSuffix(a.Detail, notMounted) {
			break
		}
	}
	return out
}

// isFUSEType reports whether a filesystem type is served by a FUSE daemon:
// fuse.<name> and fuseblk.<name>, both with a connection in fusectl.
func isFUSEType(fsType string) bool {
	base, _, _ := strings.Cut(fsType, ".")
	return base == "fuse" || base == "fuseblk"
}

type unmountTarget struct {
	path string
	id   int    // 0: whatever is on top; -1: nothing (only a path with no mount passes)
	uid  uint64 // the unique mount ID to find on top, when known
}

func (u *Unmounter) unmountAll(ctx context.Context, targets []unmountTarget) ([]Action, error) {
	// Deepest first, so that a mount below another path is gone before its
	// parent; each path once, or a second pass would unmount the next mount
	// down a stack.
	slices.SortStableFunc(targets, func(a, b unmountTarget) int {
		da, db := depth(a.path), depth(b.path)
		if da != db {
			return db - da
		}
		return strings.Compare(filepath.Clean(b.path), filepath.Clean(a.path))
	})
	targets = slices.CompactFunc(targets, func(a, b unmountTarget) bool {
		return filepath.Clean(a.path) == filepath.Clean(b.path)
	})
	sys := u.Sys.orHost()
	var actions []Action
	for _, t := range targets {
		if err := ctx.Err(); err != nil {
			actions = append(actions, Action{Op: opUnmount, Path: t.path, DryRun: u.DryRun,
				Err: fmt.Errorf("unmount %s: %w", t.path, err)})
			continue
		}
		actions = append(actions, u.unmountOne(ctx, sys, t))
	}
	return actions, actionsErr(actions)
}

func depth(p string) int { return strings.Count(filepath.Clean(p), "/") }

// notMounted ends the Detail of an unmount that found nothing to take off.
const notMounted = "not mounted"

// Unmounted counts the mounts that actions of Unmount or UnmountMounts took
// off (or, in a dry run, would have): those that found a mount and did not
// fail or find it gone by the time of the unmount.
func Unmounted(actions []Action) int {
	n := 0
	for _, a := range actions {
		if a.Op == opUnmount && a.Err == nil && strings.HasPrefix(a.Detail, "mount ") && !strings.HasSuffix(a.Detail, notMounted) {
			n++
		}
	}
	return n
}

func (u *Unmounter) unmountOne(ctx context.Context, sys Syscalls, t unmountTarget) Action {
	logger := klog.FromContext(ctx).WithValues("path", t.path)
	a := Action{Op: opUnmount, Path: t.path, DryRun: u.DryRun}
	sp, err := openSafe(u.root(), t.path)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		a.Detail = "path gone: " + notMounted
		return a
	case err != nil:
		a.Err = fmt.Errorf("unmount %s: %w", t.path, err)
		logger.Error(err, "Refused to unmount")
		return a
	}
	defer sp.Close()
	if !sp.IsMountPoint() {
		a.Detail = notMounted
		return a
	}
	if t.id < 0 {
		a.Err = fmt.Errorf("unmount %s: mount %d is on top there, none was when our mount table was read: %w", t.path, sp.MountID, ErrMountChanged)
		logger.V(2).Info("Left a new mount alone", "found", sp.MountID)
		return a
	}
	if t.id != 0 {
		if err := sp.isMount(&probe.Mount{ID: t.id, UniqueID: t.uid}); err != nil {
			a.Err = fmt.Errorf("unmount %s: %w", t.path, err)
			logger.V(2).Info("Left a changed mount alone", "want", t.id, "found", sp.MountID, "err", err)
			return a
		}
	}
	a.Detail = "mount " + strconv.Itoa(sp.MountID)
	if u.DryRun {
		logger.V(2).Info("Would unmount lazily", "mountID", sp.MountID)
		return a
	}
	start := time.Now()
	err = sys.Unmount(sp.FDPath(), unix.MNT_DETACH)
	a.Took = time.Since(start)
	switch {
	case errors.Is(err, unix.EINVAL):
		// Not a mount point (any more), or a mount locked into a less
		// privileged namespace; either way nothing is ours to unmount.
		a.Detail += ": " + notMounted
	case err != nil:
		a.Err = fmt.Errorf("unmount %s: %w", t.path, err)
		logger.Error(err, "Lazy unmount failed", "mountID", sp.MountID)
	default:
		logger.V(2).Info("Unmounted lazily", "mountID", sp.MountID)
	}
	return a
}

// MountFusectl makes the fuse control filesystem readable when it is not
// mounted at FusectlDir: a detached fusectl mount (fsopen, fsmount), which
// no mount table shows and which nothing on the host sees, named by its
// descriptor's /proc/self/fd/<n>. Its abort files end a hung connection,
// its waiting files tell the prober a connection has requests waiting
// (probe.Prober.WatchStallsAt). dir is where to read it; release closes
// the detached mount (a no-op when FusectlDir holds fusectl already, and
// then no action is returned). A dry run makes nothing: it reads fusectl
// only where it is mounted.
func (u *Unmounter) MountFusectl(ctx context.Context) (dir string, release func(), actions []Action, err error) {
	dir = u.fusectlDir()
	nop := func() {}
	mounted, err := isFusectl(dir)
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		a := Action{Op: opMountFusectl, Path: dir, DryRun: u.DryRun, Err: fmt.Errorf("check fusectl at %s: %w", dir, err)}
		return dir, nop, []Action{a}, a.Err
	}
	if mounted {
		return dir, nop, nil, nil
	}
	a := Action{Op: opMountFusectl, Path: dir, DryRun: u.DryRun, Detail: "fusectl not mounted there: read through a detached mount that no mount table shows"}
	if u.DryRun {
		return dir, nop, []Action{a}, nil
	}
	start := time.Now()
	fd, err := detachedFusectl()
	a.Took = time.Since(start)
	if err != nil {
		a.Err = fmt.Errorf("mount fusectl detached: %w", err)
		return dir, nop, []Action{a}, a.Err
	}
	klog.FromContext(ctx).V(4).Info("Mounted fusectl detached", "fd", fd)
	return "/proc/self/fd/" + strconv.Itoa(fd), func() { unix.Close(fd) }, []Action{a}, nil
}

// detachedFusectl makes a fuse control filesystem mount attached nowhere
// and returns its root's descriptor: the host's mount tables stay as they
// were, and the mount ends when the descriptor is closed.
func detachedFusectl() (int, error) {
	fsfd, err := unix.Fsopen("fusectl", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("fsopen fusectl: %w", err)
	}
	defer unix.Close(fsfd)
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return -1, fmt.Errorf("create fusectl: %w", err)
	}
	mfd, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV|unix.MOUNT_ATTR_NOEXEC)
	if err != nil {
		return -1, fmt.Errorf("fsmount fusectl: %w", err)
	}
	return mfd, nil
}

// AbortFUSE aborts the FUSE connection of the filesystem with device number
// dev: it writes 1 to <FusectlDir>/<conn>/abort (or the same file of a
// detached fusectl mount where FusectlDir holds none, see MountFusectl).
// Requests in flight then fail with ECONNABORTED and later ones with
// ENOTCONN, so a hung daemon no longer blocks callers. A connection that
// is gone already counts as done. The processes serving the connection
// are killed right before the abort (findServers): woken, a daemon would
// unmount its mountpoint by path, where the volume is staged again next.
//
// Connection numbers are device numbers, which the kernel hands out again
// once a filesystem is gone: the connection is pinned and checked first.
// at is the mount of dev the caller found (in its mount table) on top at
// its path; AbortFUSE opens that path (openSafe: below the kubelet root, no
// symlink, no call into the filesystem) and holds the descriptor, which
// keeps the filesystem, its device number and its connection alive, until
// the abort is written. Right before writing it re-reads the pinned mount's
// device number (statx without sync, which asks no daemon) and its line in
// our mount table (by mount ID), and checks that the connection still has
// requests waiting (the hung one): a path now holding another mount or
// another filesystem, or a connection with nothing waiting, is not aborted.
func (u *Unmounter) AbortFUSE(ctx context.Context, dev probe.Dev, at *probe.Mount) ([]Action, error) {
	logger := klog.FromContext(ctx).WithValues("dev", dev.String())
	sys := u.Sys.orHost()
	dir := u.fusectlDir()
	var actions []Action
	if err := ctx.Err(); err != nil {
		actions = append(actions, Action{Op: opAbortFUSE, Path: dir, DryRun: u.DryRun,
			Err: fmt.Errorf("abort fuse connection of %s: %w", dev, err)})
		return actions, actionsErr(actions)
	}

	dir, release, mount, err := u.MountFusectl(ctx)
	defer release()
	actions = append(actions, mount...)
	if err != nil {
		return actions, err
	}

	conn := probe.FusectlConn(dev)
	connDir := filepath.Join(dir, strconv.FormatUint(uint64(conn), 10))
	p := filepath.Join(connDir, "abort")
	a := Action{Op: opAbortFUSE, Path: p, DryRun: u.DryRun, Detail: fmt.Sprintf("fuse connection %d of device %s", conn, dev)}
	if at == nil {
		a.Err = fmt.Errorf("abort fuse connection %d: no mount of device %s to pin it by", conn, dev)
		return append(actions, a), actionsErr(append(actions, a))
	}
	a.Detail += fmt.Sprintf(", pinned by mount %d at %s", at.ID, at.Path)
	if u.DryRun {
		logger.V(2).Info("Would abort FUSE connection", "conn", conn)
		servers, notes := u.findServers(ctx, conn)
		closeServers(servers)
		actions = append(actions, a)
		for _, s := range servers {
			actions = append(actions, Action{Op: opKillServer, Path: "pid " + strconv.Itoa(s.pid), DryRun: true,
				Detail: fmt.Sprintf("%s serves fuse connection %d: would be killed right before the abort", s, conn)})
		}
		return append(actions, notes...), nil
	}
	pin, err := openSafe(u.root(), at.Path)
	if err != nil {
		a.Err = fmt.Errorf("abort fuse connection %d: pin mount %d at %s: %w", conn, at.ID, at.Path, err)
		return append(actions, a), actionsErr(append(actions, a))
	}
	defer pin.Close()
	if err := pin.isMount(at); err != nil {
		a.Err = fmt.Errorf("abort fuse connection %d: %w", conn, err)
		return append(actions, a), actionsErr(append(actions, a))
	}
	waiting, err := u.recheckConn(pin, at, dev, connDir)
	switch {
	case err != nil:
		a.Err = fmt.Errorf("abort fuse connection %d: %w", conn, err)
		return append(actions, a), actionsErr(append(actions, a))
	case waiting == 0:
		a.Detail += ": no request waiting, not aborted"
		logger.V(2).Info("FUSE connection not aborted: no request waiting", "conn", conn)
		return append(actions, a), actionsErr(append(actions, a))
	}
	// The processes serving the connection are found while it is up and
	// killed before the abort: woken by it, a daemon's exit path
	// unmounts its mountpoint by path, which holds the fresh mount once
	// the volume is staged again. A process with SIGKILL pending never
	// runs its own code again, so no process is ever left stopped.
	servers, notes := u.findServers(ctx, conn)
	defer closeServers(servers)
	logServers(logger, conn, servers, notes)
	kills := signalServers(servers, conn)
	start := time.Now()
	err = sys.WriteFile(p, []byte("1"))
	a.Took = time.Since(start)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		a.Detail += ": connection gone"
	case err != nil:
		a.Err = fmt.Errorf("abort fuse connection %d: %w", conn, err)
		logger.Error(err, "FUSE abort failed", "conn", conn)
	default:
		logger.V(2).Info("Aborted FUSE connection", "conn", conn, "waiting", waiting)
	}
	if len(servers) == 0 && len(notes) == 0 {
		why := noServerReason()
		a.Detail += "; no process the agent can see serves it (" + why + "): its daemon is left alone"
		logger.Info("Left the daemon of an aborted FUSE connection alone: no process the agent can see serves it", "conn", conn, "why", why)
	}
	actions = append(actions, a)
	waitServers(ctx, servers, kills)
	for i, k := range kills {
		if k.Err != nil {
			// The abort stands: a kill refused is told, not a failed
			// repair (the re-stage goes on).
			logger.Error(k.Err, "Killing the process that served an aborted FUSE connection failed", "conn", conn)
			kills[i].Op, kills[i].Detail, kills[i].Err = opSkip, k.Detail+": "+k.Err.Error()+"; left running", nil
		} else {
			logger.Info("Killed the process that served an aborted FUSE connection", "conn", conn, "process", k.Path, "detail", k.Detail)
		}
	}
	actions = append(append(actions, kills...), notes...)
	return actions, actionsErr(actions)
}

// recheckConn re-reads, through the pinned mount, that it is still of
// device dev (statx with AT_STATX_DONT_SYNC: no request to the daemon) and
// still of dev for the kernel (statmount of its unique ID, or its line in
// our mount table where the kernel has no unique IDs), and returns the
// requests waiting on the connection (fusectl <conn>/waiting).
func (u *Unmounter) recheckConn(pin *safePath, at *probe.Mount, dev probe.Dev, connDir string) (int, error) {
	var stx unix.Statx_t
	if err := unix.Statx(pin.FD(), "", unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW|unix.AT_STATX_DONT_SYNC, 0, &stx); err != nil {
		return 0, fmt.Errorf("device of pinned mount %d at %s: %w", pin.MountID, pin.Path, err)
	}
	if got := (probe.Dev{Major: stx.Dev_major, Minor: stx.Dev_minor}); got != dev {
		return 0, fmt.Errorf("pinned mount %d at %s is of device %s now, not %s: %w", pin.MountID, pin.Path, got, dev, ErrMountChanged)
	}
	got, err := u.pinnedDev(pin, at)
	if err != nil {
		return 0, err
	}
	if got != dev {
		return 0, fmt.Errorf("mount %d at %s is of device %s in our mount table now, not %s: %w", pin.MountID, pin.Path, got, dev, ErrMountChanged)
	}
	n, err := probe.FusectlWaiting(unix.AT_FDCWD, filepath.Join(connDir, "waiting"))
	if errors.Is(err, fs.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("requests waiting on %s: %w", connDir, err)
	}
	return n, nil
}

// pinnedDev is the device of the pinned mount at: by its unique ID
// (statmount, whatever the node's mount count) when at has one, else from
// our mount table.
func (u *Unmounter) pinnedDev(pin *safePath, at *probe.Mount) (probe.Dev, error) {
	if at.UniqueID == 0 {
		return mountDev(u.procDir(), pin.MountID)
	}
	s, err := probe.Statmount(at.UniqueID)
	if errors.Is(err, unix.ENOENT) {
		return probe.Dev{}, fmt.Errorf("mount %d (unique ID %d) is gone: %w", pin.MountID, at.UniqueID, ErrMountChanged)
	}
	if err != nil {
		return probe.Dev{}, err
	}
	return s.Dev, nil
}

// mountDev reads the device number of mount id from our mount table.
func mountDev(procDir string, id int) (probe.Dev, error) {
	f, err := os.Open(filepath.Join(procDir, "thread-self", "mountinfo"))
	if err != nil {
		return probe.Dev{}, fmt.Errorf("read our mount table: %w", err)
	}
	defer f.Close()
	infos, err := mountinfo.GetMountsFromReader(f, func(in *mountinfo.Info) (skip, stop bool) {
		return in.ID != id, in.ID == id
	})
	if err != nil {
		return probe.Dev{}, fmt.Errorf("read our mount table: %w", err)
	}
	if len(infos) == 0 {
		return probe.Dev{}, fmt.Errorf("mount %d is no longer in our mount table: %w", id, ErrMountChanged)
	}
	return probe.Dev{Major: uint32(infos[0].Major), Minor: uint32(infos[0].Minor)}, nil
}

// mountParent reads the parent mount ID of mount id from our mount table.
func mountParent(procDir string, id int) (int, error) {
	f, err := os.Open(filepath.Join(procDir, "thread-self", "mountinfo"))
	if err != nil {
		return 0, fmt.Errorf("read our mount table: %w", err)
	}
	defer f.Close()
	infos, err := mountinfo.GetMountsFromReader(f, func(in *mountinfo.Info) (skip, stop bool) {
		return in.ID != id, in.ID == id
	})
	if err != nil {
		return 0, fmt.Errorf("read our mount table: %w", err)
	}
	if len(infos) == 0 {
		return 0, fmt.Errorf("mount %d is not in our mount table: %w", id, ErrMountChanged)
	}
	return infos[0].Parent, nil
}

// isFusectl reports whether the fuse control filesystem is mounted at dir.
func isFusectl(dir string) (bool, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return false, err
	}
	return st.Type == probe.FusectlMagic, nil
}
