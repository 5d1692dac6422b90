package agent_test

import (
	"context"
	"errors"
	"net"
	"os"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"

	"github.com/mountmedic/mountmedic/agent"
	"github.com/mountmedic/mountmedic/remount"
	"github.com/mountmedic/mountmedic/scripts/csilab"
)

// blockedNode is a CSI node plugin that accepts connections and never
// answers a call.
type blockedNode struct {
	csi.UnimplementedNodeServer
}

func (blockedNode) NodeGetCapabilities(ctx context.Context, _ *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	<-ctx.Done()
	return nil, ctx.Err()
}

func (blockedNode) NodeStageVolume(ctx context.Context, _ *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	<-ctx.Done()
	return nil, ctx.Err()
}

func (blockedNode) NodePublishVolume(ctx context.Context, _ *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	<-ctx.Done()
	return nil, ctx.Err()
}

// TestAgentWaitsForBlockedDriver: the real driver dies and a process that
// accepts connections on its socket and blocks in every call takes its
// place. The agent takes the driver for down: a DriverDown event, and no
// live swap, restart or eviction however long it lasts.
func TestAgentWaitsForBlockedDriver(t *testing.T) {
	d := newDriverEnv(t)
	s := d.newVolume("blocked")

	d.drv.Kill()
	sock := d.drv.Socket()
	if err := os.Remove(sock); err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	csi.RegisterNodeServer(srv, blockedNode{})
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)

	cfg := d.config()
	a := d.startAgent(cfg, d.withRepairer(cfg, remount.Config{CSI: remount.CSIOptions{ProbeTimeout: 300 * time.Millisecond, StageTimeout: 300 * time.Millisecond, PublishTimeout: 300 * time.Millisecond}}, agent.Deps{}))
	d.waitEvent(s.pod.UID, string(agent.ReasonDriverDown), csilab.DriverName)
	// Long enough for several runs at the test's backoff (0.2 s to 2 s).
	time.Sleep(5 * time.Second)
	for _, ev := range d.eventsOf(s.pod.UID) {
		switch ev.Reason {
		case string(agent.ReasonRepairEscalated), string(agent.ReasonVolumeRepaired):
			t.Errorf("event %s %q while the driver blocks", ev.Reason, ev.Note)
		}
	}
	for _, tier := range []remount.Tier{remount.TierLiveSwap, remount.TierRestart, remount.TierEvict} {
		for _, result := range []string{"success", "failure"} {
			if n, _ := a.metric(`mountmedic_repairs_total{result="` + result + `",tier="` + tier.String() + `"}`); n != 0 {
				t.Errorf("repairs_total{%s,%s} = %v while the driver blocks, want 0", tier, result, n)
			}
		}
	}
	if n, _ := a.metric(`mountmedic_evictions_total`); n != 0 {
		t.Errorf("evictions_total = %v while the driver blocks", n)
	}
}
