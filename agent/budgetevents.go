package agent

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
)

// evictionEventSelector selects the agent's events that record an
// eviction or deletion it made: reason Evicting, on a pod (each action
// also has an event on the claim), type Normal. core/v1 field names: the
// API server has no field selector on events.k8s.io's reportingController
// or reportingInstance.
var evictionEventSelector = fields.Set{
	"reportingComponent":  ReportingController,
	"reason":              string(ReasonEvicting),
	"type":                corev1.EventTypeNormal,
	"involvedObject.kind": "Pod",
}.AsSelector().String()

// pastEvictions lists the evictions and deletions this node's agent
// recorded in events within window before now (oldest first, one time per
// occurrence): what a previous run of the agent took from the budget.
// Only events naming node as their reportingInstance count, which the
// admission policy mountmedic-agent-events admits from that node's
// identity alone, so no one else can use up a node's budget with forged
// events. Dry-run events (they take nothing) do not count.
func pastEvictions(ctx context.Context, client kubernetes.Interface, node string, window time.Duration, now time.Time) ([]time.Time, error) {
	var out []time.Time
	opts := metav1.ListOptions{FieldSelector: evictionEventSelector, Limit: 500}
	for {
		list, err := client.CoreV1().Events(metav1.NamespaceAll).List(ctx, opts)
		if err != nil {
			return nil, fmt.Errorf("list the agent's eviction events (%s): %w", evictionEventSelector, err)
		}
		for i := range list.Items {
			ev := &list.Items[i]
			if ev.ReportingInstance != node || strings.HasPrefix(ev.Message, dryRunPrefix) {
				continue
			}
			at, n := ev.EventTime.Time, int32(1)
			if ev.Series != nil {
				at, n = ev.Series.LastObservedTime.Time, max(ev.Series.Count, 1)
			}
			if at.IsZero() {
				at = ev.LastTimestamp.Time
			}
			if at.IsZero() || now.Sub(at) >= window || at.After(now) {
				continue
			}
			for range n {
				out = append(out, at)
			}
		}
		if list.Continue == "" {
			break
		}
		opts.Continue = list.Continue
	}
	slices.SortFunc(out, func(a, b time.Time) int { return a.Compare(b) })
	return out, nil
}

// restore puts actions taken at the given times (oldest first) into the
// budget, as a previous run of the agent took them.
func (b *budget) restore(taken []time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.taken = append(append([]time.Time(nil), taken...), b.taken...)
	slices.SortFunc(b.taken, func(a, b time.Time) int { return a.Compare(b) })
	b.prune(b.now())
}

// restoreBudget takes from the budget what the agent's events say this
// node evicted or deleted within the window: a restarted (or crash-looping)
// agent goes on with the budget its previous runs left. When the events
// cannot be listed the budget starts full, and the log says so.
func (a *Agent) restoreBudget(ctx context.Context) {
	if a.cfg.MaxEvictions == 0 {
		return
	}
	logger := klog.FromContext(ctx)
	client := a.eventReader
	if client == nil {
		client = a.client
	}
	cctx, cancel := context.WithTimeout(ctx, a.cfg.APITimeout)
	defer cancel()
	taken, err := pastEvictions(cctx, client, a.cfg.NodeName, a.cfg.EvictionWindow, a.budget.now())
	if err != nil {
		logger.Error(err, "Cannot rebuild the eviction budget from the agent's events: it starts full", "maxEvictions", a.cfg.MaxEvictions, "window", a.cfg.EvictionWindow)
		return
	}
	a.budget.restore(taken)
	logger.Info("Rebuilt the eviction budget from the agent's events", "taken", len(taken), "maxEvictions", a.cfg.MaxEvictions, "window", a.cfg.EvictionWindow)
}
