package remount

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// TestUnmountFromTable unmounts mounts named by another namespace's table,
// whose mount IDs mean nothing here: a stack named whole goes from the top
// down; a stack whose top the table does not name stays whole
// (ErrMountChanged); a path whose mount is gone counts as not mounted;
// UnmountMounts with the foreign IDs refuses them all (the bug this
// replaces in the fence).
func TestUnmountFromTable(t *testing.T) {
	lab.RequireRoot(t)
	ctx := context.Background()
	k := newKubelet(t)
	dir := func(name string) string {
		p := filepath.Join(k.Root(), "pods", labPod, "volumes", "kubernetes.io~csi", name, "mount")
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
		return p
	}
	tmpfs := func(p string) {
		if err := unix.Mount("tmpfs", p, "tmpfs", 0, "size=1m"); err != nil {
			t.Fatal(err)
		}
	}
	whole, partial, gone := dir("whole"), dir("partial"), dir("gone")
	tmpfs(whole)
	tmpfs(whole)
	tmpfs(partial)
	tmpfs(gone)
	table := lab.StartMountNamespace(t, "unchanged")
	inv, err := probe.ReadFile(table, probe.Options{Root: k.Root()})
	if err != nil {
		t.Fatal(err)
	}
	tmpfs(partial) // on top after the table was read: it names only the one below
	if err := unix.Unmount(gone, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	byPath := map[string][]*probe.Mount{}
	for _, m := range inv.Mounts {
		byPath[m.Path] = append(byPath[m.Path], m)
	}
	if len(byPath[whole]) != 2 || len(byPath[partial]) != 1 || len(byPath[gone]) != 1 {
		t.Fatalf("foreign table: %d mounts at whole, %d at partial, %d at gone; want 2, 1, 1", len(byPath[whole]), len(byPath[partial]), len(byPath[gone]))
	}
	named := append(append(append([]*probe.Mount{}, byPath[whole]...), byPath[partial]...), byPath[gone]...)

	u := &Unmounter{Root: k.Root()}
	if acts, err := u.UnmountMounts(ctx, named); !errors.Is(err, ErrMountChanged) || Unmounted(acts) != 0 {
		t.Errorf("UnmountMounts with the foreign table's IDs = %d unmounted, %v; want none and ErrMountChanged", Unmounted(acts), err)
	}

	dry := &Unmounter{Root: k.Root(), DryRun: true}
	if acts, _ := dry.UnmountFromTable(ctx, named); Unmounted(acts) != 2 {
		t.Errorf("dry-run UnmountFromTable planned %d unmounts, want 2 (the stack at whole): %v", Unmounted(acts), acts)
	}

	acts, err := u.UnmountFromTable(ctx, named)
	if !errors.Is(err, ErrMountChanged) {
		t.Errorf("UnmountFromTable: err = %v, want ErrMountChanged for partial", err)
	}
	if got := Unmounted(acts); got != 2 {
		t.Errorf("UnmountFromTable unmounted %d mounts, want 2 (the stack at whole): %v", got, acts)
	}
	for _, c := range []struct {
		table, path string
		want        int
	}{
		{"/proc/self/mountinfo", whole, 0}, {table, whole, 0},
		{"/proc/self/mountinfo", partial, 2}, {table, partial, 2},
		{"/proc/self/mountinfo", gone, 0},
	} {
		inv, err := probe.ReadFile(c.table, probe.Options{Root: k.Root()})
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, m := range inv.Mounts {
			if m.Path == c.path {
				n++
			}
		}
		if n != c.want {
			t.Errorf("%s: %d mounts at %s, want %d", c.table, n, c.path, c.want)
		}
	}
}

// TestUnmountFromTableSymlink: after the table was read, the path it names
// was swapped for a symlink to a mount outside the kubelet root. The
// unmount is refused (errUnsafePath) and the mount outside stays.
func TestUnmountFromTableSymlink(t *testing.T) {
	lab.RequireRoot(t)
	ctx := context.Background()
	k := newKubelet(t)
	vol := filepath.Join(k.Root(), "pods", labPod, "volumes", "kubernetes.io~csi", "sym")
	target := filepath.Join(vol, "mount")
	outside := filepath.Join(t.TempDir(), "mount")
	for _, p := range []string{target, outside} {
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mount("tmpfs", p, "tmpfs", 0, "size=1m"); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() { _ = unix.Unmount(outside, unix.MNT_DETACH) })
	inv, err := probe.ReadFile(lab.StartMountNamespace(t, "unchanged"), probe.Options{Root: k.Root()})
	if err != nil {
		t.Fatal(err)
	}
	var named []*probe.Mount
	for _, m := range inv.Mounts {
		if m.Path == target {
			named = append(named, m)
		}
	}
	if len(named) != 1 {
		t.Fatalf("the table names %d mounts at %s, want 1", len(named), target)
	}
	if err := unix.Unmount(target, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(vol, vol+"-old"); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Dir(outside), vol); err != nil {
		t.Fatal(err)
	}

	u := &Unmounter{Root: k.Root()}
	acts, err := u.UnmountFromTable(ctx, named)
	if !errors.Is(err, errUnsafePath) || Unmounted(acts) != 0 {
		t.Errorf("UnmountFromTable through a symlink out of the root = %d unmounted, %v; want none and errUnsafePath", Unmounted(acts), err)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(outside, &st); err != nil || st.Type != unix.TMPFS_MAGIC {
		t.Errorf("the mount outside the kubelet root at %s is gone (statfs type %#x, %v)", outside, st.Type, err)
	}
}
