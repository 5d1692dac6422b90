package failover

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Fail-over results, as mountmedic_failover_failovers_total labels them.
const (
	resultSuccess  = "success"
	resultFailure  = "failure"
	resultDryRun   = "dry_run"
	resultDeferred = "deferred"
)

var failoverResults = []string{resultSuccess, resultFailure, resultDryRun, resultDeferred}

// Renewal results of the heartbeat.
var renewalResults = []string{resultSuccess, resultFailure}

// controllerMetrics are the cluster side's collectors. No label names a
// pod; only failedOver names a node (the one failed over, which the
// scrape target's node label, the leader's, cannot say).
type controllerMetrics struct {
	failovers    *prometheus.CounterVec
	failedOver   *failedOverNodes
	deathToAct   prometheus.Histogram
	podDeletions *prometheus.CounterVec
	inFailover   prometheus.Gauge
	leader       prometheus.Gauge
	recovered    prometheus.Counter
	nodesJudged  prometheus.Gauge
	nodesDead    prometheus.Gauge
	standDown    prometheus.Gauge
	standDowns   prometheus.Counter
	// freshRefusals: fail-overs called off because the node's fresh state
	// did not confirm what the informers said.
	freshRefusals prometheus.Counter
	sightRegained prometheus.Counter
	// podsLeft: pods with ReadWriteOnce volumes a dead node keeps.
	podsLeft *prometheus.CounterVec
}

func newControllerMetrics(reg prometheus.Registerer) (*controllerMetrics, error) {
	m := &controllerMetrics{
		failovers: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mountmedic_failover_failovers_total",
			Help: "Node fail-overs decided by the failover leader, by result (deferred: held back by --failover-max-nodes; counted once per node and outage).",
		}, []string{"result"}),
		failedOver: newFailedOverNodes(),
		deathToAct: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "mountmedic_failover_death_to_action_seconds",
			Help:    "Seconds from a node's last sign of life seen by the leader (kubelet Lease, Ready heartbeat or mountmedic heartbeat) to the fail-over action.",
			Buckets: []float64{10, 20, 30, 40, 50, 60, 75, 90, 120, 180, 300, 600},
		}),
		podDeletions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mountmedic_failover_pod_deletions_total",
			Help: "Force deletions of pods on dead nodes, by result.",
		}, []string{"result"}),
		inFailover: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "mountmedic_failover_nodes_in_failover",
			Help: "Nodes failed over whose eligible pods are not all gone yet (the leader's view; 0 on standbys).",
		}),
		leader: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "mountmedic_failover_leader",
			Help: "1 while this instance is the failover leader.",
		}),
		recovered: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "mountmedic_failover_nodes_recovered_total",
			Help: "Failed-over nodes that became Ready again and had the duty's taint or mark removed.",
		}),
		nodesJudged: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "mountmedic_failover_nodes_judged",
			Help: "Nodes in the leader's scope it has judged since it began leading (0 on standbys).",
		}),
		nodesDead: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "mountmedic_failover_nodes_not_ready",
			Help: "Judged nodes whose Ready condition is not True in the leader's view, which the stand-down counts (0 on standbys).",
		}),
		standDown: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "mountmedic_failover_stand_down",
			Help: "1 while the leader fails no node over because too many are not Ready at once (--failover-stand-down-share).",
		}),
		standDowns: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "mountmedic_failover_stand_downs_total",
			Help: "Stand-downs the leader began.",
		}),
		freshRefusals: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "mountmedic_failover_fresh_read_refusals_total",
			Help: "Fail-overs or pod deletions called off because the node and its Leases, read fresh from the API server, did not confirm it dead.",
		}),
		sightRegained: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "mountmedic_failover_watch_regained_total",
			Help: "Times the leader's watches reached the API server again after losing it (every node's silence clock restarted).",
		}),
		podsLeft: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mountmedic_failover_pods_left_total",
			Help: "Pods with ReadWriteOnce volumes left on a dead node, once per outage, by reason (not_eligible: the policy keeps them, e.g. opted out; not_planned: not in the fence plan the node last published, so perhaps not fenced).",
		}, []string{"reason"}),
	}
	for _, r := range leftReasons {
		m.podsLeft.WithLabelValues(r)
	}
	for _, r := range failoverResults {
		m.failovers.WithLabelValues(r)
	}
	for _, r := range []string{resultSuccess, resultFailure, resultDryRun} {
		m.podDeletions.WithLabelValues(r)
	}
	if err := register(reg, m.failovers, m.failedOver.vec, m.deathToAct, m.podDeletions, m.inFailover, m.leader, m.recovered,
		m.nodesJudged, m.nodesDead, m.standDown, m.standDowns, m.freshRefusals, m.sightRegained, m.podsLeft); err != nil {
		return nil, err
	}
	return m, nil
}

// failedOverKeep is how long a failed-over node keeps its series: past
// the alert's 10 minute window, short enough that the label's values stay
// few (the nodes failed over in the last hour).
const failedOverKeep = time.Hour

// failedOverNodes is mountmedic_failover_last_failover_timestamp_seconds:
// per node failed over, when the leader last did it. A series goes after
// failedOverKeep (pruned at the next fail-over), so a node's name does not
// stay a label value for the leader's whole life.
type failedOverNodes struct {
	mu  sync.Mutex
	vec *prometheus.GaugeVec
	at  map[string]time.Time
}

func newFailedOverNodes() *failedOverNodes {
	return &failedOverNodes{
		vec: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "mountmedic_failover_last_failover_timestamp_seconds",
			Help: "Unix time of the leader's last successful fail-over of the node named by failed_node (kept for an hour).",
		}, []string{"failed_node"}),
		at: map[string]time.Time{},
	}
}

// set records a fail-over of node at now and drops the series of nodes
// failed over more than failedOverKeep before.
func (f *failedOverNodes) set(node string, now time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for n, t := range f.at {
		if now.Sub(t) > failedOverKeep {
			delete(f.at, n)
			f.vec.DeleteLabelValues(n)
		}
	}
	f.at[node] = now
	f.vec.WithLabelValues(node).Set(float64(now.UnixNano()) / 1e9)
}

// heartbeatMetrics are the node side's collectors.
type heartbeatMetrics struct {
	renewals *prometheus.CounterVec
	fenced   prometheus.Gauge
	fences   prometheus.Counter
	lastOK   prometheus.Gauge
}

func newHeartbeatMetrics(reg prometheus.Registerer) (*heartbeatMetrics, error) {
	m := &heartbeatMetrics{
		renewals: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mountmedic_failover_heartbeat_renewals_total",
			Help: "Renewals of this node's heartbeat Lease, by result.",
		}, []string{"result"}),
		fenced: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "mountmedic_failover_node_fenced",
			Help: "1 while this node is fenced (it could not renew its heartbeat for --failover-fence-after); sum it over agents for the nodes fenced.",
		}),
		fences: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "mountmedic_failover_fences_total",
			Help: "Times this node fenced itself.",
		}),
		lastOK: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "mountmedic_failover_heartbeat_last_success_timestamp_seconds",
			Help: "Unix time the last successful heartbeat renewal started.",
		}),
	}
	for _, r := range renewalResults {
		m.renewals.WithLabelValues(r)
	}
	if err := register(reg, m.renewals, m.fenced, m.fences, m.lastOK); err != nil {
		return nil, err
	}
	return m, nil
}

// register registers cs on reg (a nil reg registers nowhere).
func register(reg prometheus.Registerer, cs ...prometheus.Collector) error {
	if reg == nil {
		return nil
	}
	var errs []error
	for _, c := range cs {
		if err := reg.Register(c); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("register failover metrics: %w", err)
	}
	return nil
}
