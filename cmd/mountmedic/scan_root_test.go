package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/scripts/lab"
)

func TestMain(m *testing.M) {
	if p := os.Getenv(envParseMountinfo); p != "" {
		os.Exit(parseMountinfoOnly(p))
	}
	if os.Getenv(envRunMain) == "1" {
		// A copy of the test binary that a test started as the command.
		code := run()
		if p := os.Getenv(envPeakRSS); p != "" {
			writePeakRSS(p)
		}
		os.Exit(code)
	}
	lab.Main(m)
}

// TestScanNamesRealFaults is the "done when": on a lab with a dead,
// a hung, an EIO and a shut-down volume, scan names each within its
// deadline and exits 2.
func TestScanNamesRealFaults(t *testing.T) {
	lab.RequireRoot(t)
	lab.RequireBinary(t, "mkfs.ext4")
	k := lab.NewKubelet(t, filepath.Join(t.TempDir(), "kubelet"))
	const driver = "lab.csi.mountmedic.io"
	fuse := map[string]*lab.FaultFS{}
	pubs := map[string]string{}
	for _, name := range []string{"ok", "dead", "hung", "eio"} {
		staging := k.StagingPath(driver, name)
		fuse[name] = lab.StartFaultFS(t, staging)
		pubs[name] = k.Publish("pod-"+name, "pv-"+name, driver, name, staging, false)
	}
	shutStaging := k.StagingPath(driver, "shut")
	shut := lab.NewExt4(t, shutStaging, 16)
	pubs["shut"] = k.Publish("pod-shut", "pv-shut", driver, "shut", shutStaging, false)

	fuse["dead"].Kill()
	fuse["hung"].Hang()
	defer fuse["hung"].Abort()
	fuse["eio"].SetErrno(unix.EIO)
	shut.Shutdown()

	var stdout, stderr bytes.Buffer
	code := execute(context.Background(), []string{"scan", "--kubelet-root", k.Root(), "--timeout", "500ms", "-o", "json"}, &stdout, &stderr)
	if code != exitBroken {
		t.Errorf("scan exit status = %d, want %d (stderr %s)", code, exitBroken, stderr.String())
	}
	var doc scanDoc
	if err := json.Unmarshal(stdout.Bytes(), &doc); err != nil {
		t.Fatalf("scan -o json output is not JSON: %v\n%s", err, stdout.String())
	}
	got := map[string]string{}
	for _, r := range doc.Mounts {
		got[r.Path] = r.State.String()
	}
	want := map[string]string{"ok": "Healthy", "dead": "Disconnected", "hung": "Hung", "eio": "IOError", "shut": "Shutdown"}
	for name, st := range want {
		if got[pubs[name]] != st {
			t.Errorf("scan: %s volume publish target state %q, want %q", name, got[pubs[name]], st)
		}
	}
	if doc.Broken != 8 {
		t.Errorf("scan: broken = %d, want 8 (staging and publish of four faulty volumes)", doc.Broken)
	}

	// The table output names the states too, for a person.
	stdout.Reset()
	execute(context.Background(), []string{"scan", "--kubelet-root", k.Root(), "--timeout", "500ms"}, &stdout, &stderr)
	for _, st := range []string{"Disconnected", "Hung", "IOError", "Shutdown", "Healthy", "8 broken"} {
		if !bytes.Contains(stdout.Bytes(), []byte(st)) {
			t.Errorf("scan table output lacks %q:\n%s", st, stdout.String())
		}
	}
	if _, err := os.Stat(pubs["ok"]); err != nil {
		t.Errorf("healthy volume after scan: %v", err)
	}
}

// TestScanCephRBDLayoutHealthy rebuilds a healthy ceph-csi RBD volume as
// ceph-csi lays it out: NodeStageVolume mounts the device at
// <stagingTargetPath>/<volumeID>, one directory below kubelet's globalmount
// (internal/rbd/nodeserver.go getStagingTargetPath), and NodePublishVolume
// binds from there. A tmpfs whose source is /dev/rbd0 stands in for the
// krbd device. scan must call it healthy, link the publish target to the
// staging mount, and exit 0.
func TestScanCephRBDLayoutHealthy(t *testing.T) {
	lab.RequireRoot(t)
	k := lab.NewKubelet(t, filepath.Join(t.TempDir(), "kubelet"))
	const (
		driver = "rook-ceph.rbd.csi.ceph.com"
		volID  = "0001-0009-rook-ceph-0000000000000002-5c2e1a3d-9b1f-11ef-8f3a-0a580a810215"
		pv     = "pvc-5c2e1a3d-9b1f-11ef-8f3a-0a580a810215"
	)
	globalmount := k.StagingPath(driver, volID)
	staging := filepath.Join(globalmount, volID)
	if err := os.Mkdir(staging, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("/dev/rbd0", staging, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatalf("mount tmpfs standing in for /dev/rbd0 on %s: %v", staging, err)
	}
	t.Cleanup(func() { unix.Unmount(staging, unix.MNT_DETACH) })
	pub := k.Publish("pod-rbd", pv, driver, volID, staging, false)

	var stdout, stderr bytes.Buffer
	code := execute(context.Background(), []string{"scan", "--kubelet-root", k.Root(), "--timeout", "2s", "-o", "json"}, &stdout, &stderr)
	if code != exitOK {
		t.Errorf("scan of a healthy ceph-csi RBD volume: exit status = %d, want %d (stderr %s)\n%s", code, exitOK, stderr.String(), stdout.String())
	}
	var doc scanDoc
	if err := json.Unmarshal(stdout.Bytes(), &doc); err != nil {
		t.Fatalf("scan -o json output is not JSON: %v\n%s", err, stdout.String())
	}
	rows := map[string]scanRow{}
	for _, r := range doc.Mounts {
		rows[r.Path] = r
	}
	if r, ok := rows[staging]; !ok || r.State.String() != "Healthy" || r.Target.Kind.String() != "staging" {
		t.Errorf("scan: staging mount %s = %+v (listed %v), want a Healthy staging row", staging, r, ok)
	}
	if r := rows[pub]; r.State.String() != "Healthy" || r.From != staging || r.Driver != driver {
		t.Errorf("scan: publish target = state %s from %q driver %q, want Healthy from %s driver %s", r.State, r.From, r.Driver, staging, driver)
	}
	if _, ok := rows[globalmount]; ok {
		t.Errorf("scan lists %s, which is not a mount point in this layout", globalmount)
	}
	if doc.Broken != 0 {
		t.Errorf("scan: broken = %d, want 0", doc.Broken)
	}
}
