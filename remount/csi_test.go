package remount

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// shortTimeouts keep tests quick; no test asserts a duration.
var shortTimeouts = CSIOptions{
	StageTimeout:   200 * time.Millisecond,
	PublishTimeout: 200 * time.Millisecond,
	ProbeTimeout:   200 * time.Millisecond,
}

func dial(t *testing.T, path string, opts CSIOptions) *CSIClient {
	t.Helper()
	c, err := DialCSI(t.Context(), path, opts)
	if err != nil {
		t.Fatalf("DialCSI(%s) = %v, want a client", path, err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// watchdog fails the test if fn does not return: a per-call timeout that is
// not honoured would otherwise hang until the test binary's timeout.
func watchdog(t *testing.T, fn func() error) error {
	t.Helper()
	done := make(chan error, 1)
	go func() { done <- fn() }()
	select {
	case err := <-done:
		return err
	case <-time.After(30 * time.Second):
		t.Fatal("call did not return: per-call timeout not honoured")
		return nil
	}
}

func TestDialCSIRefuses(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	tests := map[string]struct {
		endpoint        string
		wantUnavailable bool
	}{
		"missing socket":     {endpoint: filepath.Join(dir, "nope.sock"), wantUnavailable: true},
		"missing unix url":   {endpoint: "unix://" + filepath.Join(dir, "nope.sock"), wantUnavailable: true},
		"regular file":       {endpoint: file},
		"directory":          {endpoint: dir},
		"tcp endpoint":       {endpoint: "tcp://127.0.0.1:10000"},
		"relative path":      {endpoint: "csi.sock"},
		"relative unix path": {endpoint: "unix:csi.sock"},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			c, err := DialCSI(t.Context(), tc.endpoint, CSIOptions{})
			if err == nil {
				c.Close()
				t.Fatalf("DialCSI(%q) = nil error, want an error", tc.endpoint)
			}
			if got := errors.Is(err, ErrDriverUnavailable); got != tc.wantUnavailable {
				t.Errorf("DialCSI(%q) = %v; errors.Is(ErrDriverUnavailable) = %v, want %v", tc.endpoint, err, got, tc.wantUnavailable)
			}
		})
	}
}

func TestCSIClientCalls(t *testing.T) {
	f := &fakeDriver{
		caps: []csi.NodeServiceCapability_RPC_Type{
			csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME,
			csi.NodeServiceCapability_RPC_VOLUME_MOUNT_GROUP,
			csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER,
			csi.NodeServiceCapability_RPC_GET_VOLUME_STATS,
		},
	}
	path, _ := serveDriver(t, f)
	ctx := t.Context()
	c := dial(t, "unix://"+path, shortTimeouts)
	if c.Endpoint() != path {
		t.Errorf("Endpoint() = %q, want %q", c.Endpoint(), path)
	}

	want := kubelet.NodeCapabilities{StageUnstage: true, VolumeMountGroup: true, SingleNodeMultiWriter: true}
	for i := range 3 {
		got, err := c.NodeGetCapabilities(ctx)
		if err != nil || got != want {
			t.Fatalf("NodeGetCapabilities() call %d = %+v, %v; want %+v, nil", i, got, err, want)
		}
	}
	if n := f.capsCalls.Load(); n != 3 {
		t.Errorf("driver got %d NodeGetCapabilities calls, want 3 (asked every time)", n)
	}

	vr := kubelet.VolumeRequest{
		Driver: "fake.csi.example.com", VolumeHandle: "bucket/prefix", AccessMode: csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER,
		StageUnstage: true, StagingPath: "/var/lib/kubelet/staging", TargetPath: "/var/lib/kubelet/target",
		StageSecrets: map[string]string{"secretAccessKey": "s3cr3t"},
	}
	stage, publish := kubelet.StageRequest(vr), kubelet.PublishRequest(vr)
	if err := c.NodeStageVolume(ctx, stage); err != nil {
		t.Fatalf("NodeStageVolume() = %v", err)
	}
	if err := c.NodePublishVolume(ctx, publish); err != nil {
		t.Fatalf("NodePublishVolume() = %v", err)
	}
	wantGot := []proto.Message{stage, publish}
	got := f.received()
	if len(got) != len(wantGot) {
		t.Fatalf("driver received %d requests, want %d", len(got), len(wantGot))
	}
	for i := range got {
		if !proto.Equal(got[i], wantGot[i]) {
			t.Errorf("driver request %d = %v, want %v", i, got[i], wantGot[i])
		}
	}
}

func TestCSIClientRejectsIncompleteRequests(t *testing.T) {
	f := &fakeDriver{}
	path, _ := serveDriver(t, f)
	c := dial(t, path, shortTimeouts)
	ctx := t.Context()
	capab := &csi.VolumeCapability{}
	errs := map[string]error{
		"stage without volume id":     c.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{StagingTargetPath: "/s", VolumeCapability: capab}),
		"stage without staging path":  c.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "v", VolumeCapability: capab}),
		"stage without capability":    c.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "v", StagingTargetPath: "/s"}),
		"publish without target path": c.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "v", VolumeCapability: capab}),
		"publish without volume id":   c.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{TargetPath: "/t", VolumeCapability: capab}),
	}
	for name, err := range errs {
		if err == nil {
			t.Errorf("%s: got nil error, want one", name)
		}
	}
	if n := len(f.received()); n != 0 {
		t.Errorf("driver received %d requests, want 0", n)
	}
}

func TestCSIClientErrorCodes(t *testing.T) {
	tests := map[string]struct {
		code            codes.Code
		wantUnavailable bool
	}{
		"not found":          {code: codes.NotFound},
		"invalid argument":   {code: codes.InvalidArgument},
		"internal":           {code: codes.Internal},
		"aborted":            {code: codes.Aborted},
		"resource exhausted": {code: codes.ResourceExhausted},
		"unavailable":        {code: codes.Unavailable, wantUnavailable: true},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			f := &fakeDriver{err: status.Error(tc.code, "driver says no")}
			path, _ := serveDriver(t, f)
			c := dial(t, path, shortTimeouts)
			err := c.NodeStageVolume(t.Context(), kubelet.StageRequest(kubelet.VolumeRequest{VolumeHandle: "v", StagingPath: "/s"}))
			var rpcErr *rpcError
			if !errors.As(err, &rpcErr) {
				t.Fatalf("NodeStageVolume() = %v, want an *rpcError", err)
			}
			if rpcErr.Code != tc.code || status.Code(err) != tc.code {
				t.Errorf("NodeStageVolume() code = %v (status.Code %v), want %v", rpcErr.Code, status.Code(err), tc.code)
			}
			if rpcErr.Method != "NodeStageVolume" {
				t.Errorf("rpcError.Method = %q, want NodeStageVolume", rpcErr.Method)
			}
			if got := errors.Is(err, ErrDriverUnavailable); got != tc.wantUnavailable {
				t.Errorf("errors.Is(%v, ErrDriverUnavailable) = %v, want %v", err, got, tc.wantUnavailable)
			}
		})
	}
}

func TestCSIClientDriverDown(t *testing.T) {
	t.Run("server stopped", func(t *testing.T) {
		path, srv := serveDriver(t, &fakeDriver{})
		c := dial(t, path, shortTimeouts)
		if _, err := c.NodeGetCapabilities(t.Context()); err != nil {
			t.Fatalf("NodeGetCapabilities() before stop = %v", err)
		}
		srv.Stop()
		_, err := c.NodeGetCapabilities(t.Context())
		if !errors.Is(err, ErrDriverUnavailable) {
			t.Errorf("NodeGetCapabilities() after stop = %v, want ErrDriverUnavailable", err)
		}
		// Dialing afresh finds no socket.
		if _, err := DialCSI(t.Context(), path, shortTimeouts); !errors.Is(err, ErrDriverUnavailable) {
			t.Errorf("DialCSI() after stop = %v, want ErrDriverUnavailable", err)
		}
	})
	t.Run("socket left behind", func(t *testing.T) {
		path := filepath.Join(socketDir(t), "csi.sock")
		deadSocket(t, path)
		c := dial(t, path, shortTimeouts)
		_, err := c.NodeGetCapabilities(t.Context())
		if !errors.Is(err, ErrDriverUnavailable) {
			t.Errorf("NodeGetCapabilities() on a dead socket = %v, want ErrDriverUnavailable", err)
		}
		if status.Code(err) != codes.Unavailable {
			t.Errorf("status.Code(%v) = %v, want Unavailable", err, status.Code(err))
		}
	})
	t.Run("socket never answers", func(t *testing.T) {
		path := filepath.Join(socketDir(t), "csi.sock")
		silentSocket(t, path)
		c := dial(t, path, shortTimeouts)
		err := watchdog(t, func() error { _, err := c.NodeGetCapabilities(t.Context()); return err })
		if !errors.Is(err, ErrDriverUnavailable) {
			t.Errorf("NodeGetCapabilities() on a socket that never answers = %v, want ErrDriverUnavailable", err)
		}
	})
	t.Run("driver comes back", func(t *testing.T) {
		path, srv := serveDriver(t, &fakeDriver{})
		c := dial(t, path, shortTimeouts)
		srv.Stop()
		if _, err := c.NodeGetCapabilities(t.Context()); !errors.Is(err, ErrDriverUnavailable) {
			t.Fatalf("NodeGetCapabilities() while down = %v, want ErrDriverUnavailable", err)
		}
		serveUnix(t, path, func(s *grpc.Server) { registerDriver(s, &fakeDriver{}) })
		err := watchdog(t, func() error {
			for {
				_, err := c.NodeGetCapabilities(t.Context())
				if !errors.Is(err, ErrDriverUnavailable) {
					return err
				}
				time.Sleep(20 * time.Millisecond)
			}
		})
		if err != nil {
			t.Errorf("NodeGetCapabilities() after the driver came back = %v, want nil", err)
		}
	})
}

// TestCSIClientGivesAReattachItsOwnDeadline: a re-attach (the volume
// context's kubelet.ReattachContextKey) gets ReattachTimeout, longer than
// a stage's: ceph-csi waits there for the dead daemon's watch to expire.
// The driver reports the deadline each call came with.
func TestCSIClientGivesAReattachItsOwnDeadline(t *testing.T) {
	f := &fakeDriver{}
	path, _ := serveDriver(t, f)
	c := dial(t, path, CSIOptions{StageTimeout: time.Minute, ReattachTimeout: time.Hour})
	vr := kubelet.VolumeRequest{VolumeHandle: "v", StagingPath: "/s", TargetPath: "/t", StageUnstage: true}
	if err := c.NodeStageVolume(t.Context(), kubelet.StageRequest(vr)); err != nil {
		t.Fatal(err)
	}
	req := kubelet.StageRequest(vr)
	req.VolumeContext = map[string]string{kubelet.ReattachContextKey: "true"}
	if err := c.NodeStageVolume(t.Context(), req); err != nil {
		t.Fatal(err)
	}
	f.mu.Lock()
	left := append([]time.Duration(nil), f.left...)
	f.mu.Unlock()
	if len(left) != 2 {
		t.Fatalf("the driver got %d stage calls, want 2", len(left))
	}
	if left[0] <= 0 || left[0] > time.Minute {
		t.Errorf("a stage came with %v left, want StageTimeout (1m) at most", left[0])
	}
	if left[1] <= time.Minute || left[1] > time.Hour {
		t.Errorf("a re-attach came with %v left, want more than StageTimeout, ReattachTimeout (1h) at most", left[1])
	}
	if d := (CSIOptions{}).withDefaults(); d.ReattachTimeout <= d.StageTimeout {
		t.Errorf("default ReattachTimeout %v is not longer than StageTimeout %v", d.ReattachTimeout, d.StageTimeout)
	}
}

func TestCSIClientTimeouts(t *testing.T) {
	f := &fakeDriver{block: true}
	path, _ := serveDriver(t, f)
	c := dial(t, path, shortTimeouts)
	ctx := t.Context() // no deadline: only the per-call timeout can end a call
	vr := kubelet.VolumeRequest{VolumeHandle: "v", StagingPath: "/s", TargetPath: "/t", StageUnstage: true}
	calls := map[string]func() error{
		"NodeStageVolume":     func() error { return c.NodeStageVolume(ctx, kubelet.StageRequest(vr)) },
		"NodePublishVolume":   func() error { return c.NodePublishVolume(ctx, kubelet.PublishRequest(vr)) },
		"NodeGetCapabilities": func() error { _, err := c.NodeGetCapabilities(ctx); return err },
	}
	for name, call := range calls {
		t.Run(name, func(t *testing.T) {
			err := watchdog(t, call)
			var rpcErr *rpcError
			if !errors.As(err, &rpcErr) || rpcErr.Code != codes.DeadlineExceeded {
				t.Fatalf("%s() on a blocked driver = %v, want an *rpcError with DeadlineExceeded", name, err)
			}
			if !errors.Is(err, ErrDriverUnavailable) {
				t.Errorf("%s() = %v does not match ErrDriverUnavailable; a driver that accepts and never answers is down", name, err)
			}
		})
	}
}
