package probe

import (
	"io/fs"
	"testing"

	"golang.org/x/sys/unix"
	mountutils "k8s.io/mount-utils"
)

// TestStateOfAgainstKubelet pins StateOf against kubelet's own definition of
// a corrupted mount (mount-utils' IsCorruptedMnt, which kubelet uses to
// decide whether to unmount before it mounts again). Every errno kubelet
// counts as corrupted is broken here too, except EACCES: a filesystem that
// answers "permission denied" is alive, and repairing it would remount
// healthy volumes. Beyond kubelet's list, a FUSE connection aborted by
// fusectl (ECONNABORTED) and a read-only filesystem (EROFS) are broken.
func TestStateOfAgainstKubelet(t *testing.T) {
	for e := unix.Errno(1); e < 134; e++ {
		err := &fs.PathError{Op: "statfs", Path: "/var/lib/kubelet/pods/x", Err: e}
		corrupted := mountutils.IsCorruptedMnt(err)
		state := StateOf(err)
		switch {
		case e == unix.EACCES:
			if !corrupted || state != Healthy {
				t.Errorf("EACCES: kubelet corrupted %v, StateOf %s; want kubelet true and Healthy here", corrupted, state)
			}
		case corrupted && !state.Broken():
			t.Errorf("%s (%d): kubelet counts the mount corrupted, StateOf says %s", unix.ErrnoName(e), int(e), state)
		}
	}
	for _, e := range []unix.Errno{unix.ECONNABORTED, unix.EROFS} {
		err := &fs.PathError{Op: "statfs", Path: "/var/lib/kubelet/pods/x", Err: e}
		if mountutils.IsCorruptedMnt(err) {
			t.Errorf("%s: kubelet now counts it corrupted; update this test's comment", unix.ErrnoName(e))
		}
		if !StateOf(err).Broken() {
			t.Errorf("%s: StateOf = %s, want a broken state", unix.ErrnoName(e), StateOf(err))
		}
	}
}
