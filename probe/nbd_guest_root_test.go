//go:build guest

package probe

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/scripts/csilab"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// These tests need the kernel's nbd driver, which the host kernel here lacks:
// they build only with the tag guest, and scripts/guest runs them inside
// Debian's 6.1 kernel under qemu (go test ./scripts/guest -run TestNBD).

// nbdDriver is the CSI driver whose layout the NBD volumes follow: ceph-csi's
// RBD driver, which mounts at <stagingTargetPath>/<volumeID>
// (internal/rbd/nodeserver.go, getStagingTargetPath) and publishes by bind.
const nbdDriver = "rbd.csi.ceph.com"

// nbdVolume is an ext4 filesystem on /dev/nbdN, served by nbdkit from an image
// file, staged and published as ceph-csi's rbd-nbd mounter does.
type nbdVolume struct {
	t                testing.TB
	id               string
	image, socket    string
	daemon           *csilab.NBDDaemon
	index            int
	staging, publish string
	// ack is what was written and fsync'd before any fault.
	ack []byte
}

func (v *nbdVolume) device() string { return fmt.Sprintf("/dev/nbd%d", v.index) }

func stageNBD(t *testing.T, k *lab.Kubelet, id, podUID string, opts csilab.NBDOptions) *nbdVolume {
	t.Helper()
	return stageNBDVia(t, k, id, podUID, func(v *nbdVolume) (int, error) { return csilab.NBDMap(v.socket, opts) })
}

// stageNBDVia is stageNBD with the device mapped by mapDevice, given the
// volume with its daemon listening.
func stageNBDVia(t *testing.T, k *lab.Kubelet, id, podUID string, mapDevice func(v *nbdVolume) (int, error)) *nbdVolume {
	t.Helper()
	mkfs := lab.RequireBinary(t, "mkfs.ext4")
	dir := t.TempDir()
	v := &nbdVolume{t: t, id: id, image: filepath.Join(dir, "image"), socket: filepath.Join(dir, "nbd.sock")}
	if err := os.WriteFile(v.image, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(v.image, 64<<20); err != nil {
		t.Fatal(err)
	}
	// Block size 4096, as the nbd device's: a 64 MiB ext4 would default to
	// 1024, which the kernel refuses to mount on a 4096-byte device.
	if out, err := exec.Command(mkfs, "-q", "-F", "-b", "4096", "-E", "nodiscard,lazy_itable_init=0,lazy_journal_init=0", v.image).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4 %s: %v: %s", v.image, err, out)
	}
	v.daemon = csilab.StartNBDDaemon(t, v.image, v.socket)
	idx, err := mapDevice(v)
	if err != nil {
		t.Fatal(err)
	}
	v.index = idx
	t.Cleanup(func() { _ = csilab.NBDUnmap(idx) })
	waitDeviceSize(t, idx)

	v.staging = filepath.Join(k.StagingPath(nbdDriver, id), id)
	if err := os.MkdirAll(v.staging, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(v.device(), v.staging, "ext4", 0, ""); err != nil {
		t.Fatalf("mount %s at %s: %v", v.device(), v.staging, err)
	}
	t.Cleanup(func() { detachAll(t, v.staging) })
	v.publish = k.Publish(podUID, "pv-"+id, nbdDriver, id, v.staging, false)

	v.ack = make([]byte, 1<<20)
	_, _ = rand.Read(v.ack)
	writeSynced(t, filepath.Join(v.publish, "acked"), v.ack)
	return v
}

// waitDeviceSize waits until /dev/nbd<idx> has its size: the netlink connect
// returns before the kernel sets the capacity.
func waitDeviceSize(t *testing.T, idx int) {
	t.Helper()
	p := fmt.Sprintf("/sys/block/nbd%d/size", idx)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if raw, err := os.ReadFile(p); err == nil && strings.TrimSpace(string(raw)) != "0" {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("/dev/nbd%d never got its size", idx)
		}
	}
}

// writeSynced writes data and fsyncs the file and its directory: an
// acknowledged write.
func writeSynced(t *testing.T, path string, data []byte) {
	t.Helper()
	if err := writeFileSync(path, data); err != nil {
		t.Fatalf("acknowledged write of %s: %v", path, err)
	}
}

func writeFileSync(path string, data []byte) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	d, err := os.Open(filepath.Dir(path))
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

// readUncached reads a file after dropping its clean pages, so the read
// reaches the device.
func readUncached(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	_ = unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED)
	var buf bytes.Buffer
	_, err = buf.ReadFrom(f)
	return buf.Bytes(), err
}

// checkAcked fails the test unless the acknowledged data reads back whole
// from the device through the publish path, and a new write is acknowledged.
func (v *nbdVolume) checkAcked(t *testing.T) {
	t.Helper()
	got, err := readUncached(filepath.Join(v.publish, "acked"))
	if err != nil {
		t.Fatalf("read the acknowledged file after the heal: %v", err)
	}
	if !bytes.Equal(got, v.ack) {
		t.Fatalf("acknowledged file after the heal: %d bytes, want the %d written before the fault", len(got), len(v.ack))
	}
	if err := writeFileSync(filepath.Join(v.publish, "after-heal"), []byte("ok")); err != nil {
		t.Fatalf("write after the heal: %v", err)
	}
}

// superOptions are the super options of the filesystem mounted at path.
func superOptions(t *testing.T, path string) (string, mountinfo.Info) {
	t.Helper()
	ms, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(path))
	if err != nil || len(ms) == 0 {
		t.Fatalf("%s is not mounted (%v)", path, err)
	}
	m := ms[len(ms)-1]
	return m.VFSOptions, *m
}

// probeState is one probe cycle's verdict on the mount at path.
func probeState(t *testing.T, p *Prober, root, path string) Result {
	t.Helper()
	rep := p.Probe(context.Background(), liveInventory(t, root))
	r, ok := statesByPath(rep)[path]
	if !ok {
		t.Fatalf("no probe result for %s", path)
	}
	return r
}

// fsyncDir fsyncs the directory: nothing to write on a clean directory, but
// ext4 answers EIO once shut down, where mountinfo on 6.1 shows nothing.
func fsyncDir(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	return f.Sync()
}

// detachAll lazily unmounts every mount stacked at path.
func detachAll(t testing.TB, path string) {
	for range 8 {
		if err := unix.Unmount(path, unix.MNT_DETACH); err != nil {
			if !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
				t.Errorf("unmount %s: %v", path, err)
			}
			return
		}
	}
}

// TestNBDDaemonKilledReattach kills the nbd daemon of a volume mapped with a
// dead-connection timeout (rbd-nbd maps with --reattach-timeout, 30 s by
// default) and heals it the cheapest way: a fresh daemon re-attached to the
// same /dev/nbdN within the timeout, as `rbd-nbd attach --device` does. The
// kernel holds the I/O meanwhile, so the filesystem never sees an error:
// device, mount and publish bind stay, and the acknowledged data is intact.
func TestNBDDaemonKilledReattach(t *testing.T) {
	lab.RequireRoot(t)
	k := lab.NewKubelet(t, t.TempDir())
	v := stageNBD(t, k, "0001-0009-rook-ceph-0000000000000001-a", "pod-a",
		csilab.NBDOptions{DeadConnTimeout: 30 * time.Second})
	opts0, m0 := superOptions(t, v.staging)
	p := NewProber(Config{Timeout: 2 * time.Second, ReadDevice: true})
	if r := probeState(t, p, k.Root(), v.publish); r.State != Healthy {
		t.Fatalf("probe before the fault = %v (%v), want Healthy", r.State, r.Err)
	}

	killed := time.Now()
	v.daemon.Kill()
	// The probe's device read waits in the kernel for a re-attach: Hung
	// once past its deadline, while stat and statfs answer from memory.
	var r Result
	for deadline := time.Now().Add(20 * time.Second); ; {
		r = probeState(t, p, k.Root(), v.publish)
		if r.State.Broken() || time.Now().After(deadline) {
			break
		}
		time.Sleep(500 * time.Millisecond)
	}
	detected := time.Since(killed)
	opts1, _ := superOptions(t, v.staging)
	t.Logf("nbd facts: daemon killed, dead-conn timeout 30s: probe %v (%v) after %v; super options %q; sysfs pid %d",
		r.State, r.Err, detected.Round(time.Millisecond), opts1, csilab.NBDDaemonPID(v.index))
	if r.State != Hung {
		t.Errorf("probe after the daemon died = %v (%v), want Hung (the device read waits for a re-attach)", r.State, r.Err)
	}

	csilab.StartNBDDaemon(t, v.image, v.socket)
	if err := csilab.NBDReattach(v.index, v.socket); err != nil {
		t.Fatal(err)
	}
	v.checkAcked(t)
	healed := time.Since(killed)
	opts2, m2 := superOptions(t, v.staging)
	if m2.ID != m0.ID || m2.Major != m0.Major || m2.Minor != m0.Minor {
		t.Errorf("staging mount after the re-attach: ID %d dev %d:%d, want the same mount (ID %d dev %d:%d)",
			m2.ID, m2.Major, m2.Minor, m0.ID, m0.Major, m0.Minor)
	}
	if opts2 != opts0 {
		t.Errorf("super options after the re-attach = %q, want %q as before the fault", opts2, opts0)
	}
	var after Result
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(500 * time.Millisecond) {
		after = probeState(t, p, k.Root(), v.publish)
		if after.State == Healthy || time.Now().After(deadline) {
			break
		}
	}
	if after.State != Healthy {
		t.Errorf("probe after the re-attach = %v (%v), want Healthy", after.State, after.Err)
	}
	t.Logf("nbd figures: reattach: killed -> broken %v, killed -> acked data read and new write acknowledged %v, device %s kept, mount ID %d kept",
		detected.Round(time.Millisecond), healed.Round(time.Millisecond), v.device(), m2.ID)
}

// TestNBDDaemonKilledRestage kills the nbd daemon of a volume mapped without
// a dead-connection timeout (nbd-client's default): I/O fails at once and the
// filesystem aborts its journal. A re-attach brings the device back, but not
// the filesystem on it: the heal re-stages on the same device (lazy unmount
// of the publish bind and the staging mount, mount again, which replays the
// journal, bind again) and the acknowledged data is intact.
func TestNBDDaemonKilledRestage(t *testing.T) {
	lab.RequireRoot(t)
	k := lab.NewKubelet(t, t.TempDir())
	v := stageNBD(t, k, "0001-0009-rook-ceph-0000000000000001-b", "pod-b", csilab.NBDOptions{})
	p := NewProber(Config{Timeout: 2 * time.Second, ReadDevice: true})

	killed := time.Now()
	v.daemon.Kill()
	_, readErr := readUncached(filepath.Join(v.publish, "acked"))
	writeErr := writeFileSync(filepath.Join(v.publish, "lost"), []byte("x"))
	r := probeState(t, p, k.Root(), v.publish)
	detected := time.Since(killed)
	opts1, _ := superOptions(t, v.staging)
	t.Logf("nbd facts: daemon killed, no dead-conn timeout: uncached read %v; write+fsync %v; probe %v (%v); super options %q",
		readErr, writeErr, r.State, r.Err, opts1)
	if !errors.Is(readErr, unix.EIO) {
		t.Errorf("uncached read after the daemon died: %v, want EIO", readErr)
	}
	if !r.State.Broken() {
		t.Errorf("probe after the daemon died = %v, want a broken state", r.State)
	}
	// The journal aborts at its next commit (5 s by default): wait for the
	// filesystem to say so, so that what the heal meets is the steady state.
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(500 * time.Millisecond) {
		_ = writeFileSync(filepath.Join(v.publish, "lost"), []byte("x"))
		if o, _ := superOptions(t, v.staging); o != opts1 {
			break
		}
	}
	opts2, _ := superOptions(t, v.staging)
	r2 := probeState(t, p, k.Root(), v.publish)
	t.Logf("nbd facts: later: super options %q, probe %v (%v), fsync of the root directory %v", opts2, r2.State, r2.Err, fsyncDir(v.staging))

	// Cheapest first: a fresh daemon on the same device.
	csilab.StartNBDDaemon(t, v.image, v.socket)
	if err := csilab.NBDReattach(v.index, v.socket); err != nil {
		t.Fatal(err)
	}
	_, reattachedRead := readUncached(filepath.Join(v.publish, "acked"))
	reattachedWrite := writeFileSync(filepath.Join(v.publish, "after-reattach"), []byte("x"))
	reattached := probeState(t, p, k.Root(), v.publish)
	opts3, _ := superOptions(t, v.staging)
	t.Logf("nbd facts: after the re-attach, same mount: read %v, write+fsync %v, probe %v (%v), super options %q, fsync of the root directory %v",
		reattachedRead, reattachedWrite, reattached.State, reattached.Err, opts3, fsyncDir(v.staging))

	// Re-stage on the kept device.
	detachAll(t, v.publish)
	detachAll(t, v.staging)
	if err := unix.Mount(v.device(), v.staging, "ext4", 0, ""); err != nil {
		t.Fatalf("re-stage: mount %s at %s: %v", v.device(), v.staging, err)
	}
	if err := unix.Mount(v.staging, v.publish, "", unix.MS_BIND, ""); err != nil {
		t.Fatalf("re-publish %s: %v", v.publish, err)
	}
	v.checkAcked(t)
	healed := time.Since(killed)
	if after := probeState(t, NewProber(Config{Timeout: 2 * time.Second, ReadDevice: true}), k.Root(), v.publish); after.State != Healthy {
		t.Errorf("probe after the re-stage = %v (%v), want Healthy", after.State, after.Err)
	}
	t.Logf("nbd figures: restage: killed -> broken %v, killed -> acked data read and new write acknowledged %v (includes waiting for the journal abort), device %s kept",
		detected.Round(time.Millisecond), healed.Round(time.Millisecond), v.device())
}
