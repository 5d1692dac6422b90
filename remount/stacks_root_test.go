package remount

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/probe/kubelet"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// TestStacksAtOwnPaths: per-path lookups find what the whole table shows
// at a volume's own paths (its publish target's stack, its subPath binds
// listed under volume-subpaths), and the two agree mount by mount.
func TestStacksAtOwnPaths(t *testing.T) {
	lab.RequireRoot(t)
	k := newKubelet(t)
	root := k.Root()
	r, err := New(Config{KubeletRoot: root})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	perPath := r.lookup.get(r.procDir) == lookupPerPath
	t.Logf("kernel %s: per-path lookups %t", kernelRelease(), perPath)
	const uid, vol = "11111111-2222-3333-4444-555555555555", "pv-a"
	src := filepath.Join(t.TempDir(), "src")
	if err := os.MkdirAll(filepath.Join(src, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("stacks", src, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	defer unix.Unmount(src, unix.MNT_DETACH)
	if err := os.MkdirAll(filepath.Join(src, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	target := k.Publish(uid, vol, "drv", "h", src, false)
	if err := unix.Mount(src, target, "", unix.MS_BIND, ""); err != nil { // a stack of two
		t.Fatal(err)
	}
	sp0 := k.SubPath(uid, vol, "app", 0, filepath.Join(src, "sub"))
	sp1 := k.SubPath(uid, vol, "side", 3, filepath.Join(src, "sub"))

	binds, err := r.subPathBinds(target)
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(binds)
	if want := []string{sp0, sp1}; !slices.Equal(binds, want) {
		t.Errorf("subPathBinds(%s) = %v, want %v", target, binds, want)
	}
	paths := append([]string{target, filepath.Join(root, "pods", uid, "nothing")}, binds...)
	per, err := r.readStacks(paths)
	if err != nil {
		t.Fatal(err)
	}
	whole := table(t, root)
	for _, p := range paths {
		got, want := per.stack(p), whole.stack(p)
		if len(got) != len(want) {
			t.Errorf("stack at %s: %d mounts per path, %d in the table", p, len(got), len(want))
			continue
		}
		for i := range got {
			g, w := got[i], want[i]
			if g.ID != w.ID || g.Dev != w.Dev || g.Root != w.Root || g.FSType != w.FSType || g.Source != w.Source || g.Target != w.Target || perPath != (g.UniqueID != 0) {
				t.Errorf("stack at %s, mount %d: per path %+v, table %+v", p, i, g, w)
			}
		}
	}
	if b := per.byDev[per.top(target).Dev]; perPath && (b == nil || len(b.Mounts) != 4) {
		t.Errorf("per-path lookup: filesystem of %s shows %v, want its 4 mounts at the paths read", target, b)
	}
	if k, _ := kubelet.Classify(root, sp1); per.top(sp1).Target != k {
		t.Errorf("subPath bind classified %+v, want %+v", per.top(sp1).Target, k)
	}
}

// TestUniqueIDRefusesReusedMount: the hostile actor makes a fresh mount
// at a volume's path after the mount a repair read there was freed; the
// kernel gives the fresh one the freed mount's mount ID and device number
// (the lowest free ones). With unique IDs the repair's unmount refuses it;
// reading the table, the same unmount takes it, which is why the table
// path probes a FUSE mount again before it acts (confirmDead).
func TestUniqueIDRefusesReusedMount(t *testing.T) {
	lab.RequireRoot(t)
	k := newKubelet(t)
	root := k.Root()
	for _, mode := range []lookupMode{lookupPerPath, lookupTable} {
		r, err := New(Config{KubeletRoot: root})
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		if mode == lookupPerPath && r.lookup.get(r.procDir) != lookupPerPath {
			t.Logf("kernel %s: no statmount with mount sources; only the table half runs", kernelRelease())
			continue
		}
		r.lookup.mode = mode
		target := k.PublishPath("aaaaaaaa-2222-3333-4444-555555555555", "pv-reuse")
		mountTmpfs := func() {
			if err := unix.Mount("reuse", target, "tmpfs", 0, "size=1m"); err != nil {
				t.Fatal(err)
			}
		}
		mountTmpfs()
		before, err := r.readStacks([]string{target})
		if err != nil {
			t.Fatal(err)
		}
		old := before.top(target)
		if err := unix.Unmount(target, unix.MNT_DETACH); err != nil {
			t.Fatal(err)
		}
		mountTmpfs()
		now := table(t, root).top(target)
		if now.ID != old.ID || now.Dev != old.Dev {
			t.Logf("mode %d: the kernel gave the fresh mount ID %d dev %s, not the freed %d %s: nothing reused to refuse", mode, now.ID, now.Dev, old.ID, old.Dev)
			unix.Unmount(target, unix.MNT_DETACH)
			continue
		}
		acts, err := before.unmountDead(context.Background(), r.unmounter(), target, devSet{old.Dev: true})
		left := table(t, root).top(target)
		switch mode {
		case lookupPerPath:
			if !errors.Is(err, ErrMountChanged) || left == nil || left.ID != now.ID {
				t.Errorf("per path: unmount of the freed mount %d (unique %d) = %v, %v; the fresh mount must stay", old.ID, old.UniqueID, acts, err)
			}
		case lookupTable:
			if err != nil || left != nil {
				t.Errorf("table: unmount = %v, %v, left %v: the table cannot tell the fresh mount from the freed one", acts, err, left)
			}
		}
		unix.Unmount(target, unix.MNT_DETACH)
	}
}

func kernelRelease() string {
	var u unix.Utsname
	if unix.Uname(&u) != nil {
		return "?"
	}
	return unix.ByteSliceToString(u.Release[:])
}

// BenchmarkRepairLookups: what one repair's look at its paths costs with
// other mounts on the node: per path (statx + statmount at the staging
// path, the publish target and a subPath bind) against a read of the
// whole table.
//
//	go test -run '^$' -bench RepairLookups ./remount
func BenchmarkRepairLookups(b *testing.B) {
	lab.RequireRoot(b)
	k := newKubelet(b)
	root := k.Root()
	const uid, vol = "cccccccc-2222-3333-4444-555555555555", "pv-bench"
	src := filepath.Join(b.TempDir(), "src")
	if err := os.MkdirAll(src, 0o755); err != nil {
		b.Fatal(err)
	}
	if err := unix.Mount("bench", src, "tmpfs", 0, "size=1m,nr_inodes=100k"); err != nil {
		b.Fatal(err)
	}
	defer unix.Unmount(src, unix.MNT_DETACH)
	if err := os.MkdirAll(filepath.Join(src, "sub"), 0o755); err != nil {
		b.Fatal(err)
	}
	staging := k.StagingPath("drv", "h")
	if err := unix.Mount(src, staging, "", unix.MS_BIND, ""); err != nil {
		b.Fatal(err)
	}
	target := k.Publish(uid, vol, "drv", "h", staging, false)
	sp := k.SubPath(uid, vol, "app", 0, filepath.Join(src, "sub"))
	others := filepath.Join(root, "others")
	made := 0
	for _, n := range []int{0, 1000, 10000} {
		for ; made < n; made++ {
			dir := filepath.Join(others, strconv.Itoa(made))
			if err := os.MkdirAll(dir, 0o755); err != nil {
				b.Fatal(err)
			}
			if err := unix.Mount(src, dir, "", unix.MS_BIND, ""); err != nil {
				b.Fatal(err)
			}
		}
		for _, mode := range []lookupMode{lookupPerPath, lookupTable} {
			name := map[lookupMode]string{lookupPerPath: "per-path", lookupTable: "table"}[mode]
			b.Run(fmt.Sprintf("mounts=%d/%s", n, name), func(b *testing.B) {
				r, err := New(Config{KubeletRoot: root})
				if err != nil {
					b.Fatal(err)
				}
				defer r.Close()
				if mode == lookupPerPath && r.lookup.get(r.procDir) != lookupPerPath {
					b.Skipf("kernel %s: no per-path lookups", kernelRelease())
				}
				r.lookup.mode = mode
				paths := []string{staging, target, sp}
				for b.Loop() {
					tab, err := r.readStacks(paths)
					if err != nil || tab.top(target) == nil {
						b.Fatalf("readStacks = %v, %v", tab, err)
					}
				}
			})
		}
	}
}
