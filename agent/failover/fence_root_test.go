package failover

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/remount"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// TestNodeFenceUnmount fences one pod of a real kubelet tree (ext4 volumes
// on loop devices, publish binds, a subPath bind, a memory emptyDir with
// its own subPath): the pod's CSI publish target and the subPath bind of
// it go, everything else stays.
func TestNodeFenceUnmount(t *testing.T) {
	lab.RequireRoot(t)
	ctx := context.Background()
	k := lab.NewKubelet(t, filepath.Join(t.TempDir(), "kubelet"))
	const drv = "lab.csi.mountmedic.test"
	stagingA := k.StagingPath(drv, "vol-a")
	lab.NewExt4(t, stagingA, 16)
	stagingB := k.StagingPath(drv, "vol-b")
	lab.NewExt4(t, stagingB, 16)
	pubA := k.Publish("pod-a", "pv-a", drv, "vol-a", stagingA, false)
	if err := os.Mkdir(filepath.Join(pubA, "data"), 0o755); err != nil {
		t.Fatal(err)
	}
	subA := k.SubPath("pod-a", "pv-a", "app", 0, filepath.Join(pubA, "data"))
	scratch := k.EmptyDir("pod-a", "scratch", true)
	subScratch := k.SubPath("pod-a", "scratch", "app", 1, scratch)
	pubB := k.Publish("pod-b", "pv-b", drv, "vol-b", stagingB, false)

	f := &NodeFence{KubeletRoot: k.Root(), HostTable: "/proc/self/mountinfo", Guard: true}
	pods, err := f.MountedPods(ctx)
	if err != nil {
		t.Fatalf("MountedPods: %v", err)
	}
	slices.Sort(pods)
	if want := []string{"pod-a", "pod-b"}; !slices.Equal(pods, want) {
		t.Errorf("MountedPods = %v, want %v", pods, want)
	}

	dry := &NodeFence{KubeletRoot: k.Root(), HostTable: "/proc/self/mountinfo", DryRun: true, Guard: true}
	if got, want := dry.UnmountPodVolumes(ctx, []string{"pod-a", "pod-b", "pod-c"}), []PodResult{{N: 2}, {N: 1}, {}}; !slices.Equal(got, want) {
		t.Errorf("dry-run UnmountPodVolumes(pod-a, pod-b, pod-c) = %v, want %v", got, want)
	}
	assertMounted(t, map[string]bool{pubA: true, subA: true, pubB: true})

	if got, want := f.UnmountPodVolumes(ctx, []string{"pod-a"}), []PodResult{{N: 2}}; !slices.Equal(got, want) {
		t.Fatalf("UnmountPodVolumes(pod-a) = %v, want %v", got, want)
	}
	assertMounted(t, map[string]bool{subA: false, subScratch: true, pubB: true, stagingA: true, stagingB: true})
	assertGuarded(t, "/proc/self/mountinfo", pubA)

	// What a container started now would get: the guard, neither the
	// volume nor the node's disk.
	if err := os.WriteFile(filepath.Join(pubA, "after-fence"), []byte("x"), 0o644); !errors.Is(err, unix.EROFS) {
		t.Errorf("a write to the fenced publish path = %v, want EROFS (the guard)", err)
	}
	if _, err := os.Stat(filepath.Join(stagingA, "after-fence")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a write to the fenced publish path reached the volume: stat = %v", err)
	}
	if pods, err := f.MountedPods(ctx); err != nil || slices.Contains(pods, "pod-a") {
		t.Errorf("MountedPods after the fence = %v, %v; want pod-a gone (only its guard is there)", pods, err)
	}

	if got, want := f.UnmountPodVolumes(ctx, []string{"pod-a"}), []PodResult{{}}; !slices.Equal(got, want) {
		t.Errorf("second UnmountPodVolumes(pod-a) = %v, want %v", got, want)
	}
}

// mountsAt lists the mounts at path in the mount table, bottom first.
func mountsAt(t *testing.T, table, path string) []*mountinfo.Info {
	t.Helper()
	f, err := os.Open(table)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	infos, err := mountinfo.GetMountsFromReader(f, mountinfo.SingleEntryFilter(path))
	if err != nil {
		t.Fatal(err)
	}
	return infos
}

// assertGuarded checks that the top mount at path in the mount table is
// mountmedic's guard.
func assertGuarded(t *testing.T, table, path string) {
	t.Helper()
	infos := mountsAt(t, table, path)
	if len(infos) == 0 || infos[len(infos)-1].Source != probe.GuardSource {
		t.Errorf("%s in %s: %d mounts, want the guard on top", path, table, len(infos))
	}
}

func assertMounted(t *testing.T, want map[string]bool) {
	t.Helper()
	for p, w := range want {
		infos, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(p))
		if err != nil {
			t.Fatal(err)
		}
		if got := len(infos) > 0; got != w {
			t.Errorf("%s mounted = %v, want %v", p, got, w)
		}
	}
}

// TestNodeFenceNoRuntime: a fence without a container runtime says so for
// every pod.
func TestNodeFenceNoRuntime(t *testing.T) {
	f := &NodeFence{CRIEndpoint: "unix://" + filepath.Join(t.TempDir(), "containerd.sock"), CRITimeout: time.Second}
	got := f.StopPodContainers(context.Background(), []string{"pod-a", "pod-b"}, time.Second)
	if len(got) != 2 {
		t.Fatalf("StopPodContainers(pod-a, pod-b) = %v, want 2 results", got)
	}
	for i, r := range got {
		if r.N != 0 || !errors.Is(r.Err, remount.ErrRuntimeUnavailable) {
			t.Errorf("StopPodContainers without a runtime: result %d = %v, want 0 and ErrRuntimeUnavailable", i, r)
		}
	}
}

// mountedIn reports whether something other than mountmedic's guard is
// mounted at path in the mount table.
func mountedIn(t *testing.T, table, path string) bool {
	t.Helper()
	for _, in := range mountsAt(t, table, path) {
		if in.Source != probe.GuardSource {
			return true
		}
	}
	return false
}

// TestNodeFenceOtherNamespace is the shipped configuration: the fence reads
// --host-table from another mount namespace than the one it acts in (the
// DaemonSet's /proc/1/mountinfo), where every mount has another ID. It must
// still unmount what that table names, and the unmount must reach that
// namespace. Hostile: a mount on top of a target in our namespace that the
// table does not show (the path changed under the fence) stays, and a
// namespace the unmounts do not reach (no propagation) is an error, not a
// fence reported done.
func TestNodeFenceOtherNamespace(t *testing.T) {
	lab.RequireRoot(t)
	ctx := context.Background()
	k := lab.NewKubelet(t, filepath.Join(t.TempDir(), "kubelet"))
	const drv = "lab.csi.mountmedic.test"
	stagingA := k.StagingPath(drv, "vol-a")
	lab.NewExt4(t, stagingA, 16)
	stagingB := k.StagingPath(drv, "vol-b")
	lab.NewExt4(t, stagingB, 16)
	pubA := k.Publish("pod-a", "pv-a", drv, "vol-a", stagingA, false)
	if err := os.Mkdir(filepath.Join(pubA, "data"), 0o755); err != nil {
		t.Fatal(err)
	}
	subA := k.SubPath("pod-a", "pv-a", "app", 0, filepath.Join(pubA, "data"))
	pubB := k.Publish("pod-b", "pv-b", drv, "vol-b", stagingB, false)

	host := lab.StartMountNamespace(t, "unchanged")

	// pod-b's publish target changes under the fence in our namespace
	// only: private here, then a tmpfs on top that the table never shows.
	if err := unix.Mount("", pubB, "", unix.MS_PRIVATE, ""); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", pubB, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(pubB, unix.MNT_DETACH) })

	f := &NodeFence{KubeletRoot: k.Root(), HostTable: host, Guard: true}
	pods, err := f.MountedPods(ctx)
	if err != nil {
		t.Fatalf("MountedPods: %v", err)
	}
	slices.Sort(pods)
	if want := []string{"pod-a", "pod-b"}; !slices.Equal(pods, want) {
		t.Errorf("MountedPods = %v, want %v", pods, want)
	}

	dry := &NodeFence{KubeletRoot: k.Root(), HostTable: host, DryRun: true, Guard: true}
	if got := dry.UnmountPodVolumes(ctx, []string{"pod-a"}); len(got) != 1 || got[0].N != 2 || got[0].Err != nil {
		t.Errorf("dry-run UnmountPodVolumes(pod-a) = %v, want 2 mounts and no error", got)
	}
	for _, p := range []string{pubA, subA} {
		if !mountedIn(t, host, p) || !mountedIn(t, "/proc/self/mountinfo", p) {
			t.Errorf("the dry run unmounted %s", p)
		}
	}

	got := f.UnmountPodVolumes(ctx, []string{"pod-a", "pod-b"})
	if len(got) != 2 {
		t.Fatalf("UnmountPodVolumes(pod-a, pod-b) = %v, want 2 results", got)
	}
	if got[0].N != 2 || got[0].Err != nil {
		t.Errorf("UnmountPodVolumes(pod-a) = %v, want 2 mounts and no error", got[0])
	}
	if got[1].N != 0 || !errors.Is(got[1].Err, remount.ErrMountChanged) {
		t.Errorf("UnmountPodVolumes(pod-b) with another mount on top here = %v, want 0 and ErrMountChanged", got[1])
	}
	for _, p := range []string{pubA, subA} {
		if mountedIn(t, host, p) {
			t.Errorf("%s is still mounted in the table's namespace", p)
		}
		if mountedIn(t, "/proc/self/mountinfo", p) {
			t.Errorf("%s is still mounted in the fence's namespace", p)
		}
	}
	if !mountedIn(t, host, pubB) {
		t.Errorf("pod-b's publish target was unmounted in the table's namespace")
	}
	var st unix.Statfs_t
	if err := unix.Statfs(pubB, &st); err != nil {
		t.Fatal(err)
	}
	if st.Type != unix.TMPFS_MAGIC {
		t.Errorf("the tmpfs on top of pod-b's publish target here was unmounted (statfs type %#x)", st.Type)
	}
	for _, p := range []string{stagingA, stagingB} {
		if !mountedIn(t, host, p) {
			t.Errorf("staging mount %s was unmounted", p)
		}
	}
	// A container started now gets the guard, in both namespaces.
	assertGuarded(t, host, pubA)
	if err := os.WriteFile(filepath.Join(pubA, "after-fence"), []byte("x"), 0o644); !errors.Is(err, unix.EROFS) {
		t.Errorf("a write to the fenced publish path = %v, want EROFS (the guard)", err)
	}
	if _, err := os.Stat(filepath.Join(stagingA, "after-fence")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a write to the fenced publish path reached the volume: stat = %v", err)
	}
	if got := f.UnmountPodVolumes(ctx, []string{"pod-a"}); len(got) != 1 || got[0] != (PodResult{}) {
		t.Errorf("second UnmountPodVolumes(pod-a) = %v, want nothing to do", got)
	}
}

// TestNodeFenceUnreached: the table's namespace holds private copies that
// no unmount of ours reaches (an agent without Bidirectional propagation).
// The fence unmounts here, then finds the volume still mounted in the table
// and says so.
func TestNodeFenceUnreached(t *testing.T) {
	lab.RequireRoot(t)
	ctx := context.Background()
	k := lab.NewKubelet(t, filepath.Join(t.TempDir(), "kubelet"))
	const drv = "lab.csi.mountmedic.test"
	staging := k.StagingPath(drv, "vol-a")
	lab.NewExt4(t, staging, 16)
	pub := k.Publish("pod-a", "pv-a", drv, "vol-a", staging, false)
	host := lab.StartMountNamespace(t, "private")

	f := &NodeFence{KubeletRoot: k.Root(), HostTable: host}
	got := f.UnmountPodVolumes(ctx, []string{"pod-a"})
	if len(got) != 1 || got[0].Err == nil || !strings.Contains(got[0].Err.Error(), "still mounted") {
		t.Errorf("UnmountPodVolumes(pod-a) whose table is out of reach = %v, want an error saying it is still mounted there", got)
	}
	if !mountedIn(t, host, pub) {
		t.Fatalf("%s was unmounted in a private namespace: the test does not test", pub)
	}
}
