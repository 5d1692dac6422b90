package failover

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"

	"github.com/mountmedic/mountmedic/probe/lab"
	"github.com/mountmedic/mountmedic/remount"
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

	f := &NodeFence{KubeletRoot: k.Root(), HostTable: "/proc/self/mountinfo"}
	pods, err := f.MountedPods(ctx)
	if err != nil {
		t.Fatalf("MountedPods: %v", err)
	}
	slices.Sort(pods)
	if want := []string{"pod-a", "pod-b"}; !slices.Equal(pods, want) {
		t.Errorf("MountedPods = %v, want %v", pods, want)
	}

	dry := &NodeFence{KubeletRoot: k.Root(), HostTable: "/proc/self/mountinfo", DryRun: true}
	if got, want := dry.UnmountPodVolumes(ctx, []string{"pod-a", "pod-b", "pod-c"}), []PodResult{{N: 2}, {N: 1}, {}}; !slices.Equal(got, want) {
		t.Errorf("dry-run UnmountPodVolumes(pod-a, pod-b, pod-c) = %v, want %v", got, want)
	}
	assertMounted(t, map[string]bool{pubA: true, subA: true, pubB: true})

	if got, want := f.UnmountPodVolumes(ctx, []string{"pod-a"}), []PodResult{{N: 2}}; !slices.Equal(got, want) {
		t.Fatalf("UnmountPodVolumes(pod-a) = %v, want %v", got, want)
	}
	assertMounted(t, map[string]bool{pubA: false, subA: false, subScratch: true, pubB: true, stagingA: true, stagingB: true})

	// What a container started now would get: the node's directory, not
	// the volume.
	if err := os.WriteFile(filepath.Join(pubA, "after-fence"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(stagingA, "after-fence")); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a write to the fenced publish path reached the volume: stat = %v", err)
	}

	if got, want := f.UnmountPodVolumes(ctx, []string{"pod-a"}), []PodResult{{}}; !slices.Equal(got, want) {
		t.Errorf("second UnmountPodVolumes(pod-a) = %v, want %v", got, want)
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
