package agent

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/scripts/csilab"
	"github.com/mountmedic/mountmedic/scripts/lab"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// TestHealthyDriverLayoutsAreLeftAlone builds, with real mounts in the
// private mount namespace, a healthy volume in each layout of the driver
// catalogue (tmpfs standing in for each filesystem): ceph-csi RBD's
// <globalmount>/<volumeID> with a subPath, kubelet's plain globalmount
// (CephFS), a JuiceFS mount pod's mount outside the kubelet root bound onto
// the publish target, publish-only mounts (GCS FUSE, csi-driver-nfs), and an
// uncatalogued driver staging below globalmount. The agent's live read and
// probe of the table must find nothing broken, and so start no repair.
func TestHealthyDriverLayoutsAreLeftAlone(t *testing.T) {
	lab.RequireRoot(t)
	dir := t.TempDir()
	k := lab.NewKubelet(t, filepath.Join(dir, "kubelet"))
	tmpfs := func(source, target string) {
		t.Helper()
		if err := os.MkdirAll(target, 0o750); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mount(source, target, "tmpfs", 0, "size=1m"); err != nil {
			t.Fatalf("mount tmpfs on %s: %v", target, err)
		}
		t.Cleanup(func() { unix.Unmount(target, unix.MNT_DETACH) })
	}
	mkdir := func(p string) string {
		t.Helper()
		if err := os.MkdirAll(p, 0o750); err != nil {
			t.Fatal(err)
		}
		return p
	}

	// ceph-csi RBD: staged at <globalmount>/<volumeID>, published by bind.
	const rbd, rbdID = "rook-ceph.rbd.csi.ceph.com", "0001-0009-rook-ceph-0000000000000002-5c2e1a3d"
	rbdStage := filepath.Join(k.StagingPath(rbd, rbdID), rbdID)
	tmpfs("/dev/rbd0", rbdStage)
	k.Publish("pod-rbd", "pv-rbd", rbd, rbdID, rbdStage, false)
	k.SubPath("pod-rbd", "pv-rbd", "app", 0, mkdir(filepath.Join(rbdStage, "data")))

	// CephFS (and most drivers): kubelet's plain globalmount.
	const cephfs = "rook-ceph.cephfs.csi.ceph.com"
	fsStage := k.StagingPath(cephfs, "fs-1")
	tmpfs("10.0.0.1:6789:/volumes/csi/csi-vol-1", fsStage)
	k.Publish("pod-fs", "pv-fs", cephfs, "fs-1", fsStage, false)

	// JuiceFS: the mount pod's mount outside the kubelet root, the
	// volume's directory in it bound onto the publish target.
	jfs := filepath.Join(dir, "juicefs", "volume", "pv-jfs-abcdef")
	tmpfs("JuiceFS:myjfs", jfs)
	k.Publish("pod-jfs", "pv-jfs", "csi.juicefs.com", "pv-jfs", mkdir(filepath.Join(jfs, "pv-jfs")), false)

	// GCS FUSE and csi-driver-nfs: mounted on the publish target itself.
	for _, v := range []struct{ driver, vol, source string }{
		{"gcsfuse.csi.storage.gke.io", "pv-gcs", "my-bucket"},
		{"nfs.csi.k8s.io", "pv-nfs", "nfs-server:/srv/nfs1"},
	} {
		tmpfs(v.source, k.PreparePublish("pod-"+v.vol, v.vol, v.driver, v.vol))
	}

	// A driver not in the catalogue that stages below globalmount.
	const other = "fs.example.com"
	otherStage := filepath.Join(k.StagingPath(other, "x-1"), "x-1")
	tmpfs("example", otherStage)
	k.Publish("pod-x", "pv-x", other, "x-1", otherStage, false)

	ctx := context.Background()
	inv, err := probe.ReadTable(ctx, "/proc/self/mountinfo", probe.Options{Root: k.Root(), Live: true, PublishGrace: -1})
	if err != nil {
		t.Fatal(err)
	}
	rep := probe.NewProber(probe.Config{Timeout: 2 * time.Second}).Probe(ctx, inv)
	if n := len(rep.Mounts); n != 10 {
		t.Errorf("probe: %d kubelet mounts, want 10 (2 staging below globalmount, 1 at globalmount, 6 publish targets, 1 subPath)", n)
	}
	for _, r := range rep.Mounts {
		if r.State != probe.Healthy {
			t.Errorf("%s (%s of %s): state %s (%v), want Healthy", r.Mount.Path, r.Mount.Target.Kind, r.Mount.Driver, r.State, r.Err)
		}
	}
	if got := groupBroken(rep); len(got) != 0 {
		for key, v := range got {
			t.Errorf("groupBroken: volume %s of %s is %s: the agent would repair a healthy volume", key, v.driver, v.state)
		}
	}
}

// TestVolumeIDDirLayoutWithRealDriver runs the real k8s-csi-s3 node plugin
// behind the lab's layout proxy, which stages as ceph-csi RBD does
// (<globalmount>/<volumeID>) under a driver name the catalogue does not
// know. Healthy, its volume is read as staged and left alone; when the
// plugin dies (and its s3fs with it), the volume is broken, and the agent
// reports it without repairing it unless --repair-unknown-drivers: its
// re-stage would unmount globalmount, not the directory the driver staged.
func TestVolumeIDDirLayoutWithRealDriver(t *testing.T) {
	lab.RequireRoot(t)
	s3 := csilab.StartS3(t)
	dir := t.TempDir()
	k := lab.NewKubelet(t, filepath.Join(dir, "kubelet"))
	drv := csilab.StartDriver(t, filepath.Join(dir, "s3driver.sock"), k.NodeName())
	node := csilab.StartVolumeIDDirProxy(t, drv, filepath.Join(dir, "csi.sock")).Node(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	const name = csilab.VolumeIDDirDriverName
	sv := s3.Volume(csilab.Bucket, "")
	staging := k.StagingPath(name, sv.Handle)
	target := k.PreparePublish("pod-1", "pv-1", name, sv.Handle)
	t.Cleanup(func() {
		for _, p := range []string{target, filepath.Join(staging, sv.Handle)} {
			for unix.Unmount(p, unix.MNT_DETACH) == nil {
			}
		}
	})
	vr := kubelet.VolumeRequest{
		Driver: name, VolumeHandle: sv.Handle, VolumeAttributes: sv.Attributes,
		StageSecrets: sv.Secrets, PublishSecrets: sv.Secrets,
		AccessMode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, StageUnstage: true,
		StagingPath: staging, TargetPath: target,
	}
	if _, err := node.NodeStageVolume(ctx, kubelet.StageRequest(vr)); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	if _, err := node.NodePublishVolume(ctx, kubelet.PublishRequest(vr)); err != nil {
		t.Fatalf("NodePublishVolume: %v", err)
	}

	probeNode := func() (*probe.Report, map[string]*brokenVolume) {
		inv, err := probe.ReadTable(ctx, "/proc/self/mountinfo", probe.Options{Root: k.Root(), Live: true, PublishGrace: -1})
		if err != nil {
			t.Fatal(err)
		}
		rep := probe.NewProber(probe.Config{Timeout: 2 * time.Second}).Probe(ctx, inv)
		return rep, groupBroken(rep)
	}
	rep, broken := probeNode()
	var stagedBelow bool
	for _, r := range rep.Mounts {
		if r.State != probe.Healthy {
			t.Errorf("healthy volume: %s is %s (%v)", r.Mount.Path, r.State, r.Err)
		}
		if r.Mount.Target.Kind == kubelet.KindStaging && r.Mount.Target.Sub == sv.Handle {
			stagedBelow = true
		}
	}
	if !stagedBelow || len(rep.Mounts) != 2 {
		t.Errorf("healthy volume: %d mounts, staging below globalmount found %v; want its staging mount at %s and its publish target", len(rep.Mounts), stagedBelow, filepath.Join(staging, sv.Handle))
	}
	if len(broken) != 0 {
		t.Errorf("healthy volume: groupBroken = %d volumes, want none", len(broken))
	}

	drv.Kill()
	var st unix.Statfs_t
	if err := unix.Statfs(target, &st); !errors.Is(err, unix.ENOTCONN) {
		t.Fatalf("statfs(%s) after the plugin died = %v, want ENOTCONN", target, err)
	}
	_, broken = probeNode()
	if len(broken) != 1 {
		t.Fatalf("dead volume: groupBroken = %d volumes, want 1", len(broken))
	}
	for key, v := range broken {
		if v.state != probe.Disconnected || v.driver != name {
			t.Errorf("dead volume %s: state %s driver %s, want Disconnected of %s", key, v.state, v.driver, name)
		}
		if why := notUnderstood(v, false); !strings.Contains(why, "--repair-unknown-drivers") {
			t.Errorf("dead volume %s: skip = %q, want it reported, naming --repair-unknown-drivers", key, why)
		}
		if why := notUnderstood(v, true); why != "" {
			t.Errorf("dead volume %s with --repair-unknown-drivers: skip = %q, want repaired", key, why)
		}
	}
}

// TestMountPodRecoveryEndsTheEpisode serves a JuiceFS-style volume from a
// real rclone "mount pod" and kills it: the volume is broken, reported
// with the catalogue's recovery and never re-staged. Then the mount pod
// recovers as JuiceFS CSI's does (the daemon mounts again outside the
// kubelet root, the publish target gets a fresh bind on top of its dead
// one): the volume is no longer broken, so the agent's episode ends there
// and its grace never runs out into an eviction. The dead bind left below
// is not taken for a broken volume.
func TestMountPodRecoveryEndsTheEpisode(t *testing.T) {
	lab.RequireRoot(t)
	dir := t.TempDir()
	k := lab.NewKubelet(t, filepath.Join(dir, "kubelet"))
	const name, handle = "csi.juicefs.com", "pv-jfs"
	drv := csilab.StartLayoutDriver(t, name, filepath.Join(k.Root(), "plugins", name, "csi.sock"), filepath.Join(dir, "jfs"), kubelet.DaemonMountPod)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	k.StagingPath(name, handle)
	target := k.PreparePublish("pod-1", "pv-1", name, handle)
	t.Cleanup(func() {
		for unix.Unmount(target, unix.MNT_DETACH) == nil {
		}
	})
	conn, err := grpc.NewClient("unix://"+drv.Socket(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := csi.NewNodeClient(conn).NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
		VolumeId: handle, TargetPath: target,
		VolumeCapability: &csi.VolumeCapability{
			AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER},
		},
	}); err != nil {
		t.Fatalf("NodePublishVolume: %v", err)
	}
	broken := func() map[string]*brokenVolume {
		inv, err := probe.ReadTable(ctx, "/proc/self/mountinfo", probe.Options{Root: k.Root(), Live: true, PublishGrace: -1})
		if err != nil {
			t.Fatal(err)
		}
		return groupBroken(probe.NewProber(probe.Config{Timeout: 2 * time.Second}).Probe(ctx, inv))
	}
	if got := broken(); len(got) != 0 {
		t.Fatalf("healthy volume: groupBroken = %d volumes, want none", len(got))
	}

	if err := drv.KillDaemon(handle); err != nil {
		t.Fatal(err)
	}
	got := broken()
	if len(got) != 1 {
		t.Fatalf("mount pod dead: groupBroken = %d volumes, want 1", len(got))
	}
	a := &Agent{cfg: DefaultConfig()}
	a.cfg.EscalateOutOfReach = true
	for key, v := range got {
		rec, why := a.recoveryPlan(v.driver, notUnderstood(v, false))
		if v.driver != name || v.state != probe.Disconnected || rec == nil || !strings.Contains(why, "mount pod") || !strings.Contains(why, "--enable-manager") {
			t.Errorf("mount pod dead: volume %s of %q is %s, report %q; want Disconnected, reported with JuiceFS's recovery", key, v.driver, v.state, why)
		}
	}

	if err := drv.RecoverMountPod(ctx, handle, target); err != nil {
		t.Fatal(err)
	}
	if got := broken(); len(got) != 0 {
		for key, v := range got {
			t.Errorf("mount pod recovered: volume %s is still %s (%v), want none broken: the episode ends with the driver's recovery", key, v.state, v.err)
		}
	}
	if err := os.WriteFile(filepath.Join(target, "after"), []byte("x"), 0o644); err != nil {
		t.Errorf("write through the recovered target: %v", err)
	}
}
