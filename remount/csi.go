package remount

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

var (
	// ErrDriverUnavailable marks a CSI driver that is down: its socket is
	// missing or refuses connections, or a call ended with gRPC Unavailable,
	// or ran out of time (no connection came up, or the driver accepted it
	// and never answered the call). Retry later.
	ErrDriverUnavailable = errors.New("csi driver unavailable")
	// ErrBackendUnavailable marks a volume whose driver answered and whose
	// device still does not: the storage behind it (the Ceph OSDs of an
	// rbd-nbd volume) is down. Such an error matches ErrDriverUnavailable
	// too: both are waited out, never escalated; the agent tells them
	// apart to name what is down.
	ErrBackendUnavailable = errors.New("volume backend unavailable")
	// errDriverNotFound marks a driver that no registration socket names and
	// that has no socket at the conventional path. Such an error matches
	// ErrDriverUnavailable too: the driver may be restarting.
	errDriverNotFound = errors.New("csi driver not found")
)

// backendError is ErrBackendUnavailable with its cause.
type backendError struct{ err error }

func (e *backendError) Error() string {
	return e.err.Error() + ": the driver answered, its backend does not"
}

func (e *backendError) Unwrap() error { return e.err }

// Is matches ErrBackendUnavailable and ErrDriverUnavailable.
func (e *backendError) Is(target error) bool {
	return target == ErrBackendUnavailable || target == ErrDriverUnavailable
}

// Default per-call timeouts of a CSIClient.
const (
	defaultStageTimeout = 30 * time.Second
	// defaultReattachTimeout covers ceph-csi's wait in a re-attach for
	// the dead rbd-nbd's watch on the image to expire (waitForrbdImage:
	// 1 s backoff, factor 1.4, 10 steps, about 50 s of sleeps besides
	// its `rbd status` calls), with room for a loaded node.
	defaultReattachTimeout = 90 * time.Second
	defaultPublishTimeout  = 15 * time.Second
	defaultProbeTimeout    = 5 * time.Second
	// defaultReconnectMaxDelay caps gRPC's reconnect backoff, so that a
	// client notices a restarted driver within about a second (gRPC's own
	// default grows to two minutes).
	defaultReconnectMaxDelay = time.Second
)

// CSIOptions configures a CSIClient. Zero fields take the defaults.
type CSIOptions struct {
	// StageTimeout bounds NodeStageVolume.
	StageTimeout time.Duration
	// ReattachTimeout bounds a re-attach: NodeStageVolume whose volume
	// context has kubelet.ReattachContextKey "true".
	ReattachTimeout time.Duration
	// PublishTimeout bounds NodePublishVolume.
	PublishTimeout time.Duration
	// ProbeTimeout bounds NodeGetCapabilities and each connection attempt.
	ProbeTimeout time.Duration
	// ReconnectMaxDelay caps the backoff between connection attempts.
	ReconnectMaxDelay time.Duration
}

func (o CSIOptions) withDefaults() CSIOptions {
	if o.StageTimeout <= 0 {
		o.StageTimeout = defaultStageTimeout
	}
	if o.ReattachTimeout <= 0 {
		o.ReattachTimeout = defaultReattachTimeout
	}
	if o.PublishTimeout <= 0 {
		o.PublishTimeout = defaultPublishTimeout
	}
	if o.ProbeTimeout <= 0 {
		o.ProbeTimeout = defaultProbeTimeout
	}
	if o.ReconnectMaxDelay <= 0 {
		o.ReconnectMaxDelay = defaultReconnectMaxDelay
	}
	return o
}

func nodeCapabilities(caps []*csi.NodeServiceCapability) kubelet.NodeCapabilities {
	var nc kubelet.NodeCapabilities
	for _, c := range caps {
		switch c.GetRpc().GetType() {
		case csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME:
			nc.StageUnstage = true
		case csi.NodeServiceCapability_RPC_SINGLE_NODE_MULTI_WRITER:
			nc.SingleNodeMultiWriter = true
		case csi.NodeServiceCapability_RPC_VOLUME_MOUNT_GROUP:
			nc.VolumeMountGroup = true
		}
	}
	return nc
}

// rpcError is a CSI call that reached gRPC and failed. It keeps the status
// code; errors.Is(err, ErrDriverUnavailable) holds when the driver was down
// rather than refusing the request.
type rpcError struct {
	Method   string // e.g. "NodeStageVolume"
	Endpoint string // socket path
	Code     codes.Code
	// unavailable: the driver could not be reached.
	unavailable bool
	err         error
}

func (e *rpcError) Error() string {
	return fmt.Sprintf("csi %s on %s: %v", e.Method, e.Endpoint, e.err)
}

// Unwrap returns the gRPC status error.
func (e *rpcError) Unwrap() error { return e.err }

// Is reports ErrDriverUnavailable for a driver that could not be reached.
func (e *rpcError) Is(target error) bool {
	return target == ErrDriverUnavailable && e.unavailable
}

// GRPCStatus lets status.Code and status.FromError see through the wrapping.
func (e *rpcError) GRPCStatus() *status.Status {
	st, _ := status.FromError(e.err)
	return st
}

// CSIClient talks to one CSI node plugin over its unix socket. It is safe
// for concurrent use. The gRPC connection is made lazily and re-made after a
// driver restart.
type CSIClient struct {
	path string
	opts CSIOptions
	conn *grpc.ClientConn
	node csi.NodeClient
}

// DialCSI prepares a client for the CSI socket at endpoint (an absolute path
// or a unix:// URL). It fails with ErrDriverUnavailable when the socket does
// not exist, and refuses anything that is not a unix socket. No connection is
// made until the first call.
func DialCSI(ctx context.Context, endpoint string, opts CSIOptions) (*CSIClient, error) {
	path, err := socketPath("csi", endpoint)
	if err != nil {
		return nil, err
	}
	if err := checkSocket("csi", path, ErrDriverUnavailable); err != nil {
		return nil, err
	}
	opts = opts.withDefaults()
	bo := backoff.DefaultConfig
	bo.BaseDelay = 100 * time.Millisecond
	bo.MaxDelay = opts.ReconnectMaxDelay
	conn, err := grpc.NewClient("unix://"+path,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithNoProxy(),
		grpc.WithAuthority("localhost"),
		grpc.WithConnectParams(grpc.ConnectParams{Backoff: bo, MinConnectTimeout: opts.ProbeTimeout}),
	)
	if err != nil {
		return nil, fmt.Errorf("csi client for %s: %w", path, err)
	}
	klog.FromContext(ctx).V(4).Info("CSI client ready", "endpoint", path)
	return &CSIClient{
		path: path,
		opts: opts,
		conn: conn,
		node: csi.NewNodeClient(conn),
	}, nil
}

// Endpoint returns the socket path the client talks to.
func (c *CSIClient) Endpoint() string { return c.path }

// Close releases the connection.
func (c *CSIClient) Close() error { return c.conn.Close() }

// call runs one RPC under its own timeout and classifies its error.
func (c *CSIClient) call(ctx context.Context, method string, timeout time.Duration, rpc func(context.Context) error) error {
	logger := klog.FromContext(ctx)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	err := rpc(ctx)
	if err == nil {
		return nil
	}
	err = c.classify(method, err)
	logger.V(4).Info("CSI call failed", "endpoint", c.path, "method", method, "err", err)
	return err
}

func (c *CSIClient) classify(method string, err error) error {
	st, ok := status.FromError(err)
	if !ok {
		return fmt.Errorf("csi %s on %s: %w", method, c.path, err)
	}
	e := &rpcError{Method: method, Endpoint: c.path, Code: st.Code(), err: err}
	switch st.Code() {
	case codes.Unavailable:
		e.unavailable = true
	case codes.DeadlineExceeded:
		// Out of time: the driver never answered, whether no connection
		// came up or it accepted one and then blocked in the call. Either
		// way it is down for the repair: wait for it, never escalate
		// (restarting or evicting pods does not bring a driver back).
		e.unavailable = true
	}
	return e
}

// NodeGetCapabilities asks the driver for its node capabilities, every time:
// it is also the check that the driver answers before anything is
// unmounted, and a restarted driver may advertise otherwise. A connection
// that failed while the driver was down is re-dialled at once instead of
// after gRPC's backoff, so a driver that has just come back answers the
// first call.
func (c *CSIClient) NodeGetCapabilities(ctx context.Context) (kubelet.NodeCapabilities, error) {
	if err := checkSocket("csi", c.path, ErrDriverUnavailable); err != nil {
		return kubelet.NodeCapabilities{}, err
	}
	c.redial(ctx)
	var resp *csi.NodeGetCapabilitiesResponse
	err := c.call(ctx, "NodeGetCapabilities", c.opts.ProbeTimeout, func(ctx context.Context) error {
		var err error
		resp, err = c.node.NodeGetCapabilities(ctx, &csi.NodeGetCapabilitiesRequest{})
		return err
	})
	if err != nil {
		return kubelet.NodeCapabilities{}, err
	}
	return nodeCapabilities(resp.GetCapabilities()), nil
}

// redialWait bounds how long redial waits for a fresh connection attempt to
// leave TRANSIENT_FAILURE.
const redialWait = 200 * time.Millisecond

// redial cuts gRPC's reconnect backoff short: in TRANSIENT_FAILURE a call
// fails at once with Unavailable until the backoff timer fires (up to
// ReconnectMaxDelay), even when the driver is back. ResetConnectBackoff
// starts a new attempt now; a call made while it connects waits for it.
func (c *CSIClient) redial(ctx context.Context) {
	if c.conn.GetState() != connectivity.TransientFailure {
		return
	}
	c.conn.ResetConnectBackoff()
	ctx, cancel := context.WithTimeout(ctx, redialWait)
	defer cancel()
	c.conn.WaitForStateChange(ctx, connectivity.TransientFailure)
}

// NodeStageVolume sends req (see kubelet.StageRequest).
func (c *CSIClient) NodeStageVolume(ctx context.Context, req *csi.NodeStageVolumeRequest) error {
	switch {
	case req.GetVolumeId() == "":
		return errors.New("csi NodeStageVolume: missing volume id")
	case req.GetStagingTargetPath() == "":
		return errors.New("csi NodeStageVolume: missing staging target path")
	case req.GetVolumeCapability() == nil:
		return errors.New("csi NodeStageVolume: missing volume capability")
	}
	klog.FromContext(ctx).V(4).Info("Calling NodeStageVolume", "endpoint", c.path,
		"volumeID", req.GetVolumeId(), "stagingPath", req.GetStagingTargetPath())
	timeout := c.opts.StageTimeout
	if req.GetVolumeContext()[kubelet.ReattachContextKey] == "true" {
		timeout = c.opts.ReattachTimeout
	}
	return c.call(ctx, "NodeStageVolume", timeout, func(ctx context.Context) error {
		_, err := c.node.NodeStageVolume(ctx, req)
		return err
	})
}

// NodePublishVolume sends req (see kubelet.PublishRequest).
func (c *CSIClient) NodePublishVolume(ctx context.Context, req *csi.NodePublishVolumeRequest) error {
	switch {
	case req.GetVolumeId() == "":
		return errors.New("csi NodePublishVolume: missing volume id")
	case req.GetTargetPath() == "":
		return errors.New("csi NodePublishVolume: missing target path")
	case req.GetVolumeCapability() == nil:
		return errors.New("csi NodePublishVolume: missing volume capability")
	}
	klog.FromContext(ctx).V(4).Info("Calling NodePublishVolume", "endpoint", c.path,
		"volumeID", req.GetVolumeId(), "stagingPath", req.GetStagingTargetPath(), "targetPath", req.GetTargetPath())
	return c.call(ctx, "NodePublishVolume", c.opts.PublishTimeout, func(ctx context.Context) error {
		_, err := c.node.NodePublishVolume(ctx, req)
		return err
	})
}

// socketPath turns a kind ("csi", "cri") endpoint (an absolute path,
// unix:///path or unix:/path) into a socket path, refusing any other scheme.
func socketPath(kind, endpoint string) (string, error) {
	p := endpoint
	switch {
	case strings.HasPrefix(p, "unix://"):
		p = strings.TrimPrefix(p, "unix://")
	case strings.HasPrefix(p, "unix:"):
		p = strings.TrimPrefix(p, "unix:")
	}
	if !filepath.IsAbs(p) {
		return "", fmt.Errorf("%s endpoint %q is not a unix socket path: give an absolute path or unix:///path", kind, endpoint)
	}
	return filepath.Clean(p), nil
}

// checkSocket reports a missing path as down (ErrDriverUnavailable,
// ErrRuntimeUnavailable) and refuses a path that exists but is not a socket.
func checkSocket(kind, path string, down error) error {
	fi, err := os.Stat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%s socket %s: %w: %w", kind, path, down, err)
	}
	if err != nil {
		return fmt.Errorf("%s socket %s: %w", kind, path, err)
	}
	if fi.Mode().Type() != fs.ModeSocket {
		return fmt.Errorf("%s endpoint %s is not a unix socket (mode %v)", kind, path, fi.Mode().Type())
	}
	return nil
}
