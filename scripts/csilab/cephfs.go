package csilab

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mountmedic/mountmedic/scripts/lab"
)

// CephFSDriverName is ceph-csi's default name of its CephFS driver (Rook
// prefixes its namespace; kubelet's socket paths must stay short).
const CephFSDriverName = "cephfs.csi.ceph.com"

// CephFSDriver is a CSI node plugin that stages and publishes CephFS
// volumes as ceph-csi's CephFS node plugin does with its FUSE mounter
// (internal/cephfs/nodeserver.go, internal/cephfs/fuserecovery.go,
// internal/cephfs/mounter/fuse.go), with Debian's ceph-fuse against a
// Ceph lab:
//
//   - NodeStageVolume mounts ceph-fuse on kubelet's staging path itself
//     (globalmount; the CephFS node server takes the request's path, unlike
//     ceph-csi RBD's <volumeID> directory), with ceph-csi's arguments: -m
//     <monitors> -c <conf> -n client.<userID> -r <rootPath> -o nonempty
//     --client_mds_namespace=<fsName> (no --keyfile: cephx is off in the
//     lab). A staging path whose stat fails as a corrupted mount does
//     (ENOTCONN, ESTALE, EIO, EACCES, EHOSTDOWN: a dead or aborted
//     ceph-fuse) is unmounted first and mounted afresh; a live mount there
//     is answered OK untouched.
//   - NodePublishVolume binds the staging path onto the target. When the
//     staging path is not a live mount, or the target is a corrupted one,
//     it first restores them as ceph-csi's FUSE recovery does: the staging
//     path is unmounted and mounted again from the last NodeStageVolume's
//     secrets, and the target unmounted.
//   - NodeUnpublishVolume and NodeUnstageVolume unmount.
//
// Volumes are static ones (volumeContext staticVolume "true", rootPath,
// fsName, mounter "fuse"; node stage secrets userID and userKey), as
// ceph-csi's docs/static-pvc.md lays out. The node plugin runs in the test
// process; each ceph-fuse daemonizes into a session of its own, so
// KillFuse and StopFuse act on one volume's daemon as its crash, or a
// stop of the plugin container that holds it, does.
type CephFSDriver struct {
	name, socket string
	ceph         *Ceph
	fuse         string

	mu sync.Mutex
	// daemons maps a staging path to its ceph-fuse's PID, as ceph-csi's
	// fusePidMap; staged maps a volume ID to its staging path and stage
	// request (ceph-csi's NodeStageMountinfo, for the FUSE recovery).
	daemons map[string]int
	staged  map[string]*csi.NodeStageVolumeRequest
	mounts  int // ceph-fuse mounts made
	paths   map[string]bool
}

// StartCephFSDriver serves the CephFS driver as name on socketPath until
// the test ends, mounting from ceph.
func StartCephFSDriver(t testing.TB, name, socketPath string, ceph *Ceph) *CephFSDriver {
	t.Helper()
	d := &CephFSDriver{name: name, socket: socketPath, ceph: ceph, fuse: lab.RequireBinary(t, "ceph-fuse"),
		daemons: map[string]int{}, staged: map[string]*csi.NodeStageVolumeRequest{}, paths: map[string]bool{}}
	srv := serveNode(t, socketPath, name, &cephFSNode{d: d})
	t.Cleanup(func() {
		srv.Stop()
		d.mu.Lock()
		defer d.mu.Unlock()
		for p, pid := range d.daemons {
			if isCephFuse(pid, p) {
				unix.Kill(pid, unix.SIGCONT)
				unix.Kill(pid, unix.SIGKILL)
			}
		}
		for p := range d.paths {
			for unix.Unmount(p, unix.MNT_DETACH) == nil {
			}
		}
	})
	return d
}

// Name is the CSI name the driver reports.
func (d *CephFSDriver) Name() string { return d.name }

// Socket is the driver's CSI socket.
func (d *CephFSDriver) Socket() string { return d.socket }

// Mounts is how many ceph-fuse mounts the driver has made.
func (d *CephFSDriver) Mounts() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.mounts
}

// FusePid is the PID of the ceph-fuse serving volumeID's staging mount,
// 0 when the volume is not staged.
func (d *CephFSDriver) FusePid(volumeID string) int {
	d.mu.Lock()
	defer d.mu.Unlock()
	if r := d.staged[volumeID]; r != nil {
		return d.daemons[r.GetStagingTargetPath()]
	}
	return 0
}

// KillFuse kills volumeID's ceph-fuse with SIGKILL and waits until it is
// gone: the volume's mounts then answer ENOTCONN.
func (d *CephFSDriver) KillFuse(volumeID string) error {
	pid := d.FusePid(volumeID)
	if pid == 0 {
		return fmt.Errorf("volume %q is not staged", volumeID)
	}
	if err := unix.Kill(pid, unix.SIGKILL); err != nil {
		return fmt.Errorf("kill ceph-fuse %d: %w", pid, err)
	}
	if !waitGone(pid, 30*time.Second) {
		return fmt.Errorf("ceph-fuse %d still alive 30s after SIGKILL", pid)
	}
	return nil
}

// StopFuse stops volumeID's ceph-fuse with SIGSTOP: the volume's mounts
// then hang. It returns the PID, for SIGCONT.
func (d *CephFSDriver) StopFuse(volumeID string) (int, error) {
	pid := d.FusePid(volumeID)
	if pid == 0 {
		return 0, fmt.Errorf("volume %q is not staged", volumeID)
	}
	if err := unix.Kill(pid, unix.SIGSTOP); err != nil {
		return 0, fmt.Errorf("stop ceph-fuse %d: %w", pid, err)
	}
	return pid, nil
}

// CephFSVolumeContext is the volumeAttributes of a static ceph-csi CephFS
// volume at rootPath of the lab's file system, mounted with ceph-fuse.
func CephFSVolumeContext(rootPath string) map[string]string {
	return map[string]string{"clusterID": "lab", "fsName": "cephfs", "staticVolume": "true", "rootPath": rootPath, "mounter": "fuse"}
}

// CephFSSecrets are the node stage secrets of a static volume: the Ceph
// user (cephx is off in the lab, so the key is not checked).
func CephFSSecrets() map[string]string {
	return map[string]string{"userID": "admin", "userKey": "cephx-off-in-the-lab"}
}

// fusePidRx is the line ceph-fuse prints when its daemon serves the mount,
// which ceph-csi reads the daemon's PID from (mounter/fuse.go).
var fusePidRx = regexp.MustCompile(`(?m)^ceph-fuse\[(\d+)\]: starting fuse$`)

// runCephFuse mounts rootPath of fsName on mountpoint with ceph-fuse as
// ceph-csi's mountFuse does, and returns the daemon's PID once it serves.
func runCephFuse(ctx context.Context, c *Ceph, mountpoint, user, rootPath, fsName string) (int, error) {
	args := []string{mountpoint, "-m", c.monAddr, "-c", c.conf, "-n", "client." + user, "-r", rootPath, "-o", "nonempty"}
	if fsName != "" {
		args = append(args, "--client_mds_namespace="+fsName)
	}
	cmd := exec.CommandContext(ctx, "ceph-fuse", args...)
	cmd.Env = c.env
	// The daemon ceph-fuse forks keeps the session: a session of its own,
	// not the test's.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	// The daemon keeps stdout open; only stderr is read, and the command
	// is done when the parent exits.
	cmd.WaitDelay = time.Second
	err := cmd.Run()
	m := fusePidRx.FindSubmatch(stderr.Bytes())
	if err != nil || m == nil {
		return 0, fmt.Errorf("ceph-fuse on %s: %v: %s", mountpoint, err, strings.TrimSpace(lastLines(stderr.String(), 12)))
	}
	return strconv.Atoi(string(m[1]))
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// isCephFuse reports whether pid is a live ceph-fuse serving path.
func isCephFuse(pid int, path string) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/cmdline")
	if err != nil {
		return false
	}
	args := strings.Split(string(b), "\x00")
	return len(args) > 1 && filepath.Base(args[0]) == "ceph-fuse" && args[1] == path
}

// mountState is ceph-csi's view of a path (fuserecovery.go getMountState).
type mountState int

const (
	msNotMounted mountState = iota
	msMounted
	msCorrupted
)

// corrupted are the stat errors mount-utils' IsCorruptedMnt, which ceph-csi
// uses, takes for a corrupted mount.
var corrupted = []error{unix.ENOTCONN, unix.ESTALE, unix.EIO, unix.EACCES, unix.EHOSTDOWN}

func stateOf(path string) (mountState, error) {
	if _, err := os.Stat(path); err != nil {
		for _, c := range corrupted {
			if errors.Is(err, c) {
				return msCorrupted, nil
			}
		}
		return msNotMounted, err
	}
	if mountedAt(path) {
		return msMounted, nil
	}
	return msNotMounted, nil
}

// mountedAt reports whether this mount namespace has a mount on p.
func mountedAt(p string) bool {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if fields := strings.Fields(sc.Text()); len(fields) > 4 && fields[4] == p {
			return true
		}
	}
	return false
}

// unmountAll unmounts every mount stacked on p.
func unmountAll(p string) error {
	for {
		err := unix.Unmount(p, 0)
		switch {
		case errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT):
			return nil
		case err != nil:
			return fmt.Errorf("unmount %s: %w", p, err)
		}
	}
}

type cephFSNode struct {
	csi.UnimplementedNodeServer
	d *CephFSDriver
}

func (n *cephFSNode) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	return &csi.NodeGetCapabilitiesResponse{Capabilities: []*csi.NodeServiceCapability{{
		Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{Type: csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME}},
	}}}, nil
}

func (n *cephFSNode) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	return &csi.NodeGetInfoResponse{NodeId: lab.DefaultNodeName}, nil
}

func (n *cephFSNode) NodeStageVolume(ctx context.Context, r *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	staging := r.GetStagingTargetPath()
	if r.GetVolumeId() == "" || staging == "" || r.GetVolumeCapability() == nil {
		return nil, status.Error(codes.InvalidArgument, "volume ID, staging target path and volume capability are required")
	}
	vc := r.GetVolumeContext()
	if vc["staticVolume"] != "true" || vc["rootPath"] == "" || vc["mounter"] != "fuse" {
		return nil, status.Errorf(codes.InvalidArgument, "volume %q: the lab serves static volumes with the fuse mounter (volumeContext staticVolume \"true\", rootPath, mounter \"fuse\")", r.GetVolumeId())
	}
	if r.GetSecrets()["userID"] == "" {
		return nil, status.Errorf(codes.InvalidArgument, "volume %q: node stage secrets lack userID", r.GetVolumeId())
	}
	n.d.mu.Lock()
	defer n.d.mu.Unlock()
	// tryRestoreFuseMountInNodeStage: a corrupted staging mount is
	// unmounted, and staged again below.
	st, err := stateOf(staging)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, status.Error(codes.Internal, err.Error())
	}
	if st == msCorrupted {
		if err := unmountAll(staging); err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
	} else if st == msMounted {
		n.d.staged[r.GetVolumeId()] = r
		return &csi.NodeStageVolumeResponse{}, nil
	}
	if err := n.d.mount(ctx, staging, r); err != nil {
		return nil, err
	}
	n.d.staged[r.GetVolumeId()] = r
	return &csi.NodeStageVolumeResponse{}, nil
}

// mount runs ceph-fuse on staging for r; d.mu is held.
func (d *CephFSDriver) mount(ctx context.Context, staging string, r *csi.NodeStageVolumeRequest) error {
	if err := os.MkdirAll(staging, 0o750); err != nil {
		return status.Error(codes.Internal, err.Error())
	}
	vc := r.GetVolumeContext()
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	pid, err := runCephFuse(ctx, d.ceph, staging, r.GetSecrets()["userID"], vc["rootPath"], vc["fsName"])
	if err != nil {
		return status.Error(codes.Internal, err.Error())
	}
	d.daemons[staging] = pid
	d.paths[staging] = true
	d.mounts++
	return nil
}

func (n *cephFSNode) NodePublishVolume(ctx context.Context, r *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	staging, target := r.GetStagingTargetPath(), r.GetTargetPath()
	if r.GetVolumeId() == "" || staging == "" || target == "" {
		return nil, status.Error(codes.InvalidArgument, "volume ID, staging target path and target path are required")
	}
	d := n.d
	d.mu.Lock()
	defer d.mu.Unlock()
	if err := os.MkdirAll(target, 0o750); err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	// tryRestoreFuseMountsInNodePublish.
	sst, err := stateOf(staging)
	if err != nil && sst != msCorrupted {
		return nil, status.Error(codes.Internal, err.Error())
	}
	tst, err := stateOf(target)
	if err != nil && tst != msCorrupted {
		return nil, status.Error(codes.Internal, err.Error())
	}
	if sst != msMounted || tst == msCorrupted {
		if stage := d.staged[r.GetVolumeId()]; stage != nil {
			if sst != msMounted {
				if err := unmountAll(staging); err != nil {
					return nil, status.Error(codes.Internal, err.Error())
				}
				if err := d.mount(ctx, staging, stage); err != nil {
					return nil, err
				}
			}
			if err := unix.Unmount(target, 0); err != nil && !errors.Is(err, unix.EINVAL) {
				return nil, status.Errorf(codes.Internal, "unmount %s: %v", target, err)
			}
		}
	}
	if !mountedAt(staging) {
		return nil, status.Errorf(codes.Internal, "staging path %s for volume %s is not a mountpoint", staging, r.GetVolumeId())
	}
	if mountedAt(target) {
		return &csi.NodePublishVolumeResponse{}, nil
	}
	if err := unix.Mount(staging, target, "", unix.MS_BIND, ""); err != nil {
		return nil, status.Errorf(codes.Internal, "bind %s on %s: %v", staging, target, err)
	}
	if r.GetReadonly() {
		if err := unix.Mount("", target, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
			return nil, status.Errorf(codes.Internal, "remount %s read-only: %v", target, err)
		}
	}
	d.paths[target] = true
	return &csi.NodePublishVolumeResponse{}, nil
}

func (n *cephFSNode) NodeUnpublishVolume(_ context.Context, r *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	target := r.GetTargetPath()
	st, err := stateOf(target)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return &csi.NodeUnpublishVolumeResponse{}, nil
	case err != nil && st != msCorrupted:
		return nil, status.Error(codes.Internal, err.Error())
	}
	if st != msNotMounted {
		if err := unix.Unmount(target, 0); err != nil {
			return nil, status.Errorf(codes.Internal, "unmount %s: %v", target, err)
		}
	}
	if err := os.Remove(target); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

func (n *cephFSNode) NodeUnstageVolume(_ context.Context, r *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	staging := r.GetStagingTargetPath()
	n.d.mu.Lock()
	defer n.d.mu.Unlock()
	delete(n.d.staged, r.GetVolumeId())
	st, err := stateOf(staging)
	switch {
	case errors.Is(err, os.ErrNotExist):
		return &csi.NodeUnstageVolumeResponse{}, nil
	case err != nil && st != msCorrupted:
		return nil, status.Error(codes.Internal, err.Error())
	}
	if st != msNotMounted {
		if err := unmountAll(staging); err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
	}
	delete(n.d.daemons, staging)
	return &csi.NodeUnstageVolumeResponse{}, nil
}
