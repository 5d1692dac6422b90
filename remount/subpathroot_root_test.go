package remount

import (
	"errors"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/scripts/lab"
)

// TestMountOverAnInvalidatedSubPathRoot records the kernel fact behind the
// live swap's limit on kernels without MOVE_MOUNT_BENEATH (docs/
// kernel-facts.md): a mount can be put on top of a dead FUSE mount's root,
// and on top of a dead subPath bind whose root (a subdirectory of the dead
// filesystem) nothing has looked up since the daemon died; once a lookup
// through the dead filesystem invalidated that subdirectory (revalidate
// fails), mounting on it answers ENOENT (the kernel mounts only on a
// hashed dentry). A swap that can mount beneath never mounts on it.
func TestMountOverAnInvalidatedSubPathRoot(t *testing.T) {
	lab.RequireRoot(t)
	k := newKubelet(t)
	fresh := freshFS(t, k, "fresh")
	mountOver := func(t *testing.T, src, dst string) error {
		t.Helper()
		tree, err := unix.OpenTree(unix.AT_FDCWD, src, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
		if err != nil {
			t.Fatalf("open_tree %s: %v", src, err)
		}
		defer unix.Close(tree)
		fd, err := unix.Open(dst, unix.O_PATH|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatalf("open %s: %v", dst, err)
		}
		defer unix.Close(fd)
		return unix.MoveMount(tree, "", fd, "", unix.MOVE_MOUNT_F_EMPTY_PATH|unix.MOVE_MOUNT_T_EMPTY_PATH)
	}

	t.Run("not looked up since the death", func(t *testing.T) {
		v := newLabVolume(t, k, "vol-quiet", "pv-quiet")
		v.fs.Kill()
		if err := mountOver(t, filepath.Join(fresh, "sub"), v.subPath); err != nil {
			t.Errorf("mount over the dead subPath bind = %v, want it mounted", err)
		}
		if err := mountOver(t, fresh, v.target); err != nil {
			t.Errorf("mount over the dead publish target = %v, want it mounted", err)
		}
	})
	t.Run("looked up through the dead filesystem", func(t *testing.T) {
		v := newLabVolume(t, k, "vol-looked", "pv-looked")
		v.fs.Kill()
		var st unix.Stat_t
		if err := unix.Stat(filepath.Join(v.target, "sub"), &st); !errors.Is(err, unix.ENOTCONN) {
			t.Fatalf("stat of sub through the dead mount = %v, want ENOTCONN", err)
		}
		if err := mountOver(t, filepath.Join(fresh, "sub"), v.subPath); !errors.Is(err, unix.ENOENT) {
			t.Errorf("mount over the dead subPath bind after the lookup = %v, want ENOENT", err)
		}
		// The filesystem's root is never invalidated.
		if err := mountOver(t, fresh, v.target); err != nil {
			t.Errorf("mount over the dead publish target after the lookup = %v, want it mounted", err)
		}
	})
}
