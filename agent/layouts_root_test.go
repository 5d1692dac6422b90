package agent

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/scripts/lab"
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
