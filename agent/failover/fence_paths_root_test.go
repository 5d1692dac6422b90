package failover

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// TestNodeFencePerPathMatchesTable: on a kernel with per-path lookups the
// fence finds the pods' volume mounts at their own paths (each with its
// unique mount ID: never read from a table), and picks the same mounts as
// from the whole mount table: CSI publish targets, the subPath binds of
// them, raw block binds; not a memory emptyDir nor its subPath.
func TestNodeFencePerPathMatchesTable(t *testing.T) {
	lab.RequireRoot(t)
	k := lab.NewKubelet(t, filepath.Join(t.TempDir(), "kubelet"))
	const drv = "lab.csi.mountmedic.test"
	stagingA := k.StagingPath(drv, "vol-a")
	lab.NewExt4(t, stagingA, 16)
	pubA := k.Publish("pod-a", "pv-a", drv, "vol-a", stagingA, false)
	if err := os.Mkdir(filepath.Join(pubA, "data"), 0o755); err != nil {
		t.Fatal(err)
	}
	k.SubPath("pod-a", "pv-a", "app", 0, filepath.Join(pubA, "data"))
	scratch := k.EmptyDir("pod-a", "scratch", true)
	k.SubPath("pod-a", "scratch", "app", 1, scratch)
	blk := lab.NewExt4(t, filepath.Join(t.TempDir(), "blk"), 16)
	k.BlockDevice("pod-b", "pv-blk", blk.Device())
	stagingC := k.StagingPath(drv, "vol-c")
	lab.NewExt4(t, stagingC, 16)
	k.Publish("pod-c", "pv-c", drv, "vol-c", stagingC, false)

	f := &NodeFence{KubeletRoot: k.Root(), HostTable: "/proc/self/mountinfo"}
	if !f.unmounter().PerPath() {
		t.Skipf("this kernel has no per-path lookups (statmount with mount sources): the fence reads the table")
	}
	pods := []string{"pod-a", "pod-b"}
	perPath, err := f.inventory(pods)
	if err != nil {
		t.Fatalf("inventory(%v) per path: %v", pods, err)
	}
	for _, m := range perPath.Mounts {
		if m.UniqueID == 0 {
			t.Errorf("mount %d at %s: no unique ID, not read per path", m.ID, m.Path)
		}
	}
	whole, err := probe.ReadFile(f.HostTable, probe.Options{Root: f.KubeletRoot})
	if err != nil {
		t.Fatal(err)
	}
	got, want := picked(podMounts(perPath, pods)), picked(podMounts(whole, pods))
	if !slices.Equal(got, want) {
		t.Errorf("per path the fence picks\n%v\nfrom the table\n%v", got, want)
	}
	if len(want) != 4 {
		t.Errorf("from the table the fence picks %v, want pod-a's publish target and subPath, pod-b's two block binds", want)
	}

	mounted, err := f.MountedPods(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(mounted)
	if want := []string{"pod-a", "pod-b", "pod-c"}; !slices.Equal(mounted, want) {
		t.Errorf("MountedPods = %v, want %v", mounted, want)
	}
}

// picked lists what the fence would take off per pod: pod, path, device
// and root of each mount, sorted.
func picked(byPod map[string][]*probe.Mount) []string {
	var out []string
	for uid, ms := range byPod {
		for _, m := range ms {
			out = append(out, fmt.Sprintf("%s %s %s %s", uid, m.Path, m.Dev, m.Root))
		}
	}
	slices.Sort(out)
	return out
}

// TestNodeFenceNeverFollowsSymlinks: the hostile actor is whoever can plant
// a symlink in kubelet's pod directories (a compromised node component, a
// hostPath volume of the pods directory): links from a volume directory and
// from a subPath directory to mounts outside the kubelet root. The fence
// lists those directories per path, passes over the links, fences the pod's
// real volume and never touches what the links point at.
func TestNodeFenceNeverFollowsSymlinks(t *testing.T) {
	lab.RequireRoot(t)
	ctx := context.Background()
	k := lab.NewKubelet(t, filepath.Join(t.TempDir(), "kubelet"))
	const drv = "lab.csi.mountmedic.test"
	staging := k.StagingPath(drv, "vol-a")
	lab.NewExt4(t, staging, 16)
	pub := k.Publish("pod-a", "pv-a", drv, "vol-a", staging, false)

	outside := t.TempDir()
	for _, dir := range []string{"mount", "ctr/0"} {
		p := filepath.Join(outside, dir)
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mount("outside", p, "tmpfs", 0, "size=1m"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = unix.Unmount(p, unix.MNT_DETACH) })
	}
	pod := filepath.Join(k.Root(), "pods", "pod-a")
	links := map[string]string{
		filepath.Join(pod, "volumes", "kubernetes.io~csi", "pv-evil"): outside,
		filepath.Join(pod, "volume-subpaths", "pv-a"):                 outside,
	}
	for link, to := range links {
		if err := os.MkdirAll(filepath.Dir(link), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(to, link); err != nil {
			t.Fatal(err)
		}
	}

	f := &NodeFence{KubeletRoot: k.Root(), HostTable: "/proc/self/mountinfo"}
	if got, want := f.UnmountPodVolumes(ctx, []string{"pod-a"}), []PodResult{{N: 1}}; !slices.Equal(got, want) {
		t.Errorf("UnmountPodVolumes(pod-a) with planted links = %v, want %v", got, want)
	}
	assertMounted(t, map[string]bool{
		pub: false, staging: true,
		filepath.Join(outside, "mount"): true, filepath.Join(outside, "ctr/0"): true,
	})
}

// TestNodeFenceHostOnlyMount: the table's namespace has a pod's volume
// mounted where ours has nothing (a namespace ours receives no mounts
// from). The fence cannot take it off and must say so, not report the pod
// fenced.
func TestNodeFenceHostOnlyMount(t *testing.T) {
	lab.RequireRoot(t)
	ctx := context.Background()
	k := lab.NewKubelet(t, filepath.Join(t.TempDir(), "kubelet"))
	const drv = "lab.csi.mountmedic.test"
	pub := k.PreparePublish("pod-a", "pv-a", drv, "vol-a")
	host := lab.StartMountNamespace(t, "private")
	pid := filepath.Base(filepath.Dir(host))
	if out, err := exec.Command("nsenter", "-t", pid, "-m", "mount", "-t", "tmpfs", "-o", "size=1m", "host-only", pub).CombinedOutput(); err != nil {
		t.Fatalf("mount in the table's namespace: %v: %s", err, out)
	}
	if !mountedIn(t, host, pub) || mountedIn(t, "/proc/self/mountinfo", pub) {
		t.Fatalf("%s: want mounted in the table's namespace only", pub)
	}
	f := &NodeFence{KubeletRoot: k.Root(), HostTable: host}
	got := f.UnmountPodVolumes(ctx, []string{"pod-a"})
	if len(got) != 1 || got[0].Err == nil {
		t.Errorf("UnmountPodVolumes(pod-a) mounted in the table's namespace only = %v, want an error", got)
	}
	if !mountedIn(t, host, pub) {
		t.Errorf("%s was unmounted in a private namespace", pub)
	}
}
