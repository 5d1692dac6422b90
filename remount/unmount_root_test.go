package remount

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
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

// TestFusectlLeavesTheHostAsFound: where fusectl is not mounted at the
// configured directory, the abort goes through a detached fusectl mount:
// the hung connection is aborted, and no mount table changes (no fusectl
// mount appears anywhere, the directory stays bare). The Repairer keeps
// one detached mount for the stall watch and closes it with Close.
func TestFusectlLeavesTheHostAsFound(t *testing.T) {
	lab.RequireRoot(t)
	k := newKubelet(t)
	v := newLabVolume(t, k, labHandle, labVolume)
	bare := t.TempDir()
	fusectlMounts := func() int {
		ms, err := mountinfo.GetMounts(mountinfo.FSTypeFilter("fusectl"))
		if err != nil {
			t.Fatal(err)
		}
		return len(ms)
	}
	before := fusectlMounts()

	r, err := New(Config{KubeletRoot: k.Root(), FusectlDir: bare})
	if err != nil {
		t.Fatal(err)
	}
	dir, err := r.FusectlDir(context.Background())
	if err != nil || !strings.HasPrefix(dir, "/proc/self/fd/") {
		t.Fatalf("FusectlDir with fusectl not mounted at %s = %q, %v; want a detached mount's /proc/self/fd/<n>", bare, dir, err)
	}
	if _, err := os.Stat(filepath.Join(dir, strconv.FormatUint(uint64(v.fs.Conn()), 10), "waiting")); err != nil {
		t.Errorf("the lab volume's connection in the detached fusectl: %v", err)
	}

	v.fs.Hang()
	blocked := blockedStatfs(t, v.staging)
	u := &Unmounter{Root: k.Root(), FusectlDir: bare}
	at := &probe.Mount{Path: v.staging, ID: topID(t, k.Root(), v.staging), Dev: v.dev()}
	acts, err := u.AbortFUSE(context.Background(), v.dev(), at)
	t.Logf("actions: %v", acts)
	if err != nil || ops(acts)[opAbortFUSE] != 1 {
		t.Fatalf("AbortFUSE through a detached fusectl = %v, %v", acts, err)
	}
	select {
	case <-blocked:
	case <-time.After(failBound):
		t.Fatalf("statfs still blocked %s after the abort", failBound)
	}
	if after := fusectlMounts(); after != before {
		t.Errorf("fusectl mounts in our table: %d before, %d after: the host was not left as found", before, after)
	}
	if ms, _ := mountinfo.GetMounts(mountinfo.SingleEntryFilter(bare)); len(ms) != 0 {
		t.Errorf("%s holds %d mounts after the abort, want none", bare, len(ms))
	}
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	n, _ := strconv.Atoi(strings.TrimPrefix(dir, "/proc/self/fd/"))
	if _, err := unix.FcntlInt(uintptr(n), unix.F_GETFD, 0); err == nil {
		// The number may have been reused by another descriptor: only a
		// fusectl there is the leak.
		var st unix.Statfs_t
		if unix.Fstatfs(n, &st) == nil && st.Type == probe.FusectlMagic {
			t.Errorf("the detached fusectl mount is still open after Close")
		}
	}
}

// TestFenceRemovesAPropagatedGuard: a publish target that binds a bare
// staging directory (a pod published while the staging mount was gone,
// or the lab's failover node) is a peer of the shared kubelet root, so
// the guard attached at the staging path propagates over it. The
// fence's UnmountFromTable, which names the publish bind only (guards
// are never named), unmounts the guard on top first and then the bind:
// the guard cannot keep a fenced pod on its volume (the regression that
// took the staging guard out: TestLiveDashboardAndAlerts' fence).
func TestFenceRemovesAPropagatedGuard(t *testing.T) {
	lab.RequireRoot(t)
	ctx := context.Background()
	k := newKubelet(t)
	staging := k.StagingPath(labDriver, labHandle)
	if err := os.MkdirAll(staging, 0o750); err != nil {
		t.Fatal(err)
	}
	target := k.Publish(labPod, labVolume, labDriver, labHandle, staging, false)
	if a := (&Guarder{Root: k.Root()}).Guard(ctx, staging); a.Err != nil {
		t.Fatalf("guard %s: %v", staging, a.Err)
	}
	inv, err := probe.ReadFile("/proc/self/mountinfo", probe.Options{Root: k.Root()})
	if err != nil {
		t.Fatal(err)
	}
	var named []*probe.Mount
	guarded := false
	for _, m := range inv.Mounts {
		switch {
		case m.Path == target && m.Guard:
			guarded = true
		case m.Path == target:
			named = append(named, m)
		}
	}
	if !guarded || len(named) != 1 {
		t.Fatalf("at the publish target: guard propagated %t, %d other mounts; want the guard over the one bind (the layout this test is about)", guarded, len(named))
	}
	u := &Unmounter{Root: k.Root()}
	acts, err := u.UnmountFromTable(ctx, named)
	t.Logf("actions: %v", acts)
	if err != nil {
		t.Fatalf("UnmountFromTable = %v; want the propagated guard and the bind unmounted", err)
	}
	if id := topID(t, k.Root(), target); id != 0 {
		t.Errorf("the publish target %s is still a mount point (mount %d)", target, id)
	}
	// The guard at the staging path is a peer of the one unmounted: the
	// unmount propagates to it (the agent guards the path again in its
	// next cycle).
	t.Logf("staging path a mount point after the fence: %t", topID(t, k.Root(), staging) != 0)
}
