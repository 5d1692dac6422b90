package agent

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

// fakeRecorder records the events it is given (pure-logic tests only: the
// agent's events against a real API server are checked by the root tests).
type fakeRecorder struct {
	mu     sync.Mutex
	events []fakeEvent
}

type fakeEvent struct {
	regarding, reason, note string
}

func (f *fakeRecorder) Eventf(regarding, _ runtime.Object, _, reason, _, note string, args ...interface{}) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.events = append(f.events, fakeEvent{objectName(regarding), reason, fmt.Sprintf(note, args...)})
}

func pods(n int) []*corev1.Pod {
	out := make([]*corev1.Pod, n)
	for i := range out {
		out[i] = &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "apps", Name: fmt.Sprintf("p%d", i)}}
	}
	return out
}

// TestEventBudget: a thousand volumes break at once on a node. The agent
// sends the first eventBurst events, holds the rest and sums them up in one
// event per reason on the Node; then one event a second passes again.
// Evictions always pass.
func TestEventBudget(t *testing.T) {
	now := time.Unix(1000, 0)
	rec := &fakeRecorder{}
	l := newLimitedRecorder(rec, "node-1", func() time.Time { return now })
	r := reporter{rec: l}
	ps := pods(1000)
	for _, p := range ps {
		r.pod(p, nil, corev1.EventTypeWarning, ReasonVolumeBroken, actionProbe, "broken")
	}
	if len(rec.events) != eventBurst {
		t.Fatalf("%d events sent for 1000 broken volumes at once, want the burst of %d", len(rec.events), eventBurst)
	}
	r.pod(ps[0], nil, corev1.EventTypeNormal, ReasonEvicting, actionEvict, "evicted")
	if got := rec.events[len(rec.events)-1]; Reason(got.reason) != ReasonEvicting {
		t.Errorf("an eviction past the budget was held, want it sent (last event %v)", got)
	}
	for _, p := range ps[:10] {
		r.pod(p, nil, corev1.EventTypeNormal, ReasonVolumeRepaired, actionRepair, "repaired")
	}
	before := len(rec.events)
	l.flush(false)
	summaries := rec.events[before:]
	if len(summaries) != 2 {
		t.Fatalf("flush sent %d events, want one per held reason (2): %v", len(summaries), summaries)
	}
	for _, s := range summaries {
		if s.regarding != "node-1" {
			t.Errorf("summary regards %q, want the node", s.regarding)
		}
		switch Reason(s.reason) {
		case ReasonVolumeBroken:
			if !strings.HasPrefix(s.note, "975 VolumeBroken events") || !strings.Contains(s.note, "apps/p25, ") || !strings.Contains(s.note, "and 965 more") {
				t.Errorf("VolumeBroken summary = %q, want the count, the first pods held and how many more", s.note)
			}
		case ReasonVolumeRepaired:
			if !strings.HasPrefix(s.note, "10 VolumeRepaired events") {
				t.Errorf("VolumeRepaired summary = %q", s.note)
			}
		default:
			t.Errorf("summary of reason %s, want VolumeBroken or VolumeRepaired", s.reason)
		}
	}
	before = len(rec.events)
	l.flush(false)
	if len(rec.events) != before {
		t.Errorf("a second flush with nothing held sent %d events", len(rec.events)-before)
	}
	now = now.Add(5 * time.Second)
	for _, p := range ps[:20] {
		r.pod(p, nil, corev1.EventTypeNormal, ReasonVolumeRepaired, actionRepair, "repaired")
	}
	if sent := len(rec.events) - before; sent != 5 {
		t.Errorf("%d events sent 5 s after the burst, want 5 (one a second)", sent)
	}
}
