package failover

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// TestFailedOverNodes checks the failed-over node's series: named by the
// node failed over, set to when, and gone an hour after.
func TestFailedOverNodes(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	m, err := newControllerMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	const name = "mountmedic_failover_last_failover_timestamp_seconds"
	t0 := time.Unix(1_800_000_000, 0)
	m.failedOver.set("node-a", t0)
	m.failedOver.set("node-b", t0.Add(30*time.Minute))
	for node, want := range map[string]float64{"node-a": 1_800_000_000, "node-b": 1_800_001_800} {
		if got := metric(t, reg, name, map[string]string{"failed_node": node}); got != want {
			t.Errorf("%s{failed_node=%s} = %v, want %v", name, node, got, want)
		}
	}
	// A fail-over more than an hour after node-a's drops node-a's series.
	m.failedOver.set("node-c", t0.Add(61*time.Minute))
	if got := seriesOf(t, reg, name); len(got) != 2 || got["node-a"] || !got["node-b"] || !got["node-c"] {
		t.Errorf("%s series after an hour: %v, want node-b and node-c", name, got)
	}
}

// seriesOf is the failed_node values of the series of name.
func seriesOf(t *testing.T, reg prometheus.Gatherer, name string) map[string]bool {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "failed_node" {
					out[l.GetValue()] = true
				}
			}
		}
	}
	return out
}
