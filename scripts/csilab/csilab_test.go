package csilab_test

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/scripts/csilab"
	"github.com/mountmedic/mountmedic/scripts/lab"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

func TestMain(m *testing.M) { lab.Main(m) }

// TestDeadStagingMount shows what a node-plugin crash does to an s3fs volume and
// what it takes to bring it back: NodeStage on the dead path answers OK and
// changes nothing; after a lazy unmount, NodeStage and NodePublish mount afresh.
func TestDeadStagingMount(t *testing.T) {
	lab.RequireRoot(t)
	s3 := csilab.StartS3(t)
	dir := t.TempDir()
	driver := csilab.StartDriver(t, filepath.Join(dir, "csi.sock"), "node-1")
	node := driver.Node(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	staging := filepath.Join(dir, "globalmount")
	target := filepath.Join(dir, "pods", "uid", "mount")
	t.Cleanup(func() { detach(t, target, staging) }) // runs before dir is removed
	vol := s3.Volume(csilab.Bucket, "")
	// What kubelet sends for a ReadWriteOnce filesystem volume of a driver
	// that stages.
	vr := kubelet.VolumeRequest{
		Driver: csilab.DriverName, VolumeHandle: vol.Handle, VolumeAttributes: vol.Attributes,
		StageSecrets: vol.Secrets, PublishSecrets: vol.Secrets,
		AccessMode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER, StageUnstage: true,
		StagingPath: staging, TargetPath: target,
	}

	caps, err := node.NodeGetCapabilities(ctx, &csi.NodeGetCapabilitiesRequest{})
	if err != nil {
		t.Fatalf("NodeGetCapabilities: %v", err)
	}
	if !hasStageUnstage(caps) {
		t.Fatalf("NodeGetCapabilities = %v, want STAGE_UNSTAGE_VOLUME", caps)
	}
	if _, err := node.NodeStageVolume(ctx, kubelet.StageRequest(vr)); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	if _, err := node.NodePublishVolume(ctx, kubelet.PublishRequest(vr)); err != nil {
		t.Fatalf("NodePublishVolume: %v", err)
	}
	want := []byte("written before the crash\n")
	if err := os.WriteFile(filepath.Join(target, "data.txt"), want, 0o644); err != nil {
		t.Fatalf("write through the published volume: %v", err)
	}

	// s3fs uploaded the file on close: the S3 server's posix root holds it.
	if got, err := os.ReadFile(filepath.Join(s3.Root, csilab.Bucket, "data.txt")); err != nil || !bytes.Equal(got, want) {
		t.Fatalf("object in the S3 backend = %q, %v; want %q", got, err, want)
	}

	driver.Kill()
	for _, p := range []string{staging, target} {
		if err := statfs(p); !errors.Is(err, unix.ENOTCONN) {
			t.Fatalf("statfs(%s) after the plugin died = %v, want ENOTCONN", p, err)
		}
	}
	t.Logf("plugin killed: statfs on staging and target answers ENOTCONN")

	if err := driver.Restart(); err != nil {
		t.Fatal(err)
	}
	// The plugin sees the dead mount as mounted (a cached stat) and does nothing.
	if _, err := node.NodeStageVolume(ctx, kubelet.StageRequest(vr)); err != nil {
		t.Fatalf("NodeStageVolume on the dead staging path: %v, want OK", err)
	}
	if err := statfs(staging); !errors.Is(err, unix.ENOTCONN) {
		t.Fatalf("statfs(%s) after NodeStageVolume on the dead path = %v, want still ENOTCONN", staging, err)
	}
	t.Logf("restarted plugin: NodeStageVolume on the dead path answered OK, statfs still ENOTCONN")

	// Repair: lazily unmount the dead publish bind and staging mount, then stage
	// and publish again.
	for _, p := range []string{target, staging} {
		if err := unix.Unmount(p, unix.MNT_DETACH); err != nil {
			t.Fatalf("unmount %s: %v", p, err)
		}
	}
	if _, err := node.NodeStageVolume(ctx, kubelet.StageRequest(vr)); err != nil {
		t.Fatalf("NodeStageVolume after unmount: %v", err)
	}
	if _, err := node.NodePublishVolume(ctx, kubelet.PublishRequest(vr)); err != nil {
		t.Fatalf("NodePublishVolume after unmount: %v", err)
	}
	got, err := os.ReadFile(filepath.Join(target, "data.txt"))
	if err != nil {
		t.Fatalf("read back through the restaged volume: %v", err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("read back %q, want %q", got, want)
	}
	t.Logf("after lazy unmount, NodeStage and NodePublish: the file reads back")
}

func statfs(path string) error {
	var st unix.Statfs_t
	return unix.Statfs(path, &st)
}

func hasStageUnstage(resp *csi.NodeGetCapabilitiesResponse) bool {
	for _, c := range resp.GetCapabilities() {
		if c.GetRpc().GetType() == csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME {
			return true
		}
	}
	return false
}

// detach lazily unmounts every mount stacked on the paths, so that removing the
// test directory does not walk into a live or dead FUSE mount.
func detach(t *testing.T, paths ...string) {
	for _, p := range paths {
		for range 8 {
			if err := unix.Unmount(p, unix.MNT_DETACH); err != nil {
				if !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
					t.Errorf("unmount %s: %v", p, err)
				}
				break
			}
		}
	}
}
