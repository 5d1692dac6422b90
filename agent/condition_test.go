package agent

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/scripts/kubetest"
)

// report builds a probe report with mounts of driver in the given states.
func conditionReport(mounts ...struct {
	driver string
	state  probe.State
}) *probe.Report {
	rep := &probe.Report{}
	for _, m := range mounts {
		rep.Mounts = append(rep.Mounts, probe.Result{Mount: &probe.Mount{Driver: m.driver}, State: m.state})
	}
	return rep
}

type ds = struct {
	driver string
	state  probe.State
}

func TestConditionOf(t *testing.T) {
	tests := map[string]struct {
		rep  *probe.Report
		want conditionState
	}{
		"no mounts": {conditionReport(), conditionState{corev1.ConditionFalse, ReasonMountsHealthy, "0 pod volume mounts healthy"}},
		"healthy": {conditionReport(ds{"s3", probe.Healthy}, ds{"s3", probe.Healthy}),
			conditionState{corev1.ConditionFalse, ReasonMountsHealthy, "2 pod volume mounts healthy"}},
		"broken by driver and state": {conditionReport(ds{"s3", probe.Healthy}, ds{"s3", probe.Hung}, ds{"s3", probe.Disconnected},
			ds{"s3", probe.Disconnected}, ds{"rbd", probe.IOError}),
			conditionState{corev1.ConditionTrue, ReasonMountsBroken, "4 of 5 pod volume mounts broken: rbd IOError 1, s3 Disconnected 2, s3 Hung 1"}},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			if got := conditionOf(tt.rep); got != tt.want {
				t.Errorf("conditionOf = %+v, want %+v", got, tt.want)
			}
		})
	}
	// Many drivers: the message stays bounded.
	var many []ds
	for i := range 500 {
		many = append(many, ds{strings.Repeat("d", 40) + string(rune('a'+i%26)) + string(rune('a'+i/26)), probe.Disconnected})
	}
	if got := conditionOf(conditionReport(many...)); len(got.message) > maxConditionMessage || !strings.HasSuffix(got.message, ", ...") {
		t.Errorf("message of 500 drivers: %d bytes, ends %q; want at most %d, ending with ', ...'", len(got.message), got.message[len(got.message)-10:], maxConditionMessage)
	}
}

// TestNodeConditionOnRealAPIServer writes the condition as the shipped agent
// does, with its node's own identity (Node authorizer + NodeRestriction):
// its own Node's condition is set, changed and kept beside kubelet's, its
// transition time survives a restart, and another node's is refused.
func TestNodeConditionOnRealAPIServer(t *testing.T) {
	c := kubetest.Start(t, kubetest.Options{})
	ctx := context.Background()
	for _, name := range []string{"cond-a", "cond-b"} {
		n, err := c.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		now := metav1.Now()
		n.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady", LastHeartbeatTime: now, LastTransitionTime: now}}
		if _, err := c.Client.CoreV1().Nodes().UpdateStatus(ctx, n, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	nodeClient := func(node string) kubernetes.Interface {
		cs, err := kubernetes.NewForConfig(c.ImpersonateConfig("system:node:"+node, "system:nodes", "system:authenticated"))
		if err != nil {
			t.Fatal(err)
		}
		return cs
	}
	condition := func(node string) *corev1.NodeCondition {
		t.Helper()
		n, err := c.Client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		var ready bool
		var found *corev1.NodeCondition
		for i, cond := range n.Status.Conditions {
			switch cond.Type {
			case corev1.NodeReady:
				ready = cond.Status == corev1.ConditionTrue
			case ConditionType:
				found = &n.Status.Conditions[i]
			}
		}
		if !ready {
			t.Errorf("node %s lost kubelet's Ready condition: %v", node, n.Status.Conditions)
		}
		return found
	}

	clock := time.Now()
	w := newConditionWriter(nodeClient("cond-a"), "cond-a", 10*time.Second, prometheus.NewRegistry())
	w.now = func() time.Time { return clock }
	healthy := conditionOf(conditionReport(ds{"s3", probe.Healthy}))
	if err := w.write(ctx, healthy, clock); err != nil {
		t.Fatalf("write own node's condition with the node identity: %v", err)
	}
	got := condition("cond-a")
	if got == nil || got.Status != corev1.ConditionFalse || got.Reason != ReasonMountsHealthy {
		t.Fatalf("condition after a healthy cycle = %+v", got)
	}
	firstTransition := got.LastTransitionTime

	clock = clock.Add(time.Minute)
	broken := conditionOf(conditionReport(ds{"s3", probe.Disconnected}))
	if err := w.write(ctx, broken, clock); err != nil {
		t.Fatal(err)
	}
	got = condition("cond-a")
	if got.Status != corev1.ConditionTrue || got.Reason != ReasonMountsBroken || got.Message != "1 of 1 pod volume mounts broken: s3 Disconnected 1" {
		t.Errorf("condition after a broken cycle = %+v", got)
	}
	if !got.LastTransitionTime.After(firstTransition.Time) {
		t.Errorf("transition time %s not moved by the change from %s", got.LastTransitionTime, firstTransition)
	}
	brokenSince := got.LastTransitionTime

	// An agent restart with the same status keeps the transition time.
	clock = clock.Add(time.Minute)
	w2 := newConditionWriter(nodeClient("cond-a"), "cond-a", 10*time.Second, prometheus.NewRegistry())
	if err := w2.write(ctx, broken, clock); err != nil {
		t.Fatal(err)
	}
	if got = condition("cond-a"); !got.LastTransitionTime.Equal(&brokenSince) || !got.LastHeartbeatTime.After(brokenSince.Time) {
		t.Errorf("after a restart: transition %s (want %s kept), heartbeat %s (want later)", got.LastTransitionTime, brokenSince, got.LastHeartbeatTime)
	}

	// Node A's identity cannot write node B's condition.
	hostile := newConditionWriter(nodeClient("cond-a"), "cond-b", 10*time.Second, prometheus.NewRegistry())
	hostile.written = &healthy // skip the GET: go straight to the write
	err := hostile.write(ctx, broken, clock)
	if err == nil || !apierrors.IsForbidden(err) {
		t.Errorf("node cond-a writing cond-b's condition: err = %v, want forbidden", err)
	}
	if got := condition("cond-b"); got != nil {
		t.Errorf("cond-b has a condition written by cond-a's identity: %+v", got)
	}
}

// TestConditionWriterCoalesces drives run: a flapping state is written at
// most once per minGap, an unchanged one again only after the heartbeat.
func TestConditionWriterCoalesces(t *testing.T) {
	c := kubetest.Start(t, kubetest.Options{})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	if _, err := c.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "cond-c"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	cs, err := kubernetes.NewForConfig(c.ImpersonateConfig("system:node:cond-c", "system:nodes", "system:authenticated"))
	if err != nil {
		t.Fatal(err)
	}
	reg := prometheus.NewRegistry()
	w := newConditionWriter(cs, "cond-c", 10*time.Second, reg)
	w.minGap = time.Hour // only the first write can happen within the test
	done := make(chan struct{})
	go func() { defer close(done); w.run(ctx) }()
	for i := range 50 {
		st := probe.Healthy
		if i%2 == 1 {
			st = probe.Disconnected
		}
		w.observe(conditionReport(ds{"s3", st}))
	}
	deadline := time.Now().Add(30 * time.Second)
	for counterValue(t, w.writes.WithLabelValues(resultSuccess)) < 1 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(500 * time.Millisecond) // room for a wrong second write
	cancel()
	<-done
	if got := counterValue(t, w.writes.WithLabelValues(resultSuccess)); got != 1 {
		t.Errorf("writes after 50 flapping cycles within minGap = %v, want 1", got)
	}
}

func counterValue(t *testing.T, c prometheus.Counter) float64 {
	t.Helper()
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		t.Fatal(err)
	}
	return m.GetCounter().GetValue()
}

// The message conditionOf writes reads back to its counts.
func TestParseConditionMessage(t *testing.T) {
	for name, rep := range map[string]*probe.Report{
		"healthy": conditionReport(ds{"s3", probe.Healthy}),
		"none":    conditionReport(),
		"broken":  conditionReport(ds{"s3", probe.Healthy}, ds{"s3", probe.Hung}, ds{"rbd", probe.IOError}, ds{"rbd", probe.IOError}),
	} {
		t.Run(name, func(t *testing.T) {
			st := conditionOf(rep)
			got, err := ParseConditionMessage(st.message)
			if err != nil {
				t.Fatalf("ParseConditionMessage(%q): %v", st.message, err)
			}
			broken, n := 0, 0
			for _, c := range got.Counts {
				n += c.Count
			}
			for _, r := range rep.Mounts {
				if r.State.Broken() {
					broken++
				}
			}
			if got.Total != len(rep.Mounts) || got.Broken != broken || n != broken {
				t.Errorf("ParseConditionMessage(%q) = %+v, want total %d, broken %d", st.message, got, len(rep.Mounts), broken)
			}
		})
	}
	for _, bad := range []string{"", "kubelet is posting ready status", "2 of 3 pod volume mounts broken: s3 Hung"} {
		if _, err := ParseConditionMessage(bad); err == nil {
			t.Errorf("ParseConditionMessage(%q): no error", bad)
		}
	}
}

// TestConditionWriterBacksOff: a Node that is missing (or a write refused)
// costs a few requests with backoff, not one per probe cycle.
func TestConditionWriterBacksOff(t *testing.T) {
	c := kubetest.Start(t, kubetest.Options{})
	cs, err := kubernetes.NewForConfig(c.ImpersonateConfig("system:node:cond-gone", "system:nodes", "system:authenticated"))
	if err != nil {
		t.Fatal(err)
	}
	w := newConditionWriter(cs, "cond-gone", 10*time.Second, prometheus.NewRegistry())
	w.minGap = 50 * time.Millisecond
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); w.run(ctx) }()
	for range 60 { // a probe cycle every 20 ms for 1.2 s
		w.observe(conditionReport(ds{"s3", probe.Healthy}))
		time.Sleep(20 * time.Millisecond)
	}
	cancel()
	<-done
	// Backoff 50, 100, 200, 400, 800 ms: at most 6 tries in 1.2 s.
	if got := counterValue(t, w.writes.WithLabelValues(resultFailure)); got < 1 || got > 6 {
		t.Errorf("failed writes over 60 cycles with the Node missing = %v, want 1 to 6 (backing off)", got)
	}
}
