package probe

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/scripts/lab"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

func TestMain(m *testing.M) { lab.Main(m) }

const labDriver = "lab.csi.mountmedic.io"

// labVolume is a FaultFS staged, published to one pod and bound by subPath.
type labVolume struct {
	fs                      *lab.FaultFS
	staging, publish, subPt string
}

func stageFaultFS(t *testing.T, k *lab.Kubelet, handle, podUID string) labVolume {
	t.Helper()
	staging := k.StagingPath(labDriver, handle)
	fs := lab.StartFaultFS(t, staging)
	if err := os.MkdirAll(filepath.Join(staging, "data"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(staging, "data", "hello"), []byte("hi"), 0o644); err != nil {
		t.Fatal(err)
	}
	pub := k.Publish(podUID, "pv-"+handle, labDriver, handle, staging, false)
	sub := k.SubPath(podUID, "pv-"+handle, "app", 0, filepath.Join(pub, "data"))
	return labVolume{fs: fs, staging: staging, publish: pub, subPt: sub}
}

// Drivers not in the catalogue whose capabilities the lab's tests know: the
// agent asks each driver's NodeGetCapabilities.
const (
	// noStageDriver advertises no STAGE_UNSTAGE_VOLUME.
	noStageDriver = "nostage.lab.mountmedic.io"
	// silentDriver did not answer.
	silentDriver = "silent.lab.mountmedic.io"
)

func labDriverStages(driver string) (stages, known bool) {
	switch driver {
	case labDriver:
		return true, true
	case noStageDriver:
		return false, true
	}
	return false, false
}

func liveInventory(t *testing.T, root string) *Inventory {
	t.Helper()
	inv, err := ReadFile("/proc/self/mountinfo", Options{Root: root, Live: true, DriverStages: labDriverStages})
	if err != nil {
		t.Fatal(err)
	}
	return inv
}

func statesByPath(rep *Report) map[string]Result {
	out := make(map[string]Result)
	for _, r := range rep.Mounts {
		out[r.Mount.Path] = r
	}
	return out
}

// TestProbeRealFaults drives every state from a real fault on real mounts
// and checks that one probe cycle names each, bounded by its deadline.
func TestProbeRealFaults(t *testing.T) {
	lab.RequireRoot(t)
	lab.RequireBinary(t, "mkfs.ext4")
	k := lab.NewKubelet(t, filepath.Join(t.TempDir(), "kubelet"))
	root := k.Root()

	healthy := stageFaultFS(t, k, "healthy", "pod-healthy")
	dead := stageFaultFS(t, k, "dead", "pod-dead")
	hung := stageFaultFS(t, k, "hung", "pod-hung")
	eio := stageFaultFS(t, k, "eio", "pod-eio")

	// A block volume whose filesystem is shut down (ext4 on loop).
	shutStaging := k.StagingPath(labDriver, "shutdown")
	shut := lab.NewExt4(t, shutStaging, 16)
	shutPub := k.Publish("pod-shut", "pv-shutdown", labDriver, "shutdown", shutStaging, false)

	// NBD-like: ext4 on a loop device whose backing file is on FUSE.
	lowerFS := lab.StartFaultFS(t, filepath.Join(t.TempDir(), "lower"))
	nbdStaging := k.StagingPath(labDriver, "nbd")
	nbd := lab.NewExt4On(t, nbdStaging, lowerFS.Mountpoint(), 16)
	nbdPub := k.Publish("pod-nbd", "pv-nbd", labDriver, "nbd", nbdStaging, false)

	// Missing: kubelet set the volume up, the mount went away.
	missing := stageFaultFS(t, k, "missing", "pod-missing")
	// Staging gone: the staging mount alone was unmounted by path (a stale
	// FUSE daemon's exit) while the pod reads on through its binds.
	unstaged := stageFaultFS(t, k, "unstaged", "pod-unstaged")
	// A driver that never stages (csi-driver-nfs): kubelet still made
	// globalmount and vol_data.json, and the publish target is mounted
	// from elsewhere (a tmpfs standing in for the NFS export).
	nfsStaging := k.StagingPath("nfs.csi.k8s.io", "server#srv/share#pv-nfs#")
	nfsExport := filepath.Join(t.TempDir(), "export")
	if err := os.MkdirAll(nfsExport, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("export", nfsExport, "tmpfs", 0, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Unmount(nfsExport, unix.MNT_DETACH) })
	nfsPub := k.Publish("pod-nfs", "pv-nfs", "nfs.csi.k8s.io", "server#srv/share#pv-nfs#", nfsExport, false)
	// Drivers not in the catalogue that publish from elsewhere too: one
	// says it does not stage, one did not answer.
	noStage := k.StagingPath(noStageDriver, "ns-1")
	k.Publish("pod-ns", "pv-ns", noStageDriver, "ns-1", nfsExport, false)
	silent := k.StagingPath(silentDriver, "si-1")
	k.Publish("pod-si", "pv-si", silentDriver, "si-1", nfsExport, false)
	// Deleted: the subPath directory was removed under the bind.
	delStaging := k.StagingPath(labDriver, "deleted")
	lab.StartFaultFS(t, delStaging)
	if err := os.MkdirAll(filepath.Join(delStaging, "gone"), 0o755); err != nil {
		t.Fatal(err)
	}
	delPub := k.Publish("pod-del", "pv-deleted", labDriver, "deleted", delStaging, false)
	delSub := k.SubPath("pod-del", "pv-deleted", "app", 0, filepath.Join(delPub, "gone"))

	// The faults.
	dead.fs.Kill()
	hung.fs.Hang()
	eio.fs.SetErrno(unix.EIO)
	shut.Shutdown()
	if err := os.WriteFile(filepath.Join(nbdStaging, "f"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	lowerFS.Kill()
	// A write that reaches the dead backing file aborts the journal.
	if f, err := os.OpenFile(filepath.Join(nbdStaging, "g"), os.O_CREATE|os.O_WRONLY, 0o644); err == nil {
		_, _ = f.Write([]byte("y"))
		_ = f.Sync()
		f.Close()
	}
	_ = nbd
	for _, p := range []string{missing.subPt, missing.publish, missing.staging} {
		if err := unix.Unmount(p, unix.MNT_DETACH); err != nil {
			t.Fatalf("unmount %s: %v", p, err)
		}
	}
	k.AgeVolData(missing.publish, time.Minute) // published long ago
	if err := unix.Unmount(unstaged.staging, unix.MNT_DETACH); err != nil {
		t.Fatalf("unmount %s: %v", unstaged.staging, err)
	}
	if err := os.Remove(filepath.Join(delStaging, "gone")); err != nil {
		t.Fatal(err)
	}

	inv := liveInventory(t, root)
	p := NewProber(Config{Timeout: 300 * time.Millisecond, Parallel: 4, ReadDevice: true})
	rep := p.Probe(context.Background(), inv)
	got := statesByPath(rep)

	want := map[string]State{
		healthy.staging: Healthy, healthy.publish: Healthy, healthy.subPt: Healthy,
		dead.staging: Disconnected, dead.publish: Disconnected, dead.subPt: Disconnected,
		hung.staging: Hung, hung.publish: Hung, hung.subPt: Hung,
		eio.staging: IOError, eio.publish: IOError, eio.subPt: IOError,
		shutStaging: Shutdown, shutPub: Shutdown,
		missing.publish:  Missing,
		delSub:           Deleted,
		unstaged.staging: Missing, unstaged.publish: Healthy, unstaged.subPt: Healthy,
	}
	for path, st := range want {
		r, ok := got[path]
		if !ok {
			t.Errorf("%s: not in the report", path)
			continue
		}
		if r.State != st {
			t.Errorf("%s: state %v (err %v), want %v", strings.TrimPrefix(path, root), r.State, r.Err, st)
		}
	}
	if r := got[unstaged.staging]; r.Mount.Target.Kind != kubelet.KindStaging || r.Mount.VolumeHandle != "unstaged" || r.Mount.Driver != labDriver {
		t.Errorf("staging gone under live binds: %+v, want a staging mount of %s/unstaged", r.Mount, labDriver)
	}
	if r, ok := got[nfsStaging]; ok {
		t.Errorf("%s: state %v; the bare globalmount of a driver that never stages is what kubelet leaves, not a lost staging mount", nfsStaging, r.State)
	}
	for _, p := range []string{noStage, silent} {
		if r, ok := got[p]; ok {
			t.Errorf("%s: state %v; a driver that does not stage, or did not say, leaves globalmount bare", p, r.State)
		}
	}
	if !slices.Equal(inv.StagingUnknown, []string{silentDriver}) {
		t.Errorf("StagingUnknown = %q, want %q: the driver that did not say whether it stages", inv.StagingUnknown, silentDriver)
	}
	if r := got[nfsPub]; r.State != Healthy {
		t.Errorf("nfs publish target: state %v, want Healthy", r.State)
	}
	if _, ok := got[missing.staging]; ok {
		t.Errorf("%s: a staging mount gone with every publish target of its volume is kubelet's teardown, not a fault", missing.staging)
	}
	if r := got[dead.publish]; !errors.Is(r.Err, unix.ENOTCONN) {
		t.Errorf("dead publish err = %v, want ENOTCONN", r.Err)
	}
	if r := got[healthy.publish]; r.Mount.Driver != labDriver || r.Mount.VolumeHandle != "healthy" {
		t.Errorf("healthy publish driver %q handle %q, want %q and %q from vol_data.json", r.Mount.Driver, r.Mount.VolumeHandle, labDriver, "healthy")
	}
	if r := got[nbdPub]; !r.State.Broken() {
		t.Errorf("NBD-like publish over a dead FUSE backing file: state %v, want a broken state", r.State)
	}
	if b := got[nbdPub].Mount.Backend; b.Lower == nil || b.Lower.Kind != BackendFUSE {
		t.Errorf("NBD-like backend %+v: want its lower backend, the FUSE mount holding the loop file", b)
	}
	if rep.InFlight != 1 {
		t.Errorf("InFlight = %d, want 1 (the hung mount)", rep.InFlight)
	}
	// A second cycle starts no second probe of the hung mount.
	rep2 := p.Probe(context.Background(), liveInventory(t, root))
	if r := statesByPath(rep2)[hung.publish]; r.State != Hung || rep2.InFlight != 1 {
		t.Errorf("second cycle: hung publish %v with %d in flight, want Hung with 1", r.State, rep2.InFlight)
	}
	hung.fs.Abort()
}

// TestHungMountsDoNotGrowThreads probes hung mounts for many cycles: the
// thread count stays flat (one parked thread per hung mount), because no
// second probe starts while the first is stuck.
func TestHungMountsDoNotGrowThreads(t *testing.T) {
	lab.RequireRoot(t)
	k := lab.NewKubelet(t, filepath.Join(t.TempDir(), "kubelet"))
	const n = 10
	var fss []*lab.FaultFS
	for i := 0; i < n; i++ {
		v := stageFaultFS(t, k, "hung"+string(rune('a'+i)), "pod")
		v.fs.Hang()
		fss = append(fss, v.fs)
	}
	defer func() {
		for _, fs := range fss {
			fs.Abort()
		}
	}()
	inv := liveInventory(t, k.Root())
	p := NewProber(Config{Timeout: 50 * time.Millisecond, Parallel: 4})
	p.Probe(context.Background(), inv)
	after1 := threads(t)
	for i := 0; i < 20; i++ {
		rep := p.Probe(context.Background(), inv)
		if rep.InFlight != n {
			t.Fatalf("cycle %d: InFlight = %d, want %d", i, rep.InFlight, n)
		}
	}
	if after20 := threads(t); after20 > after1+4 {
		t.Errorf("threads grew from %d to %d over 20 cycles of %d hung mounts", after1, after20, n)
	}
}

func threads(t testing.TB) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "Threads:"); ok {
			var n int
			for _, c := range strings.TrimSpace(v) {
				n = n*10 + int(c-'0')
			}
			return n
		}
	}
	t.Fatal("no Threads line in /proc/self/status")
	return 0
}

// TestPublishWindowIsNotUnmounted: kubelet writes vol_data.json before it
// calls NodePublishVolume, so a new pod's publish target is briefly set up
// but not mounted. The probe must not call that Missing (the agent would
// re-stage a volume kubelet is still setting up), and must call it Missing
// once the window has passed and the target is still not mounted.
func TestPublishWindowIsNotUnmounted(t *testing.T) {
	lab.RequireRoot(t)
	k := lab.NewKubelet(t, filepath.Join(t.TempDir(), "kubelet"))
	root := k.Root()
	target := k.PreparePublish("pod-new", "pv-new", labDriver, "new")

	before := time.Now()
	inv := liveInventory(t, root)
	if len(inv.Unmounted) != 0 {
		t.Errorf("a target kubelet is publishing (vol_data.json just written) was listed Unmounted: %v", inv.Unmounted[0].Path)
	}
	if inv.Publishing.Before(before.Add(DefaultPublishGrace-time.Second)) || inv.Publishing.After(time.Now().Add(DefaultPublishGrace)) {
		t.Errorf("Publishing = %v, want about %v after vol_data.json was written", inv.Publishing, DefaultPublishGrace)
	}
	rep := NewProber(Config{Timeout: time.Second}).Probe(context.Background(), inv)
	if r, ok := statesByPath(rep)[target]; ok {
		t.Errorf("target in kubelet's publish window reported %v", r.State)
	}

	k.AgeVolData(target, DefaultPublishGrace+time.Second)
	inv = liveInventory(t, root)
	if !inv.Publishing.IsZero() {
		t.Errorf("Publishing = %v after the window, want zero", inv.Publishing)
	}
	rep = NewProber(Config{Timeout: time.Second}).Probe(context.Background(), inv)
	if r := statesByPath(rep)[target]; r.State != Missing {
		t.Errorf("target still unmounted after kubelet's publish window = %v, want %v", r.State, Missing)
	}

	// No grace asked: reported at once.
	k.AgeVolData(target, 0)
	inv, err := ReadFile("/proc/self/mountinfo", Options{Root: root, Live: true, PublishGrace: -1})
	if err != nil {
		t.Fatal(err)
	}
	if len(inv.Unmounted) != 1 || inv.Unmounted[0].Path != target {
		t.Errorf("PublishGrace -1: Unmounted = %v, want %s", inv.Unmounted, target)
	}
}

// TestLostStagingNeedsAStagingMountBefore: a staging path that is not a
// mount point under a live publish target is listed Unmounted (lost)
// only when the publish target shows another filesystem than the staging
// directory's own, the one a staging mount put there. A publish target
// that binds the bare directory (published while nothing was staged, as
// the failover lab does, or a driver that publishes the directory) is
// not: guarding that staging path would propagate over the pod's volume.
func TestLostStagingNeedsAStagingMountBefore(t *testing.T) {
	lab.RequireRoot(t)
	k := lab.NewKubelet(t, filepath.Join(t.TempDir(), "kubelet"))
	root := k.Root()
	bare := k.StagingPath(labDriver, "bare")
	if err := os.MkdirAll(bare, 0o750); err != nil {
		t.Fatal(err)
	}
	k.Publish("pod-bare", "pv-bare", labDriver, "bare", bare, false)
	lost := stageFaultFS(t, k, "lost", "pod-lost")
	if err := unix.Unmount(lost.staging, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	inv, err := ReadFile("/proc/self/mountinfo", Options{Root: root, Live: true, PublishGrace: -1, DriverStages: labDriverStages})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, m := range inv.Unmounted {
		if m.Target.Kind == kubelet.KindStaging {
			got = append(got, m.Path)
		}
	}
	if len(got) != 1 || got[0] != lost.staging {
		t.Errorf("staging paths listed Unmounted = %v, want only %s (its staging mount is gone)", got, lost.staging)
	}
}
