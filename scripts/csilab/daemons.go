package csilab

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mountmedic/mountmedic/probe/kubelet"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// LayoutDriver is a CSI node plugin that stages nothing (no
// STAGE_UNSTAGE_VOLUME) and publishes each volume with a real FUSE daemon,
// Debian's rclone serving a local directory, where the driver families of
// mountmedic's catalogue (probe/kubelet/drivers.go) keep theirs:
//
//   - kubelet.DaemonMountPod, as JuiceFS CSI (pkg/juicefs/mount/pod_mount.go):
//     a daemon outside the node plugin mounts the volume outside the kubelet
//     root, and NodePublishVolume binds the volume's directory in it onto
//     the publish target;
//   - kubelet.DaemonAppSidecar, as Cloud Storage FUSE CSI
//     (pkg/csi_driver/node.go): the FUSE mount is on the publish target,
//     served by a daemon of the application pod;
//   - kubelet.DaemonNodePlugin: a publish-only driver whose daemon mounts
//     the publish target.
//
// The daemon is rclone serving a local directory, or with WithSSHFS Debian's
// sshfs talking SFTP to Debian's sftp-server, which the driver serves on a
// loopback port (sshfs -o directport, no sshd). It runs in the test
// process; its daemons are processes of their own, in their own sessions,
// which killing the plugin does not reach.
type LayoutDriver struct {
	name, socket, dir string
	home              kubelet.DaemonHome
	rclone            string
	sshfs             string // with WithSSHFS
	sftpPort          int

	mu      sync.Mutex
	daemons map[string]*lab.Process // by volume ID
	mounts  []string                // the daemons' mount points
}

// LayoutOption changes a LayoutDriver.
type LayoutOption func(*layoutOptions)

type layoutOptions struct{ sshfs bool }

// WithSSHFS serves volumes with sshfs over SFTP instead of rclone.
func WithSSHFS() LayoutOption { return func(o *layoutOptions) { o.sshfs = true } }

// StartLayoutDriver serves CSI as driver name on socketPath until the test
// ends, keeping its backing directories and mount pods' mounts under dir
// (outside the kubelet root).
func StartLayoutDriver(t testing.TB, name, socketPath, dir string, home kubelet.DaemonHome, opts ...LayoutOption) *LayoutDriver {
	t.Helper()
	var o layoutOptions
	for _, opt := range opts {
		opt(&o)
	}
	switch home {
	case kubelet.DaemonMountPod, kubelet.DaemonAppSidecar, kubelet.DaemonNodePlugin:
	default:
		t.Fatalf("layout driver %s: daemon home %s is not served: use mount-pod, app-sidecar or node-plugin", name, home)
	}
	d := &LayoutDriver{name: name, socket: socketPath, dir: dir, home: home, daemons: make(map[string]*lab.Process)}
	lab.RequireBinary(t, "fusermount3")
	if o.sshfs {
		d.sshfs = lab.RequireBinary(t, "sshfs")
		d.sftpPort = serveSFTP(t)
	} else {
		d.rclone = lab.RequireBinary(t, "rclone")
	}
	srv := serveNode(t, socketPath, name, &layoutNode{d: d})
	t.Cleanup(func() {
		srv.Stop()
		d.mu.Lock()
		defer d.mu.Unlock()
		for id, p := range d.daemons {
			if t.Failed() {
				t.Logf("last lines of the daemon of %s:\n%s", id, p.Tail(10))
			}
			p.Kill()
		}
		// A killed daemon leaves its mount dead: detach it so that the
		// test's directories can be removed.
		for _, m := range d.mounts {
			for unix.Unmount(m, unix.MNT_DETACH) == nil {
			}
		}
	})
	return d
}

// Name is the CSI name the driver reports.
func (d *LayoutDriver) Name() string { return d.name }

// Socket is the driver's CSI socket.
func (d *LayoutDriver) Socket() string { return d.socket }

// KillDaemon kills the FUSE daemon serving volumeID, as a crashed mount
// pod or sidecar dies: its mounts then answer ENOTCONN. The node plugin
// keeps running.
func (d *LayoutDriver) KillDaemon(volumeID string) error {
	d.mu.Lock()
	p := d.daemons[volumeID]
	d.mu.Unlock()
	if p == nil {
		return fmt.Errorf("no daemon serves volume %q", volumeID)
	}
	p.Kill()
	return nil
}

// RecoverMountPod does for a mount-pod volume what JuiceFS CSI does when
// kubelet has restarted a dead mount pod (juicefs-csi-driver
// pkg/controller/pod_driver.go, recover and recoverTarget): the daemon
// mounts again on the mount pod's path outside the kubelet root (the dead
// mount there detached first), and each publish target in targets gets the
// volume's directory bound on top of its dead bind, which stays below.
func (d *LayoutDriver) RecoverMountPod(ctx context.Context, volumeID string, targets ...string) error {
	if d.home != kubelet.DaemonMountPod {
		return fmt.Errorf("layout driver %s: its daemons are not in mount pods (%s)", d.name, d.home)
	}
	mnt := filepath.Join(d.dir, "mountpods", volumeID)
	if err := unix.Unmount(mnt, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
		return fmt.Errorf("detach the dead mount at %s: %w", mnt, err)
	}
	if err := d.mountDaemon(ctx, volumeID, mnt); err != nil {
		return err
	}
	src := filepath.Join(mnt, volumeID)
	for _, t := range targets {
		if err := unix.Mount(src, t, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind %s on %s: %w", src, t, err)
		}
	}
	return nil
}

// mountDaemon starts rclone serving the volume's backing directory on
// mountpoint and waits until the mount is there.
func (d *LayoutDriver) mountDaemon(ctx context.Context, volumeID, mountpoint string) error {
	backing := filepath.Join(d.dir, "backing", volumeID)
	for _, p := range []string{backing, mountpoint} {
		if err := os.MkdirAll(p, 0o750); err != nil {
			return status.Error(codes.Internal, err.Error())
		}
	}
	var cmd *exec.Cmd
	if d.sshfs != "" {
		cmd = exec.Command(d.sshfs, "-f", "-o", "directport="+strconv.Itoa(d.sftpPort), "127.0.0.1:"+backing, mountpoint)
	} else {
		cmd = exec.Command(d.rclone, "mount", backing, mountpoint, "--config", "/dev/null",
			"--vfs-cache-mode", "off", "--dir-cache-time", "1s", "--attr-timeout", "0s")
	}
	cmd.Env = append(os.Environ(), "HOME="+d.dir)
	// Its own session: the node plugin's end is not the daemon's.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	p, err := lab.RunProcess("daemon-"+volumeID, cmd, filepath.Join(d.dir, "daemon-"+volumeID+".log"))
	if err != nil {
		return status.Error(codes.Internal, err.Error())
	}
	deadline := time.Now().Add(30 * time.Second)
	for !isFUSEMount(mountpoint) {
		if p.Exited() || time.Now().After(deadline) || ctx.Err() != nil {
			p.Kill()
			return status.Errorf(codes.Internal, "%s did not mount %s: %s", filepath.Base(cmd.Path), mountpoint, p.Tail(5))
		}
		time.Sleep(50 * time.Millisecond)
	}
	d.mu.Lock()
	d.daemons[volumeID] = p
	d.mounts = append(d.mounts, mountpoint)
	d.mu.Unlock()
	return nil
}

// serveSFTP serves Debian's sftp-server on a loopback port until the test
// ends, one server process per connection, as sshd's sftp subsystem would,
// and returns the port.
func serveSFTP(t testing.TB) int {
	t.Helper()
	server := "/usr/lib/openssh/sftp-server"
	if _, err := os.Stat(server); err != nil {
		lab.SkipOrFail(t, "sshfs needs %s (Debian's openssh-sftp-server): %v", server, err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("listen for sftp: %v", err)
	}
	var (
		mu    sync.Mutex
		procs []*exec.Cmd
	)
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			cmd := exec.Command(server)
			cmd.Stdin, cmd.Stdout = conn, conn
			cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
			if err := cmd.Start(); err != nil {
				conn.Close()
				continue
			}
			mu.Lock()
			procs = append(procs, cmd)
			mu.Unlock()
			go func() {
				cmd.Wait()
				conn.Close()
			}()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range procs {
			c.Process.Kill()
		}
	})
	return ln.Addr().(*net.TCPAddr).Port
}

// isFUSEMount reports whether this mount namespace has a FUSE mount on p.
func isFUSEMount(p string) bool {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return false
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 10 || fields[4] != p {
			continue
		}
		for i, f := range fields {
			if f == "-" && i+1 < len(fields) && strings.HasPrefix(fields[i+1], "fuse") {
				return true
			}
		}
	}
	return false
}

type layoutIdentity struct {
	csi.UnimplementedIdentityServer
	name string
}

func (l *layoutIdentity) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	return &csi.GetPluginInfoResponse{Name: l.name, VendorVersion: "lab"}, nil
}

func (l *layoutIdentity) GetPluginCapabilities(context.Context, *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	return &csi.GetPluginCapabilitiesResponse{}, nil
}

func (l *layoutIdentity) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{}, nil
}

type layoutNode struct {
	csi.UnimplementedNodeServer
	d *LayoutDriver
}

func (n *layoutNode) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	// No STAGE_UNSTAGE_VOLUME: kubelet still makes globalmount and
	// vol_data.json, and leaves globalmount bare.
	return &csi.NodeGetCapabilitiesResponse{}, nil
}

func (n *layoutNode) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	return &csi.NodeGetInfoResponse{NodeId: lab.DefaultNodeName}, nil
}

func (n *layoutNode) NodePublishVolume(ctx context.Context, r *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	id, target := r.GetVolumeId(), r.GetTargetPath()
	if id == "" || strings.ContainsAny(id, "/\x00") || id == "." || id == ".." || target == "" {
		return nil, status.Errorf(codes.InvalidArgument, "volume ID %q or target %q", id, target)
	}
	if isFUSEMount(target) {
		return &csi.NodePublishVolumeResponse{}, nil
	}
	d := n.d
	switch d.home {
	case kubelet.DaemonMountPod:
		// The mount pod's mount is per volume, outside the kubelet
		// root; the publish target binds the volume's directory in it.
		mnt := filepath.Join(d.dir, "mountpods", id)
		d.mu.Lock()
		running := d.daemons[id] != nil
		d.mu.Unlock()
		if !running {
			if err := d.mountDaemon(ctx, id, mnt); err != nil {
				return nil, err
			}
		}
		src := filepath.Join(mnt, id)
		if err := os.MkdirAll(src, 0o750); err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
		if err := os.MkdirAll(target, 0o750); err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
		if err := unix.Mount(src, target, "", unix.MS_BIND, ""); err != nil {
			return nil, status.Errorf(codes.Internal, "bind %s on %s: %v", src, target, err)
		}
	default:
		if err := d.mountDaemon(ctx, id, target); err != nil {
			return nil, err
		}
	}
	return &csi.NodePublishVolumeResponse{}, nil
}

func (n *layoutNode) NodeUnpublishVolume(_ context.Context, r *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	if err := unix.Unmount(r.GetTargetPath(), unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &csi.NodeUnpublishVolumeResponse{}, nil
}

// serveNode serves a node plugin named name on socketPath (its directory
// made if missing) with node as its Node service, until srv.Stop.
func serveNode(t testing.TB, socketPath, name string, node csi.NodeServer) *grpc.Server {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(socketPath), 0o750); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("unix", socketPath)
	if err != nil {
		t.Fatalf("listen on %s: %v", socketPath, err)
	}
	srv := grpc.NewServer()
	csi.RegisterIdentityServer(srv, &layoutIdentity{name: name})
	csi.RegisterNodeServer(srv, node)
	go srv.Serve(l)
	return srv
}
