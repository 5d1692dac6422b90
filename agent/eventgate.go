package agent

import (
	"context"
	"sync"
	"time"

	eventsv1 "k8s.io/api/events/v1"
	"k8s.io/client-go/tools/events"
)

// eventHoldMax bounds how long the event writes wait for the repairs
// (eventGate): an event is at most this late, however long the node's
// queue of broken volumes lasts.
const eventHoldMax = 30 * time.Second

// eventGate holds the agent's event writes while broken volumes wait for a
// repair slot. The events and the repairs' reads (claims, the node's pods)
// share the client's rate limit, kubelet's: during an outage that breaks
// more volumes than MaxConcurrentRepairs, each event written ahead of a
// claim's read delays every repair behind it by one request. Held, the
// events (already within the node's event budget, limitedRecorder) are
// written once the last due volume has its run, or eventHoldMax after the
// gate closed. Their eventTime is when they happened.
type eventGate struct {
	max time.Duration
	now func() time.Time

	mu sync.Mutex
	// busy: volumes wait for a slot; since when; open is closed when it
	// turns idle again.
	busy  bool
	since time.Time
	open  chan struct{}
}

func newEventGate(max time.Duration, now func() time.Time) *eventGate {
	if now == nil {
		now = time.Now
	}
	g := &eventGate{max: max, now: now, open: make(chan struct{})}
	close(g.open)
	return g
}

// set says whether broken volumes wait for a repair slot.
func (g *eventGate) set(busy bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	switch {
	case busy && !g.busy:
		g.busy, g.since, g.open = true, g.now(), make(chan struct{})
	case !busy && g.busy:
		g.busy = false
		close(g.open)
	}
}

// wait returns when no volume waits for a slot, eventHoldMax after the
// gate closed, or when ctx ends.
func (g *eventGate) wait(ctx context.Context) {
	g.mu.Lock()
	busy, open, left := g.busy, g.open, g.max-g.now().Sub(g.since)
	g.mu.Unlock()
	if !busy || left <= 0 {
		return
	}
	t := time.NewTimer(left)
	defer t.Stop()
	select {
	case <-open:
	case <-t.C:
	case <-ctx.Done():
	}
}

// gatedSink is an event sink whose writes wait for the gate.
type gatedSink struct {
	events.EventSink
	gate *eventGate
}

func (s gatedSink) Create(ctx context.Context, ev *eventsv1.Event) (*eventsv1.Event, error) {
	s.gate.wait(ctx)
	return s.EventSink.Create(ctx, ev)
}

func (s gatedSink) Update(ctx context.Context, ev *eventsv1.Event) (*eventsv1.Event, error) {
	s.gate.wait(ctx)
	return s.EventSink.Update(ctx, ev)
}

func (s gatedSink) Patch(ctx context.Context, old *eventsv1.Event, data []byte) (*eventsv1.Event, error) {
	s.gate.wait(ctx)
	return s.EventSink.Patch(ctx, old, data)
}
