package agent

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/probe"
)

// The node condition: the agent keeps one condition on its own Node saying
// whether the node's pod volume mounts are healthy, with node-problem-
// detector's convention (status True: the problem is there), so that
// `kubectl describe node`, `mountmedic status` and node health checkers
// (medik8s node-healthcheck) see it without scraping metrics. Only the
// agent's own Node is written (its node identity can write no other).
const (
	ConditionType = corev1.NodeConditionType("PodVolumeMountsBroken")
	// ReasonMountsHealthy: status False, every kubelet volume mount probed
	// healthy (or none).
	ReasonMountsHealthy = "PodVolumeMountsHealthy"
	// ReasonMountsBroken: status True; the message counts the broken mounts
	// by driver and state.
	ReasonMountsBroken = "PodVolumeMountsBroken"
)

// maxConditionMessage bounds the message (the API server takes 32 KiB; a
// node with many drivers and states must not come near).
const maxConditionMessage = 1024

// conditionState is what the condition says.
type conditionState struct {
	status  corev1.ConditionStatus
	reason  string
	message string
}

// conditionOf summarizes one probe cycle: the broken mounts counted by
// driver and state, and how many mounts were probed in all.
func conditionOf(rep *probe.Report) conditionState {
	type key struct{ driver, state string }
	counts := map[key]int{}
	broken := 0
	for _, r := range rep.Mounts {
		if r.State.Broken() {
			counts[key{driverLabel(r.Mount), r.State.String()}]++
			broken++
		}
	}
	total := len(rep.Mounts)
	if broken == 0 {
		return conditionState{corev1.ConditionFalse, ReasonMountsHealthy, fmt.Sprintf("%d pod volume mounts healthy", total)}
	}
	keys := make([]key, 0, len(counts))
	for k := range counts {
		keys = append(keys, k)
	}
	slices.SortFunc(keys, func(a, b key) int { return cmp.Or(cmp.Compare(a.driver, b.driver), cmp.Compare(a.state, b.state)) })
	var b strings.Builder
	fmt.Fprintf(&b, "%d of %d pod volume mounts broken:", broken, total)
	for i, k := range keys {
		part := fmt.Sprintf(" %s %s %d", k.driver, k.state, counts[k])
		if i > 0 {
			part = "," + part
		}
		if b.Len()+len(part) > maxConditionMessage-5 {
			b.WriteString(", ...")
			break
		}
		b.WriteString(part)
	}
	return conditionState{corev1.ConditionTrue, ReasonMountsBroken, b.String()}
}

// conditionWriter keeps the condition on the agent's Node: it writes when
// what the condition says changes (at most once per minGap, so a flapping
// mount costs one write per minGap), and at least every heartbeat, so that
// a condition whose lastHeartbeatTime is old tells that the agent stopped.
// The probe loop never waits for it.
type conditionWriter struct {
	client    kubernetes.Interface
	node      string
	timeout   time.Duration
	minGap    time.Duration
	heartbeat time.Duration
	now       func() time.Time

	writes *prometheus.CounterVec
	broken prometheus.Gauge

	mu   sync.Mutex
	want *conditionState
	wake chan struct{}

	// Owned by run.
	written    *conditionState
	writtenAt  time.Time
	transition time.Time
	backoff    time.Duration
	retryAt    time.Time
}

// newConditionWriter makes the writer of node's condition and registers its
// collectors on reg.
func newConditionWriter(client kubernetes.Interface, node string, timeout time.Duration, reg prometheus.Registerer) *conditionWriter {
	w := &conditionWriter{client: client, node: node, timeout: timeout, minGap: 10 * time.Second,
		heartbeat: 5 * time.Minute, now: time.Now, wake: make(chan struct{}, 1),
		writes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mountmedic_node_condition_writes_total",
			Help: "Writes of the PodVolumeMountsBroken condition to this node's Node object, by result.",
		}, []string{"result"}),
		broken: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "mountmedic_node_condition_broken",
			Help: "1 while the PodVolumeMountsBroken condition this agent last wrote on its Node is True.",
		}),
	}
	reg.MustRegister(w.writes, w.broken)
	for _, r := range []string{resultSuccess, resultFailure} {
		w.writes.WithLabelValues(r)
	}
	return w
}

// observe takes one probe cycle's report; run writes it.
func (w *conditionWriter) observe(rep *probe.Report) {
	st := conditionOf(rep)
	w.mu.Lock()
	w.want = &st
	w.mu.Unlock()
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// run writes the condition until ctx ends.
func (w *conditionWriter) run(ctx context.Context) {
	logger := klog.FromContext(ctx).WithValues("condition", string(ConditionType))
	tick := time.NewTicker(w.minGap)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-w.wake:
		case <-tick.C:
		}
		w.mu.Lock()
		want := w.want
		w.mu.Unlock()
		if want == nil {
			continue
		}
		now := w.now()
		changed := w.written == nil || *w.written != *want
		if !changed && now.Sub(w.writtenAt) < w.heartbeat {
			continue
		}
		if w.written != nil && now.Sub(w.writtenAt) < w.minGap {
			continue // the next tick writes it
		}
		if now.Before(w.retryAt) {
			continue // backing off after a failed write
		}
		if err := w.write(ctx, *want, now); err != nil {
			w.writes.WithLabelValues(resultFailure).Inc()
			// Back off: minGap, doubling up to the heartbeat period (a
			// missing Node or a refused write must not cost a request a
			// probe cycle).
			w.backoff = min(max(2*w.backoff, w.minGap), w.heartbeat)
			w.retryAt = now.Add(w.backoff)
			logger.Info("Cannot write the node condition; retrying", "err", err, "retryIn", w.backoff)
			continue
		}
		w.backoff, w.retryAt = 0, time.Time{}
		w.writes.WithLabelValues(resultSuccess).Inc()
		w.broken.Set(boolGauge(want.status == corev1.ConditionTrue))
		if changed {
			logger.V(2).Info("Wrote the node condition", "status", want.status, "reason", want.reason, "message", want.message)
		}
	}
}

// write patches the condition into the Node's status (PatchStatus sends a
// strategic merge patch, which merges conditions by type and leaves
// kubelet's alone). Its transition time
// is kept from the Node when the status did not change, so an agent
// restart does not reset it.
func (w *conditionWriter) write(ctx context.Context, st conditionState, now time.Time) error {
	ctx, cancel := context.WithTimeout(ctx, w.timeout)
	defer cancel()
	if w.written == nil {
		node, err := w.client.CoreV1().Nodes().Get(ctx, w.node, metav1.GetOptions{})
		if err != nil {
			return fmt.Errorf("get node %s: %w", w.node, err)
		}
		for _, c := range node.Status.Conditions {
			if c.Type == ConditionType && c.Status == st.status {
				w.transition = c.LastTransitionTime.Time
			}
		}
	} else if w.written.status != st.status {
		w.transition = time.Time{}
	}
	if w.transition.IsZero() {
		w.transition = now
	}
	c := corev1.NodeCondition{
		Type:               ConditionType,
		Status:             st.status,
		Reason:             st.reason,
		Message:            st.message,
		LastHeartbeatTime:  metav1.NewTime(now),
		LastTransitionTime: metav1.NewTime(w.transition),
	}
	patch, err := json.Marshal(map[string]any{"status": map[string]any{"conditions": []corev1.NodeCondition{c}}})
	if err != nil {
		return err
	}
	if _, err := w.client.CoreV1().Nodes().PatchStatus(ctx, w.node, patch); err != nil {
		return fmt.Errorf("patch node %s status: %w", w.node, err)
	}
	w.written, w.writtenAt = &st, now
	return nil
}

func boolGauge(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// MountCount is one driver's broken mounts in one state, as the condition's
// message gives them.
type MountCount struct {
	Driver string `json:"driver"`
	State  string `json:"state"`
	Count  int    `json:"count"`
}

// ConditionSummary is what a PodVolumeMountsBroken condition's message says.
type ConditionSummary struct {
	Broken int          `json:"broken"`
	Total  int          `json:"total"`
	Counts []MountCount `json:"counts,omitempty"`
	// Truncated: the message was cut (more drivers and states than fit).
	Truncated bool `json:"truncated,omitempty"`
}

// ParseConditionMessage reads the message conditionOf writes; readers
// (mountmedic status) use it instead of a second copy of the format.
func ParseConditionMessage(msg string) (ConditionSummary, error) {
	var s ConditionSummary
	if _, err := fmt.Sscanf(msg, "%d pod volume mounts healthy", &s.Total); err == nil && !strings.Contains(msg, "broken") {
		return s, nil
	}
	head, list, ok := strings.Cut(msg, " pod volume mounts broken:")
	if !ok {
		return s, fmt.Errorf("condition message %q: not a mountmedic message", msg)
	}
	if _, err := fmt.Sscanf(head, "%d of %d", &s.Broken, &s.Total); err != nil {
		return s, fmt.Errorf("condition message %q: %w", msg, err)
	}
	for part := range strings.SplitSeq(list, ",") {
		f := strings.Fields(part)
		if len(f) == 1 && f[0] == "..." {
			s.Truncated = true
			continue
		}
		if len(f) != 3 {
			return s, fmt.Errorf("condition message %q: count %q is not 'driver state n'", msg, part)
		}
		n, err := strconv.Atoi(f[2])
		if err != nil {
			return s, fmt.Errorf("condition message %q: count %q: %w", msg, part, err)
		}
		s.Counts = append(s.Counts, MountCount{Driver: f[0], State: f[1], Count: n})
	}
	return s, nil
}
