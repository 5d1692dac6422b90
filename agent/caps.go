package agent

import (
	"context"
	"fmt"
	"sync"

	"github.com/mountmedic/mountmedic/remount"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// DriverCapsFunc returns a CSI driver's node capabilities; errors match
// remount.ErrDriverUnavailable when the driver is down.
type DriverCapsFunc func(ctx context.Context, driver string) (kubelet.NodeCapabilities, error)

// driverCapser is a repairer that asks drivers for their capabilities
// through the clients it keeps (a *remount.Repairer).
type driverCapser interface {
	Capabilities(ctx context.Context, driver string) (kubelet.NodeCapabilities, error)
}

// The command's repairer must keep satisfying driverCapser, or New would
// quietly fall back to dialing drivers itself.
var _ driverCapser = (*remount.Repairer)(nil)

// DialDriverCaps returns a DriverCapsFunc that finds the driver's socket
// under kubeletRoot the way kubelet does and dials it once per call: for an
// agent without a repairer, which still reports whether drivers are up.
func DialDriverCaps(kubeletRoot string) DriverCapsFunc {
	return func(ctx context.Context, driver string) (kubelet.NodeCapabilities, error) {
		ep, err := remount.FindDriver(ctx, kubeletRoot, driver)
		if err != nil {
			return kubelet.NodeCapabilities{}, err
		}
		c, err := remount.DialCSI(ctx, ep.Path, remount.CSIOptions{})
		if err != nil {
			return kubelet.NodeCapabilities{}, err
		}
		defer c.Close()
		caps, err := c.NodeGetCapabilities(ctx)
		if err != nil {
			return kubelet.NodeCapabilities{}, fmt.Errorf("csi driver %q: %w", driver, err)
		}
		return caps, nil
	}
}

// capsCache remembers each driver's capabilities until the driver
// re-registers (its socket appears again) or the resync; errors are not
// remembered.
type capsCache struct {
	fn DriverCapsFunc
	mu sync.Mutex
	m  map[string]kubelet.NodeCapabilities
}

func newCapsCache(fn DriverCapsFunc) *capsCache {
	return &capsCache{fn: fn, m: make(map[string]kubelet.NodeCapabilities)}
}

func (c *capsCache) get(ctx context.Context, driver string) (kubelet.NodeCapabilities, error) {
	c.mu.Lock()
	caps, ok := c.m[driver]
	c.mu.Unlock()
	if ok {
		return caps, nil
	}
	caps, err := c.fn(ctx, driver)
	if err != nil {
		return caps, err
	}
	c.mu.Lock()
	c.m[driver] = caps
	c.mu.Unlock()
	return caps, nil
}

// forget drops driver ("" for all).
func (c *capsCache) forget(driver string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if driver == "" {
		clear(c.m)
		return
	}
	delete(c.m, driver)
}
