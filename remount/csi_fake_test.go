package remount

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// socketDir is a temporary directory short enough for unix socket paths
// (108 bytes), which t.TempDir (named after the test) can exceed.
func socketDir(t *testing.T) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "mmcsi")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// serveUnix serves a new gRPC server on a unix socket at path until the test
// ends. Stopping the server removes the socket file.
func serveUnix(t *testing.T, path string, register func(*grpc.Server)) *grpc.Server {
	t.Helper()
	lis, err := net.Listen("unix", path)
	if err != nil {
		t.Fatalf("listen on %s: %v", path, err)
	}
	srv := grpc.NewServer()
	register(srv)
	go func() { _ = srv.Serve(lis) }() // returns when stopped
	t.Cleanup(srv.Stop)
	return srv
}

// deadSocket leaves a socket file nobody listens on, as a crashed plugin does.
func deadSocket(t *testing.T, path string) {
	t.Helper()
	lis, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		t.Fatalf("listen on %s: %v", path, err)
	}
	lis.SetUnlinkOnClose(false)
	lis.Close()
}

// silentSocket accepts connections and never answers.
func silentSocket(t *testing.T, path string) {
	t.Helper()
	lis, err := net.Listen("unix", path)
	if err != nil {
		t.Fatalf("listen on %s: %v", path, err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	go func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		lis.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			c.Close()
		}
	})
}

// fakeRegistration answers GetInfo like node-driver-registrar.
type fakeRegistration struct {
	registerapi.UnimplementedRegistrationServer
	info     *registerapi.PluginInfo
	notified atomic.Int32
}

func (f *fakeRegistration) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	return proto.Clone(f.info).(*registerapi.PluginInfo), nil
}

func (f *fakeRegistration) NotifyRegistrationStatus(context.Context, *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	f.notified.Add(1)
	return &registerapi.RegistrationStatusResponse{}, nil
}

// serveRegistration serves a registration socket at path.
func serveRegistration(t *testing.T, path, typ, name, endpoint string, versions ...string) *fakeRegistration {
	t.Helper()
	f := &fakeRegistration{info: &registerapi.PluginInfo{Type: typ, Name: name, Endpoint: endpoint, SupportedVersions: versions}}
	serveUnix(t, path, func(s *grpc.Server) { registerapi.RegisterRegistrationServer(s, f) })
	return f
}

// fakeDriver is a CSI node service that records what it got.
// It is a unit-test fake of the wire protocol; real drivers are tested
// elsewhere.
type fakeDriver struct {
	csi.UnimplementedNodeServer

	caps []csi.NodeServiceCapability_RPC_Type
	// err, when set, is returned by every node call.
	err error
	// block, when set, makes every node call wait for the caller's deadline.
	block bool

	capsCalls atomic.Int32
	mu        sync.Mutex
	got       []proto.Message
	// left is the time each call had left before its deadline, as the
	// driver got it (0: no deadline).
	left []time.Duration
}

func (f *fakeDriver) record(m proto.Message) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.got = append(f.got, proto.Clone(m))
}

// recordDeadline records what ctx had left before its deadline.
func (f *fakeDriver) recordDeadline(ctx context.Context) {
	var left time.Duration
	if d, ok := ctx.Deadline(); ok {
		left = time.Until(d)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.left = append(f.left, left)
}

func (f *fakeDriver) received() []proto.Message {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]proto.Message(nil), f.got...)
}

// answer applies block and err.
func (f *fakeDriver) answer(ctx context.Context) error {
	if f.block {
		<-ctx.Done()
		return ctx.Err()
	}
	return f.err
}

func (f *fakeDriver) NodeGetCapabilities(ctx context.Context, _ *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	f.capsCalls.Add(1)
	if err := f.answer(ctx); err != nil {
		return nil, err
	}
	resp := &csi.NodeGetCapabilitiesResponse{}
	for _, c := range f.caps {
		resp.Capabilities = append(resp.Capabilities, &csi.NodeServiceCapability{
			Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{Type: c}},
		})
	}
	return resp, nil
}

func (f *fakeDriver) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	f.record(req)
	f.recordDeadline(ctx)
	if err := f.answer(ctx); err != nil {
		return nil, err
	}
	return &csi.NodeStageVolumeResponse{}, nil
}

func (f *fakeDriver) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	f.record(req)
	if err := f.answer(ctx); err != nil {
		return nil, err
	}
	return &csi.NodePublishVolumeResponse{}, nil
}

func registerDriver(s *grpc.Server, f *fakeDriver) {
	csi.RegisterNodeServer(s, f)
}

// serveDriver serves f on a socket in a new temporary directory and returns
// the socket path and the server.
func serveDriver(t *testing.T, f *fakeDriver) (string, *grpc.Server) {
	t.Helper()
	path := filepath.Join(socketDir(t), "csi.sock")
	srv := serveUnix(t, path, func(s *grpc.Server) { registerDriver(s, f) })
	return path, srv
}
