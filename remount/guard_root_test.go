package remount

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// guardAt returns the mountinfo entry of the guard at path, nil when none.
func guardAt(t testing.TB, path string) *mountinfo.Info {
	t.Helper()
	infos, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(path))
	if err != nil {
		t.Fatal(err)
	}
	for _, in := range infos {
		if in.Source == probe.GuardSource && in.FSType == "tmpfs" {
			return in
		}
	}
	return nil
}

// underneath returns the names in the directory dir as it is on its own
// filesystem, below any mount on it: a non-recursive bind of its parent
// shows no submount.
func underneath(t testing.TB, dir string) []string {
	t.Helper()
	view := t.TempDir()
	if err := unix.Mount(filepath.Dir(dir), view, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	defer unix.Unmount(view, unix.MNT_DETACH)
	ents, err := os.ReadDir(filepath.Join(view, filepath.Base(dir)))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

// TestGuardMakesWritesFail: the guard over a publish target that lost its
// mount makes every write there fail with EROFS, leaves the node's
// directory empty, is known to the probe as the volume still Missing, and
// is lifted like a dead mount by the repair's unmount. It goes only on a
// CSI publish target below the kubelet root that is a directory and not a
// mount point, reached without a symlink; a dry run mounts nothing.
func TestGuardMakesWritesFail(t *testing.T) {
	lab.RequireRoot(t)
	k := newKubelet(t)
	root := k.Root()
	target := k.PreparePublish(labPod, labVolume, labDriver, labHandle)
	k.AgeVolData(target, probe.DefaultPublishGrace*2)
	ctx := context.Background()

	dry, err := New(Config{KubeletRoot: root, DryRun: true})
	if err != nil {
		t.Fatal(err)
	}
	defer dry.Close()
	if a := dry.Guard(ctx, target); a.Err != nil || !a.DryRun {
		t.Errorf("dry-run Guard = %v, want planned", a)
	}
	if g := guardAt(t, target); g != nil {
		t.Fatalf("dry-run Guard mounted %v", g)
	}

	r, err := New(Config{KubeletRoot: root})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	if a := r.Guard(ctx, target); a.Err != nil {
		t.Fatalf("Guard(%s) = %v", target, a)
	}
	g := guardAt(t, target)
	if g == nil {
		t.Fatalf("no guard mounted at %s", target)
	}
	t.Logf("guard: %s %s %s", g.FSType, g.Options, g.VFSOptions)
	if err := os.WriteFile(filepath.Join(target, "f"), []byte("x"), 0o644); !errors.Is(err, unix.EROFS) {
		t.Errorf("write under the guard = %v, want EROFS", err)
	}
	if err := os.Mkdir(filepath.Join(target, "sub"), 0o755); !errors.Is(err, unix.EROFS) {
		t.Errorf("mkdir under the guard (kubelet's subPath preparation) = %v, want EROFS", err)
	}
	if names := underneath(t, target); len(names) != 0 {
		t.Errorf("the node's directory under the guard holds %v, want nothing", names)
	}
	if a := r.Guard(ctx, target); !errors.Is(a.Err, ErrMountChanged) {
		t.Errorf("Guard over the guard = %v, want ErrMountChanged (a mount point)", a)
	}

	// The probe: the volume is still Missing, the guard known as such.
	inv, err := probe.ReadFile("/proc/self/mountinfo", probe.Options{Root: root, Live: true})
	if err != nil {
		t.Fatal(err)
	}
	rep := probe.NewProber(probe.Config{Timeout: failBound}).Probe(ctx, inv)
	var seen bool
	for _, res := range rep.Mounts {
		if res.Mount.Path != target {
			continue
		}
		seen = true
		if !res.Mount.Guard || res.State != probe.Missing || res.Mount.Driver != labDriver || res.Mount.VolumeHandle != labHandle {
			t.Errorf("probe of the guarded target: guard %t, %v, driver %q, handle %q; want the guard, Missing, and the volume from vol_data.json",
				res.Mount.Guard, res.State, res.Mount.Driver, res.Mount.VolumeHandle)
		}
	}
	if !seen {
		t.Errorf("the guarded target is not in the probe's report")
	}

	// The repair lifts it like a dead mount.
	dead := devSet{{Major: uint32(g.Major), Minor: uint32(g.Minor)}: true}
	table, err := readHostTable("/proc", root)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := table.unmountDead(ctx, r.unmounter(), target, dead); err != nil {
		t.Fatal(err)
	}
	if g := guardAt(t, target); g != nil {
		t.Errorf("guard still mounted after the repair's unmount: %v", g)
	}

	// Refused: not a CSI publish target or staging path, a symlink,
	// outside the root.
	staging := filepath.Join(root, "pods", labPod, "volumes", "kubernetes.io~empty-dir", "cache")
	if err := os.MkdirAll(staging, 0o750); err != nil {
		t.Fatal(err)
	}
	if a := r.Guard(ctx, staging); a.Err == nil {
		t.Errorf("Guard(an emptyDir volume) = %v, want refused", a)
	}
	other := k.PreparePublish(labPod, "pv-2", labDriver, "vol-2")
	if err := os.Remove(other); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(t.TempDir(), other); err != nil {
		t.Fatal(err)
	}
	if a := r.Guard(ctx, other); a.Err == nil {
		t.Errorf("Guard through a symlink = %v, want refused", a)
	}
	if a := r.Guard(ctx, filepath.Join(t.TempDir(), "pods", labPod, "volumes", "kubernetes.io~csi", "pv", "mount")); a.Err == nil {
		t.Errorf("Guard outside the kubelet root = %v, want refused", a)
	}
	for _, p := range []string{staging, other} {
		if g := guardAt(t, p); g != nil {
			t.Errorf("guard mounted at refused path %s", p)
		}
	}
}

// testGuardOnRealDriver: a pod's publish target loses its mount while the
// volume lives on in its staging mount. The guard makes a container
// started then fail to write; the repair lifts it, publishes again and
// swaps the fresh mount into that container, whose write then reaches S3.
// And with no agent left to lift it (SIGKILLed, uninstalled), the driver's
// own NodeUnpublishVolume, kubelet's teardown, takes the guard away and
// kubelet can remove the directory.
func testGuardOnRealDriver(t *testing.T, d *driverLab) {
	const prefix = "guarded"
	r := d.repairer(t, Config{})
	rv := d.newVolume(t, prefix, podDef{name: "a", ctrs: []ctrDef{{name: "app", mounts: []corev1.VolumeMount{{Name: testVolumeName, MountPath: "/data"}}}}})
	rp := rv.pods[0]
	ctx := context.Background()

	lose := func() {
		t.Helper()
		if err := unix.Unmount(rp.target, unix.MNT_DETACH); err != nil {
			t.Fatal(err)
		}
		d.k.AgeVolData(rp.target, 2*probe.DefaultPublishGrace)
		if a := r.Guard(ctx, rp.target); a.Err != nil {
			t.Fatalf("Guard: %v", a)
		}
	}
	lose()
	// A container started now gets the guard from kubelet's bind.
	id := randomHex(t, 32)
	late := d.startContainer(t, rp, ctrDef{name: "late", mounts: []corev1.VolumeMount{{Name: testVolumeName, MountPath: "/data"}}}, id)
	if err := os.WriteFile(late.Path("/data/late.txt"), []byte("late"), 0o644); !errors.Is(err, unix.EROFS) {
		t.Fatalf("write of a container started on the guard = %v, want EROFS", err)
	}
	if names := underneath(t, rp.target); len(names) != 0 {
		t.Errorf("the node's directory under the guard holds %v, want nothing", names)
	}

	// The repair, given what the agent gives it: the probe's report.
	inv, err := probe.ReadFile("/proc/self/mountinfo", probe.Options{Root: d.root, Live: true})
	if err != nil {
		t.Fatal(err)
	}
	rep := probe.NewProber(probe.Config{Timeout: failBound}).Probe(ctx, inv)
	for _, res := range rep.Mounts {
		if res.Mount.Path == rp.target && res.Mount.Guard && res.State == probe.Missing {
			rv.vol.Backend = res.Mount.Backend
			rv.vol.Pods[0].Dead = []*probe.Mount{res.Mount}
		}
	}
	if rv.vol.Backend == nil {
		t.Fatalf("the probe did not report the guarded target Missing")
	}
	rv.vol.Pods[0].Containers = append(rv.vol.Pods[0].Containers, ContainerMount{PodUID: rp.uid, Container: "late", ContainerID: id, MountPath: "/data"})
	re, ls := repair(t, r, rv.vol)
	if !re.Healed && !ls.Healed {
		t.Fatalf("repair: restage %v, live swap %v", re.Err, ls.Err)
	}
	if g := guardAt(t, rp.target); g != nil {
		t.Errorf("guard still at the publish target after the repair: %v", g)
	}
	writeFile(t, late.Path("/data/late.txt"), "late")
	wantFile(t, filepath.Join(rv.staging, "late.txt"), "late")
	wantFile(t, rp.ctrs["app"].Path("/data/late.txt"), "late")

	// No agent left: kubelet's teardown through the driver.
	lose()
	node := csi.NewNodeClient(d.csi.conn)
	if _, err := node.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: rv.handle, TargetPath: rp.target}); err != nil {
		t.Fatalf("the driver's NodeUnpublishVolume of a guarded target: %v", err)
	}
	if g := guardAt(t, rp.target); g != nil {
		t.Fatalf("guard still at the publish target after NodeUnpublishVolume: %v", g)
	}
	// kubelet's removeMountDir: the target directory, then vol_data.json.
	if err := os.Remove(rp.target); err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Errorf("kubelet's removal of the publish target: %v", err)
	}
}

// TestGuardStagingPath: a staging path that lost its mount is guarded like
// a publish target: writes fail, the probe reports the volume Missing with
// the guard known as such.
func TestGuardStagingPath(t *testing.T) {
	lab.RequireRoot(t)
	k := newKubelet(t)
	staging := k.StagingPath(labDriver, labHandle)
	if err := os.MkdirAll(staging, 0o750); err != nil {
		t.Fatal(err)
	}
	g := &Guarder{Root: k.Root()}
	if a := g.Guard(context.Background(), staging); a.Err != nil {
		t.Fatalf("Guard(%s) = %v", staging, a)
	}
	if guardAt(t, staging) == nil {
		t.Fatalf("no guard at %s", staging)
	}
	if err := os.WriteFile(filepath.Join(staging, "f"), []byte("x"), 0o644); !errors.Is(err, unix.EROFS) {
		t.Errorf("write under the staging guard = %v, want EROFS", err)
	}
	inv, err := probe.ReadFile("/proc/self/mountinfo", probe.Options{Root: k.Root()})
	if err != nil {
		t.Fatal(err)
	}
	var seen bool
	for _, m := range inv.Mounts {
		if m.Path == staging {
			seen = m.Guard
		}
	}
	if !seen {
		t.Errorf("the probe does not know the guard at the staging path")
	}
}

// TestGuardNeverLandsOnALiveMount reproduces issue 28's race: a publish
// between the guard's check and its attach. The kernel attaches the guard
// on top of whatever is mounted at the directory by then; Guard sees that
// the guard's parent is not the mount it checked, detaches it, finds the
// target a mount point and leaves it (ErrMountChanged). The live mount is
// on top, no guard anywhere at the path. The fence's guard is the same
// Guarder.
func TestGuardNeverLandsOnALiveMount(t *testing.T) {
	lab.RequireRoot(t)
	k := newKubelet(t)
	target := k.PreparePublish(labPod, labVolume, labDriver, labHandle)
	published := false
	g := &Guarder{Root: k.Root(), Sys: Syscalls{MoveMount: func(fromDirfd int, fromPath string, toDirfd int, toPath string, flags int) error {
		if !published {
			// kubelet's NodePublishVolume lands here.
			if err := unix.Mount("live", target, "tmpfs", 0, "size=1m"); err != nil {
				return err
			}
			published = true
		}
		return unix.MoveMount(fromDirfd, fromPath, toDirfd, toPath, flags)
	}}}
	a := g.Guard(context.Background(), target)
	t.Logf("guard: %v", a)
	if !errors.Is(a.Err, ErrMountChanged) {
		t.Errorf("Guard with a publish during it = %v, want ErrMountChanged", a)
	}
	if gd := guardAt(t, target); gd != nil {
		t.Errorf("the guard is mounted at %s (over the live volume): %v", target, gd)
	}
	infos, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(target))
	if err != nil {
		t.Fatal(err)
	}
	if len(infos) != 1 || infos[0].Source != "live" {
		t.Errorf("mounts at %s after the race: %d, top %v; want the live mount alone", target, len(infos), infos)
	}
	if err := os.WriteFile(filepath.Join(target, "f"), []byte("x"), 0o644); err != nil {
		t.Errorf("write to the live volume after the race: %v", err)
	}
}
