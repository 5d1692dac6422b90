package failover

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

// TestAttachmentName pins the name kubelet's CSI attacher gives a
// VolumeAttachment (pkg/volume/csi getAttachmentName: "csi-" and the hex
// sha256 of volume handle, driver and node name, concatenated). The value
// was computed apart: echo -n vol-1csi.example.comnode-1 | sha256sum.
func TestAttachmentName(t *testing.T) {
	got := attachmentName("vol-1", "csi.example.com", "node-1")
	want := "csi-b74c7fc125891ffa0d0f2e0d645733e3fae7fba3066e76500a771ea08be9da28"
	if got != want {
		t.Errorf("attachmentName(vol-1, csi.example.com, node-1) = %s, want %s", got, want)
	}
}

// TestStripNode: the controller's node cache keeps what it reads, and the
// evidence from a stripped node is the evidence from the full one.
func TestStripNode(t *testing.T) {
	full := testNode(corev1.ConditionUnknown,
		corev1.Taint{Key: TaintOutOfService, Value: TaintValue, Effect: corev1.TaintEffectNoExecute},
		corev1.Taint{Key: TaintShutdown, Effect: corev1.TaintEffectNoSchedule})
	full.UID, full.ResourceVersion = "uid-1", "42"
	full.Labels = map[string]string{"zone": "a"}
	full.Annotations = map[string]string{FailedOverAnnotation: "2026-01-01T00:00:00Z", "big": string(make([]byte, 4096))}
	full.ManagedFields = []metav1.ManagedFieldsEntry{{Manager: "kubelet"}}
	full.Status.Images = []corev1.ContainerImage{{Names: []string{"registry.example/app:1"}, SizeBytes: 1 << 20}}
	full.Status.VolumesInUse = []corev1.UniqueVolumeName{"kubernetes.io/csi/d^v"}
	full.Status.Capacity = corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("8")}
	full.Status.Conditions = append(full.Status.Conditions, corev1.NodeCondition{Type: corev1.NodeMemoryPressure, Status: corev1.ConditionFalse})
	obj, err := stripNode(full)
	if err != nil {
		t.Fatal(err)
	}
	n := obj.(*corev1.Node)
	if n.Name != full.Name || n.UID != full.UID || n.ResourceVersion != full.ResourceVersion || len(n.Spec.Taints) != 2 ||
		n.Annotations[FailedOverAnnotation] != full.Annotations[FailedOverAnnotation] {
		t.Errorf("stripNode lost what the controller reads: %+v", n)
	}
	if len(n.Annotations) != 1 || n.Labels != nil || n.ManagedFields != nil || n.Status.Images != nil || n.Status.VolumesInUse != nil ||
		n.Status.Capacity != nil || len(n.Status.Conditions) != 1 {
		t.Errorf("stripNode kept what the controller does not read: %+v", n)
	}
	c := validControllerConfig()
	t0 := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	kl, hb := testLease("node-1", t0, 40), testLease("agent", t0, 30)
	a := c.gather(newObserver(), full, kl, hb, t0)
	b := c.gather(newObserver(), n, kl, hb, t0)
	if a != b {
		t.Errorf("evidence from the stripped node = %+v, from the full one %+v", b, a)
	}

	l := testLease("agent", t0, 30)
	l.Namespace, l.ResourceVersion = "mountmedic", "7"
	l.Labels = map[string]string{HeartbeatLabel: HeartbeatLabelValue}
	l.ManagedFields = []metav1.ManagedFieldsEntry{{Manager: "mountmedic"}}
	l.Spec.AcquireTime = &metav1.MicroTime{Time: t0}
	obj, _ = stripLease(l)
	sl := obj.(*coordinationv1.Lease)
	if leaseVersion(sl) != leaseVersion(l) || *sl.Spec.LeaseDurationSeconds != 30 || sl.ManagedFields != nil || sl.Labels != nil || sl.Spec.AcquireTime != nil {
		t.Errorf("stripLease(%+v) = %+v", l, sl)
	}
	if got, _ := stripNode("tombstone"); got != "tombstone" {
		t.Errorf("stripNode of a non-node = %v, want it unchanged", got)
	}
}

// TestSight: one broken watch blinds the controller; it sees again only
// when every informer's last call succeeded, and each regain is counted
// once.
func TestSight(t *testing.T) {
	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	s := newSight(func() time.Time { return now })
	regained := 0
	s.regained = func() { regained++ }
	a, b, c := s.register(), s.register(), s.register()
	down := errors.New("connection refused")
	steps := []struct {
		id      int
		err     error
		blind   bool
		regains int
	}{
		{a, nil, false, 0}, // a healthy start
		{b, down, true, 0}, // one watch cannot be re-established
		{a, down, true, 0}, // the others fail too
		{b, nil, true, 0},  // b is back, a still failing
		{a, nil, false, 1}, // a is back, c never failed: sight regained
		{c, nil, false, 1}, // nothing to regain
		{c, down, true, 1}, // a second loss
		{c, nil, false, 2}, // and its end
		{a, nil, false, 2}, // still seeing
		{b, down, true, 2}, // a third loss
		{b, down, true, 2}, // repeated failures do not regain
		{b, nil, false, 3}, // and its end
	}
	for i, st := range steps {
		s.report(st.id, st.err)
		blind, _, regains := s.state()
		if blind != st.blind || regains != st.regains || regained != st.regains {
			t.Fatalf("step %d (informer %d, err %v): blind %v, regains %d (callback %d); want blind %v, regains %d",
				i, st.id, st.err, blind, regains, regained, st.blind, st.regains)
		}
	}
}

// TestStandDown: the thresholds of kube's node lifecycle controller (more
// than two and at least the share, or all of them).
func TestStandDown(t *testing.T) {
	tests := []struct {
		dead, total int
		share       float64
		want        bool
	}{
		{0, 10, 0.55, false},
		{1, 2, 0.55, false},
		{2, 2, 0.55, true}, // all of them
		{1, 1, 0.55, false},
		{2, 3, 0.55, false}, // two are never a disruption
		{3, 5, 0.55, true},
		{3, 6, 0.55, false},
		{1000, 5000, 0.55, false},
		{2750, 5000, 0.55, true},
		{1000, 5000, 0.2, true},
		{4999, 5000, 1, false},
		{5000, 5000, 1, true},
	}
	for _, tc := range tests {
		tm := &term{c: &Controller{cfg: ControllerConfig{StandDownShare: tc.share}}, state: map[string]*nodeState{}, dead: map[string]bool{}}
		for i := range tc.total {
			name := fmt.Sprintf("n%d", i)
			tm.state[name] = &nodeState{}
			if i < tc.dead {
				tm.dead[name] = true
			}
		}
		if got := tm.standDown(); got != tc.want {
			t.Errorf("standDown with %d of %d dead, share %v = %v, want %v", tc.dead, tc.total, tc.share, got, tc.want)
		}
	}
}

// TestComesOfAge: a node that is not Ready is judged again when both its
// kubelet's grace and its heartbeat's fence window could have passed.
func TestComesOfAge(t *testing.T) {
	c := validControllerConfig() // kubelet grace 40s, window 45s
	tests := map[string]struct {
		ev   evidence
		want time.Duration
	}{
		"ready":             {ev: evidence{Ready: corev1.ConditionTrue}, want: 0},
		"kubelet fresh":     {ev: evidence{Ready: corev1.ConditionUnknown, KubeletSilent: 10 * time.Second, Heartbeat: heartbeatMissing}, want: 30 * time.Second},
		"heartbeat longer":  {ev: evidence{Ready: corev1.ConditionUnknown, KubeletSilent: 10 * time.Second, Heartbeat: heartbeatHeld, HeartbeatSilent: 5 * time.Second, FenceWindow: 45 * time.Second}, want: 40 * time.Second},
		"past both":         {ev: evidence{Ready: corev1.ConditionUnknown, KubeletSilent: time.Minute, Heartbeat: heartbeatHeld, HeartbeatSilent: time.Minute, FenceWindow: 45 * time.Second}, want: 0},
		"operator's taint":  {ev: evidence{Ready: corev1.ConditionUnknown, OutOfService: oosOther}, want: 0},
		"released, waiting": {ev: evidence{Ready: corev1.ConditionFalse, KubeletSilent: 39 * time.Second, Heartbeat: heartbeatReleased}, want: time.Second},
	}
	for name, tc := range tests {
		if got := c.comesOfAge(tc.ev); got != tc.want {
			t.Errorf("%s: comesOfAge = %s, want %s", name, got, tc.want)
		}
	}
}

// TestFreshReadStampsAfterReads: a renewal that the fresh reads find counts
// as seen when the reads ended, not when the judgement began: a slow read
// must not make the next renewal's silence look longer than it is.
func TestFreshReadStampsAfterReads(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	clock := t0
	node := testNode(corev1.ConditionUnknown)
	kl := testLease("node-1", t0, 40)
	kl.Namespace = KubeletLeaseNamespace
	hb := testLease("agent", t0, 30)
	hb.Namespace, hb.Labels = "mountmedic", map[string]string{HeartbeatLabel: HeartbeatLabelValue}
	client := fake.NewClientset(node, kl, hb)
	// Each read takes 10 s.
	client.PrependReactor("get", "*", func(k8stesting.Action) (bool, runtime.Object, error) {
		clock = clock.Add(10 * time.Second)
		return false, nil, nil
	})
	cfg := validControllerConfig()
	c, err := NewController(cfg, client, client, nil)
	if err != nil {
		t.Fatal(err)
	}
	c.now = func() time.Time { return clock }
	tm := c.newTerm(func() bool { return true })
	// The informers' view at t0: the old heartbeat.
	old := testLease("agent", t0.Add(-time.Minute), 30)
	cfg.gather(tm.obs, node, kl, old, t0)
	// The fresh reads (node, kubelet Lease, heartbeat Lease: 30 s) find
	// the heartbeat renewed.
	if _, ev, _, _, err := tm.fresh(context.Background(), "node-1", t0); err != nil {
		t.Fatal(err)
	} else if ev.HeartbeatSilent != 0 {
		t.Errorf("heartbeat silent %s on the reads that found it renewed, want 0", ev.HeartbeatSilent)
	}
	// 40 s after the judgement began, the renewal has been silent 10 s
	// at most as far as anyone can tell.
	ev := cfg.gather(tm.obs, node, kl, hb, t0.Add(40*time.Second))
	if ev.HeartbeatSilent > 10*time.Second {
		t.Errorf("heartbeat silent %s 40 s after a judgement whose reads took 30 s and found it renewed, want at most 10s", ev.HeartbeatSilent)
	}
}
