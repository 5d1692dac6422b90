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

// TestStrayBelowGlobalmountIsLeftAlone: the hostile actor is a pod's user
// with Bidirectional mount propagation, who mounts a FUSE filesystem and
// kills its daemon one directory below a healthy volume's globalmount,
// under a name that is not the volume ID. The healthy ceph-csi RBD volume
// beside it (tmpfs standing in for /dev/rbd0) must stay healthy, and the
// dead mount must be reported as a stray, never grouped into a volume the
// agent would repair.
func TestStrayBelowGlobalmountIsLeftAlone(t *testing.T) {
	lab.RequireRoot(t)
	dir := t.TempDir()
	k := lab.NewKubelet(t, filepath.Join(dir, "kubelet"))

	const rbd, rbdID = "rook-ceph.rbd.csi.ceph.com", "0001-0009-rook-ceph-0000000000000002-5c2e1a3d"
	globalmount := k.StagingPath(rbd, rbdID)
	rbdStage := filepath.Join(globalmount, rbdID)
	if err := os.MkdirAll(rbdStage, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("/dev/rbd0", rbdStage, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(rbdStage, unix.MNT_DETACH) })
	k.Publish("pod-rbd", "pv-rbd", rbd, rbdID, rbdStage, false)

	// The hostile mount, and one below an uncatalogued driver's
	// globalmount: both dead.
	evil := filepath.Join(globalmount, "evil")
	other := filepath.Join(k.StagingPath("fs.example.com", "x-1"), "not-x-1")
	for _, p := range []string{evil, other} {
		if err := os.MkdirAll(p, 0o750); err != nil {
			t.Fatal(err)
		}
		lab.StartFaultFS(t, p).Kill()
	}

	ctx := context.Background()
	inv, err := probe.ReadTable(ctx, "/proc/self/mountinfo", probe.Options{Root: k.Root(), Live: true, PublishGrace: -1})
	if err != nil {
		t.Fatal(err)
	}
	strays := map[string]bool{}
	for _, s := range inv.Strays {
		strays[s.Path] = true
	}
	if !strays[evil] || !strays[other] {
		t.Errorf("strays %+v, want %s and %s", inv.Strays, evil, other)
	}
	rep := probe.NewProber(probe.Config{Timeout: 2 * time.Second}).Probe(ctx, inv)
	for _, r := range rep.Mounts {
		if r.State != probe.Healthy {
			t.Errorf("%s (%s): %s (%v), want Healthy", r.Mount.Path, r.Mount.Target.Kind, r.State, r.Err)
		}
	}
	for key, v := range groupBroken(rep) {
		t.Errorf("groupBroken: volume %s of %s is %s: the agent would act on a stray", key, v.driver, v.state)
	}
}
