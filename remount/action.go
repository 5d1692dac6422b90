package remount

import (
	"errors"
	"fmt"
	"os"
	"time"

	"golang.org/x/sys/unix"
)

// Op names a mount-side repair step.
type Op string

// The steps the mount-side actors take.
const (
	// opAbortFUSE writes 1 to a FUSE connection's fusectl abort file.
	opAbortFUSE Op = "abort-fuse"
	// opMountFusectl mounts the fuse control filesystem detached (attached
	// nowhere) where it is not mounted.
	opMountFusectl Op = "mount-fusectl"
	// opUnmount lazily unmounts (MNT_DETACH) the top mount at a path.
	opUnmount Op = "unmount"
	// opOverMount binds a fresh mount on top of a dead one on the host.
	opOverMount Op = "over-mount"
	// opSwap replaces a dead mount inside a container's mount namespace.
	opSwap Op = "swap"
	// opStopContainer stops a container through the CRI so that kubelet
	// starts it again.
	opStopContainer Op = "stop-container"
	// opCheckDriver asks the CSI driver for its node capabilities before
	// anything is unmounted.
	opCheckDriver Op = "check-driver"
	// opStage sends NodeStageVolume.
	opStage Op = "stage"
	// opPublish sends NodePublishVolume.
	opPublish Op = "publish"
	// opFindProcesses finds the processes of a pod's containers.
	opFindProcesses Op = "find-processes"
	// opHolder reports a process that still holds a dead mount (an open
	// file, a working directory): it keeps failing after the repair.
	opHolder Op = "holder"
	// opWaitRunning waits for the runtime to run a stopped container again.
	opWaitRunning Op = "wait-running"
	// opVerify probes a place the tier repaired (statfs and statx with
	// AT_STATX_FORCE_SYNC, with a deadline).
	opVerify Op = "verify"
	// opBind binds a subPath of the fresh volume again where kubelet keeps
	// it (volume-subpaths).
	opBind Op = "bind"
	// opSkip is a volume or pod a tier leaves alone, and why.
	opSkip Op = "skip"
	// opRetry is a tier run again after a transient failure (Transient).
	opRetry Op = "retry"
)

// Action is one step a repair took, or would take in dry-run.
type Action struct {
	Op Op
	// Path is what the step acted on: a host path, "pid <n>:<path>" for a
	// path in a container's mount namespace, the fusectl abort file, or a
	// container ID.
	Path string
	// Detail says what was done or found ("not mounted", "mount 123", ...).
	Detail string
	// DryRun is set when the step was only planned.
	DryRun bool
	// Err is why the step failed; nil when it succeeded or had nothing to do.
	Err error
	// Took is how long the step ran (zero in dry-run).
	Took time.Duration
}

func (a Action) String() string {
	s := string(a.Op) + " " + a.Path
	if a.Detail != "" {
		s += ": " + a.Detail
	}
	if a.DryRun {
		s += " (dry-run)"
	}
	if a.Err != nil {
		s += ": " + a.Err.Error()
	}
	return s
}

// Changed reports whether actions changed anything (a mount, a FUSE
// connection, a driver's volume, a container), or in a dry run would have:
// false for a tier that only checked, probed and left things alone, as one
// does for a mount that answers again (its report was older than it).
func Changed(actions []Action) bool {
	for _, a := range actions {
		switch a.Op {
		case opAbortFUSE, opKillServer, opUnmount, opOverMount, opSwap, opStopContainer, opStage, opPublish, opBind:
			if a.Err == nil {
				return true
			}
		}
	}
	return false
}

// actionsErr joins the errors of actions, nil when every action succeeded.
func actionsErr(actions []Action) error {
	var errs []error
	for _, a := range actions {
		if a.Err != nil {
			errs = append(errs, a.Err)
		}
	}
	return errors.Join(errs...)
}

// ErrMountChanged marks a step that was not taken because the mount at its
// path is no longer the one the caller saw: gone, covered by another mount,
// or replaced. Read the mount table again before retrying.
var ErrMountChanged = errors.New("mount changed since it was read")

// moveMountBeneath is MOVE_MOUNT_BENEATH (Linux 6.5), which x/sys lacks: the
// moved mount goes under the top mount at the target, so that unmounting the
// top reveals it without a moment where the path shows the directory below.
const moveMountBeneath = 0x200

// Syscalls are the operations that change mounts, a seam for unit tests.
// Path resolution and /proc reads are real in every case; only these are
// replaced.
type Syscalls struct {
	// Unmount is umount2(2).
	Unmount func(target string, flags int) error
	// Mount is mount(2).
	Mount func(source, target, fstype string, flags uintptr, data string) error
	// WriteFile writes data to an existing file (the fusectl abort file).
	WriteFile func(path string, data []byte) error
	// OpenTree is open_tree(2).
	OpenTree func(dirfd int, path string, flags uint) (int, error)
	// MountSetattr is mount_setattr(2).
	MountSetattr func(dirfd int, path string, flags uint, attr *unix.MountAttr) error
	// MoveMount is move_mount(2).
	MoveMount func(fromDirfd int, fromPath string, toDirfd int, toPath string, flags int) error
	// Unshare is unshare(2), called on the locked thread of a swap.
	Unshare func(flags int) error
	// Setns is setns(2), called on the locked thread of a swap.
	Setns func(fd int, nstype int) error
	// Fchdir is fchdir(2), called on the locked thread of a swap.
	Fchdir func(fd int) error
}

// hostSyscalls are the real operations.
func hostSyscalls() Syscalls {
	return Syscalls{
		Unmount:      unix.Unmount,
		Mount:        unix.Mount,
		WriteFile:    writeExisting,
		OpenTree:     unix.OpenTree,
		MountSetattr: unix.MountSetattr,
		MoveMount:    unix.MoveMount,
		Unshare:      unix.Unshare,
		Setns:        unix.Setns,
		Fchdir:       unix.Fchdir,
	}
}

// orHost fills the operations s lacks with the host's.
func (s Syscalls) orHost() Syscalls {
	h := hostSyscalls()
	if s.Unmount == nil {
		s.Unmount = h.Unmount
	}
	if s.Mount == nil {
		s.Mount = h.Mount
	}
	if s.WriteFile == nil {
		s.WriteFile = h.WriteFile
	}
	if s.OpenTree == nil {
		s.OpenTree = h.OpenTree
	}
	if s.MountSetattr == nil {
		s.MountSetattr = h.MountSetattr
	}
	if s.MoveMount == nil {
		s.MoveMount = h.MoveMount
	}
	if s.Unshare == nil {
		s.Unshare = h.Unshare
	}
	if s.Setns == nil {
		s.Setns = h.Setns
	}
	if s.Fchdir == nil {
		s.Fchdir = h.Fchdir
	}
	return s
}

// writeExisting writes data to path without creating or truncating it.
func writeExisting(path string, data []byte) error {
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	return f.Close()
}
