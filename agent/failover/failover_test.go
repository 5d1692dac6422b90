package failover

import (
	"context"
	"net/url"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/util/retry"

	"github.com/mountmedic/mountmedic/scripts/lab"
)

func TestMain(m *testing.M) { lab.Main(m) }

// TestFailover runs every case against one real control plane (etcd,
// kube-apiserver, kube-controller-manager with a 6 s node monitor grace
// period), under deploy/rbac.yaml's ServiceAccount. Each case has its own
// zone, nodes, namespace and controllers (NodeSelector on its case label),
// so the cases run in parallel.
func TestFailover(t *testing.T) {
	h := startHarness(t,
		"--node-monitor-period=1s", "--node-monitor-grace-period=6s",
		// Force-delete mode: the attach/detach controller notices a
		// deleted VolumeAttachment at its state sync.
		"--attach-detach-reconcile-sync-period=5s")
	t.Run("cases", func(t *testing.T) {
		t.Run("node dies, taint, node returns", func(t *testing.T) { t.Parallel(); testNodeDiesTaint(t, h) })
		t.Run("node dies, force-delete mode", func(t *testing.T) { t.Parallel(); testForceDelete(t, h) })
		t.Run("heartbeat alive", func(t *testing.T) { t.Parallel(); testHeartbeatAlive(t, h) })
		t.Run("partitioned node fences first", func(t *testing.T) { t.Parallel(); testPartitioned(t, h) })
		t.Run("fence lifted before the window", func(t *testing.T) { t.Parallel(); testFenceLifted(t, h) })
		t.Run("fence before the first renewal", func(t *testing.T) { t.Parallel(); testFenceWithoutPlan(t, h) })
		t.Run("two nodes die, cap 1", func(t *testing.T) { t.Parallel(); testCap(t, h) })
		t.Run("leader changes mid-failover", func(t *testing.T) { t.Parallel(); testLeaderChange(t, h) })
		t.Run("dry run and operator taint", func(t *testing.T) { t.Parallel(); testDryRunAndOperator(t, h) })
		t.Run("cached dead, fresh alive", func(t *testing.T) { t.Parallel(); testFreshRead(t, h) })
		t.Run("three of four die: stand-down", func(t *testing.T) { t.Parallel(); testStandDown(t, h) })
		t.Run("RBAC of agents and controller", func(t *testing.T) { t.Parallel(); testRBAC(t, h) })
		t.Run("leader keeps its lease over throttled work", func(t *testing.T) { t.Parallel(); testLeaseOverThrottledWork(t, h) })
	})
}

// podOf returns the StatefulSet's pod name-0, or nil.
func (s *scenario) podOf(ctx context.Context, sts string) *corev1.Pod {
	p, err := s.h.admin.CoreV1().Pods(s.ns).Get(ctx, sts+"-0", metav1.GetOptions{})
	if err != nil {
		return nil
	}
	return p
}

// waitReplacedOn waits until the StatefulSet's pod is a new one (not
// oldUID) bound to node and its volume is attached there, and returns when
// the test's attacher attached it.
func (s *scenario) waitReplacedOn(sts string, oldUID types.UID, pv *corev1.PersistentVolume, node string, timeout time.Duration) time.Time {
	s.t.Helper()
	var at time.Time
	s.waitFor("replacement of "+sts+" attached on "+node, timeout, func(ctx context.Context) (bool, error) {
		p := s.podOf(ctx, sts)
		if p == nil || p.UID == oldUID || p.Spec.NodeName != node {
			return false, nil
		}
		va := s.attachment(ctx, pv.Name, node)
		if va == nil || !va.Status.Attached {
			return false, nil
		}
		var ok bool
		at, ok = s.h.attachedAt(va.Name)
		return ok, nil
	})
	return at
}

func testNodeDiesTaint(t *testing.T, h *harness) {
	s := h.scenario(t, "taint")
	victim := s.addNode("taint-a", true)
	target := s.addNode("taint-b", true)
	pv := s.statefulSet("db", nil)
	ctx := h.ctx
	old := s.podOf(ctx, "db")
	// An unrelated taint on the victim must survive the whole story.
	s.addTaint(victim.name, corev1.Taint{Key: "example.com/maintenance", Effect: corev1.TaintEffectNoSchedule})
	_, reg, _ := s.controller(s.ctl, "taint-leader")

	died := time.Now()
	victim.kill()
	attached := s.waitReplacedOn("db", old.UID, pv, target.name, 90*time.Second)
	t.Logf("node death -> replacement's volume attached on %s: %s", target.name, attached.Sub(died).Round(100*time.Millisecond))

	taint, err := s.ourTaint(ctx, victim.name)
	if err != nil || taint == nil || taint.Effect != corev1.TaintEffectNoExecute {
		t.Fatalf("taint on dead node = %v (err %v), want %s=%s:NoExecute", taint, err, TaintOutOfService, TaintValue)
	}
	if got := metric(t, reg, "mountmedic_failover_failovers_total", map[string]string{"result": resultSuccess}); got != 1 {
		t.Errorf("failovers_total{result=success} = %v, want 1", got)
	}
	if got := metric(t, reg, "mountmedic_failover_death_to_action_seconds", nil); got != 1 {
		t.Errorf("death_to_action_seconds count = %v, want 1", got)
	}
	if got := seriesOf(t, reg, "mountmedic_failover_last_failover_timestamp_seconds"); len(got) != 1 || !got[victim.name] {
		t.Errorf("last_failover_timestamp_seconds names nodes %v, want only the dead %s", got, victim.name)
	}
	s.waitFor("FailedOver events on the node and the pod", 20*time.Second, func(ctx context.Context) (bool, error) {
		return len(s.events(ctx, "default", "Node", victim.name, ReasonFailedOver)) == 1 &&
			len(s.events(ctx, s.ns, "Pod", "db-0", ReasonFailedOver)) >= 1, nil
	})
	if notes := s.events(ctx, "default", "Node", victim.name, ReasonFailedOver); !strings.Contains(notes[0], "case-taint/db-0") ||
		!strings.Contains(notes[0], "heartbeat") {
		t.Errorf("node event note = %q, want the pod and the evidence", notes[0])
	}

	// The node returns: the taint mountmedic applied goes, nothing else.
	victim.revive(t)
	s.waitFor("out-of-service taint removed", 30*time.Second, func(ctx context.Context) (bool, error) {
		taint, err := s.ourTaint(ctx, victim.name)
		return taint == nil, err
	})
	n, err := h.admin.CoreV1().Nodes().Get(ctx, victim.name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == "example.com/maintenance" }) {
		t.Errorf("taints after recovery = %v, want example.com/maintenance kept", n.Spec.Taints)
	}
	if got := metric(t, reg, "mountmedic_failover_nodes_recovered_total", nil); got != 1 {
		t.Errorf("nodes_recovered_total = %v, want 1", got)
	}
}

func testForceDelete(t *testing.T, h *harness) {
	s := h.scenario(t, "force")
	s.ctl.Mode = ModeForceDelete
	s.ctl.ForceDetach = true
	cfg := s.ctl
	victim := s.addNode("force-a", true)
	target := s.addNode("force-b", true)
	pv := s.statefulSet("db", nil)
	ctx := h.ctx
	old := s.podOf(ctx, "db")
	oldVA := s.attachment(ctx, pv.Name, victim.name)
	_, reg, _ := s.controller(cfg, "force-leader")

	victim.kill()
	s.waitReplacedOn("db", old.UID, pv, target.name, 90*time.Second)
	n, err := h.admin.CoreV1().Nodes().Get(ctx, victim.name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := n.Annotations[FailedOverAnnotation]; !ok {
		t.Errorf("force-delete mode left no %s annotation on the node", FailedOverAnnotation)
	}
	if taint, _ := s.ourTaint(ctx, victim.name); taint != nil {
		t.Errorf("force-delete mode tainted the node: %v", taint)
	}
	if _, err := h.admin.StorageV1().VolumeAttachments().Get(ctx, oldVA.Name, metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Errorf("VolumeAttachment on the dead node: err = %v, want it deleted", err)
	}
	if got := metric(t, reg, "mountmedic_failover_pod_deletions_total", map[string]string{"result": resultSuccess}); got != 1 {
		t.Errorf("pod_deletions_total{result=success} = %v, want 1", got)
	}
	victim.revive(t)
	s.waitFor("failed-over annotation removed", 30*time.Second, func(ctx context.Context) (bool, error) {
		n, err := h.admin.CoreV1().Nodes().Get(ctx, victim.name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		_, ok := n.Annotations[FailedOverAnnotation]
		return !ok, nil
	})
}

func testHeartbeatAlive(t *testing.T, h *harness) {
	s := h.scenario(t, "alive")
	victim := s.addNode("alive-a", true)
	s.addNode("alive-b", true)
	s.statefulSet("db", nil)
	ctx := h.ctx
	old := s.podOf(ctx, "db")
	_, reg, _ := s.controller(s.ctl, "alive-leader")

	// Only kubelet stops (a kubelet crash, a node that is up and writing):
	// the agent keeps renewing its heartbeat.
	victim.stopKubelet()
	s.waitFor("node NotReady", 30*time.Second, func(ctx context.Context) (bool, error) {
		n, err := h.admin.CoreV1().Nodes().Get(ctx, victim.name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		for _, c := range n.Status.Conditions {
			if c.Type == corev1.NodeReady {
				return c.Status != corev1.ConditionTrue, nil
			}
		}
		return false, nil
	})
	notReady := time.Now()
	// The event that says why the node is not failed over, once kubelet
	// is silent past its grace: "heartbeat silent only ...".
	s.waitFor("FailoverHeld naming the heartbeat", 30*time.Second, func(ctx context.Context) (bool, error) {
		for _, n := range s.events(ctx, "default", "Node", victim.name, ReasonFailoverHeld) {
			if strings.Contains(n, "heartbeat is silent only") {
				return true, nil
			}
		}
		return false, nil
	})
	// Well past the fence window and kubelet grace: still nothing.
	deadline := notReady.Add(s.ctl.FenceWindow(0) + s.ctl.KubeletGrace + 3*time.Second)
	time.Sleep(time.Until(deadline))
	if taint, err := s.ourTaint(ctx, victim.name); err != nil || taint != nil {
		t.Errorf("node with a live heartbeat tainted: %v (err %v)", taint, err)
	}
	if p := s.podOf(ctx, "db"); p == nil || p.UID != old.UID || p.DeletionTimestamp != nil {
		t.Errorf("pod of a node with a live heartbeat changed: %v", p)
	}
	if got := metric(t, reg, "mountmedic_failover_failovers_total", map[string]string{"result": resultSuccess}); got != 0 {
		t.Errorf("failovers_total{result=success} = %v, want 0", got)
	}
	if got := victim.fence.stoppedPods(); len(got) != 0 {
		t.Errorf("agent with a live heartbeat fenced %v", got)
	}

	// A clean agent stop releases its heartbeat (no fence promise left).
	victim.stopAgent()
	l, err := h.admin.CoordinationV1().Leases(agentNS).Get(ctx, victim.name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if l.Spec.HolderIdentity != nil && *l.Spec.HolderIdentity != "" {
		t.Errorf("heartbeat lease holder after a clean stop = %q, want released", *l.Spec.HolderIdentity)
	}
	victim.revive(t)
}

// testPartitioned: a node cut off from the API server fences its planned
// pod, and only that pod moves. The node also runs a bare pod with an RWO
// claim (never failed over, never fenced) and a StatefulSet pod opted out
// that is made eligible after the cut (not in the plan the node
// published, so not fenced): the out-of-service taint would evict and
// force-detach both while they run, so the node is not tainted; the
// controller force-deletes the fenced pod alone and the other two stay,
// reported.
func testPartitioned(t *testing.T, h *harness) {
	s := h.scenario(t, "partition")
	s.ctl.ForceDetach = true
	victim := s.addNode("partition-a", true)
	target := s.addNode("partition-b", true)
	pv := s.statefulSet("db", nil)
	latePV := s.statefulSet("late", map[string]string{Annotation: "false"})
	ctx := h.ctx
	old := s.podOf(ctx, "db")
	late := s.podOf(ctx, "late")
	bare := s.barePod("bare", victim.name)
	s.waitPublished(victim.name, old.UID)
	if l, err := h.admin.CoordinationV1().Leases(agentNS).Get(ctx, victim.name, metav1.GetOptions{}); err != nil || planOf(l).has(string(late.UID)) || planOf(l).has(string(bare.UID)) {
		t.Fatalf("published plan %v (err %v) holds the opted-out or the bare pod", l.Annotations[FencePlanAnnotation], err)
	}
	_, reg, _ := s.controller(s.ctl, "partition-leader")

	cut := time.Now()
	victim.partition()
	// The pod is made eligible after the cut: the node cannot know.
	if _, err := h.admin.CoreV1().Pods(s.ns).Patch(ctx, late.Name, types.MergePatchType,
		[]byte(`{"metadata":{"annotations":{"`+Annotation+`":"true"}}}`), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	s.waitReplacedOn("db", old.UID, pv, target.name, 90*time.Second)
	fencedAt, ok := victim.fence.stoppedAt(string(old.UID))
	if !ok {
		t.Fatalf("partitioned agent did not fence the StatefulSet pod; fenced %v", victim.fence.stoppedPods())
	}
	for _, p := range []*corev1.Pod{bare, late} {
		if _, ok := victim.fence.stoppedAt(string(p.UID)); ok {
			t.Errorf("fence stopped %s, which was not in the plan", p.Name)
		}
	}
	if taint, err := s.ourTaint(ctx, victim.name); err != nil || taint != nil {
		t.Errorf("node with unfenced RWO pods tainted: %v (err %v); the taint evicts them", taint, err)
	}
	n, err := h.admin.CoreV1().Nodes().Get(ctx, victim.name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	markedAt, err := time.Parse(time.RFC3339, n.Annotations[FailedOverAnnotation])
	if err != nil {
		t.Fatalf("partitioned node's %s annotation = %q: %v", FailedOverAnnotation, n.Annotations[FailedOverAnnotation], err)
	}
	// Safety, not speed: the cluster acted only after the node fenced,
	// and not before the fence window had passed since the node's last
	// renewal (less the second the mark is truncated to).
	if !markedAt.Add(time.Second).After(fencedAt) {
		t.Errorf("failed over at %s, before the node fenced at %s", markedAt.Format(time.RFC3339Nano), fencedAt.Format(time.RFC3339Nano))
	}
	lease, err := h.admin.CoordinationV1().Leases(agentNS).Get(ctx, victim.name, metav1.GetOptions{})
	if err != nil || lease.Spec.RenewTime == nil {
		t.Fatalf("heartbeat lease of the partitioned node: %v %v", lease, err)
	}
	if min, since := s.ctl.FenceWindow(0)-time.Second, markedAt.Sub(lease.Spec.RenewTime.Time); since < min {
		t.Errorf("failed over %s after the last renewal (%s after the cut), want at least %s", since, markedAt.Sub(cut), min)
	}
	// Writers on the fenced side after the fail-over: the moved pod was
	// stopped; the two that stay kept their pods and their volumes on the
	// partitioned node (no replacement, no detach).
	for _, p := range []*corev1.Pod{bare, late} {
		got, err := h.admin.CoreV1().Pods(s.ns).Get(ctx, p.Name, metav1.GetOptions{})
		if err != nil || got.UID != p.UID || got.DeletionTimestamp != nil {
			t.Errorf("pod %s on the partitioned node: %v (err %v), want it untouched", p.Name, got, err)
		}
	}
	if va := s.attachment(ctx, latePV.Name, victim.name); va == nil || va.DeletionTimestamp != nil {
		t.Errorf("VolumeAttachment of the unfenced pod %s on the partitioned node: %v, want it kept", late.Name, va)
	}
	s.waitFor("FailoverLeft events on the pods that stay", 20*time.Second, func(ctx context.Context) (bool, error) {
		return len(s.events(ctx, s.ns, "Pod", bare.Name, ReasonFailoverLeft)) == 1 && len(s.events(ctx, s.ns, "Pod", late.Name, ReasonFailoverLeft)) == 1, nil
	})
	if got := metric(t, reg, "mountmedic_failover_pods_left_total", map[string]string{"reason": leftNotPlanned}); got != 1 {
		t.Errorf("pods_left_total{reason=not_planned} = %v, want 1", got)
	}
	if got := metric(t, reg, "mountmedic_failover_pods_left_total", map[string]string{"reason": leftNotEligible}); got != 1 {
		t.Errorf("pods_left_total{reason=not_eligible} = %v, want 1", got)
	}
	if !victim.hb.Fenced(string(old.UID)) {
		t.Errorf("Fenced(%s) = false during the fence", old.UID)
	}
	// The node returns: its agent lifts the fence; the fenced pod is gone
	// (failed over), so it deletes nothing.
	victim.revive(t)
	s.waitFor("fence lifted", 20*time.Second, func(context.Context) (bool, error) {
		return !victim.hb.Fenced(string(old.UID)), nil
	})
	if p := s.podOf(ctx, "db"); p == nil || p.Spec.NodeName != target.name {
		t.Errorf("replacement pod after the node returned = %v, want it left on %s", p, target.name)
	}
	s.waitFor("failed-over annotation removed", 30*time.Second, func(ctx context.Context) (bool, error) {
		n, err := h.admin.CoreV1().Nodes().Get(ctx, victim.name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		_, ok := n.Annotations[FailedOverAnnotation]
		return !ok, nil
	})
}

// barePod creates a pod no controller owns, with its own RWO claim bound
// to a static PV, on node.
func (s *scenario) barePod(name, node string) *corev1.Pod {
	t, h := s.t, s.h
	t.Helper()
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: s.ns, Name: name},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			StorageClassName: new(string),
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
		},
	}
	if _, err := h.admin.CoreV1().PersistentVolumeClaims(s.ns).Create(h.ctx, pvc, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create claim: %v", err)
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: s.ns, Name: name},
		Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "c", Image: "busybox"}},
			Volumes: []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{
				PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: name}}}}},
	}
	pod, err := h.admin.CoreV1().Pods(s.ns).Create(h.ctx, pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create bare pod: %v", err)
	}
	return pod
}

func testFenceLifted(t *testing.T, h *harness) {
	s := h.scenario(t, "lifted")
	victim := s.addNode("lifted-a", true)
	s.addNode("lifted-b", true)
	s.statefulSet("db", nil)
	ctx := h.ctx
	old := s.podOf(ctx, "db")
	s.waitFor("agent plan to include the pod", 20*time.Second, func(context.Context) (bool, error) {
		victim.hb.mu.Lock()
		defer victim.hb.mu.Unlock()
		return slices.ContainsFunc(victim.hb.plan, func(ft fenceTarget) bool { return ft.UID == string(old.UID) }), nil
	})
	_, reg, _ := s.controller(s.ctl, "lifted-leader")

	// A partition longer than FenceAfter but shorter than the fence
	// window: the node fences, the cluster must not fail it over.
	victim.partition()
	s.waitFor("the node to fence", 20*time.Second, func(context.Context) (bool, error) {
		_, ok := victim.fence.stoppedAt(string(old.UID))
		return ok, nil
	})
	victim.revive(t)
	// Lifting the fence deletes the fenced pod, which must not resume on
	// its unmounted volume; its StatefulSet recreates it.
	s.waitFor("fenced pod recreated", 30*time.Second, func(ctx context.Context) (bool, error) {
		p := s.podOf(ctx, "db")
		return p != nil && p.UID != old.UID, nil
	})
	if victim.hb.Fenced(string(old.UID)) {
		t.Errorf("Fenced(%s) = true after the heartbeat came back", old.UID)
	}
	// Give the controller the rest of a window: it never acts.
	time.Sleep(s.ctl.FenceWindow(0))
	if taint, err := s.ourTaint(ctx, victim.name); err != nil || taint != nil {
		t.Errorf("node whose partition ended inside the window tainted: %v (err %v)", taint, err)
	}
	if got := metric(t, reg, "mountmedic_failover_failovers_total", map[string]string{"result": resultSuccess}); got != 0 {
		t.Errorf("failovers_total{result=success} = %v, want 0", got)
	}
}

// testFenceWithoutPlan starts an agent that never reaches the API server:
// it cannot know which pods the controller would fail over, so it fences
// every pod with a CSI mount, a bare pod too. When the API server answers,
// lifting the fence deletes the StatefulSet's pod for its controller to
// recreate, never the bare pod, which no controller would bring back.
func testFenceWithoutPlan(t *testing.T, h *harness) {
	s := h.scenario(t, "noplan")
	victim := s.addNode("noplan-a", false)
	s.statefulSet("db", nil)
	ctx := h.ctx
	old := s.podOf(ctx, "db")
	bare := s.barePod("bare", victim.name)

	u, err := url.Parse(h.sa.Host)
	if err != nil {
		t.Fatal(err)
	}
	victim.proxy = lab.StartTCPProxy(t, u.Host)
	// The bare pod first: unfence handles the targets in order, so once the
	// StatefulSet's pod is replaced the bare pod's fate is settled.
	victim.fence = &recordingFence{mounted: []string{string(bare.UID), string(old.UID)}}
	victim.proxy.Cut()
	victim.startAgent(t, s.cfg)
	t.Cleanup(victim.stopAgent) // before the proxy closes
	s.waitFor("the agent to fence both pods", 20*time.Second, func(context.Context) (bool, error) {
		_, okBare := victim.fence.stoppedAt(string(bare.UID))
		_, okOld := victim.fence.stoppedAt(string(old.UID))
		return okBare && okOld, nil
	})
	if !victim.hb.Fenced(string(bare.UID)) {
		t.Errorf("Fenced(%s) = false for the bare pod during the fence", bare.UID)
	}

	victim.proxy.Restore()
	s.waitFor("the StatefulSet's fenced pod recreated", 30*time.Second, func(ctx context.Context) (bool, error) {
		p := s.podOf(ctx, "db")
		return p != nil && p.UID != old.UID, nil
	})
	p, err := h.admin.CoreV1().Pods(s.ns).Get(ctx, bare.Name, metav1.GetOptions{})
	switch {
	case err != nil:
		t.Errorf("bare pod after the fence lifted: %v, want it kept", err)
	case p.UID != bare.UID || p.DeletionTimestamp != nil:
		t.Errorf("bare pod after the fence lifted: uid %s (was %s), deleting %v; want it untouched", p.UID, bare.UID, p.DeletionTimestamp != nil)
	}
	if victim.hb.Fenced(string(bare.UID)) {
		t.Errorf("Fenced(%s) = true after the heartbeat came back", bare.UID)
	}
}

func testCap(t *testing.T, h *harness) {
	s := h.scenario(t, "cap") // MaxNodes 1
	a := s.addNode("cap-a", true)
	b := s.addNode("cap-b", true)
	target := s.addNode("cap-c", true)
	// One StatefulSet per doomed node: the test scheduler places each on
	// the first living node of the namespace.
	pvA := s.statefulSet("db-a", nil)
	h.mu.Lock()
	h.placement[s.ns] = []*simNode{b, a, target}
	h.mu.Unlock()
	pvB := s.statefulSet("db-b", nil)
	h.mu.Lock()
	h.placement[s.ns] = []*simNode{target}
	h.mu.Unlock()
	ctx := h.ctx
	oldA, oldB := s.podOf(ctx, "db-a"), s.podOf(ctx, "db-b")
	var log requestLog
	_, reg, _ := s.controllerWith(s.ctl, "cap-leader", ctlOptions{wrap: log.wrap})

	a.kill()
	b.kill()
	s.waitReplacedOn("db-a", oldA.UID, pvA, target.name, 90*time.Second)
	s.waitReplacedOn("db-b", oldB.UID, pvB, target.name, 90*time.Second)
	ta, _ := s.ourTaint(ctx, a.name)
	tb, _ := s.ourTaint(ctx, b.name)
	if ta == nil || tb == nil {
		t.Fatalf("taints after both fail-overs: %v, %v", ta, tb)
	}
	if got := metric(t, reg, "mountmedic_failover_failovers_total", map[string]string{"result": resultSuccess}); got != 2 {
		t.Errorf("failovers_total{result=success} = %v, want 2", got)
	}
	// One of them waited for the other (taint times have second
	// resolution: the deferral event says which).
	deferredA := s.events(ctx, "default", "Node", a.name, ReasonFailoverDeferred)
	deferredB := s.events(ctx, "default", "Node", b.name, ReasonFailoverDeferred)
	if (len(deferredA) == 0) == (len(deferredB) == 0) {
		t.Errorf("%s events: %d on %s, %d on %s; want exactly one node deferred", ReasonFailoverDeferred, len(deferredA), a.name, len(deferredB), b.name)
	}
	if got := metric(t, reg, "mountmedic_failover_failovers_total", map[string]string{"result": resultDeferred}); got != 1 {
		t.Errorf("failovers_total{result=deferred} = %v, want 1", got)
	}
	// The deferred node cost no request when it was deferred: none about
	// it in the seconds before its deferral event, nor just after (the
	// other node's fail-over takes longer than that to end).
	for _, n := range []*simNode{a, b} {
		at, ok := s.eventTime(ctx, "default", "Node", n.name, ReasonFailoverDeferred)
		if !ok {
			continue
		}
		if reqs := log.namingBetween(n.name, at.Add(-5*time.Second), at.Add(300*time.Millisecond)); len(reqs) > 0 {
			t.Errorf("requests about %s around its deferral at %s: %q", n.name, at.Format(time.RFC3339Nano), reqs)
		}
	}
}

func testLeaderChange(t *testing.T, h *harness) {
	s := h.scenario(t, "leader")
	// Leave the pods to the pod garbage collector (20 s period), so the
	// fail-over is still in progress when the leader goes.
	s.ctl.DeletePods = false
	cfg := s.ctl
	victim := s.addNode("leader-a", true)
	target := s.addNode("leader-b", true)
	pv := s.statefulSet("db", nil)
	ctx := h.ctx
	old := s.podOf(ctx, "db")
	_, regA, stopA := s.controller(cfg, "leader-a-ctl")
	s.waitFor("controller A to lead", 20*time.Second, func(context.Context) (bool, error) {
		return metric(t, regA, "mountmedic_failover_leader", nil) == 1, nil
	})
	_, regB, _ := s.controller(cfg, "leader-b-ctl")

	victim.kill()
	var taint *corev1.Taint
	s.waitFor("A to taint the dead node", 60*time.Second, func(ctx context.Context) (bool, error) {
		var err error
		taint, err = s.ourTaint(ctx, victim.name)
		return taint != nil, err
	})
	if p := s.podOf(ctx, "db"); p == nil || p.UID != old.UID {
		t.Fatalf("pod gone before the leader change: the fail-over was not in progress (pod %v)", p)
	}
	stopA() // releases the leader Lease after it stopped acting
	s.waitFor("controller B to lead", 20*time.Second, func(context.Context) (bool, error) {
		return metric(t, regB, "mountmedic_failover_leader", nil) == 1, nil
	})
	s.waitReplacedOn("db", old.UID, pv, target.name, 90*time.Second)

	n, err := h.admin.CoreV1().Nodes().Get(ctx, victim.name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	count := 0
	for _, tt := range n.Spec.Taints {
		if tt.Key == TaintOutOfService {
			count++
			if !tt.TimeAdded.Equal(taint.TimeAdded) {
				t.Errorf("taint re-applied: added %s, first %s", tt.TimeAdded, taint.TimeAdded)
			}
		}
	}
	if count != 1 {
		t.Errorf("%d out-of-service taints, want 1", count)
	}
	if got := metric(t, regB, "mountmedic_failover_failovers_total", map[string]string{"result": resultSuccess}); got != 0 {
		t.Errorf("B failovers_total{result=success} = %v, want 0: it repeated A's fail-over", got)
	}
	if got := metric(t, regA, "mountmedic_failover_failovers_total", map[string]string{"result": resultSuccess}); got != 1 {
		t.Errorf("A failovers_total{result=success} = %v, want 1", got)
	}
	if got := len(s.events(ctx, "default", "Node", victim.name, ReasonFailedOver)); got != 1 {
		t.Errorf("%d FailedOver events on the node, want 1", got)
	}
	// B ends the fail-over A started.
	victim.revive(t)
	s.waitFor("B to remove A's taint", 30*time.Second, func(ctx context.Context) (bool, error) {
		taint, err := s.ourTaint(ctx, victim.name)
		return taint == nil, err
	})
}

func testDryRunAndOperator(t *testing.T, h *harness) {
	s := h.scenario(t, "dryrun")
	s.ctl.DryRun = true
	cfg := s.ctl
	victim := s.addNode("dryrun-a", true)
	operator := s.addNode("dryrun-b", true)
	s.addNode("dryrun-c", true)
	s.statefulSet("db", nil)
	ctx := h.ctx
	old := s.podOf(ctx, "db")
	_, reg, _ := s.controller(cfg, "dryrun-leader")

	victim.kill()
	operator.kill()
	// The operator applied the out-of-service taint by hand on one node.
	s.addTaint(operator.name, corev1.Taint{Key: TaintOutOfService, Value: "nodeshutdown", Effect: corev1.TaintEffectNoExecute})
	s.waitFor("dry-run FailedOver event", 60*time.Second, func(ctx context.Context) (bool, error) {
		notes := s.events(ctx, "default", "Node", victim.name, ReasonFailedOver)
		return len(notes) == 1 && strings.HasPrefix(notes[0], dryRunPrefix), nil
	})
	s.waitFor("event about the operator's taint", 30*time.Second, func(ctx context.Context) (bool, error) {
		return len(s.events(ctx, "default", "Node", operator.name, ReasonOperatorTaint)) == 1, nil
	})
	time.Sleep(2 * time.Second)
	if taint, err := s.ourTaint(ctx, victim.name); err != nil || taint != nil {
		t.Errorf("dry run tainted the node: %v (err %v)", taint, err)
	}
	if p := s.podOf(ctx, "db"); p == nil || p.UID != old.UID || p.DeletionTimestamp != nil {
		t.Errorf("dry run changed the pod: %v", p)
	}
	if got := metric(t, reg, "mountmedic_failover_failovers_total", map[string]string{"result": resultDryRun}); got != 1 {
		t.Errorf("failovers_total{result=dry_run} = %v, want 1", got)
	}
	// The operator's taint stays after the node returns: not ours.
	operator.revive(t)
	victim.revive(t)
	time.Sleep(3 * time.Second)
	n, err := h.admin.CoreV1().Nodes().Get(ctx, operator.name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(n.Spec.Taints, func(t corev1.Taint) bool { return t.Key == TaintOutOfService && t.Value == "nodeshutdown" }) {
		t.Errorf("operator's out-of-service taint removed: taints %v", n.Spec.Taints)
	}
}

// addTaint adds a taint to node as an operator would.
func (s *scenario) addTaint(node string, taint corev1.Taint) {
	s.t.Helper()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		n, err := s.h.admin.CoreV1().Nodes().Get(s.h.ctx, node, metav1.GetOptions{})
		if err != nil {
			return err
		}
		n.Spec.Taints = append(n.Spec.Taints, taint)
		_, err = s.h.admin.CoreV1().Nodes().Update(s.h.ctx, n, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		s.t.Fatalf("taint node %s: %v", node, err)
	}
}
