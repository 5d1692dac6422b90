package remount

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mountmedic/mountmedic/probe"
)

// TestCheckFlightsParkOnePerKey: a device that never answers (its read
// parks in the kernel) is checked again and again while its backend stays
// down. Only the first check starts a goroutine; the others wait on it,
// answer hung, and leave nothing behind. Once the read returns, the next
// check is a fresh one.
func TestCheckFlightsParkOnePerKey(t *testing.T) {
	var c checkFlights
	var started atomic.Int32
	release := make(chan struct{})
	parked := func() error {
		started.Add(1)
		<-release
		return errors.New("input/output error")
	}
	for i := range 50 {
		err := c.run(context.Background(), "read nbd0", time.Millisecond, parked)
		if !errors.Is(err, probe.ErrHung) {
			t.Fatalf("check %d of a parked device: %v, want ErrHung", i, err)
		}
	}
	if n := started.Load(); n != 1 {
		t.Fatalf("50 checks of one parked device started %d reads, want 1", n)
	}
	// Another device is not held up by the first.
	if err := c.run(context.Background(), "read nbd1", time.Minute, func() error { return nil }); err != nil {
		t.Fatalf("check of another device: %v", err)
	}
	if n := c.running(); n != 1 {
		t.Fatalf("%d checks in flight, want the one parked read", n)
	}
	close(release)
	// A check now either joins the returning read (its error) or starts
	// a fresh one; never a hang.
	if err := c.run(context.Background(), "read nbd0", time.Minute, parked); err == nil || errors.Is(err, probe.ErrHung) {
		t.Fatalf("check after the read returned: %v, want the read's error", err)
	}
	for c.running() != 0 {
		time.Sleep(time.Millisecond)
	}
	if err := c.run(context.Background(), "read nbd0", time.Minute, func() error { return nil }); err != nil {
		t.Fatalf("fresh check after the device answered: %v", err)
	}
}

// TestCheckFlightsContext: a caller whose context ends stops waiting.
func TestCheckFlightsContext(t *testing.T) {
	var c checkFlights
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	block := make(chan struct{})
	defer close(block)
	if err := c.run(ctx, "write check /x", time.Minute, func() error { <-block; return nil }); !errors.Is(err, context.Canceled) {
		t.Fatalf("run with a cancelled context: %v, want context.Canceled", err)
	}
}
