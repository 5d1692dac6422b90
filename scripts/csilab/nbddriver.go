package csilab

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mountmedic/mountmedic/scripts/lab"
)

// NBDDriverName is the lab NBD driver's CSI name: Rook's form of ceph-csi
// RBD's ("<prefix>.rbd.csi.ceph.com"), because it keeps ceph-csi RBD's node
// contract, so mountmedic's driver catalogue treats it as ceph-csi.
const NBDDriverName = "lab.rbd.csi.ceph.com"

// nbdStashName is the file the driver records a staged volume in, in the
// staging path (ceph-csi stashes image-meta.json there,
// internal/rbd/rbd_util.go stashRBDImageMetadata).
const nbdStashName = "image-meta.json"

// NBDDriver is a CSI node plugin for NBD volumes that keeps ceph-csi RBD's
// rbd-nbd contract (internal/rbd/nodeserver.go), with nbdkit in rbd-nbd's
// place and an image file in the Ceph image's:
//
//   - NodeStageVolume answers OK while <stagingTargetPath>/<volumeID> is a
//     mount; otherwise it records the volume in the staging path, maps the
//     image (reusing the device it is mapped on, as ceph-csi finds an image
//     already mapped), formats a new image with ext4 and mounts the device
//     at <stagingTargetPath>/<volumeID>;
//   - with volumeContext volumeHealerContext "true" it only re-attaches: a
//     fresh daemon on the device the record names (`rbd-nbd attach
//     --device`), killing the volume's old daemon first;
//   - NodePublishVolume binds <stagingTargetPath>/<volumeID> onto the
//     target.
//
// The daemons are the driver's children, as rbd-nbd runs in the node
// plugin's container: Restart kills them all, as a plugin restart does.
// It serves in the test process; its daemons die with it.
type NBDDriver struct {
	t      testing.TB
	socket string
	bin    string
	// ImageDir holds the volumes' image files (the "cluster").
	ImageDir string
	opts     NBDOptions
	// healAtStart: Restart re-attaches every recorded volume, as ceph-csi's
	// healer does at plugin start (internal/rbd/rbd_healer.go).
	healAtStart bool
	// rbd is the rbd mode's cluster (rbd.go): rbd-nbd on a real Ceph
	// image in nbdkit's place.
	rbd *RBDConfig

	mu      sync.Mutex
	srv     *grpc.Server
	daemons map[string]*NBDDaemon // volume ID -> its daemon
	staged  map[string]string     // volume ID -> staging path, for the healer
	mapped  map[int]bool          // the devices it mapped
	busy    map[string]bool       // volume IDs with a call in flight (rbd mode)
	// Stages and Reattaches count the NodeStageVolume calls that staged
	// and that re-attached.
	Stages, Reattaches int
}

// NBDDriverOption changes an NBDDriver.
type NBDDriverOption func(*NBDDriver)

// WithImageDir keeps the images in dir (a FaultFS mount makes the backend
// fail or hang).
func WithImageDir(dir string) NBDDriverOption { return func(d *NBDDriver) { d.ImageDir = dir } }

// WithNBDOptions sets the device settings of every map.
func WithNBDOptions(o NBDOptions) NBDDriverOption { return func(d *NBDDriver) { d.opts = o } }

// WithHealAtStart makes Restart re-attach every volume, as ceph-csi's
// healer does when its node plugin starts.
func WithHealAtStart() NBDDriverOption { return func(d *NBDDriver) { d.healAtStart = true } }

// StartNBDDriver serves the driver on socketPath until the test ends; the
// test's cleanup kills its daemons. It needs the nbd driver (the guest of
// scripts/guest) and nbdkit and mkfs.ext4.
func StartNBDDriver(t testing.TB, socketPath string, opts ...NBDDriverOption) *NBDDriver {
	t.Helper()
	d := &NBDDriver{t: t, socket: socketPath,
		ImageDir: t.TempDir(), daemons: map[string]*NBDDaemon{}, staged: map[string]string{}, mapped: map[int]bool{}, busy: map[string]bool{}}
	lab.RequireBinary(t, "mkfs.ext4")
	for _, o := range opts {
		o(d)
	}
	if d.rbd != nil {
		for _, b := range []string{"rbd", "rbd-nbd", "blkid"} {
			lab.RequireBinary(t, b)
		}
	} else {
		d.bin = lab.RequireBinary(t, "nbdkit")
	}
	if err := os.MkdirAll(filepath.Dir(socketPath), 0o750); err != nil {
		t.Fatal(err)
	}
	if err := d.serve(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		d.stop()
		d.killDaemons()
		// Disconnected, a device fails its I/O at once: the mounts on it
		// go without waiting out the dead-connection hold.
		d.mu.Lock()
		defer d.mu.Unlock()
		for idx := range d.mapped {
			_ = NBDUnmap(idx)
		}
	})
	return d
}

// Socket is the driver's CSI socket.
func (d *NBDDriver) Socket() string { return d.socket }

func (d *NBDDriver) serve() error {
	_ = os.Remove(d.socket)
	l, err := net.Listen("unix", d.socket)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", d.socket, err)
	}
	srv := grpc.NewServer()
	csi.RegisterIdentityServer(srv, &nbdIdentity{})
	csi.RegisterNodeServer(srv, &nbdNode{d: d})
	d.mu.Lock()
	d.srv = srv
	d.mu.Unlock()
	go srv.Serve(l)
	return nil
}

func (d *NBDDriver) stop() {
	d.mu.Lock()
	srv := d.srv
	d.srv = nil
	d.mu.Unlock()
	if srv != nil {
		srv.Stop()
	}
}

func (d *NBDDriver) killDaemons() {
	if d.rbd != nil {
		d.killRBDDaemons()
		return
	}
	d.mu.Lock()
	ds := make([]*NBDDaemon, 0, len(d.daemons))
	for id, dm := range d.daemons {
		ds = append(ds, dm)
		delete(d.daemons, id)
	}
	d.mu.Unlock()
	for _, dm := range ds {
		dm.Kill()
	}
}

// Restart stops serving, kills every daemon (a node plugin's container
// going takes its rbd-nbd processes with it) and serves again on the same
// socket; with WithHealAtStart it then re-attaches every volume it staged,
// as ceph-csi's healer does.
func (d *NBDDriver) Restart() error {
	d.stop()
	d.killDaemons()
	if err := d.serve(); err != nil {
		return err
	}
	if !d.healAtStart {
		return nil
	}
	d.mu.Lock()
	staged := make(map[string]string, len(d.staged))
	for id, p := range d.staged {
		staged[id] = p
	}
	d.mu.Unlock()
	var errs []error
	var wg sync.WaitGroup
	var emu sync.Mutex
	for id, p := range staged {
		wg.Go(func() {
			if err := d.reattach(id, p); err != nil {
				emu.Lock()
				errs = append(errs, err)
				emu.Unlock()
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// Daemon is the volume's daemon, nil when none runs.
func (d *NBDDriver) Daemon(volumeID string) *NBDDaemon {
	if d.rbd != nil {
		return rbdDaemon(volumeID)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.daemons[volumeID]
}

// nbdStash is what the driver records of a staged volume.
type nbdStash struct {
	VolumeID string `json:"volumeID"`
	Image    string `json:"image"`
	Device   string `json:"device"`
}

func (d *NBDDriver) image(volumeID string) string {
	return filepath.Join(d.ImageDir, volumeID+".img")
}

// startDaemon starts a fresh daemon for the volume, after killing its
// old one.
func (d *NBDDriver) startDaemon(volumeID string) (*NBDDaemon, error) {
	d.mu.Lock()
	old := d.daemons[volumeID]
	delete(d.daemons, volumeID)
	d.mu.Unlock()
	if old != nil {
		old.Kill()
	}
	// The daemon's socket lives beside the test's files, not in the
	// image directory, which may be a failing backend.
	dm, err := startNBDDaemon(d.bin, d.image(volumeID), d.daemonSocketPath(volumeID))
	if err != nil {
		return nil, err
	}
	d.mu.Lock()
	d.daemons[volumeID] = dm
	d.mu.Unlock()
	return dm, nil
}

func (d *NBDDriver) daemonSocketPath(volumeID string) string {
	return filepath.Join(filepath.Dir(d.socket), "nbd-"+volumeID+".sock")
}

// reattach gives the device the volume's record names a fresh daemon.
func (d *NBDDriver) reattach(volumeID, staging string) error {
	if d.rbd != nil {
		return d.rbdReattach(volumeID, staging, d.rbd.Secrets)
	}
	raw, err := os.ReadFile(filepath.Join(staging, nbdStashName))
	if err != nil {
		return fmt.Errorf("find the volume's record in %s: %w", staging, err)
	}
	var st nbdStash
	if err := json.Unmarshal(raw, &st); err != nil {
		return fmt.Errorf("read the volume's record in %s: %w", staging, err)
	}
	if st.VolumeID != volumeID {
		return fmt.Errorf("the record in %s is of volume %q, not %q", staging, st.VolumeID, volumeID)
	}
	idx, ok := strings.CutPrefix(st.Device, "/dev/nbd")
	n, err := strconv.Atoi(idx)
	if !ok || err != nil {
		return fmt.Errorf("the record in %s names device %q, not an nbd device", staging, st.Device)
	}
	dm, err := d.startDaemon(volumeID)
	if err != nil {
		return err
	}
	if err := NBDReattach(n, dm.Socket); err != nil {
		return err
	}
	d.mu.Lock()
	d.Reattaches++
	d.mu.Unlock()
	return nil
}

// mappedDevice is the device the volume is mapped on and connected, as
// ceph-csi finds an image already mapped (rbd-nbd list-mapped lists the
// devices of running rbd-nbd processes): -1 when none.
func (d *NBDDriver) mappedDevice(volumeID, staging string) int {
	raw, err := os.ReadFile(filepath.Join(staging, nbdStashName))
	if err != nil {
		return -1
	}
	var st nbdStash
	if json.Unmarshal(raw, &st) != nil || st.VolumeID != volumeID {
		return -1
	}
	n, err := strconv.Atoi(strings.TrimPrefix(st.Device, "/dev/nbd"))
	if err != nil {
		return -1
	}
	d.mu.Lock()
	dm := d.daemons[volumeID]
	d.mu.Unlock()
	if dm == nil {
		return -1
	}
	select {
	case <-dm.exited:
		return -1
	default:
	}
	return n
}

// stage maps (or reuses) the volume's device and mounts it at
// <staging>/<volumeID>.
func (d *NBDDriver) stage(volumeID, staging string) error {
	target := filepath.Join(staging, volumeID)
	if mounted(target) {
		return nil
	}
	idx := d.mappedDevice(volumeID, staging)
	if idx < 0 {
		img := d.image(volumeID)
		if _, err := os.Stat(img); errors.Is(err, os.ErrNotExist) {
			if err := newExt4Image(img); err != nil {
				return err
			}
		}
		dm, err := d.startDaemon(volumeID)
		if err != nil {
			return err
		}
		if idx, err = NBDMap(dm.Socket, d.opts); err != nil {
			return err
		}
		d.mu.Lock()
		d.mapped[idx] = true
		d.mu.Unlock()
		if err := waitNBDSize(idx); err != nil {
			return err
		}
	}
	dev := "/dev/nbd" + strconv.Itoa(idx)
	raw, _ := json.Marshal(nbdStash{VolumeID: volumeID, Image: d.image(volumeID), Device: dev})
	if err := os.WriteFile(filepath.Join(staging, nbdStashName), raw, 0o600); err != nil {
		return fmt.Errorf("record the volume in %s: %w", staging, err)
	}
	if err := os.MkdirAll(target, 0o750); err != nil {
		return err
	}
	if err := unix.Mount(dev, target, "ext4", 0, ""); err != nil {
		return fmt.Errorf("mount %s at %s: %w", dev, target, err)
	}
	d.mu.Lock()
	d.staged[volumeID] = staging
	d.Stages++
	d.mu.Unlock()
	return nil
}

// newExt4Image makes a 64 MiB image with ext4 of block size 4096, the nbd
// device's (a smaller block size does not mount there).
func newExt4Image(img string) error {
	if err := os.WriteFile(img, nil, 0o600); err != nil {
		return err
	}
	if err := os.Truncate(img, 64<<20); err != nil {
		return err
	}
	out, err := exec.Command("mkfs.ext4", "-q", "-F", "-b", "4096", "-E", "nodiscard,lazy_itable_init=0,lazy_journal_init=0", img).CombinedOutput()
	if err != nil {
		return fmt.Errorf("mkfs.ext4 %s: %v: %s", img, err, out)
	}
	return nil
}

// waitNBDSize waits until /dev/nbd<idx> has its size: the netlink connect
// returns before the kernel sets the capacity.
func waitNBDSize(idx int) error {
	p := fmt.Sprintf("/sys/block/nbd%d/size", idx)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if raw, err := os.ReadFile(p); err == nil && strings.TrimSpace(string(raw)) != "0" {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("/dev/nbd%d never got its size", idx)
		}
	}
}

// mounted reports whether path is a mount point (its own mountinfo entry).
func mounted(path string) bool {
	raw, err := os.ReadFile("/proc/thread-self/mountinfo")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(raw), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && unescapeMountinfo(f[4]) == path {
			return true
		}
	}
	return false
}

func unescapeMountinfo(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

type nbdIdentity struct {
	csi.UnimplementedIdentityServer
}

func (nbdIdentity) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: NBDDriverName, VendorVersion: "lab"}, nil
}

func (nbdIdentity) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	return &csi.GetPluginCapabilitiesResponse{}, nil
}

func (nbdIdentity) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{}, nil
}

type nbdNode struct {
	csi.UnimplementedNodeServer
	d *NBDDriver
}

func (n *nbdNode) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	return &csi.NodeGetCapabilitiesResponse{Capabilities: []*csi.NodeServiceCapability{{
		Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{Type: csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME}},
	}}}, nil
}

func (n *nbdNode) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	return &csi.NodeGetInfoResponse{NodeId: lab.DefaultNodeName}, nil
}

func checkVolumeID(id string) error {
	if id == "" || strings.ContainsAny(id, "/\x00") || id == "." || id == ".." {
		return status.Errorf(codes.InvalidArgument, "volume ID %q is not one path segment", id)
	}
	return nil
}

func (n *nbdNode) NodeStageVolume(_ context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	if err := checkVolumeID(req.GetVolumeId()); err != nil {
		return nil, err
	}
	if req.GetStagingTargetPath() == "" {
		return nil, status.Error(codes.InvalidArgument, "no staging target path")
	}
	if n.d.rbd != nil {
		return n.d.rbdNodeStage(req)
	}
	var err error
	if req.GetVolumeContext()["volumeHealerContext"] == "true" {
		err = n.d.reattach(req.GetVolumeId(), req.GetStagingTargetPath())
	} else {
		err = n.d.stage(req.GetVolumeId(), req.GetStagingTargetPath())
	}
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &csi.NodeStageVolumeResponse{}, nil
}

func (n *nbdNode) NodePublishVolume(_ context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	if err := checkVolumeID(req.GetVolumeId()); err != nil {
		return nil, err
	}
	src := filepath.Join(req.GetStagingTargetPath(), req.GetVolumeId())
	target := req.GetTargetPath()
	if mounted(target) {
		return &csi.NodePublishVolumeResponse{}, nil
	}
	if err := os.MkdirAll(target, 0o750); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	if err := unix.Mount(src, target, "", unix.MS_BIND, ""); err != nil {
		return nil, status.Errorf(codes.Internal, "bind %s to %s: %v", src, target, err)
	}
	if req.GetReadonly() {
		if err := unix.Mount("", target, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
			return nil, status.Errorf(codes.Internal, "make %s read-only: %v", target, err)
		}
	}
	return &csi.NodePublishVolumeResponse{}, nil
}

func (n *nbdNode) NodeUnpublishVolume(_ context.Context, req *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	if err := unix.Unmount(req.GetTargetPath(), unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &csi.NodeUnpublishVolumeResponse{}, nil
}
