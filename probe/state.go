package probe

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// State is the health of a mount or backend.
type State int

const (
	// Unknown: not probed (an offline table, or a mount covered by another).
	Unknown State = iota
	// Healthy: the filesystem answered.
	Healthy
	// Disconnected: the daemon or server is gone (ENOTCONN, ECONNABORTED,
	// ENODEV, EHOSTDOWN, ETIMEDOUT...).
	Disconnected
	// IOError: the filesystem or its device answers EIO, or the ext4 error
	// counter grew.
	IOError
	// Stale: a stale file handle (ESTALE).
	Stale
	// Hung: the probe did not return within its deadline.
	Hung
	// ReadOnly: EROFS, ext4 emergency_ro, or a superblock read-only under a
	// writable mount (errors=remount-ro fired).
	ReadOnly
	// Shutdown: the ext4/xfs filesystem was shut down (super option
	// "shutdown"); stat and statfs still answer, reads and writes fail.
	Shutdown
	// Missing: kubelet set the volume up but the path is no longer a mount
	// point, or is gone: a pod would write to the node's disk. A publish
	// target counts only once kubelet's publish window (DefaultPublishGrace
	// after it wrote vol_data.json, before NodePublishVolume) has passed.
	Missing
	// Deleted: the directory a subPath bind shows was removed.
	Deleted
	// Failed: another error.
	Failed
)

var stateNames = [...]string{"Unknown", "Healthy", "Disconnected", "IOError", "Stale", "Hung",
	"ReadOnly", "Shutdown", "Missing", "Deleted", "Failed"}

func (s State) String() string {
	if int(s) >= 0 && int(s) < len(stateNames) {
		return stateNames[s]
	}
	return "State(" + strconv.Itoa(int(s)) + ")"
}

// MarshalText makes a State read as its name in JSON.
func (s State) MarshalText() ([]byte, error) { return []byte(s.String()), nil }

// States lists every state, for callers that pre-set metrics.
func States() []State {
	out := make([]State, len(stateNames))
	for i := range out {
		out[i] = State(i)
	}
	return out
}

// Broken reports whether the state needs a repair.
func (s State) Broken() bool {
	switch s {
	case Unknown, Healthy:
		return false
	}
	return true
}

// ErrHung is the error of a probe that passed its deadline.
var ErrHung = errors.New("probe did not return before its deadline")

// StateOf classifies a probe error. nil is Healthy. EACCES and EPERM mean
// the filesystem answered: Healthy. (mount-utils' IsCorruptedMnt counts
// EACCES as corrupted and misses ECONNABORTED and EROFS, hence our own;
// TestStateOfAgainstKubelet keeps the rest of its list broken here.)
func StateOf(err error) State {
	if err == nil {
		return Healthy
	}
	if errors.Is(err, ErrHung) {
		return Hung
	}
	var errno unix.Errno
	if !errors.As(err, &errno) {
		return Failed
	}
	switch errno {
	case unix.ENOTCONN, unix.ECONNABORTED, unix.ENODEV, unix.ENXIO, unix.EHOSTDOWN,
		unix.ETIMEDOUT, unix.ECONNREFUSED, unix.ECONNRESET, unix.ESHUTDOWN:
		return Disconnected
	case unix.EIO, unix.EUCLEAN:
		return IOError
	case unix.ESTALE:
		return Stale
	case unix.EROFS:
		return ReadOnly
	case unix.ENOENT:
		return Missing
	case unix.EACCES, unix.EPERM:
		return Healthy
	}
	return Failed
}

// hasOpt reports whether the comma-separated option list opts holds name.
func hasOpt(opts, name string) bool {
	for opts != "" {
		var o string
		o, opts, _ = strings.Cut(opts, ",")
		if o == name {
			return true
		}
	}
	return false
}

// TableState is what the mount table alone says of a backend: Shutdown for
// the "shutdown" super option, ReadOnly for "emergency_ro" or a read-only
// superblock under a writable mount; Unknown otherwise.
func TableState(b *Backend) (State, error) {
	switch {
	case hasOpt(b.SuperOptions, "shutdown"):
		return Shutdown, errors.New("super option shutdown: the filesystem was shut down")
	case hasOpt(b.SuperOptions, "emergency_ro"):
		return ReadOnly, errors.New("super option emergency_ro: the filesystem aborted its journal")
	case hasOpt(b.SuperOptions, "ro"):
		for _, m := range b.Mounts {
			if hasOpt(m.Options, "rw") {
				return ReadOnly, errors.New("superblock read-only under a writable mount")
			}
		}
	}
	return Unknown, nil
}

// UnmarshalText reads a State from its name.
func (s *State) UnmarshalText(b []byte) error {
	for i, n := range stateNames {
		if n == string(b) {
			*s = State(i)
			return nil
		}
	}
	return fmt.Errorf("unknown state %q: want one of %s", b, strings.Join(stateNames[:], ", "))
}
