package remount

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// Safe paths.
//
// Every host path remount acts on must lie strictly below the kubelet root
// and resolve without a symlink, and resolving it must never call into the
// filesystem mounted there, which may be dead (ENOTCONN) or hung (the call
// never returns). openSafe proves both with file descriptors and no stat:
//
//  1. kubelet.Under: the cleaned path lies below the root, by path segments.
//  2. The parent directory is opened O_PATH with openat2 relative to an
//     O_PATH descriptor of the root, with RESOLVE_BENEATH, RESOLVE_NO_SYMLINKS
//     and RESOLVE_NO_MAGICLINKS: no component of the parent chain is a
//     symlink and the walk never leaves the root. The parent is a directory
//     of kubelet's tree on the node's own filesystem, so the walk only looks
//     up names in healthy directories.
//  3. The last component is opened the same way relative to the parent, with
//     O_PATH and without O_NOFOLLOW (with O_PATH|O_NOFOLLOW openat2 would
//     hand back a descriptor of a trailing symlink instead of refusing it).
//     The name is looked up in the parent (healthy), the walk then steps onto
//     whatever is mounted there, and O_PATH makes no open call: nothing is
//     asked of the mounted filesystem. The root of a mount is not
//     revalidated on the way, and FUSE has no d_weak_revalidate. The lab
//     checks this on dead and on hung FUSE mounts. An fstatat of the same
//     name, even with AT_SYMLINK_NOFOLLOW, crosses onto the mount and asks
//     FUSE for attributes: ENOTCONN on a dead daemon, a hang on a hung one.
//  4. The mount IDs of the two descriptors (mnt_id in /proc/self/fdinfo, a
//     VFS field) tell whether the name is a mount point (they differ) and
//     which mount is on top there, to compare with the mount table.
//
// The mount table's path of a mount is always a resolved path (the kernel
// resolves the target at mount time and prints where the mount really is),
// so a symlink is never a mount point in mountinfo; but a path string read
// from the table may since have gained a symlink in its parent chain, or the
// name may have been swapped. Checks 2 and 3 catch both, and 4 proves that
// the descriptor is the mount the table named. Actions then go through the
// descriptor ("/proc/self/fd/N"), never through the path string again, so
// nothing can be swapped between the check and the act.

// errUnsafePath marks a path refused because it is not strictly below the
// kubelet root or because resolving it meets a symlink.
var errUnsafePath = errors.New("unsafe path")

// unsafePathError is a path refused by openSafe. errors.Is(err,
// errUnsafePath) holds for it.
type unsafePathError struct {
	Path   string
	Root   string
	Reason string
	Err    error
}

func (e *unsafePathError) Error() string {
	msg := fmt.Sprintf("refuse path %s: %s (kubelet root %s)", e.Path, e.Reason, e.Root)
	if e.Err != nil {
		msg += ": " + e.Err.Error()
	}
	return msg
}

// Unwrap returns the resolution error.
func (e *unsafePathError) Unwrap() error { return e.Err }

// Is makes errors.Is(err, errUnsafePath) hold.
func (e *unsafePathError) Is(target error) bool { return target == errUnsafePath }

const resolveSafe = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS

// safePath is a host path proven to lie below the kubelet root without a
// symlink, held open by O_PATH descriptors of its parent and of itself.
type safePath struct {
	// Path is the clean absolute path.
	Path string
	// ParentMountID is the mount of the parent directory.
	ParentMountID int
	// MountID is the top mount at Path: the mount whose root Path is when it
	// is a mount point, else the parent's.
	MountID int

	parent int
	fd     int
}

// openSafe resolves path below the kubelet root root (see the comment on
// safe paths above). A path outside root or with a symlink anywhere gives an
// *unsafePathError; a missing path an error for which errors.Is(err,
// fs.ErrNotExist) holds. It never calls into the filesystem mounted at path.
// Close the safePath when done.
func openSafe(root, path string) (*safePath, error) {
	root = filepath.Clean(root)
	clean := filepath.Clean(path)
	if !filepath.IsAbs(path) || !kubelet.Under(root, clean) {
		return nil, &unsafePathError{Path: path, Root: root, Reason: "not strictly below the kubelet root"}
	}
	rel := strings.TrimPrefix(clean, root+"/")
	rootFD, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open kubelet root %s: %w", root, err)
	}
	defer unix.Close(rootFD)

	dir, name := filepath.Split(rel)
	dir = strings.TrimSuffix(dir, "/")
	if dir == "" {
		dir = "."
	}
	parent, err := openat2(rootFD, dir, unix.O_PATH|unix.O_DIRECTORY, resolveSafe)
	if err != nil {
		return nil, resolveErr(root, clean, filepath.Join(root, dir), err)
	}
	fd, err := openat2(parent, name, unix.O_PATH, resolveSafe)
	if err != nil {
		unix.Close(parent)
		return nil, resolveErr(root, clean, clean, err)
	}
	p := &safePath{Path: clean, parent: parent, fd: fd}
	if p.ParentMountID, err = fdMountID(parent); err == nil {
		p.MountID, err = fdMountID(fd)
	}
	if err != nil {
		p.Close()
		return nil, fmt.Errorf("mount ID of %s: %w", clean, err)
	}
	return p, nil
}

func resolveErr(root, path, at string, err error) error {
	switch {
	case errors.Is(err, unix.ELOOP):
		return &unsafePathError{Path: path, Root: root, Reason: "a symlink in " + at, Err: err}
	case errors.Is(err, unix.EXDEV):
		return &unsafePathError{Path: path, Root: root, Reason: "resolving leaves the kubelet root", Err: err}
	case errors.Is(err, unix.ENOENT):
		return fmt.Errorf("resolve %s: %w", at, fs.ErrNotExist)
	}
	return fmt.Errorf("resolve %s below %s: %w", at, root, err)
}

func openat2(dirfd int, path string, flags int, resolve uint64) (int, error) {
	for {
		fd, err := unix.Openat2(dirfd, path, &unix.OpenHow{
			Flags:   uint64(flags | unix.O_CLOEXEC),
			Resolve: resolve,
		})
		// openat2 answers EAGAIN when a rename raced a scoped lookup.
		if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR) {
			continue
		}
		return fd, err
	}
}

// IsMountPoint reports whether a mount sits on Path.
func (p *safePath) IsMountPoint() bool { return p.MountID != p.ParentMountID }

// FDPath is a path string that resolves to exactly what openSafe opened:
// the magic link of its descriptor. Mount calls given it act on the top
// mount there, whatever happens to the path string meanwhile.
func (p *safePath) FDPath() string { return "/proc/self/fd/" + strconv.Itoa(p.fd) }

// FD is the O_PATH descriptor of Path, valid until Close.
func (p *safePath) FD() int { return p.fd }

// isMount checks that the mount on top at Path is m: its mount ID and,
// when m names one, its unique ID, which the kernel never hands to another
// mount (a mount made after m was freed can show m's mount ID and device
// number). It asks nothing of the mounted filesystem.
func (p *safePath) isMount(m *probe.Mount) error {
	if p.MountID != m.ID {
		return fmt.Errorf("mount %d is on top at %s, not mount %d: %w", p.MountID, p.Path, m.ID, ErrMountChanged)
	}
	if m.UniqueID == 0 {
		return nil
	}
	id, err := probe.UniqueMountID(p.fd)
	if err != nil {
		return fmt.Errorf("unique ID of the mount at %s: %w", p.Path, err)
	}
	if id != m.UniqueID {
		return fmt.Errorf("the mount on top at %s is a new mount %d with unique ID %d, not unique ID %d: %w", p.Path, p.MountID, id, m.UniqueID, ErrMountChanged)
	}
	return nil
}

// Close releases the descriptors.
func (p *safePath) Close() error {
	if p == nil {
		return nil
	}
	err := unix.Close(p.fd)
	if e := unix.Close(p.parent); err == nil {
		err = e
	}
	p.fd, p.parent = -1, -1
	return err
}

// fdMountID returns the mount ID of our descriptor fd, without asking the
// filesystem anything: statx STATX_MNT_ID with AT_STATX_DONT_SYNC, which
// resolves no /proc path (after a setns into a container's mount namespace,
// /proc is the container's procfs, where this process does not exist:
// seen on the e2e node), else the mnt_id line of /proc/self/fdinfo.
func fdMountID(fd int) (int, error) {
	var stx unix.Statx_t
	err := unix.Statx(fd, "", unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW|unix.AT_STATX_DONT_SYNC, unix.STATX_MNT_ID, &stx)
	if err == nil && stx.Mask&unix.STATX_MNT_ID != 0 {
		return int(stx.Mnt_id), nil
	}
	return fdinfoMountID("/proc/self/fdinfo/" + strconv.Itoa(fd))
}

// fdinfoMountID parses the mnt_id line of a /proc/<pid>/fdinfo/<fd> file.
func fdinfoMountID(path string) (int, error) {
	// mnt_id is in the first lines; what follows (an epoll's or an
	// inotify's watches) is the process's to grow.
	b, err := readProcHead(path, 4096)
	if err != nil {
		return 0, err
	}
	return parseFdinfoMountID(b)
}

func parseFdinfoMountID(b []byte) (int, error) {
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		v, ok := strings.CutPrefix(sc.Text(), "mnt_id:")
		if !ok {
			continue
		}
		n, err := strconv.Atoi(strings.TrimSpace(v))
		if err != nil {
			return 0, fmt.Errorf("bad mnt_id line %q: %w", sc.Text(), err)
		}
		return n, nil
	}
	return 0, errors.New("no mnt_id line in fdinfo")
}
