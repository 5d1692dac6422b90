package agent

import (
	"context"
	"sync"
	"testing"
	"time"

	eventsv1 "k8s.io/api/events/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
)

// sinkCalls is an event sink that counts its writes.
type sinkCalls struct {
	mu     sync.Mutex
	writes int
	wrote  chan struct{}
}

func (s *sinkCalls) write() (*eventsv1.Event, error) {
	s.mu.Lock()
	s.writes++
	s.mu.Unlock()
	s.wrote <- struct{}{}
	return &eventsv1.Event{}, nil
}

func (s *sinkCalls) Create(context.Context, *eventsv1.Event) (*eventsv1.Event, error) {
	return s.write()
}

func (s *sinkCalls) Update(context.Context, *eventsv1.Event) (*eventsv1.Event, error) {
	return s.write()
}

func (s *sinkCalls) Patch(context.Context, *eventsv1.Event, []byte) (*eventsv1.Event, error) {
	return s.write()
}

// TestEventGateHoldsWritesWhileVolumesWait: an event written while broken
// volumes wait for a repair slot reaches the sink once none waits, and at
// once when none waits.
func TestEventGateHoldsWritesWhileVolumesWait(t *testing.T) {
	g := newEventGate(time.Hour, nil)
	s := &sinkCalls{wrote: make(chan struct{}, 3)}
	sink := gatedSink{EventSink: s, gate: g}
	ev := &eventsv1.Event{ObjectMeta: metav1.ObjectMeta{Name: "e"}}

	if _, err := sink.Create(context.Background(), ev); err != nil {
		t.Fatal(err)
	}
	<-s.wrote // an open gate passes the write through

	g.set(true)
	g.set(true) // still busy: the hold runs from the first set
	done := make(chan struct{})
	go func() {
		defer close(done)
		sink.Patch(context.Background(), ev, []byte("{}"))
	}()
	select {
	case <-s.wrote:
		t.Fatal("an event was written while volumes wait for a repair slot, want it held")
	case <-time.After(100 * time.Millisecond):
	}
	g.set(false)
	<-s.wrote
	<-done
}

// TestEventGateHoldsAtMostMax: past the hold's bound the events are written
// though volumes still wait, and a write whose context ends stops waiting.
func TestEventGateHoldsAtMostMax(t *testing.T) {
	now := time.Unix(1000, 0)
	var mu sync.Mutex
	clock := func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	g := newEventGate(30*time.Second, clock)
	g.set(true)
	mu.Lock()
	now = now.Add(30 * time.Second)
	mu.Unlock()
	g.wait(context.Background()) // returns: held for max already

	g.set(false)
	g.set(true) // a new hold from now
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); g.wait(ctx) }()
	cancel()
	<-done
}

// TestStartRunsClosesTheGateWhileVolumesWait: the loop closes the event
// gate while due volumes are left for want of a slot, and opens it when
// none is.
func TestStartRunsClosesTheGateWhileVolumesWait(t *testing.T) {
	cfg := DefaultConfig()
	cfg.NodeName, cfg.KubeletRoot, cfg.MetricsAddr, cfg.Version = ladderNode, "/var/lib/kubelet", "", "test"
	cfg.NodeCondition = false
	a, err := New(cfg, Deps{Client: fake.NewClientset(), Repairer: &fakeRepairer{}, Events: &fakeRecorder{}})
	if err != nil {
		t.Fatal(err)
	}
	busy := func() bool { a.gate.mu.Lock(); defer a.gate.mu.Unlock(); return a.gate.busy }
	a.running = cfg.MaxConcurrentRepairs
	a.queue = []string{"driver/handle-1"}
	a.decider.vols["driver/handle-1"] = &volState{since: time.Now()}
	a.startRuns(context.Background())
	if !busy() {
		t.Errorf("gate open with %d runs under way and a volume queued, want it closed", a.running)
	}
	a.running, a.queue = 0, nil
	a.startRuns(context.Background())
	if busy() {
		t.Error("gate closed with no volume queued, want it open")
	}
}

// TestNextCycle: the next cycle starts a probe interval (jittered by up to
// 10 %) after the last one started, a quarter interval after its end at the
// soonest.
func TestNextCycle(t *testing.T) {
	const interval = 2 * time.Second
	for _, tc := range []struct {
		took     time.Duration
		min, max time.Duration
	}{
		{0, interval, interval + interval/10},
		{600 * time.Millisecond, interval - 600*time.Millisecond, interval + interval/10 - 600*time.Millisecond},
		{interval, interval / 4, interval / 4},
		{10 * interval, interval / 4, interval / 4},
	} {
		for range 20 {
			if got := nextCycle(interval, tc.took); got < tc.min || got > tc.max {
				t.Errorf("nextCycle(%s, took %s) = %s, want in [%s, %s]", interval, tc.took, got, tc.min, tc.max)
			}
		}
	}
}
