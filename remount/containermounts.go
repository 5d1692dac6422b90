package remount

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/probe"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// processMount is a mount as one process sees it in /proc/<pid>/mountinfo.
type processMount struct {
	Pid      int
	ID       int
	ParentID int
	Dev      probe.Dev
	// Root is the mountinfo root: the directory of the filesystem the
	// mount shows (a subPath bind shows a subdirectory of the volume).
	Root string
	// Path is the mount point relative to the process's root.
	Path    string
	Options string
	// Optional holds the propagation fields (shared:N, master:N).
	Optional string
	FSType   string
	// Covered is set when another mount sits on the same mount point above
	// this one.
	Covered bool
}

// processMounts lists the mounts of the devices devs in the mount namespace
// of process pid, read once from <procDir>/<pid>/mountinfo: matched by
// device number, never by path, since the container's paths are its own.
// The table is the pod's to size (a user-namespaced pod's root can stack
// mounts in its namespace): it is streamed under probe's caps, and only the
// lines of devs are kept (probe.ReadDevMounts).
func processMounts(procDir string, pid int, devs ...probe.Dev) ([]processMount, error) {
	p := filepath.Join(procDir, strconv.Itoa(pid), "mountinfo")
	want := make(map[probe.Dev]bool, len(devs))
	for _, d := range devs {
		want[d] = true
	}
	dm, err := probe.ReadDevMounts(context.Background(), p, want, 0, 0)
	if err != nil {
		return nil, fmt.Errorf("read mount table of pid %d: %w", pid, err)
	}
	out := make([]processMount, 0, len(dm.Mounts))
	for _, in := range dm.Mounts {
		out = append(out, processMount{
			Pid: pid, ID: in.ID, ParentID: in.Parent, Dev: probe.Dev{Major: uint32(in.Major), Minor: uint32(in.Minor)},
			Root: in.Root, Path: in.Mountpoint, Options: in.Options, Optional: in.Optional, FSType: in.FSType,
			Covered: dm.Covered[in.ID],
		})
	}
	return out, nil
}

// namespaceMounts lists the mounts of the devices devs in the mount
// namespaces of pids, each namespace read once (through the first of pids
// in it), leaving out our own namespace and processes that have exited.
func namespaceMounts(procDir string, pids []int, devs []probe.Dev) ([]processMount, error) {
	ours, err := os.Readlink(filepath.Join(procDir, "thread-self", "ns", "mnt"))
	if err != nil {
		return nil, fmt.Errorf("own mount namespace: %w", err)
	}
	seen := map[string]bool{ours: true}
	var out []processMount
	var errs []error
	for _, pid := range pids {
		ns, err := os.Readlink(filepath.Join(procDir, strconv.Itoa(pid), "ns", "mnt"))
		if errors.Is(err, fs.ErrNotExist) {
			continue // exited
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("mount namespace of pid %d: %w", pid, err))
			continue
		}
		if seen[ns] {
			continue
		}
		seen[ns] = true
		ms, err := processMounts(procDir, pid, devs...)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		out = append(out, ms...)
	}
	return out, errors.Join(errs...)
}

// planSwap finds, in the containers of processes pids, every uncovered mount
// of the dead volume and returns the swaps that replace them with clones of
// source, the fresh publish target on the host. dead are the dead backend's
// device numbers and deadRoot the mountinfo root of its publish target
// (usually "/"): a container mount whose root is deadRoot is the whole
// volume, one whose root lies below it a subPath, cloned from the same
// subdirectory of source. Read-only and propagation are taken from the
// container's own mount. A subPath root that reads deleted is planned from
// its name all the same (see liveRoot). Each mount namespace is read once,
// through one of its processes, and our own namespace (the host's) never.
// Each target gets the unique ID of its dead mount where the kernel has
// them (pinUniqueIDs), which the swap checks.
func planSwap(procDir string, pids []int, dead []probe.Dev, deadRoot, source string) ([]swapTarget, error) {
	if procDir == "" {
		procDir = "/proc"
	}
	mounts, err := namespaceMounts(procDir, pids, dead)
	var out []swapTarget
	for _, m := range mounts {
		if m.Covered {
			continue
		}
		sub, ok := relRoot(deadRoot, liveRoot(m.Root))
		if !ok {
			continue
		}
		out = append(out, swapTarget{
			Pid: m.Pid, ContainerPath: m.Path, Source: source, SubDir: sub,
			ReadOnly:    hasOption(m.Options, "ro"),
			Propagation: propagationOf(m.Optional),
			MountID:     m.ID,
			Dev:         m.Dev,
		})
	}
	pinUniqueIDs(procDir, out)
	return out, err
}

// pinUniqueIDs sets each target's UniqueID: the unique ID of the mount on
// top at its container path, resolved through the process's root, when
// that mount has the mountinfo ID the table showed; the table's line and
// the mount are then the same, and from here on the swap names the mount by
// an ID the kernel never reuses. A target inside another target's path is
// left out: resolving it walks through the dead mount, and its swap binds
// into the fresh parent, replacing nothing. Where the kernel has no unique
// IDs, or the mount on top changed since the read, UniqueID stays 0 and the
// swap checks the mountinfo ID.
func pinUniqueIDs(procDir string, ts []swapTarget) {
	roots := map[int]int{}
	defer func() {
		for _, fd := range roots {
			if fd >= 0 {
				unix.Close(fd)
			}
		}
	}()
	for i := range ts {
		t := &ts[i]
		if nestedTarget(ts, t) {
			continue
		}
		rootfd, ok := roots[t.Pid]
		if !ok {
			fd, err := unix.Open(filepath.Join(procDir, strconv.Itoa(t.Pid), "root"), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
			if err != nil {
				fd = -1
			}
			roots[t.Pid], rootfd = fd, fd
		}
		if rootfd < 0 {
			continue
		}
		c, err := resolveContainer(rootfd, t.ContainerPath)
		if err != nil {
			continue
		}
		if c.mountPoint && c.mountID == t.MountID {
			t.UniqueID = c.uniqueID
		}
		c.close()
	}
}

// nestedTarget reports whether t's container path lies below another
// target's of the same process.
func nestedTarget(ts []swapTarget, t *swapTarget) bool {
	for i := range ts {
		o := &ts[i]
		if o != t && o.Pid == t.Pid && kubelet.Under(filepath.Clean(o.ContainerPath), filepath.Clean(t.ContainerPath)) {
			return true
		}
	}
	return false
}

// liveRoot drops the "//deleted" mountinfo appends to a mount whose root
// dentry was unhashed. On a dead FUSE connection that happens to a subPath
// bind's directory as soon as anything looks its name up (revalidation
// fails with ENOTCONN and the kernel invalidates the dentry), while the
// directory is still there in the filesystem behind it: the fresh mount is
// asked for it by name, and a directory that is really gone fails there.
func liveRoot(root string) string { return strings.TrimSuffix(root, "//deleted") }

// relRoot returns the mountinfo root child relative to parent ("" when they
// are equal), by path segments.
func relRoot(parent, child string) (string, bool) {
	parent, child = filepath.Clean(parent), filepath.Clean(child)
	if parent == child {
		return "", true
	}
	if parent == "/" {
		return strings.TrimPrefix(child, "/"), true
	}
	if kubelet.Under(parent, child) {
		return strings.TrimPrefix(child, parent+"/"), true
	}
	return "", false
}

func hasOption(opts, name string) bool {
	for _, o := range strings.Split(opts, ",") {
		if o == name {
			return true
		}
	}
	return false
}
