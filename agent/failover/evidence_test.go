package failover

import (
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

func testNode(ready corev1.ConditionStatus, taints ...corev1.Taint) *corev1.Node {
	return &corev1.Node{
		ObjectMeta: metav1.ObjectMeta{Name: "node-1"},
		Spec:       corev1.NodeSpec{Taints: taints},
		Status: corev1.NodeStatus{Conditions: []corev1.NodeCondition{{
			Type: corev1.NodeReady, Status: ready, LastHeartbeatTime: metav1.NewTime(time.Unix(1000, 0)),
		}}},
	}
}

func testLease(holder string, renew time.Time, secs int32) *coordinationv1.Lease {
	l := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: "node-1"}}
	l.Spec.RenewTime = &metav1.MicroTime{Time: renew}
	if holder != "" {
		l.Spec.HolderIdentity = ptr.To(holder)
	}
	if secs > 0 {
		l.Spec.LeaseDurationSeconds = ptr.To(secs)
	}
	return l
}

// TestJudge drives the observer through time: the leases stop changing at
// t0 (the observer's first look), and the node is judged at t0+elapsed.
// The writer's clock (renewTime) is deliberately far off: only changes
// count.
func TestJudge(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	skewed := t0.Add(-17 * time.Minute) // the node's clock is way behind
	oos := corev1.Taint{Key: TaintOutOfService, Value: "nodeshutdown", Effect: corev1.TaintEffectNoExecute}
	ours := corev1.Taint{Key: TaintOutOfService, Value: TaintValue, Effect: corev1.TaintEffectNoExecute}
	shutdown := corev1.Taint{Key: TaintShutdown, Effect: corev1.TaintEffectNoSchedule}
	tests := map[string]struct {
		node      *corev1.Node
		kubelet   *coordinationv1.Lease
		heartbeat *coordinationv1.Lease
		elapsed   time.Duration
		// trustShutdown sets TrustShutdownTaint (off by default).
		trustShutdown bool
		want          verdict
		because       string
	}{
		"ready": {node: testNode(corev1.ConditionTrue), kubelet: testLease("node-1", skewed, 40),
			heartbeat: testLease("agent", skewed, 30), elapsed: time.Hour, want: verdictAlive},
		"not ready, kubelet fresh": {node: testNode(corev1.ConditionFalse), kubelet: testLease("node-1", skewed, 40),
			heartbeat: testLease("agent", skewed, 30), elapsed: 39 * time.Second, want: verdictSuspect, because: "it is running"},
		// kubelet posts NotReady (a network plugin down) but its Lease
		// is frozen in this view: a kubelet that reports is not dead.
		"not ready, kubelet reports, leases silent": {node: testNode(corev1.ConditionFalse), kubelet: testLease("node-1", skewed, 40),
			heartbeat: testLease("agent", skewed, 30), elapsed: time.Hour, want: verdictSuspect, because: "not Unknown"},
		"no Ready condition, leases silent": {node: &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1"}}, kubelet: testLease("node-1", skewed, 40),
			heartbeat: testLease("agent", skewed, 30), elapsed: time.Hour, want: verdictSuspect, because: "missing"},
		"partitioned, not fenced yet": {node: testNode(corev1.ConditionUnknown), kubelet: testLease("node-1", skewed, 40),
			heartbeat: testLease("agent", skewed, 30), elapsed: 44 * time.Second, want: verdictSuspect, because: "not fenced yet"},
		"dead": {node: testNode(corev1.ConditionUnknown), kubelet: testLease("node-1", skewed, 40),
			heartbeat: testLease("agent", skewed, 30), elapsed: 45 * time.Second, want: verdictDead, because: "has fenced itself"},
		"longer advertised fence": {node: testNode(corev1.ConditionUnknown), kubelet: testLease("node-1", skewed, 40),
			heartbeat: testLease("agent", skewed, 60), elapsed: 70 * time.Second, want: verdictSuspect, because: "fence window 1m15s"},
		"no kubelet lease, ready heartbeat silent": {node: testNode(corev1.ConditionUnknown),
			heartbeat: testLease("agent", skewed, 30), elapsed: 50 * time.Second, want: verdictDead},
		"no heartbeat": {node: testNode(corev1.ConditionUnknown), kubelet: testLease("node-1", skewed, 40),
			elapsed: time.Hour, want: verdictSuspect, because: "no mountmedic heartbeat"},
		"released heartbeat": {node: testNode(corev1.ConditionUnknown), kubelet: testLease("node-1", skewed, 40),
			heartbeat: testLease("", skewed, 30), elapsed: time.Hour, want: verdictSuspect, because: "released"},
		"cloud shutdown without heartbeat": {node: testNode(corev1.ConditionUnknown, shutdown), kubelet: testLease("node-1", skewed, 40),
			trustShutdown: true, elapsed: 41 * time.Second, want: verdictDead, because: "shut down"},
		"cloud shutdown, not trusted (default)": {node: testNode(corev1.ConditionUnknown, shutdown), kubelet: testLease("node-1", skewed, 40),
			elapsed: time.Hour, want: verdictSuspect, because: "no mountmedic heartbeat"},
		"cloud shutdown, kubelet fresh": {node: testNode(corev1.ConditionUnknown, shutdown), kubelet: testLease("node-1", skewed, 40),
			trustShutdown: true, elapsed: 10 * time.Second, want: verdictSuspect},
		"operator taint": {node: testNode(corev1.ConditionUnknown, oos), kubelet: testLease("node-1", skewed, 40),
			heartbeat: testLease("agent", skewed, 30), elapsed: time.Hour, want: verdictOperator},
		"our taint, dead": {node: testNode(corev1.ConditionUnknown, ours), kubelet: testLease("node-1", skewed, 40),
			heartbeat: testLease("agent", skewed, 30), elapsed: time.Hour, want: verdictDead},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			c := validControllerConfig()
			c.TrustShutdownTaint = tc.trustShutdown
			o := newObserver()
			c.gather(o, tc.node, tc.kubelet, tc.heartbeat, t0)
			ev := c.gather(o, tc.node, tc.kubelet, tc.heartbeat, t0.Add(tc.elapsed))
			j := c.judge(ev)
			if j.verdict != tc.want {
				t.Fatalf("judge(%s) = %s (%s), want %s", ev, j.verdict, j.why, tc.want)
			}
			if !strings.Contains(j.why, tc.because) {
				t.Errorf("judge reason = %q, want it to say %q", j.why, tc.because)
			}
		})
	}
}

// TestObserverChange: a renewal seen late resets the silence, whatever
// time the writer put in it.
func TestObserverChange(t *testing.T) {
	c := validControllerConfig()
	o := newObserver()
	t0 := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	node := testNode(corev1.ConditionUnknown)
	kl := testLease("node-1", t0, 40)
	hb := testLease("agent", t0, 30)
	c.gather(o, node, kl, hb, t0)
	// 44 s later the agent renews, with a clock 1 h in the past.
	hb2 := testLease("agent", t0.Add(-time.Hour), 30)
	ev := c.gather(o, node, kl, hb2, t0.Add(44*time.Second))
	if ev.HeartbeatSilent != 0 {
		t.Fatalf("heartbeat silent %s right after a change, want 0", ev.HeartbeatSilent)
	}
	ev = c.gather(o, node, kl, hb2, t0.Add(88*time.Second))
	if j := c.judge(ev); j.verdict != verdictSuspect {
		t.Errorf("44 s after a renewal: judge = %s (%s), want suspect", j.verdict, j.why)
	}
	ev = c.gather(o, node, kl, hb2, t0.Add(89*time.Second))
	if j := c.judge(ev); j.verdict != verdictDead {
		t.Errorf("45 s after a renewal: judge = %s (%s), want dead", j.verdict, j.why)
	}
	// A new holder is a change too.
	hb3 := testLease("agent-2", t0.Add(-time.Hour), 30)
	if ev := c.gather(o, node, kl, hb3, t0.Add(100*time.Second)); ev.HeartbeatSilent != 0 {
		t.Errorf("heartbeat silent %s after a new holder, want 0", ev.HeartbeatSilent)
	}
	// A node that leaves leaves nothing behind.
	o.forgetNode(node.Name)
	if len(o.seen) != 0 {
		t.Errorf("signals kept after forgetNode(%s): %v", node.Name, o.seen)
	}
}

// TestObserverRestartAll: after a time the controller could not watch, the
// silence it had counted before no longer counts; a node must stay silent a
// full window from the moment sight returned.
func TestObserverRestartAll(t *testing.T) {
	c := validControllerConfig()
	o := newObserver()
	t0 := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	node := testNode(corev1.ConditionUnknown)
	kl := testLease("node-1", t0, 40)
	hb := testLease("agent", t0, 30)
	c.gather(o, node, kl, hb, t0)
	// The watches were blind from t0+10s to t0+90s; the objects look the
	// same when sight returns.
	back := t0.Add(90 * time.Second)
	if j := c.judge(c.gather(o, node, kl, hb, back)); j.verdict != verdictDead {
		t.Fatalf("without the restart: judge = %s (%s), want dead (what the restart prevents)", j.verdict, j.why)
	}
	o.restartAll(back)
	for _, tc := range []struct {
		after time.Duration
		want  verdict
	}{{0, verdictSuspect}, {44 * time.Second, verdictSuspect}, {45 * time.Second, verdictDead}} {
		ev := c.gather(o, node, kl, hb, back.Add(tc.after))
		if j := c.judge(ev); j.verdict != tc.want {
			t.Errorf("%s after sight returned: judge = %s (%s), want %s", tc.after, j.verdict, j.why, tc.want)
		}
	}
}
