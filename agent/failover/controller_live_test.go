package failover

import (
	"context"
	"net/http"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/retry"

	"github.com/mountmedic/mountmedic/agent/kubeclient"
)

// requestLog records the controller's API requests (not the bytes of its
// watches), to check which nodes it spent requests on.
type requestLog struct {
	mu   sync.Mutex
	reqs []loggedRequest
}

type loggedRequest struct {
	at     time.Time
	method string
	url    *url.URL
}

func (l *requestLog) wrap(rt http.RoundTripper) http.RoundTripper {
	return roundTripper(func(r *http.Request) (*http.Response, error) {
		l.mu.Lock()
		l.reqs = append(l.reqs, loggedRequest{at: time.Now(), method: r.Method, url: r.URL})
		l.mu.Unlock()
		return rt.RoundTrip(r)
	})
}

type roundTripper func(*http.Request) (*http.Response, error)

func (f roundTripper) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// naming lists the requests since since that name node: a GET of the node
// or of a Lease named after it, a list of its pods.
func (l *requestLog) naming(node string, since time.Time) []string {
	return l.namingBetween(node, since, time.Now().Add(time.Hour))
}

// namingBetween lists the requests naming node sent between from and to.
func (l *requestLog) namingBetween(node string, from, to time.Time) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, r := range l.reqs {
		if r.at.Before(from) || r.at.After(to) {
			continue
		}
		if strings.HasSuffix(r.url.Path, "/"+node) || r.url.Query().Get("fieldSelector") == "spec.nodeName="+node {
			out = append(out, r.method+" "+r.url.String())
		}
	}
	return out
}

// eventTime is when the controller recorded its first event with reason
// about the object (events.k8s.io eventTime, microseconds).
func (s *scenario) eventTime(ctx context.Context, ns, kind, name, reason string) (time.Time, bool) {
	list, err := s.h.admin.EventsV1().Events(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return time.Time{}, false
	}
	var first time.Time
	for _, e := range list.Items {
		if e.Regarding.Kind == kind && e.Regarding.Name == name && e.Reason == reason && e.ReportingController == ReportingController &&
			(first.IsZero() || e.EventTime.Before(&metav1.MicroTime{Time: first})) {
			first = e.EventTime.Time
		}
	}
	return first, !first.IsZero()
}

// freezer makes the controller's watch lag for chosen nodes: events about
// them are dropped, so its cache keeps what it had, as a watch that fell
// behind does. The API server itself is untouched.
type freezer struct {
	mu     sync.Mutex
	frozen map[string]bool // kind/name
}

func (f *freezer) freeze(kind, name string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.frozen == nil {
		f.frozen = map[string]bool{}
	}
	f.frozen[kind+"/"+name] = true
}

func (f *freezer) thaw() {
	f.mu.Lock()
	defer f.mu.Unlock()
	clear(f.frozen)
}

func (f *freezer) hook(kind string, lw cache.ListerWatcher) cache.ListerWatcher {
	inner := lw.(cache.ListerWatcherWithContext)
	return &cache.ListWatch{
		ListWithContextFunc: inner.ListWithContext,
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			w, err := inner.WatchWithContext(ctx, o)
			if err != nil {
				return w, err
			}
			return watch.Filter(w, func(e watch.Event) (watch.Event, bool) {
				m, err := meta.Accessor(e.Object)
				if err != nil || e.Type == watch.Bookmark {
					return e, true
				}
				f.mu.Lock()
				defer f.mu.Unlock()
				return e, !f.frozen[kind+"/"+m.GetName()]
			}), nil
		},
	}
}

// setReady sets the node's Ready condition as its kubelet posts it.
func (s *scenario) setReady(node string, status corev1.ConditionStatus) {
	s.t.Helper()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		n, err := s.h.admin.CoreV1().Nodes().Get(s.h.ctx, node, metav1.GetOptions{})
		if err != nil {
			return err
		}
		now := metav1.Now()
		for i := range n.Status.Conditions {
			if n.Status.Conditions[i].Type == corev1.NodeReady {
				n.Status.Conditions[i] = corev1.NodeCondition{Type: corev1.NodeReady, Status: status, Reason: "KubeletNotReady",
					Message: "container runtime is down", LastHeartbeatTime: now, LastTransitionTime: now}
			}
		}
		_, err = s.h.admin.CoreV1().Nodes().UpdateStatus(s.h.ctx, n, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		s.t.Fatalf("set node %s Ready=%s: %v", node, status, err)
	}
}

// testFreshRead: the hostile actor is a watch that fell behind. The
// controller's cache stops seeing the victim's Lease renewals (both its
// kubelet's and its agent's), then the victim is marked Ready Unknown
// while its kubelet and agent keep renewing. From the cache the node
// looks dead; the quorum reads right before the taint show both Leases
// renewed, so the controller must not taint it.
func testFreshRead(t *testing.T, h *harness) {
	s := h.scenario(t, "fresh")
	victim := s.addNode("fresh-a", true)
	s.addNode("fresh-b", true)
	s.statefulSet("db", nil)
	ctx := h.ctx
	old := s.podOf(ctx, "db")
	var fr freezer
	_, reg, _ := s.controllerWith(s.ctl, "fresh-leader", ctlOptions{watchHook: fr.hook})
	// Frozen only once the informers synced and the nodes were judged: the
	// initial list may come through the watch (client-go's watch-list),
	// which the freezer would empty of the victim's Leases.
	s.waitFor("the controller to lead and judge both nodes", 20*time.Second, func(context.Context) (bool, error) {
		return metric(t, reg, "mountmedic_failover_leader", nil) == 1 && metric(t, reg, "mountmedic_failover_nodes_judged", nil) == 2, nil
	})
	fr.freeze("kubelet-leases", victim.name)
	fr.freeze("heartbeat-leases", victim.name)
	// Past the fence window, the cached heartbeat is "silent"; the node is
	// still Ready, so nothing happens yet.
	time.Sleep(s.ctl.FenceWindow(0))
	s.setReady(victim.name, corev1.ConditionUnknown)
	s.waitFor("a fail-over refused on fresh reads", 60*time.Second, func(context.Context) (bool, error) {
		return metric(t, reg, "mountmedic_failover_fresh_read_refusals_total", nil) >= 1, nil
	})
	// Another window: every attempt is refused.
	time.Sleep(s.ctl.FenceWindow(0))
	if taint, err := s.ourTaint(ctx, victim.name); err != nil || taint != nil {
		t.Errorf("node alive on fresh reads tainted: %v (err %v)", taint, err)
	}
	if got := metric(t, reg, "mountmedic_failover_failovers_total", map[string]string{"result": resultSuccess}); got != 0 {
		t.Errorf("failovers_total{result=success} = %v, want 0", got)
	}
	if p := s.podOf(ctx, "db"); p == nil || p.UID != old.UID || p.DeletionTimestamp != nil {
		t.Errorf("pod of a node alive on fresh reads changed: %v", p)
	}
	fr.thaw()
	victim.revive(t)
}

// testStandDown: three of four nodes die at once (a zone outage, or a
// control-plane problem that looks like one). The controller stands down:
// no taint, an event and the metric, and not one request about the dead
// nodes. When two return, the last dead node is failed over.
func testStandDown(t *testing.T, h *harness) {
	s := h.scenario(t, "standdown")
	a := s.addNode("standdown-a", true)
	b := s.addNode("standdown-b", true)
	c := s.addNode("standdown-c", true)
	d := s.addNode("standdown-d", true)
	h.mu.Lock()
	h.placement[s.ns] = []*simNode{a, d}
	h.mu.Unlock()
	s.statefulSet("db", nil)
	ctx := h.ctx
	var log requestLog
	_, reg, _ := s.controllerWith(s.ctl, "standdown-leader", ctlOptions{wrap: log.wrap})
	s.waitFor("the controller to lead", 20*time.Second, func(context.Context) (bool, error) {
		return metric(t, reg, "mountmedic_failover_leader", nil) == 1, nil
	})

	killed := time.Now()
	for _, n := range []*simNode{a, b, c} {
		n.kill()
	}
	s.waitFor("the stand-down", 60*time.Second, func(context.Context) (bool, error) {
		return metric(t, reg, "mountmedic_failover_stand_down", nil) == 1, nil
	})
	// Long enough for every dead node to have been judged dead more than
	// once.
	time.Sleep(s.ctl.FenceWindow(0))
	if got := metric(t, reg, "mountmedic_failover_stand_down", nil); got != 1 {
		t.Fatalf("stand_down = %v a window after it began, want 1", got)
	}
	if got := metric(t, reg, "mountmedic_failover_nodes_not_ready", nil); got != 3 {
		t.Errorf("nodes_not_ready = %v, want 3", got)
	}
	for _, n := range []*simNode{a, b, c} {
		if taint, err := s.ourTaint(ctx, n.name); err != nil || taint != nil {
			t.Errorf("node %s tainted during the stand-down: %v (err %v)", n.name, taint, err)
		}
		if reqs := log.naming(n.name, killed); len(reqs) > 0 {
			t.Errorf("requests about deferred node %s during the stand-down: %q", n.name, reqs)
		}
	}
	s.waitFor("the FailoverStandDown event on the leader Lease", 20*time.Second, func(ctx context.Context) (bool, error) {
		return len(s.events(ctx, agentNS, "Lease", s.ctl.LeaderLease, ReasonStandDown)) == 1, nil
	})
	if got := metric(t, reg, "mountmedic_failover_stand_downs_total", nil); got != 1 {
		t.Errorf("stand_downs_total = %v, want 1", got)
	}

	// Two return: one dead node of four is no disruption.
	b.revive(t)
	c.revive(t)
	s.waitFor("the last dead node failed over", 60*time.Second, func(ctx context.Context) (bool, error) {
		taint, err := s.ourTaint(ctx, a.name)
		return taint != nil, err
	})
	if got := metric(t, reg, "mountmedic_failover_stand_down", nil); got != 0 {
		t.Errorf("stand_down = %v after the stand-down ended, want 0", got)
	}
	s.waitFor("the FailoverStandDownOver event", 20*time.Second, func(ctx context.Context) (bool, error) {
		return len(s.events(ctx, agentNS, "Lease", s.ctl.LeaderLease, ReasonStandDownOver)) == 1, nil
	})
	for _, n := range []*simNode{b, c} {
		if taint, _ := s.ourTaint(ctx, n.name); taint != nil {
			t.Errorf("returned node %s tainted: %v", n.name, taint)
		}
	}
}

// TestFailoverAPIServerOutage stops the real kube-apiserver for twice the
// fence window and starts it again, with a controller whose leader Lease
// outlasts the outage (so the same term sees before and after). A node
// whose kubelet crashed (NotReady, its agent alive) was held before the
// outage; its agent comes back a few seconds after the controller sees the
// API server again, so its heartbeat Lease reads unchanged right then. The
// controller could not see the outage's silence, so it must not count it:
// no taint, no pod deleted. (Without the restart of the silence clocks,
// the fresh reads at that moment confirm a silent heartbeat and it taints.)
func TestFailoverAPIServerOutage(t *testing.T) {
	h := startHarness(t, "--node-monitor-period=1s", "--node-monitor-grace-period=6s")
	s := h.scenario(t, "outage")
	victim := s.addNode("outage-a", true)
	s.addNode("outage-b", true)
	s.statefulSet("db", nil)
	ctx := h.ctx
	cfg := s.ctl
	cfg.LeaseDuration, cfg.RenewDeadline, cfg.RetryPeriod = 2*time.Minute, 100*time.Second, 2*time.Second
	_, reg, _ := s.controller(cfg, "outage-leader")
	s.waitFor("the controller to lead", 20*time.Second, func(context.Context) (bool, error) {
		return metric(t, reg, "mountmedic_failover_leader", nil) == 1, nil
	})

	victim.stopKubelet()
	s.waitFor("FailoverHeld naming the heartbeat", 30*time.Second, func(ctx context.Context) (bool, error) {
		for _, n := range s.events(ctx, "default", "Node", victim.name, ReasonFailoverHeld) {
			if strings.Contains(n, "heartbeat is silent only") {
				return true, nil
			}
		}
		return false, nil
	})

	outage := 2 * cfg.FenceWindow(0)
	h.c.StopAPIServer()
	// The victim's agent is cut off too, and stays so for a few seconds
	// after the API server returns (it is slower to reconnect).
	victim.proxy.Cut()
	time.Sleep(outage)
	if err := h.c.StartAPIServer(); err != nil {
		t.Fatalf("start kube-apiserver again: %v", err)
	}
	back := time.Now()
	s.waitFor("the controller's watches back", 60*time.Second, func(context.Context) (bool, error) {
		return metric(t, reg, "mountmedic_failover_watch_regained_total", nil) >= 1, nil
	})
	time.Sleep(3 * time.Second)
	victim.proxy.Restore()
	t.Logf("API server down %s; the controller saw it again %s after its return", outage, time.Since(back).Round(100*time.Millisecond))
	// A full window and more after the return: never a taint.
	time.Sleep(cfg.FenceWindow(0) + 3*time.Second)
	if got := metric(t, reg, "mountmedic_failover_leader", nil); got != 1 {
		t.Fatalf("the controller lost its leader Lease during the outage: the test did not see one term across it")
	}
	if taint, err := s.ourTaint(ctx, victim.name); err != nil || taint != nil {
		t.Errorf("node tainted after an API server outage: %v (err %v)", taint, err)
	}
	// The pod itself may be gone: the victim's agent fenced it during the
	// outage and deleted it when its heartbeat came back (the heartbeat's
	// behaviour, not the controller's). The controller deleted nothing.
	if got := metric(t, reg, "mountmedic_failover_pod_deletions_total", map[string]string{"result": resultSuccess}); got != 0 {
		t.Errorf("pod_deletions_total{result=success} = %v after an API server outage, want 0", got)
	}
	for _, r := range []string{resultSuccess, resultFailure} {
		if got := metric(t, reg, "mountmedic_failover_failovers_total", map[string]string{"result": r}); got != 0 {
			t.Errorf("failovers_total{result=%s} = %v, want 0", r, got)
		}
	}
	victim.revive(t)
}

// testRBAC: the controller works under its own ServiceAccount (every case
// runs it so); the agents' ServiceAccount keeps no grant that reaches other
// nodes, and the controller's cannot touch the agents' heartbeats.
func testRBAC(t *testing.T, h *harness) {
	ctx := h.ctx
	agent := h.saClient(t, "")
	patch := []byte(`{"metadata":{"labels":{"x":"y"}}}`)
	if _, err := agent.CoreV1().Nodes().Patch(ctx, "any", types.MergePatchType, patch, metav1.PatchOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("the agents' ServiceAccount patching a node: err = %v, want forbidden", err)
	}
	if err := agent.StorageV1().VolumeAttachments().Delete(ctx, "csi-any", metav1.DeleteOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("the agents' ServiceAccount deleting a VolumeAttachment: err = %v, want forbidden", err)
	}
	if _, err := agent.CoordinationV1().Leases(agentNS).Get(ctx, DefaultLeaderLease, metav1.GetOptions{}); err == nil {
		// Reading is allowed (its heartbeat Lease lives there); taking the
		// leader Lease is what matters: the agents no longer campaign.
		t.Logf("note: the agents' ServiceAccount can read Leases in %s", agentNS)
	}
	ctl, err := kubeclient.New(h.ctl)
	if err != nil {
		t.Fatal(err)
	}
	l, err := h.admin.CoordinationV1().Leases(agentNS).Create(ctx, &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{
		Name: "rbac-node", Labels: map[string]string{HeartbeatLabel: HeartbeatLabelValue}}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ctl.CoordinationV1().Leases(agentNS).Update(ctx, l, metav1.UpdateOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("the controller's ServiceAccount updating a heartbeat Lease: err = %v, want forbidden", err)
	}
	if _, err := ctl.CoreV1().Nodes().List(ctx, metav1.ListOptions{Limit: 1}); err != nil {
		t.Errorf("the controller's ServiceAccount listing nodes: %v", err)
	}
	if _, err := ctl.CoreV1().Secrets("default").Get(ctx, "any", metav1.GetOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("the controller's ServiceAccount reading a Secret: err = %v, want forbidden", err)
	}
}

// testLeaseOverThrottledWork: a leader whose work client is throttled
// hard (one request per 5 s: its informers' lists alone queue 15 s of
// requests) keeps its lease, renewed every second on a client of its own.
// Sharing one rate limiter, the renewals queued behind the work past
// RenewDeadline and the leader lost the lease; in the scale test after an
// API-server outage, a new term's burst of announcements and fresh reads
// did the same at the controller's rate.
func testLeaseOverThrottledWork(t *testing.T, h *harness) {
	s := h.scenario(t, "throttled")
	s.addNode("throttled-a", true)
	cfg := s.ctl
	_, reg, _ := s.controllerWith(cfg, "throttled-ctl", ctlOptions{qps: 0.2, burst: 1})
	s.waitFor("the controller to lead", 20*time.Second, func(context.Context) (bool, error) {
		return metric(t, reg, "mountmedic_failover_leader", nil) == 1, nil
	})
	watch := 3*cfg.RenewDeadline + cfg.LeaseDuration
	for end := time.Now().Add(watch); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		if metric(t, reg, "mountmedic_failover_leader", nil) != 1 {
			t.Fatalf("the leader lost its lease while its work client was throttled (renew deadline %s)", cfg.RenewDeadline)
		}
	}
	l, err := h.admin.CoordinationV1().Leases(agentNS).Get(h.ctx, cfg.LeaderLease, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if l.Spec.LeaseTransitions != nil && *l.Spec.LeaseTransitions != 0 {
		t.Errorf("leader Lease changed hands %d times, want 0", *l.Spec.LeaseTransitions)
	}
}
