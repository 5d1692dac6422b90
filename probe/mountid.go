package probe

import (
	"errors"
	"fmt"
	"path/filepath"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Mount identity the kernel never reuses (Linux 6.8 and later).
//
// The mount IDs of mountinfo are reused as soon as a mount is freed, and
// device numbers as soon as a filesystem ends; a 64-bit unique mount ID is
// not. statx(STATX_MNT_ID_UNIQUE) gives it for a path or descriptor,
// statmount(2) describes a mount by it, listmount(2) lists a mount's
// children by it. golang.org/x/sys/unix has the statx flag and the syscall
// numbers, not the two calls nor their structures: they are below, laid
// out as include/uapi/linux/mount.h has them (struct mnt_id_req's first
// version, 24 bytes; struct statmount's fixed part, 512 bytes).

// ErrNoUniqueMountID is a kernel without unique mount IDs (before 6.8):
// callers fall back to the mount table.
var ErrNoUniqueMountID = errors.New("kernel gives no unique mount ID (needs Linux 6.8)")

// UniqueMountID returns the unique mount ID of the mount fd is on, without
// asking the filesystem (AT_STATX_DONT_SYNC: a hung FUSE daemon is never
// asked).
func UniqueMountID(fd int) (uint64, error) {
	var stx unix.Statx_t
	err := unix.Statx(fd, "", unix.AT_EMPTY_PATH|unix.AT_SYMLINK_NOFOLLOW|unix.AT_STATX_DONT_SYNC, unix.STATX_MNT_ID_UNIQUE, &stx)
	if err != nil {
		return 0, fmt.Errorf("statx: %w", err)
	}
	if stx.Mask&unix.STATX_MNT_ID_UNIQUE == 0 {
		return 0, ErrNoUniqueMountID
	}
	return stx.Mnt_id, nil
}

// statmount request bits (include/uapi/linux/mount.h).
const (
	statmountSBBasic   = 0x1
	statmountMntBasic  = 0x2
	statmountMntRoot   = 0x8
	statmountMntPoint  = 0x10
	statmountFSType    = 0x20
	statmountFSSubtype = 0x100
	statmountSBSource  = 0x200

	// statmountAsked are the fields asked for; statmountNeeded those every
	// answer must have (Linux 6.8): the kernel leaves a string field out
	// of the mask when it is empty, or when it does not know the field.
	statmountAsked  = statmountSBBasic | statmountMntBasic | statmountMntRoot | statmountMntPoint | statmountFSType | statmountFSSubtype | statmountSBSource
	statmountNeeded = statmountSBBasic | statmountMntBasic
)

// lsmtRoot asks listmount for the root mount of our namespace.
const lsmtRoot = ^uint64(0)

type mntIDReq struct {
	size  uint32
	spare uint32
	mntID uint64
	param uint64
}

// statmountFixed is struct statmount up to its strings.
type statmountFixed struct {
	size           uint32
	mntOpts        uint32
	mask           uint64
	sbDevMajor     uint32
	sbDevMinor     uint32
	sbMagic        uint64
	sbFlags        uint32
	fsType         uint32
	mntID          uint64
	mntParentID    uint64
	mntIDOld       uint32
	mntParentIDOld uint32
	mntAttr        uint64
	mntPropagation uint64
	mntPeerGroup   uint64
	mntMaster      uint64
	propagateFrom  uint64
	mntRoot        uint32
	mntPoint       uint32
	mntNsID        uint64
	fsSubtype      uint32
	sbSource       uint32
	spare2         [48]uint64
}

// MountStat is what statmount(2) says of one mount.
type MountStat struct {
	// ID and ParentID are unique mount IDs; the parent of a namespace's
	// root is itself.
	ID, ParentID uint64
	// OldID and OldParentID are the reused IDs mountinfo shows.
	OldID, OldParentID int
	Dev                Dev
	FSType             string
	// Root is the mountinfo root, Point the mount point as our root sees
	// it.
	Root, Point string
	// Source is the mount source, on kernels whose statmount reports it
	// (STATMOUNT_SB_SOURCE, added after 6.8; see HasSource).
	Source string
	// Attr holds MOUNT_ATTR_* flags.
	Attr uint64
	// HasSource says the kernel filled Source.
	HasSource bool
}

// Statmount describes the mount with unique ID id in our mount namespace.
// unix.ENOENT: no such mount (any more).
func Statmount(id uint64) (*MountStat, error) {
	req := mntIDReq{size: uint32(unsafe.Sizeof(mntIDReq{})), mntID: id,
		param: statmountAsked}
	buf := make([]byte, 4096)
	for {
		_, _, errno := unix.Syscall6(unix.SYS_STATMOUNT, uintptr(unsafe.Pointer(&req)),
			uintptr(unsafe.Pointer(&buf[0])), uintptr(len(buf)), 0, 0, 0)
		switch {
		case errno == unix.EOVERFLOW && len(buf) < 1<<20:
			buf = make([]byte, 2*len(buf))
			continue
		case errno == unix.ENOSYS:
			return nil, ErrNoUniqueMountID
		case errno != 0:
			return nil, fmt.Errorf("statmount %d: %w", id, errno)
		}
		break
	}
	fixed := (*statmountFixed)(unsafe.Pointer(&buf[0]))
	size := int(fixed.size)
	if size > len(buf) || size < int(unsafe.Sizeof(statmountFixed{})) {
		return nil, fmt.Errorf("statmount %d: size %d out of the buffer", id, size)
	}
	if fixed.mask&statmountNeeded != statmountNeeded {
		return nil, fmt.Errorf("statmount %d: fields %#x left out (mask %#x): %w", id, statmountNeeded&^fixed.mask, fixed.mask, ErrNoUniqueMountID)
	}
	strs := buf[unsafe.Sizeof(statmountFixed{}):size]
	str := func(off uint32) string {
		if int(off) >= len(strs) {
			return ""
		}
		s := strs[off:]
		for i, c := range s {
			if c == 0 {
				return string(s[:i])
			}
		}
		return string(s)
	}
	ms := &MountStat{
		ID: fixed.mntID, ParentID: fixed.mntParentID,
		OldID: int(fixed.mntIDOld), OldParentID: int(fixed.mntParentIDOld),
		Dev:    Dev{Major: fixed.sbDevMajor, Minor: fixed.sbDevMinor},
		FSType: str(fixed.fsType), Root: str(fixed.mntRoot), Point: str(fixed.mntPoint),
		Attr: fixed.mntAttr,
	}
	// mountinfo names a FUSE filesystem type.subtype (fuse.sshfs).
	if fixed.mask&statmountFSSubtype != 0 {
		if sub := str(fixed.fsSubtype); sub != "" {
			ms.FSType += "." + sub
		}
	}
	if fixed.mask&statmountSBSource != 0 {
		ms.Source, ms.HasSource = str(fixed.sbSource), true
	}
	return ms, nil
}

// Listmount lists the unique IDs of the mounts right below parent
// (lsmtRoot: our namespace's root), after the ID last (0 from the
// first), at most len(ids); it returns how many it wrote.
func Listmount(parent, last uint64, ids []uint64) (int, error) {
	if len(ids) == 0 {
		return 0, nil
	}
	req := mntIDReq{size: uint32(unsafe.Sizeof(mntIDReq{})), mntID: parent, param: last}
	n, _, errno := unix.Syscall6(unix.SYS_LISTMOUNT, uintptr(unsafe.Pointer(&req)),
		uintptr(unsafe.Pointer(&ids[0])), uintptr(len(ids)), 0, 0, 0)
	switch {
	case errno == unix.ENOSYS:
		return 0, ErrNoUniqueMountID
	case errno != 0:
		return 0, fmt.Errorf("listmount %d: %w", parent, errno)
	}
	return int(n), nil
}

// StackAt returns the mounts stacked at path, bottom first, by unique ID:
// the mount on top (statx of path, opened O_PATH without following a
// symlink at its end and without asking the filesystem), then each parent
// while it is mounted at the same path. Its cost is the stack's depth,
// whatever the number of mounts on the node. A path that is no mount point
// gives nil. ErrNoUniqueMountID on kernels before 6.8.
func StackAt(path string) ([]*MountStat, error) {
	path = filepath.Clean(path)
	fd, err := unix.Open(path, unix.O_PATH|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", path, err)
	}
	defer unix.Close(fd)
	return StackFD(fd, path)
}

// StackFD is StackAt for a descriptor the caller opened at path (O_PATH is
// enough): path is the mount point as our root sees it, which the mounts
// of the stack must show.
func StackFD(fd int, path string) ([]*MountStat, error) {
	path = filepath.Clean(path)
	id, err := UniqueMountID(fd)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	var stack []*MountStat
	for {
		m, err := Statmount(id)
		if err != nil {
			return nil, fmt.Errorf("stack at %s: %w", path, err)
		}
		if m.Point != path {
			break
		}
		stack = append(stack, m)
		if m.ParentID == m.ID || len(stack) > 1<<16 {
			break
		}
		id = m.ParentID
	}
	for i, j := 0, len(stack)-1; i < j; i, j = i+1, j-1 {
		stack[i], stack[j] = stack[j], stack[i]
	}
	return stack, nil
}
