package csilab

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
)

// VolumeIDDirDriverName is the name a VolumeIDDir layout proxy reports: a
// driver that is not in mountmedic's driver catalogue.
const VolumeIDDirDriverName = "volumeid-dir.lab.mountmedic.io"

// LayoutProxy serves CSI on its own socket in front of a Driver and lays
// volumes out as ceph-csi RBD does (internal/rbd/nodeserver.go
// getStagingTargetPath): NodeStageVolume stages at
// <stagingTargetPath>/<volumeID>, NodePublishVolume binds from there, and
// NodeUnstageVolume unstages there. The real daemons stay the driver's:
// killing the Driver kills them.
type LayoutProxy struct {
	socket string
}

// Socket is the path of the proxy's CSI socket.
func (p *LayoutProxy) Socket() string { return p.socket }

// StartVolumeIDDirProxy serves the VolumeIDDir layout on socketPath in front
// of d, until the test ends. A volume ID with a "/" is refused: it would not
// be one directory below the staging path.
func StartVolumeIDDirProxy(t testing.TB, d *Driver, socketPath string) *LayoutProxy {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+d.Socket(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatalf("connect to %s: %v", d.Socket(), err)
	}
	l, err := net.Listen("unix", socketPath)
	if err != nil {
		conn.Close()
		t.Fatalf("listen on %s: %v", socketPath, err)
	}
	srv := grpc.NewServer()
	csi.RegisterIdentityServer(srv, &proxyIdentity{next: csi.NewIdentityClient(conn)})
	csi.RegisterNodeServer(srv, &volumeIDDirNode{next: csi.NewNodeClient(conn)})
	go srv.Serve(l)
	t.Cleanup(func() {
		srv.Stop()
		conn.Close()
	})
	return &LayoutProxy{socket: socketPath}
}

type proxyIdentity struct {
	csi.UnimplementedIdentityServer
	next csi.IdentityClient
}

func (p *proxyIdentity) GetPluginInfo(ctx context.Context, r *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	resp, err := p.next.GetPluginInfo(ctx, r)
	if err != nil {
		return nil, err
	}
	resp.Name = VolumeIDDirDriverName
	return resp, nil
}

func (p *proxyIdentity) GetPluginCapabilities(ctx context.Context, r *csi.GetPluginCapabilitiesRequest) (*csi.GetPluginCapabilitiesResponse, error) {
	return p.next.GetPluginCapabilities(ctx, r)
}

func (p *proxyIdentity) Probe(ctx context.Context, r *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return p.next.Probe(ctx, r)
}

type volumeIDDirNode struct {
	csi.UnimplementedNodeServer
	next csi.NodeClient
}

// stagingDir is <staging>/<volumeID>, created when create is set.
func stagingDir(staging, volumeID string, create bool) (string, error) {
	if volumeID == "" || strings.Contains(volumeID, "/") || volumeID == "." || volumeID == ".." {
		return "", status.Errorf(codes.InvalidArgument, "volume ID %q is not one path segment", volumeID)
	}
	dir := filepath.Join(staging, volumeID)
	if create {
		if err := os.Mkdir(dir, 0o750); err != nil && !errors.Is(err, os.ErrExist) {
			return "", status.Error(codes.Internal, fmt.Sprintf("create %s: %v", dir, err))
		}
	}
	return dir, nil
}

func (n *volumeIDDirNode) NodeStageVolume(ctx context.Context, r *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	dir, err := stagingDir(r.GetStagingTargetPath(), r.GetVolumeId(), true)
	if err != nil {
		return nil, err
	}
	r.StagingTargetPath = dir
	return n.next.NodeStageVolume(ctx, r)
}

func (n *volumeIDDirNode) NodeUnstageVolume(ctx context.Context, r *csi.NodeUnstageVolumeRequest) (*csi.NodeUnstageVolumeResponse, error) {
	dir, err := stagingDir(r.GetStagingTargetPath(), r.GetVolumeId(), false)
	if err != nil {
		return nil, err
	}
	r.StagingTargetPath = dir
	return n.next.NodeUnstageVolume(ctx, r)
}

func (n *volumeIDDirNode) NodePublishVolume(ctx context.Context, r *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	dir, err := stagingDir(r.GetStagingTargetPath(), r.GetVolumeId(), false)
	if err != nil {
		return nil, err
	}
	r.StagingTargetPath = dir
	return n.next.NodePublishVolume(ctx, r)
}

func (n *volumeIDDirNode) NodeUnpublishVolume(ctx context.Context, r *csi.NodeUnpublishVolumeRequest) (*csi.NodeUnpublishVolumeResponse, error) {
	return n.next.NodeUnpublishVolume(ctx, r)
}

func (n *volumeIDDirNode) NodeGetCapabilities(ctx context.Context, r *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	return n.next.NodeGetCapabilities(ctx, r)
}

func (n *volumeIDDirNode) NodeGetInfo(ctx context.Context, r *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	return n.next.NodeGetInfo(ctx, r)
}

// Node returns a CSI node client of the proxy, on a connection that lives
// until the test ends.
func (p *LayoutProxy) Node(t testing.TB) csi.NodeClient {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+p.socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatalf("connect to %s: %v", p.socket, err)
	}
	t.Cleanup(func() { conn.Close() })
	return csi.NewNodeClient(conn)
}
