package remount

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/mountmedic/mountmedic/probe"
	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// Live swap: a running container sees a volume through its own bind in its
// own mount namespace, which a re-stage on the host never reaches when the
// bind is private or a subPath. swapper clones the fresh mount on the host
// (cloneSource), enters the container's namespace on a locked thread
// (inMountNamespace) and puts the clone beneath the dead mount, or over it
// where the kernel refuses (swapInNamespace), so that a mount of the volume
// is in place at every step. It enters only each container's own namespace
// (checkOtherNamespace, checkNamespaceOwner). Files open on the dead mount
// stay dead; new lookups see the fresh one. The containers' processes come
// from the Repairer's shared cgroup scan, or the CRI (docs/remount.md).

// propagation is the mount propagation of a volumeMount.
type propagation int

const (
	// propagationNone is mountPropagation None: a private mount.
	propagationNone propagation = iota
	// propagationHostToContainer is a slave of the host's mount.
	propagationHostToContainer
	// propagationBidirectional is a peer of the host's mount.
	propagationBidirectional
)

var propagationNames = [...]string{"None", "HostToContainer", "Bidirectional"}

func (p propagation) String() string {
	if int(p) >= 0 && int(p) < len(propagationNames) {
		return propagationNames[p]
	}
	return "Propagation(" + strconv.Itoa(int(p)) + ")"
}

func (p propagation) flag() uint64 {
	switch p {
	case propagationHostToContainer:
		return unix.MS_SLAVE
	case propagationBidirectional:
		return unix.MS_SHARED
	}
	return unix.MS_PRIVATE
}

// propagationOf reads the propagation of a mount from mountinfo's optional
// fields: shared:N is a peer group, master:N a slave.
func propagationOf(optional string) propagation {
	var master bool
	for _, f := range strings.Fields(optional) {
		switch {
		case strings.HasPrefix(f, "shared:"):
			return propagationBidirectional
		case strings.HasPrefix(f, "master:"):
			master = true
		}
	}
	if master {
		return propagationHostToContainer
	}
	return propagationNone
}

// swapTarget is one dead mount in one container to replace.
type swapTarget struct {
	// Pid is a process of the container; its mount namespace and root are
	// used.
	Pid int
	// ContainerPath is the mount point as the process sees it (its
	// mountinfo), relative to its root.
	ContainerPath string
	// Source is the fresh mount on the host, below the kubelet root: the
	// re-published target of the volume.
	Source string
	// SubDir is, for a subPath, the subdirectory of Source to mount: the
	// dead mount's mountinfo root relative to the volume's root. Empty for
	// the whole volume.
	SubDir string
	// ReadOnly re-applies read-only (MOUNT_ATTR_RDONLY) to the clone.
	ReadOnly bool
	// Propagation is given to the clone (recursively).
	Propagation propagation
	// MountID is the dead mount's ID in the container's mountinfo. When set
	// (and UniqueID is not), the swap happens only while a mount of that ID
	// is on top at ContainerPath; otherwise it fails with ErrMountChanged.
	// The kernel reuses it as soon as the mount is freed.
	MountID int
	// UniqueID is the dead mount's unique ID (statx STATX_MNT_ID_UNIQUE,
	// Linux 6.8), which the kernel never reuses: planSwap pins it where the
	// kernel has it, 0 elsewhere. When set, the swap happens only while that
	// mount is on top at ContainerPath, checked again right before it is
	// detached.
	UniqueID uint64
	// Dev is the dead mount's device number.
	Dev probe.Dev
}

func (t swapTarget) label() string { return fmt.Sprintf("pid %d:%s", t.Pid, t.ContainerPath) }

// swapper replaces dead mounts inside running containers' mount namespaces
// with clones of fresh mounts on the host.
type swapper struct {
	// Root is the kubelet root; probe.DefaultKubeletRoot when empty.
	Root string
	// ProcDir is where procfs is mounted; "/proc" when empty.
	ProcDir string
	// DryRun resolves and checks sources and container paths and returns
	// the plan without cloning, entering a namespace or changing a mount.
	DryRun bool
	// Sys are the operations that change mounts; zero fields take the
	// host's.
	Sys Syscalls
}

func (s *swapper) root() string {
	if s.Root == "" {
		return probe.DefaultKubeletRoot
	}
	return s.Root
}

func (s *swapper) procDir() string {
	if s.ProcDir == "" {
		return "/proc"
	}
	return s.ProcDir
}

// Swap replaces each target's dead mount with a clone of its source, in the
// target process's mount namespace. Targets of one process are swapped on
// one thread, shallowest container path first: a subPath mounted inside the
// volume's own mount point is then bound again inside the fresh volume
// rather than looked up through the dead one. A target that fails is an
// action with an error; the others go on. The error joins the actions'
// errors.
func (s *swapper) Swap(ctx context.Context, targets []swapTarget) ([]Action, error) {
	byPid := make(map[int][]swapTarget)
	var pids []int
	for _, t := range targets {
		if _, ok := byPid[t.Pid]; !ok {
			pids = append(pids, t.Pid)
		}
		byPid[t.Pid] = append(byPid[t.Pid], t)
	}
	var actions []Action
	for _, pid := range pids {
		ts := byPid[pid]
		slices.SortStableFunc(ts, func(a, b swapTarget) int {
			return depth(a.ContainerPath) - depth(b.ContainerPath)
		})
		if err := ctx.Err(); err != nil {
			for _, t := range ts {
				actions = append(actions, Action{Op: opSwap, Path: t.label(), DryRun: s.DryRun,
					Err: fmt.Errorf("swap %s: %w", t.label(), err)})
			}
			continue
		}
		actions = append(actions, s.swapPid(ctx, pid, ts)...)
	}
	return actions, actionsErr(actions)
}

// swap is one target on its way: its actions entry, the clone of its source
// and the container descriptors.
type swap struct {
	t      swapTarget
	a      *Action
	tree   int // detached clone; -1 in dry-run
	nested bool
	src    string
}

func (s *swapper) swapPid(ctx context.Context, pid int, ts []swapTarget) []Action {
	logger := klog.FromContext(ctx).WithValues("pid", pid)
	sys := s.Sys.orHost()
	actions := make([]Action, len(ts))
	for i, t := range ts {
		actions[i] = Action{Op: opSwap, Path: t.label(), DryRun: s.DryRun}
	}
	failAll := func(err error) []Action {
		for i := range actions {
			if actions[i].Err == nil {
				actions[i].Err = fmt.Errorf("swap %s: %w", actions[i].Path, err)
			}
		}
		logger.Error(err, "Live swap failed")
		return actions
	}

	proc := filepath.Join(s.procDir(), strconv.Itoa(pid))
	if err := checkOtherNamespace(s.procDir(), pid); err != nil {
		return failAll(err)
	}
	nsfd, err := unix.Open(filepath.Join(proc, "ns", "mnt"), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return failAll(fmt.Errorf("open mount namespace of pid %d: %w", pid, err))
	}
	defer unix.Close(nsfd)
	if err := checkNamespaceOwner(s.procDir(), pid, nsfd); err != nil {
		return failAll(err)
	}
	rootfd, err := unix.Open(filepath.Join(proc, "root"), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return failAll(fmt.Errorf("open root of pid %d: %w", pid, err))
	}
	defer unix.Close(rootfd)
	// Our descriptors, by the host's procfs: inside the container's
	// namespace /proc is the container's.
	fdDir, err := unix.Open(filepath.Join(s.procDir(), "self", "fd"), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return failAll(fmt.Errorf("open our descriptor directory: %w", err))
	}
	defer unix.Close(fdDir)

	// Host side: resolve and clone every source while this thread is in
	// the host namespace.
	var work []*swap
	var done []string // container paths swapped or to be swapped before
	for i, t := range ts {
		w := &swap{t: t, a: &actions[i], tree: -1}
		cp := filepath.Clean(t.ContainerPath)
		if !filepath.IsAbs(t.ContainerPath) || cp == "/" {
			w.a.Err = fmt.Errorf("swap %s: container path must be an absolute path below /", w.a.Path)
			continue
		}
		for _, d := range done {
			if kubelet.Under(d, cp) {
				w.nested = true
			}
		}
		tree, src, err := s.cloneSource(sys, t)
		if err != nil {
			w.a.Err = fmt.Errorf("swap %s: %w", w.a.Path, err)
			logger.Error(err, "Live swap refused", "containerPath", t.ContainerPath)
			continue
		}
		w.tree, w.src = tree, src
		done = append(done, cp)
		work = append(work, w)
	}
	defer func() {
		for _, w := range work {
			if w.tree >= 0 {
				unix.Close(w.tree)
			}
		}
	}()
	if len(work) == 0 {
		return actions
	}

	if s.DryRun {
		for _, w := range work {
			s.planInNamespace(rootfd, w)
			if w.a.Err == nil {
				logger.V(2).Info("Would swap", "containerPath", w.t.ContainerPath, "detail", w.a.Detail)
			}
		}
		return actions
	}

	err = inMountNamespace(sys, nsfd, func() {
		for _, w := range work {
			start := time.Now()
			s.swapInNamespace(sys, rootfd, fdDir, w)
			w.a.Took = time.Since(start)
		}
	})
	if err != nil {
		return failAll(err)
	}
	for _, w := range work {
		if w.a.Err != nil {
			logger.Error(w.a.Err, "Live swap failed", "containerPath", w.t.ContainerPath)
		} else {
			logger.V(2).Info("Swapped", "containerPath", w.t.ContainerPath, "detail", w.a.Detail)
		}
	}
	return actions
}

// checkOtherNamespace refuses a process in our own mount namespace: a swap
// there would replace host mounts, not a container's.
func checkOtherNamespace(procDir string, pid int) error {
	theirs, err := os.Readlink(filepath.Join(procDir, strconv.Itoa(pid), "ns", "mnt"))
	if err != nil {
		return fmt.Errorf("mount namespace of pid %d: %w", pid, err)
	}
	ours, err := os.Readlink(filepath.Join(procDir, "thread-self", "ns", "mnt"))
	if err != nil {
		return fmt.Errorf("own mount namespace: %w", err)
	}
	if theirs == ours {
		return fmt.Errorf("pid %d shares our mount namespace %s: not a container", pid, ours)
	}
	return nil
}

// checkNamespaceOwner refuses a mount namespace that our user namespace
// (the initial one, where the agent runs) does not own: one the process's
// own user namespace does not own either (a namespace a container user
// made), and the namespace of a user-namespaced pod. A mount moved into a
// namespace is not locked (the kernel locks mount flags only on mounts it
// copies or propagates into a less privileged mount namespace), so whoever
// holds CAP_SYS_ADMIN in the namespace's owner could remount it: make a
// read-only volume writable, or clear nosuid, nodev or noexec on a
// read-write one. In a namespace our user namespace owns, that is only the
// host's root. The restart tier repairs the others: the runtime binds the
// fresh mount into the new container, and the kernel locks it there. The
// descriptor nsfd is the namespace entered afterwards, so a process that
// changes namespace in between changes nothing.
func checkNamespaceOwner(procDir string, pid, nsfd int) error {
	owner, err := unix.IoctlRetInt(nsfd, unix.NS_GET_USERNS)
	if err != nil {
		return fmt.Errorf("owner of the mount namespace of pid %d: %w", pid, err)
	}
	defer unix.Close(owner)
	var ownerSt, theirs, ours unix.Stat_t
	if err := unix.Fstat(owner, &ownerSt); err != nil {
		return fmt.Errorf("owner of the mount namespace of pid %d: %w", pid, err)
	}
	if err := unix.Stat(filepath.Join(procDir, strconv.Itoa(pid), "ns", "user"), &theirs); err != nil {
		return fmt.Errorf("user namespace of pid %d: %w", pid, err)
	}
	if err := unix.Stat(filepath.Join(procDir, "thread-self", "ns", "user"), &ours); err != nil {
		return fmt.Errorf("own user namespace: %w", err)
	}
	same := func(a, b *unix.Stat_t) bool { return a.Dev == b.Dev && a.Ino == b.Ino }
	switch {
	case !same(&ownerSt, &theirs):
		return fmt.Errorf("the mount namespace of pid %d is owned by user namespace %d, not by its own %d: %w",
			pid, ownerSt.Ino, theirs.Ino, errForeignNamespace)
	case !same(&ownerSt, &ours):
		return fmt.Errorf("the mount namespace of pid %d is owned by user namespace %d, not by the host's %d: "+
			"its root could make a swapped mount writable or clear nosuid, nodev or noexec on it: %w",
			pid, ownerSt.Ino, ours.Ino, errForeignNamespace)
	}
	return nil
}

// errForeignNamespace marks a swap refused for the owner of the container's
// mount namespace: a restart repairs the container instead.
var errForeignNamespace = errors.New("mount namespace not swappable")

// cloneSource resolves the target's source below the kubelet root and, unless
// in dry-run, clones it into a detached tree with the target's read-only
// flag and propagation. It runs in the host's mount namespace: open_tree
// clones only a mount of the caller's namespace. The clone joins the
// source's peer group until mount_setattr sets the container's propagation,
// before anything is visible in the container.
func (s *swapper) cloneSource(sys Syscalls, t swapTarget) (tree int, desc string, err error) {
	src, err := openSafe(s.root(), t.Source)
	if err != nil {
		return -1, "", err
	}
	defer src.Close()
	if !src.IsMountPoint() {
		return -1, "", fmt.Errorf("source %s is not a mount point", t.Source)
	}
	fd, desc := src.FD(), t.Source
	if t.SubDir != "" {
		sub := filepath.Clean(t.SubDir)
		if filepath.IsAbs(sub) || sub == ".." || strings.HasPrefix(sub, "../") {
			return -1, "", &unsafePathError{Path: t.SubDir, Root: t.Source, Reason: "subPath leaves the volume"}
		}
		desc = filepath.Join(t.Source, sub)
		// In dry-run the source may still be the dead mount (the host is
		// not repaired): walking into it could hang, so it is not walked.
		if sub != "." && !s.DryRun {
			subfd, err := openat2(src.FD(), sub, unix.O_PATH, resolveSafe)
			if err != nil {
				return -1, "", resolveErr(t.Source, desc, desc, err)
			}
			defer unix.Close(subfd)
			fd = subfd
		}
	}
	if s.DryRun {
		return -1, desc, nil
	}
	tree, err = sys.OpenTree(fd, "", unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_RECURSIVE|unix.AT_EMPTY_PATH)
	if err != nil {
		return -1, "", fmt.Errorf("clone %s: %w", desc, err)
	}
	attr := unix.MountAttr{Propagation: t.Propagation.flag()}
	if t.ReadOnly {
		attr.Attr_set = unix.MOUNT_ATTR_RDONLY
	}
	if err := sys.MountSetattr(tree, "", unix.AT_EMPTY_PATH|unix.AT_RECURSIVE, &attr); err != nil {
		unix.Close(tree)
		return -1, "", fmt.Errorf("set %s%s on the clone of %s: %w", t.Propagation, roText(t.ReadOnly), desc, err)
	}
	return tree, desc, nil
}

func roText(ro bool) string {
	if ro {
		return ", read-only"
	}
	return ""
}

// containerTarget is a container path resolved below the process's root.
type containerTarget struct {
	parent, fd         int
	name               string
	parentID, mountID  int
	mountPoint, exists bool
	// uniqueID is the unique ID of the mount at fd; 0 on kernels before 6.8.
	uniqueID uint64
}

func (c *containerTarget) close() {
	if c.fd >= 0 {
		unix.Close(c.fd)
	}
	if c.parent >= 0 {
		unix.Close(c.parent)
	}
}

// resolveContainer resolves path inside the process root rootfd
// (/proc/<pid>/root, opened before setns: inside the container's namespace
// an absolute path, /proc/self included, is the container's), refusing
// symlinks, without calling into the filesystem mounted there.
func resolveContainer(rootfd int, path string) (*containerTarget, error) {
	rel := strings.TrimPrefix(filepath.Clean(path), "/")
	dir, name := filepath.Split(rel)
	dir = strings.TrimSuffix(dir, "/")
	if dir == "" {
		dir = "."
	}
	c := &containerTarget{parent: -1, fd: -1, name: name}
	parent, err := openat2(rootfd, dir, unix.O_PATH|unix.O_DIRECTORY,
		unix.RESOLVE_IN_ROOT|unix.RESOLVE_NO_SYMLINKS|unix.RESOLVE_NO_MAGICLINKS)
	if err != nil {
		return nil, containerResolveErr(path, err)
	}
	c.parent = parent
	if c.parentID, err = fdMountID(parent); err != nil {
		c.close()
		return nil, fmt.Errorf("mount ID of the parent of %s: %w", path, err)
	}
	fd, err := openat2(parent, name, unix.O_PATH, resolveSafe)
	if errors.Is(err, unix.ENOENT) {
		return c, nil
	}
	if err != nil {
		c.close()
		return nil, containerResolveErr(path, err)
	}
	c.fd, c.exists = fd, true
	if c.mountID, c.uniqueID, err = fdMountIDs(fd); err != nil {
		c.close()
		return nil, fmt.Errorf("mount ID of %s: %w", path, err)
	}
	c.mountPoint = c.mountID != c.parentID
	return c, nil
}

// fdMountIDs returns the mountinfo ID of the mount fd is on and its unique
// ID (0 on kernels before 6.8), asking nothing of the filesystem.
func fdMountIDs(fd int) (id int, unique uint64, err error) {
	if id, err = fdMountID(fd); err != nil {
		return 0, 0, err
	}
	unique, err = probe.UniqueMountID(fd)
	if errors.Is(err, probe.ErrNoUniqueMountID) {
		return id, 0, nil
	}
	return id, unique, err
}

func containerResolveErr(path string, err error) error {
	if errors.Is(err, unix.ELOOP) || errors.Is(err, unix.EXDEV) {
		return &unsafePathError{Path: path, Root: "the container root", Reason: "a symlink in the container path", Err: err}
	}
	return fmt.Errorf("resolve container path %s: %w", path, err)
}

// check decides what to do at the resolved container path: replace the
// mount on top, bind into a directory of a freshly swapped parent, or
// nothing (an error).
func (w *swap) check(c *containerTarget) error {
	switch {
	case !c.exists:
		return fmt.Errorf("container path %s does not exist", w.t.ContainerPath)
	case c.mountPoint && w.t.UniqueID != 0 && c.uniqueID != w.t.UniqueID:
		return fmt.Errorf("mount %d (unique %d) is on top at %s, not the dead mount %d (unique %d): %w",
			c.mountID, c.uniqueID, w.t.ContainerPath, w.t.MountID, w.t.UniqueID, ErrMountChanged)
	case c.mountPoint && w.t.UniqueID == 0 && w.t.MountID != 0 && c.mountID != w.t.MountID:
		return fmt.Errorf("mount %d is on top at %s, not mount %d: %w", c.mountID, w.t.ContainerPath, w.t.MountID, ErrMountChanged)
	case !c.mountPoint && !w.nested:
		return fmt.Errorf("nothing is mounted at %s: %w", w.t.ContainerPath, ErrMountChanged)
	}
	return nil
}

func (w *swap) detail(c *containerTarget, how string) string {
	d := fmt.Sprintf("clone of %s (%s%s)", w.src, w.t.Propagation, roText(w.t.ReadOnly))
	if c.mountPoint {
		return fmt.Sprintf("replace mount %d with a %s%s", c.mountID, d, how)
	}
	return "bind a " + d + " inside the swapped parent" + how
}

// planInNamespace is the dry-run: resolve and check from the host, change
// nothing. A path inside a parent that would be swapped first is not
// resolved: the walk would go through the dead mount.
func (s *swapper) planInNamespace(rootfd int, w *swap) {
	if w.nested {
		w.a.Detail = fmt.Sprintf("bind a clone of %s (%s%s) inside the swapped parent", w.src, w.t.Propagation, roText(w.t.ReadOnly))
		return
	}
	c, err := resolveContainer(rootfd, w.t.ContainerPath)
	if err != nil {
		w.a.Err = fmt.Errorf("swap %s: %w", w.a.Path, err)
		return
	}
	defer c.close()
	if err := w.check(c); err != nil {
		w.a.Err = fmt.Errorf("swap %s: %w", w.a.Path, err)
		return
	}
	w.a.Detail = w.detail(c, "")
}

// swapInNamespace runs on the thread that entered the container's mount
// namespace. fdDir is our /proc/self/fd, opened before.
func (s *swapper) swapInNamespace(sys Syscalls, rootfd, fdDir int, w *swap) {
	fail := func(err error) { w.a.Err = fmt.Errorf("swap %s: %w", w.a.Path, err) }
	c, err := resolveContainer(rootfd, w.t.ContainerPath)
	if err != nil {
		fail(err)
		return
	}
	defer c.close()
	if err := w.check(c); err != nil {
		fail(err)
		return
	}
	if !c.mountPoint {
		// The dead mount went with its swapped parent: bind the clone at
		// the same place inside the fresh parent.
		if err := sys.MoveMount(w.tree, "", c.parent, c.name, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
			fail(fmt.Errorf("move the clone to %s: %w", w.t.ContainerPath, err))
			return
		}
		w.a.Detail = w.detail(c, "")
		return
	}
	// Under the dead mount first, then the dead mount away: no gap.
	err = sys.MoveMount(w.tree, "", c.parent, c.name, unix.MOVE_MOUNT_F_EMPTY_PATH|moveMountBeneath)
	if err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOSYS) {
		fail(fmt.Errorf("move the clone beneath mount %d at %s: %w", c.mountID, w.t.ContainerPath, err))
		return
	}
	if err != nil {
		// The kernel does not mount beneath here: mount the clone on top
		// of the dead mount (the descriptor of the mount checked above,
		// never a name looked up again) and leave the dead one covered.
		// Never detach first: between a detach and the move (an agent
		// killed there, a move that fails) the container would see its
		// bare root filesystem directory, write there, and a later repair
		// would find nothing dead. Each step leaves a mount of the volume
		// in place; a run killed half-way is finished by the next.
		if err := sys.MoveMount(w.tree, "", c.fd, "", unix.MOVE_MOUNT_F_EMPTY_PATH|unix.MOVE_MOUNT_T_EMPTY_PATH); err != nil {
			fail(fmt.Errorf("move the clone over mount %d at %s: %w", c.mountID, w.t.ContainerPath, err))
			return
		}
		w.a.Detail = w.detail(c, ", mounted over the dead one")
		return
	}
	// Beneath: a run killed here leaves the dead mount on top, which the
	// next run finds and swaps again. The last look before the detach: the
	// mount checked must still be the one on top, or whatever came there
	// since stays (over the clone beneath it). The detach then names that
	// mount by the descriptor held since the check (its /proc/self/fd
	// link, through fdDir), never by a path looked up again.
	if err := recheckTop(c, w.t.ContainerPath); err != nil {
		fail(err)
		return
	}
	if err := sys.Fchdir(fdDir); err != nil {
		fail(fmt.Errorf("enter our descriptor directory: %w", err))
		return
	}
	if err := sys.Unmount(strconv.Itoa(c.fd), unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
		fail(fmt.Errorf("unmount dead mount %d at %s: %w", c.mountID, w.t.ContainerPath, err))
		return
	}
	w.a.Detail = w.detail(c, ", mounted beneath")
}

// recheckTop resolves the container path again and checks that the mount
// on top is still the one c resolved: by unique ID, or by mountinfo ID on
// kernels before 6.8 (exact here: c's descriptor keeps that mount, and so
// its ID, from being freed).
func recheckTop(c *containerTarget, path string) error {
	fd, err := openat2(c.parent, c.name, unix.O_PATH, resolveSafe)
	if err != nil {
		return containerResolveErr(path, err)
	}
	defer unix.Close(fd)
	id, unique, err := fdMountIDs(fd)
	if err != nil {
		return fmt.Errorf("mount ID of %s: %w", path, err)
	}
	if id != c.mountID || unique != c.uniqueID {
		return fmt.Errorf("mount %d came on top at %s after the check of dead mount %d: left in place over the clone: %w",
			id, path, c.mountID, ErrMountChanged)
	}
	return nil
}

// inMountNamespace runs fn on a locked OS thread that entered the mount
// namespace nsfd. The thread is never unlocked: its goroutine ends locked and
// Go ends the thread, whose fs and namespace are no longer the process's.
//
// Never on the main thread: Go does not end the main thread when a locked
// goroutine exits on it, it parks it for good, and /proc/self (mountinfo,
// ns/mnt) describes the main thread. A main thread left in a container's
// namespace would make the process read the container's mount table as its
// own. When the locked goroutine finds itself on the
// main thread, it holds that thread and does the work from a new goroutine,
// which then runs on another one.
func inMountNamespace(sys Syscalls, nsfd int, fn func()) error {
	errc := make(chan error, 1)
	// work runs on a locked thread that is not the main thread.
	work := func() {
		if err := sys.Unshare(unix.CLONE_FS); err != nil {
			errc <- fmt.Errorf("unshare fs: %w", err)
			return
		}
		if err := sys.Setns(nsfd, unix.CLONE_NEWNS); err != nil {
			errc <- fmt.Errorf("enter mount namespace: %w", err)
			return
		}
		fn()
		errc <- nil
	}
	go func() {
		runtime.LockOSThread()
		if unix.Gettid() != unix.Getpid() {
			work()
			return
		}
		// The main thread stays locked to this goroutine until the other
		// goroutine holds a thread of its own: it cannot get this one.
		locked := make(chan struct{})
		go func() {
			runtime.LockOSThread()
			close(locked)
			work()
		}()
		<-locked
		runtime.UnlockOSThread()
	}()
	return <-errc
}
