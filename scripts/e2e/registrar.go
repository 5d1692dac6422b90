package e2e

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"

	"google.golang.org/grpc"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// registrar does what node-driver-registrar does beside a CSI node plugin:
// it serves the kubelet plugin registration API on a socket in kubelet's
// plugins_registry directory, so that kubelet's plugin watcher finds the
// driver, asks GetInfo and connects to the driver's endpoint.
type registrar struct {
	registerapi.UnimplementedRegistrationServer

	driver, endpoint, socket string
	srv                      *grpc.Server

	mu     sync.Mutex
	status []*registerapi.RegistrationStatus
	notify chan struct{}
}

// startRegistrar serves the registration API for driver (whose CSI socket is
// endpoint) on socket.
func startRegistrar(driver, endpoint, socket string) (*registrar, error) {
	if err := os.Remove(socket); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("remove stale registration socket %s: %w", socket, err)
	}
	l, err := net.Listen("unix", socket)
	if err != nil {
		return nil, fmt.Errorf("listen on registration socket %s: %w", socket, err)
	}
	r := &registrar{driver: driver, endpoint: endpoint, socket: socket, srv: grpc.NewServer(), notify: make(chan struct{}, 1)}
	registerapi.RegisterRegistrationServer(r.srv, r)
	go func() { _ = r.srv.Serve(l) }()
	return r, nil
}

func (r *registrar) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	return &registerapi.PluginInfo{
		Type:              registerapi.CSIPlugin,
		Name:              r.driver,
		Endpoint:          r.endpoint,
		SupportedVersions: []string{"1.0.0"},
	}, nil
}

func (r *registrar) NotifyRegistrationStatus(_ context.Context, s *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	r.mu.Lock()
	r.status = append(r.status, s)
	r.mu.Unlock()
	select {
	case r.notify <- struct{}{}:
	default:
	}
	return &registerapi.RegistrationStatusResponse{}, nil
}

// registered waits until kubelet reported a registration and returns
// whether it succeeded, with kubelet's error.
func (r *registrar) registered(ctx context.Context) error {
	for {
		r.mu.Lock()
		var last *registerapi.RegistrationStatus
		if n := len(r.status); n > 0 {
			last = r.status[n-1]
		}
		r.mu.Unlock()
		switch {
		case last != nil && last.PluginRegistered:
			return nil
		case last != nil:
			return fmt.Errorf("kubelet refused the registration of %s: %s", r.driver, last.Error)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("kubelet did not register driver %s through %s: %w", r.driver, r.socket, ctx.Err())
		case <-r.notify:
		}
	}
}

func (r *registrar) stop() {
	r.srv.Stop()
	_ = os.Remove(r.socket)
}
