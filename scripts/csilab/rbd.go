package csilab

import (
	"bytes"
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
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mountmedic/mountmedic/scripts/lab"
)

// The rbd mode of the lab NBD driver: ceph-csi RBD's rbd-nbd mounter on a
// real Ceph image, as ceph-csi's node plugin runs it
// (internal/rbd/nodeserver.go, rbd_attach.go, rbd_util.go):
//
//   - NodeStageVolume (one call per volume at a time; another answers
//     Aborted, ceph-csi's VolumeLocks) answers OK while
//     <stagingTargetPath>/<volumeID> is a mount; otherwise it stashes the
//     volume in image-meta.json in the staging path, finds the image's
//     device among `rbd-nbd list-mapped` or, once no other client watches
//     the image (ceph-csi's waitForrbdImage: a backoff of 1 s x1.4, 10
//     steps, about 30 s, the watch timeout of a dead client), maps it with
//     `rbd map --device-type nbd` and ceph-csi's options (try-netlink,
//     reattach-timeout=300, io-timeout=0, cookie=<volumeID>), records the
//     device in the stash, formats a device with no filesystem (ext4 with
//     ceph-csi's -m0 -Enodiscard,lazy_itable_init=1,lazy_journal_init=1)
//     and mounts it at <stagingTargetPath>/<volumeID>;
//   - with volumeContext volumeHealerContext "true" (healerStageTransaction)
//     it re-attaches the device the stash names: the image's device when
//     rbd-nbd still serves it, else, after the same watcher wait,
//     `rbd-nbd attach --device <dev> --cookie=<volumeID>` with the map's
//     options;
//   - NodePublishVolume binds <stagingTargetPath>/<volumeID> onto the target.
//
// rbd-nbd daemonizes: a daemon is found by its cookie on its command line
// (rbd-nbd list-mapped reads the same). Restart kills every daemon of the
// volumes the driver staged, as a node plugin's container going takes its
// rbd-nbd processes with it.

// RBDConfig is the cluster of the rbd mode, as ceph-csi's config.json
// names a cluster's monitors for its clusterID.
type RBDConfig struct {
	// Monitors is the mons' addresses (rbd's -m).
	Monitors string
	// Conf is a client ceph.conf (rbd's -c), for settings besides the
	// monitors: log and admin socket places, messenger options.
	Conf string
	// LogDir holds each volume's rbd-nbd log (ceph-csi:
	// /var/log/ceph/rbd-nbd-<volumeID>.log).
	LogDir string
	// ReattachTimeout and IOTimeout are the map options (ceph-csi's
	// defaults when zero: 300 s and 0, no I/O timeout).
	ReattachTimeout, IOTimeout time.Duration
	// Secrets are the stage secrets Restart's healer at start sends
	// (ceph-csi reads them from the PV's nodeStageSecretRef).
	Secrets map[string]string
}

// WithRBD makes the driver map real Ceph images with rbd-nbd: a volume's
// image is volumeContext "pool"/"imageName", or pool/<volumeID> with no
// imageName (a static volume).
func WithRBD(cfg RBDConfig) NBDDriverOption {
	return func(d *NBDDriver) { d.rbd = &cfg }
}

const (
	rbdDefaultReattachTimeout = 300 * time.Second
	rbdWatcherDelay           = time.Second
	rbdWatcherFactor          = 1.4
	rbdWatcherSteps           = 10
)

// rbdStash is what the rbd mode records of a staged volume in
// image-meta.json (ceph-csi's rbdImageMetadataStash: pool, image, nbd
// access, device), with the attach cookie (ceph-csi uses the volume ID).
type rbdStash struct {
	VolumeID  string `json:"volumeID"`
	Pool      string `json:"pool"`
	Image     string `json:"image"`
	NbdAccess bool   `json:"accessType"`
	Device    string `json:"device"`
	Cookie    string `json:"cookie"`
}

func (d *NBDDriver) rbdNodeStage(req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	id := req.GetVolumeId()
	d.mu.Lock()
	if d.busy[id] {
		d.mu.Unlock()
		return nil, status.Errorf(codes.Aborted, "an operation with the given Volume ID %s already exists", id)
	}
	d.busy[id] = true
	d.mu.Unlock()
	defer func() {
		d.mu.Lock()
		delete(d.busy, id)
		d.mu.Unlock()
	}()
	var err error
	if req.GetVolumeContext()["volumeHealerContext"] == "true" {
		err = d.rbdReattach(id, req.GetStagingTargetPath(), req.GetSecrets())
	} else {
		err = d.rbdStage(req)
	}
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &csi.NodeStageVolumeResponse{}, nil
}

func (d *NBDDriver) rbdStage(req *csi.NodeStageVolumeRequest) error {
	id, staging := req.GetVolumeId(), req.GetStagingTargetPath()
	target := filepath.Join(staging, id)
	if mounted(target) {
		return nil
	}
	pool, image := req.GetVolumeContext()["pool"], req.GetVolumeContext()["imageName"]
	if image == "" {
		// A static volume (ceph-csi's staticVolume): the image is named
		// by the volume ID.
		image = id
	}
	if pool == "" {
		return fmt.Errorf("volume %q: volumeContext names no pool", id)
	}
	st := rbdStash{VolumeID: id, Pool: pool, Image: image, NbdAccess: true, Cookie: id}
	if err := writeStash(staging, st); err != nil {
		return err
	}
	dev, err := d.rbdAttach(st, "", req.GetSecrets())
	if err != nil {
		return err
	}
	st.Device = dev
	if err := writeStash(staging, st); err != nil {
		return err
	}
	if err := formatIfNew(dev); err != nil {
		return err
	}
	if err := os.MkdirAll(target, 0o750); err != nil {
		return err
	}
	if err := unix.Mount(dev, target, "ext4", 0, ""); err != nil {
		return fmt.Errorf("mount %s at %s: %w", dev, target, err)
	}
	idx, _ := strconv.Atoi(strings.TrimPrefix(dev, "/dev/nbd"))
	d.mu.Lock()
	d.mapped[idx] = true
	d.staged[id] = staging
	d.Stages++
	d.mu.Unlock()
	return nil
}

func (d *NBDDriver) rbdReattach(id, staging string, secrets map[string]string) error {
	raw, err := os.ReadFile(filepath.Join(staging, nbdStashName))
	if err != nil {
		return fmt.Errorf("find the volume's record in %s: %w", staging, err)
	}
	var st rbdStash
	if err := json.Unmarshal(raw, &st); err != nil {
		return fmt.Errorf("read the volume's record in %s: %w", staging, err)
	}
	if st.VolumeID != id || !strings.HasPrefix(st.Device, "/dev/nbd") {
		return fmt.Errorf("the record in %s is of volume %q on %q, not an nbd device of %q", staging, st.VolumeID, st.Device, id)
	}
	if _, err := d.rbdAttach(st, st.Device, secrets); err != nil {
		return err
	}
	d.mu.Lock()
	d.Reattaches++
	d.mu.Unlock()
	return nil
}

// rbdAttach is ceph-csi's attachRBDImage: the image's device when rbd-nbd
// serves it already, else a map (device "") or an attach to device, once
// no client watches the image.
func (d *NBDDriver) rbdAttach(st rbdStash, device string, secrets map[string]string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if dev := rbdMapped(ctx, st.Pool, st.Image); dev != "" {
		return dev, nil
	}
	if err := d.rbdWaitUnwatched(ctx, st.Pool+"/"+st.Image); err != nil {
		return "", err
	}
	user := secrets["userID"]
	if user == "" {
		user = "admin"
	}
	// The key goes to a file of its own, never to a command line.
	keyfile, err := os.CreateTemp("", "csi-rbd-key-")
	if err != nil {
		return "", err
	}
	defer os.Remove(keyfile.Name())
	_, err = keyfile.WriteString(secrets["userKey"])
	if cerr := keyfile.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return "", err
	}
	reattach, io := d.rbd.ReattachTimeout, d.rbd.IOTimeout
	if reattach == 0 {
		reattach = rbdDefaultReattachTimeout
	}
	args := d.rbdArgs("--id", user, "--keyfile="+keyfile.Name(),
		"--log-file", filepath.Join(d.rbd.LogDir, "rbd-nbd-"+st.VolumeID+".log"))
	bin, verb := "rbd", "map"
	if device == "" {
		args = append(args, "map", st.Pool+"/"+st.Image, "--device-type", "nbd",
			"--options", "try-netlink",
			"--options", fmt.Sprintf("reattach-timeout=%d", int(reattach/time.Second)),
			"--options", fmt.Sprintf("io-timeout=%d", int(io/time.Second)),
			"--options", "cookie="+st.Cookie)
	} else {
		bin, verb = "rbd-nbd", "attach"
		args = append(args, "attach", st.Pool+"/"+st.Image, "--device", device, "--try-netlink",
			fmt.Sprintf("--reattach-timeout=%d", int(reattach/time.Second)),
			fmt.Sprintf("--io-timeout=%d", int(io/time.Second)),
			"--cookie="+st.Cookie)
	}
	out, err := runQuiet(ctx, bin, args...)
	if err != nil {
		return "", fmt.Errorf("%s %s %s/%s: %w", bin, verb, st.Pool, st.Image, err)
	}
	dev := strings.TrimSpace(string(out))
	if !strings.HasPrefix(dev, "/dev/nbd") {
		return "", fmt.Errorf("%s of %s/%s printed %q, not a device", bin, st.Pool, st.Image, dev)
	}
	return dev, nil
}

// rbdArgs starts an rbd or rbd-nbd command line with the cluster's
// settings.
func (d *NBDDriver) rbdArgs(more ...string) []string {
	var args []string
	if d.rbd.Conf != "" {
		args = append(args, "-c", d.rbd.Conf)
	}
	args = append(args, "-m", d.rbd.Monitors)
	return append(args, more...)
}

// rbdWaitUnwatched waits, with ceph-csi's backoff, until no client
// watches the image (a dead rbd-nbd's watch lasts until the OSD's
// osd_client_watch_timeout, 30 s).
func (d *NBDDriver) rbdWaitUnwatched(ctx context.Context, spec string) error {
	wait := rbdWatcherDelay
	for step := 0; ; step++ {
		out, err := runQuiet(ctx, "rbd", d.rbdArgs("status", spec, "--format", "json")...)
		if err != nil {
			return fmt.Errorf("rbd status %s: %w", spec, err)
		}
		var s struct {
			Watchers []json.RawMessage `json:"watchers"`
		}
		if err := json.Unmarshal(out, &s); err != nil {
			return fmt.Errorf("rbd status %s: %w", spec, err)
		}
		if len(s.Watchers) == 0 {
			return nil
		}
		if step == rbdWatcherSteps-1 {
			return fmt.Errorf("rbd image %s is still being used", spec)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(wait):
		}
		wait = time.Duration(float64(wait) * rbdWatcherFactor)
	}
}

// rbdMapped is the device rbd-nbd serves the image on, "" when none
// (ceph-csi: `rbd device list --device-type nbd`, the same list).
func rbdMapped(ctx context.Context, pool, image string) string {
	out, err := runQuiet(ctx, "rbd-nbd", "list-mapped", "--format", "json")
	if err != nil {
		return ""
	}
	var list []struct {
		Pool   string `json:"pool"`
		Image  string `json:"image"`
		Device string `json:"device"`
	}
	if json.Unmarshal(out, &list) != nil {
		return ""
	}
	for _, m := range list {
		if m.Pool == pool && m.Image == image {
			return m.Device
		}
	}
	return ""
}

// runQuiet runs a Ceph command and returns its stdout; stderr goes into
// the error. stdin is /dev/null, and a daemon the command leaves behind
// holds none of its pipes past the command's exit (WaitDelay).
func runQuiet(ctx context.Context, bin string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, bin, args...)
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	cmd.WaitDelay = 5 * time.Second
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("%w: %s", err, strings.TrimSpace(stderr.String()))
	}
	return out.Bytes(), nil
}

func writeStash(staging string, st rbdStash) error {
	raw, _ := json.Marshal(st)
	if err := os.WriteFile(filepath.Join(staging, nbdStashName), raw, 0o600); err != nil {
		return fmt.Errorf("stash the volume in %s: %w", staging, err)
	}
	return nil
}

// formatIfNew makes ext4 on a device with no filesystem, with ceph-csi's
// options for a fresh image (mkfsDefaultArgs).
func formatIfNew(dev string) error {
	out, err := exec.Command("blkid", "-p", "-s", "TYPE", "-o", "value", dev).Output()
	var ee *exec.ExitError
	switch {
	case err == nil && len(bytes.TrimSpace(out)) > 0:
		return nil
	case err != nil && !(errors.As(err, &ee) && ee.ExitCode() == 2):
		return fmt.Errorf("blkid %s: %w", dev, err)
	}
	if out, err := exec.Command("mkfs.ext4", "-q", "-m0", "-Enodiscard,lazy_itable_init=1,lazy_journal_init=1", dev).CombinedOutput(); err != nil {
		return fmt.Errorf("mkfs.ext4 %s: %v: %s", dev, err, out)
	}
	return nil
}

// rbdDaemons lists the live rbd-nbd processes by the cookie on their
// command line (map and attach both pass --cookie=<cookie>).
func rbdDaemons() map[string][]int {
	ds := map[string][]int{}
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		raw, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(strings.TrimRight(string(raw), "\x00"), "\x00")
		if filepath.Base(args[0]) != "rbd-nbd" || !alive(pid) {
			continue
		}
		for _, a := range args[1:] {
			if c, ok := strings.CutPrefix(a, "--cookie="); ok {
				ds[c] = append(ds[c], pid)
			}
		}
	}
	return ds
}

// rbdDaemon is the volume's rbd-nbd daemon, nil when none runs.
func rbdDaemon(volumeID string) *NBDDaemon {
	pids := rbdDaemons()[volumeID]
	if len(pids) == 0 {
		return nil
	}
	return &NBDDaemon{pid: pids[0]}
}

// killRBDDaemons kills the rbd-nbd daemons of every volume the driver
// staged.
func (d *NBDDriver) killRBDDaemons() {
	d.mu.Lock()
	ids := make([]string, 0, len(d.staged))
	for id := range d.staged {
		ids = append(ids, id)
	}
	d.mu.Unlock()
	ds := rbdDaemons()
	var pids []int
	for _, id := range ids {
		for _, pid := range ds[id] {
			_ = unix.Kill(pid, unix.SIGKILL)
			pids = append(pids, pid)
		}
	}
	for _, pid := range pids {
		waitGone(pid, time.Minute)
	}
}

// RBDPool is the pool of the lab's RBD images.
const RBDPool = "lab"

// RBDPool makes the pool RBDPool (size 1, as the lab's pools) and
// initializes it for RBD (`rbd pool init`); it may run again.
func (c *Ceph) RBDPool(t testing.TB) {
	t.Helper()
	ctx := context.Background()
	if _, err := c.Command(ctx, "osd", "pool", "create", RBDPool, "8", "8"); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "rbd", "-c", c.conf, "pool", "init", RBDPool)
	cmd.Env = c.env
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("rbd pool init %s: %v: %s", RBDPool, err, out)
	}
}

// Ports is the lab's port range: the mon's port first, then the range the
// other daemons bind in. A client elsewhere (the guest of scripts/guest)
// reaches every daemon when each of these is forwarded.
func (c *Ceph) Ports() (lo, hi int) {
	_, p, _ := strings.Cut(c.monAddr, ":")
	lo, _ = strconv.Atoi(p)
	return lo, lo + cephPorts - 1
}

// The settings a guest test reads to reach the host's Ceph lab.
const (
	// EnvRBDPorts is the host lab's port range, LO-HI (the mon on LO).
	EnvRBDPorts = "MOUNTMEDIC_RBD_PORTS"
	// EnvRBDFwd is scripts/guest/fwd, built.
	EnvRBDFwd = "MOUNTMEDIC_RBD_FWD"
	// guestHostAddr is the host's loopback seen from the guest (qemu's
	// user-mode network).
	guestHostAddr = "10.0.2.2"
)

// GuestCeph is the host's Ceph lab seen from the guest of scripts/guest:
// it starts scripts/guest/fwd for every port of the lab (the maps name
// 127.0.0.1 addresses, which in the guest must lead to the host), writes a
// client ceph.conf and returns the rbd mode's configuration.
// Without the settings of the host side (scripts/guest's TestRBDInGuest)
// the test skips, or fails under MOUNTMEDIC_REQUIRE_ROOT=1.
func GuestCeph(t testing.TB) RBDConfig {
	t.Helper()
	ports, fwd := os.Getenv(EnvRBDPorts), os.Getenv(EnvRBDFwd)
	los, his, ok := strings.Cut(ports, "-")
	lo, err1 := strconv.Atoi(los)
	hi, err2 := strconv.Atoi(his)
	if !ok || err1 != nil || err2 != nil || hi < lo || fwd == "" {
		lab.SkipOrFail(t, "no host Ceph for rbd-nbd (%s=%q, %s=%q): run through scripts/guest's TestRBDInGuest",
			EnvRBDPorts, ports, EnvRBDFwd, fwd)
	}
	var pairs []string
	for p := lo; p <= hi; p++ {
		pairs = append(pairs, fmt.Sprintf("127.0.0.1:%d=%s:%d", p, guestHostAddr, p))
	}
	cmd := exec.Command(fwd, pairs...)
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := lab.StartProcess(cmd); err != nil {
		t.Fatalf("start %s: %v", fwd, err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	mon := fmt.Sprintf("127.0.0.1:%d", lo)
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if c, err := net.DialTimeout("tcp", mon, time.Second); err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the forwarder never listened on %s", mon)
		}
	}
	dir := t.TempDir()
	conf := filepath.Join(dir, "ceph.conf")
	text := fmt.Sprintf(`[global]
mon host = v1:%s
auth cluster required = none
auth service required = none
auth client required = none
ms bind ipv6 = false
ms bind msgr2 = false
[client]
log file = %s/$name.$pid.log
admin socket = %s/$name.$pid.asok
`, mon, dir, dir)
	if err := os.WriteFile(conf, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	return RBDConfig{Monitors: mon, Conf: conf, LogDir: dir}
}

// CreateImage makes image pool/name of sizeMiB with the layering feature
// only (ceph-csi's default imageFeatures), as ceph-csi's controller does
// at CreateVolume.
func (cfg RBDConfig) CreateImage(t testing.TB, pool, name string, sizeMiB int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	d := &NBDDriver{rbd: &cfg}
	if _, err := runQuiet(ctx, "rbd", d.rbdArgs("create", "--size", strconv.Itoa(sizeMiB), "--image-feature", "layering", pool+"/"+name)...); err != nil {
		t.Fatalf("rbd create %s/%s: %v", pool, name, err)
	}
}

// Ceph runs the ceph CLI against the cluster (`ceph osd pause` stops the
// OSDs serving clients: a backend that is down for its clients).
func (cfg RBDConfig) Ceph(t testing.TB, args ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	d := &NBDDriver{rbd: &cfg}
	if _, err := cephCLI(ctx, nil, d.rbdArgs(args...)...); err != nil {
		t.Fatal(err)
	}
}
