package failover

import (
	"context"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/fake"
	coordinationv1client "k8s.io/client-go/kubernetes/typed/coordination/v1"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/utils/ptr"
)

// TestFencePlanRoundTrip: the plan a node writes is the plan the
// controller reads, and a damaged one is an error, not an empty plan.
func TestFencePlanRoundTrip(t *testing.T) {
	l := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: "node-1", Namespace: "mountmedic", Annotations: map[string]string{
		FencePlanAnnotation: encodeFencePlan(30*time.Second, []fenceTarget{{UID: "b"}, {UID: "a"}, {UID: "b"}}),
	}}}
	p := planOf(l)
	if !p.Known || p.Err != nil || !p.has("a") || !p.has("b") || p.has("c") || p.FenceAfter != 30*time.Second {
		t.Errorf("planOf(%s) = %+v, want pods a and b, 30s", l.Annotations[FencePlanAnnotation], p)
	}
	if got := l.Annotations[FencePlanAnnotation]; got != `{"fenceAfterSeconds":30,"pods":["a","b"]}` {
		t.Errorf("encodeFencePlan = %s, want sorted and without duplicates", got)
	}
	if got := encodeFencePlan(30*time.Second, nil); got != `{"fenceAfterSeconds":30,"pods":[]}` {
		t.Errorf("encodeFencePlan(empty) = %s", got)
	}
	for name, v := range map[string]string{"not json": "a,b", "no deadline": `{"pods":["a"]}`} {
		l.Annotations[FencePlanAnnotation] = v
		if p := planOf(l); p.Known || p.Err == nil || p.has("a") {
			t.Errorf("%s: planOf(%q) = %+v, want an error and nothing planned", name, v, p)
		}
	}
	if p := planOf(&coordinationv1.Lease{}); p.Known || p.Err != nil {
		t.Errorf("planOf(no annotation) = %+v, want unknown", p)
	}
}

// TestJudgePods is the controller's judgement of a dead node's pods: only
// what the node fenced (its published plan) and the policy admits moves;
// pods with ReadWriteOnce volumes that stay are reported; and a pod the
// out-of-service taint would evict unfenced forbids the taint.
func TestJudgePods(t *testing.T) {
	pod := func(uid string, tol ...corev1.Toleration) *corev1.Pod {
		return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: uid, Namespace: "ns", UID: types.UID(uid)},
			Spec: corev1.PodSpec{Tolerations: tol}}
	}
	eligible := decision{Eligible: true, Reason: reasonEligible, PVs: []string{"pv"}}
	optedOut := decision{Reason: reasonOptedOut}
	noRWO := decision{Reason: reasonNoRWO}
	uncertain := decision{Uncertain: true, Reason: reasonLookupFailed}
	plan := func(uids ...string) publishedPlan {
		var ts []fenceTarget
		for _, u := range uids {
			ts = append(ts, fenceTarget{UID: u})
		}
		return planOf(&coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{
			FencePlanAnnotation: encodeFencePlan(time.Minute, ts)}}})
	}
	tolerates := corev1.Toleration{Key: TaintOutOfService, Operator: corev1.TolerationOpExists}
	tests := map[string]struct {
		pods     []nodePod
		plan     publishedPlan
		all      bool
		move     []string
		left     map[string]string // uid -> reason
		blockers []string
	}{
		"planned and eligible moves": {
			pods: []nodePod{{pod: pod("a"), d: eligible, rwo: true}},
			plan: plan("a"),
			move: []string{"a"},
		},
		"eligible after the partition stays": {
			pods:     []nodePod{{pod: pod("a"), d: eligible, rwo: true}, {pod: pod("late"), d: eligible, rwo: true}},
			plan:     plan("a"),
			move:     []string{"a"},
			left:     map[string]string{"late": leftNotPlanned},
			blockers: []string{"late"},
		},
		"no plan published: nothing moves": {
			pods:     []nodePod{{pod: pod("a"), d: eligible, rwo: true}},
			plan:     publishedPlan{},
			left:     map[string]string{"a": leftNotPlanned},
			blockers: []string{"a"},
		},
		"opted out and unfenced blocks the taint": {
			pods:     []nodePod{{pod: pod("a"), d: eligible, rwo: true}, {pod: pod("out"), d: optedOut, rwo: true}},
			plan:     plan("a"),
			move:     []string{"a"},
			left:     map[string]string{"out": leftNotEligible},
			blockers: []string{"out"},
		},
		"opted out after the plan: fenced, stays, no blocker": {
			pods: []nodePod{{pod: pod("a"), d: eligible, rwo: true}, {pod: pod("out"), d: optedOut, rwo: true}},
			plan: plan("a", "out"),
			move: []string{"a"},
			left: map[string]string{"out": leftNotEligible},
		},
		"opted out but tolerating the taint: no blocker": {
			pods: []nodePod{{pod: pod("a"), d: eligible, rwo: true}, {pod: pod("out", tolerates), d: optedOut, rwo: true}},
			plan: plan("a"),
			move: []string{"a"},
			left: map[string]string{"out": leftNotEligible},
		},
		"no ReadWriteOnce volume: neither left nor a blocker": {
			pods: []nodePod{{pod: pod("a"), d: eligible, rwo: true}, {pod: pod("web"), d: noRWO}},
			plan: plan("a"),
			move: []string{"a"},
		},
		"unreadable claim, unplanned: a blocker": {
			pods:     []nodePod{{pod: pod("a"), d: eligible, rwo: true}, {pod: pod("u"), d: uncertain, rwo: true}},
			plan:     plan("a"),
			move:     []string{"a"},
			left:     map[string]string{"u": leftNotEligible},
			blockers: []string{"u"},
		},
		"shut down: the plan does not limit": {
			pods: []nodePod{{pod: pod("a"), d: eligible, rwo: true}, {pod: pod("out"), d: optedOut, rwo: true}},
			all:  true,
			move: []string{"a"},
			left: map[string]string{"out": leftNotEligible},
		},
	}
	for name, tt := range tests {
		t.Run(name, func(t *testing.T) {
			fp := judgePods(tt.pods, tt.plan, tt.all)
			var move, blockers []string
			for _, p := range fp.move {
				move = append(move, string(p.pod.UID))
			}
			for _, p := range fp.taintBlockers {
				blockers = append(blockers, string(p.UID))
			}
			left := map[string]string{}
			for _, l := range fp.left {
				left[string(l.pod.UID)] = l.reason
			}
			if !slices.Equal(move, tt.move) {
				t.Errorf("move = %v, want %v", move, tt.move)
			}
			if !slices.Equal(blockers, tt.blockers) {
				t.Errorf("taint blockers = %v, want %v", blockers, tt.blockers)
			}
			if len(left) != len(tt.left) {
				t.Errorf("left = %v, want %v", left, tt.left)
			}
			for uid, r := range tt.left {
				if left[uid] != r {
					t.Errorf("left[%s] = %q, want %q", uid, left[uid], r)
				}
			}
		})
	}
}

func TestToleratesOutOfService(t *testing.T) {
	tests := map[string]struct {
		tol  corev1.Toleration
		want bool
	}{
		"exists on the key":    {corev1.Toleration{Key: TaintOutOfService, Operator: corev1.TolerationOpExists}, true},
		"exists on everything": {corev1.Toleration{Operator: corev1.TolerationOpExists}, true},
		"equal to our value":   {corev1.Toleration{Key: TaintOutOfService, Value: TaintValue, Effect: corev1.TaintEffectNoExecute}, true},
		"equal to another":     {corev1.Toleration{Key: TaintOutOfService, Value: "x"}, false},
		"NoSchedule only":      {corev1.Toleration{Key: TaintOutOfService, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoSchedule}, false},
		"for a while only":     {corev1.Toleration{Key: TaintOutOfService, Operator: corev1.TolerationOpExists, TolerationSeconds: ptr.To[int64](300)}, false},
		"another key":          {corev1.Toleration{Key: "node.kubernetes.io/unreachable", Operator: corev1.TolerationOpExists}, false},
	}
	for name, tt := range tests {
		pod := &corev1.Pod{Spec: corev1.PodSpec{Tolerations: []corev1.Toleration{tt.tol}}}
		if got := toleratesOutOfService(pod); got != tt.want {
			t.Errorf("%s: toleratesOutOfService(%+v) = %v, want %v", name, tt.tol, got, tt.want)
		}
	}
}

// TestFenceCoversPublishedPlans: the fence stops every pod the Lease may
// hold in its plan (a write that failed may have landed), besides the plan
// now; a successful write narrows that to its own plan.
func TestFenceCoversPublishedPlans(t *testing.T) {
	m, err := newHeartbeatMetrics(nil)
	if err != nil {
		t.Fatal(err)
	}
	f := &recordingFence{}
	h := &Heartbeat{cfg: fastConfig(), containers: f, volumes: f, metrics: m, boot: bootClock}
	h.cfg.NodeName = "node-1"
	// Published: a and b; the plan now (refreshed after the renewal): b
	// and c. A write carrying b, c failed ambiguously.
	h.plan, h.planSynced = []fenceTarget{{UID: "b"}, {UID: "c"}}, true
	h.sent = []fenceTarget{{UID: "a"}, {UID: "b"}}
	l := h.leaseSpec(&coordinationv1.Lease{}, time.Now(), h.plan)
	if p := planOf(l); !p.Known || !p.has("b") || !p.has("c") || p.has("a") {
		t.Errorf("lease plan = %s, want b and c", l.Annotations[FencePlanAnnotation])
	}
	h.fence(context.Background(), time.Minute, verdictIsolated, peerTally{})
	if got := f.stoppedPods(); !slices.Equal(got, []string{"a", "b", "c"}) {
		t.Errorf("fence stopped %v, want a, b, c (every plan the Lease may hold, and the plan now)", got)
	}
	if l := h.leaseSpec(&coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Annotations: map[string]string{FencePlanAnnotation: "x"}}}, time.Now(), nil); l.Annotations[FencePlanAnnotation] != "" {
		t.Errorf("a Lease written without a known plan keeps %q, want the old plan withdrawn", l.Annotations[FencePlanAnnotation])
	}
}

// TestWriteKeepsPlanAndFenceTogether: a plan written while the node is
// fenced joins the fence (the controller may read it, so its pods must be
// stopped), and a dry-run agent, which stops nothing, publishes no plan.
func TestWriteKeepsPlanAndFenceTogether(t *testing.T) {
	for _, dry := range []bool{false, true} {
		m, err := newHeartbeatMetrics(nil)
		if err != nil {
			t.Fatal(err)
		}
		f := &recordingFence{}
		cs := fake.NewClientset()
		h := &Heartbeat{cfg: fastConfig(), containers: f, volumes: f, metrics: m, boot: bootClock, leases: cs}
		h.cfg.NodeName, h.cfg.DryRun = "node-1", dry
		h.plan, h.planSynced = []fenceTarget{{UID: "a"}}, true
		h.fenced, h.isFenced = []fenceTarget{{UID: "old"}}, true
		if err := h.write(context.Background(), time.Now()); err != nil {
			t.Fatalf("dry run %t: write: %v", dry, err)
		}
		l, err := cs.CoordinationV1().Leases(h.cfg.Namespace).Get(context.Background(), "node-1", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		_, published := l.Annotations[FencePlanAnnotation]
		fenced := slices.ContainsFunc(h.fenced, func(t fenceTarget) bool { return t.UID == "a" })
		switch {
		case dry && published:
			t.Errorf("dry run: the Lease carries plan %s, want none", l.Annotations[FencePlanAnnotation])
		case !dry && (!published || !fenced):
			t.Errorf("plan published %t, pod a fenced %t (fence %v): want both", published, fenced, h.fenced)
		}
	}
}

// TestPlanDeadlineCoversPeerCheck: the deadline a plan publishes is when
// the fence has started at the latest: FenceAfter, plus the peer check's
// whole budget (twice PeerTimeout) when the agent runs one, rounded up.
func TestPlanDeadlineCoversPeerCheck(t *testing.T) {
	for _, withPeers := range []bool{false, true} {
		m, err := newHeartbeatMetrics(nil)
		if err != nil {
			t.Fatal(err)
		}
		f := &recordingFence{}
		h := &Heartbeat{cfg: fastConfig(), containers: f, volumes: f, metrics: m, boot: bootClock, leases: fake.NewClientset()}
		h.cfg.NodeName, h.cfg.FenceAfter, h.cfg.PeerTimeout = "node-1", 30*time.Second, 2500*time.Millisecond
		want := 30 * time.Second
		if withPeers {
			h.peerClient = newPeerClient("node-1", writeKey(t, "k"), h.cfg.PeerTimeout)
			want = 35 * time.Second
		}
		l := h.leaseSpec(&coordinationv1.Lease{}, time.Now(), []fenceTarget{{UID: "a"}})
		if p := planOf(l); !p.Known || p.FenceAfter != want {
			t.Errorf("peer check %t: published plan %s, want a deadline of %s", withPeers, l.Annotations[FencePlanAnnotation], want)
		}
		// The controller's watch sees no annotations: the Lease says it too.
		if got := time.Duration(*l.Spec.LeaseDurationSeconds) * time.Second; got != want {
			t.Errorf("peer check %t: leaseDurationSeconds %s, want %s", withPeers, got, want)
		}
	}
	if got := EncodeFencePlan(30*time.Second+time.Millisecond, nil); got != `{"fenceAfterSeconds":31,"pods":[]}` {
		t.Errorf("EncodeFencePlan(30.001s) = %s, want the deadline rounded up to 31", got)
	}
}

// TestRenewalNotDelayedByPeerWork: the peer refresh (a list of the
// heartbeat Leases) and the peer probes run beside the renewals: a list
// that never returns must not stop the Lease from being renewed.
func TestRenewalNotDelayedByPeerWork(t *testing.T) {
	m, err := newHeartbeatMetrics(nil)
	if err != nil {
		t.Fatal(err)
	}
	pm, err := newPeerMetrics(nil)
	if err != nil {
		t.Fatal(err)
	}
	cs := fake.NewClientset()
	release := make(chan struct{})
	listed := make(chan struct{}, 1)
	updates := make(chan struct{}, 100)
	cs.PrependReactor("update", "leases", func(k8stesting.Action) (bool, runtime.Object, error) {
		updates <- struct{}{}
		return false, nil, nil
	})
	// The fake serializes its reactors: the list hangs before it.
	leases := hangingList{Interface: cs, listed: listed, release: release}
	f := &recordingFence{}
	cfg := fastConfig()
	cfg.NodeName, cfg.HeartbeatInterval, cfg.PeerKeyFile = "node-1", 10*time.Millisecond, writeKey(t, strings.Repeat("k", 64))
	h := &Heartbeat{cfg: cfg, client: cs, leases: leases, containers: f, volumes: f, metrics: m, peerMetrics: pm, boot: bootClock, now: time.Now,
		rand: rand.New(rand.NewPCG(1, 2)), jitter: func(d time.Duration) time.Duration { return d },
		renewed: make(chan struct{}, 1), apiDue: make(chan struct{}, 1), peersDue: make(chan struct{}, 1)}
	h.peerClient = newPeerClient("node-1", cfg.PeerKeyFile, time.Second)
	h.lastOK = h.boot()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer wg.Wait()
	defer close(release)
	defer cancel()
	wg.Go(func() { h.renewLoop(ctx, func() bool { return false }) })
	wg.Go(func() { h.peerLoop(ctx) })
	deadline := time.After(time.Minute)
	select {
	case <-listed:
	case <-deadline:
		t.Fatal("the peer refresh never listed the heartbeat Leases")
	}
	for i := range 3 {
		select {
		case <-updates:
		case <-deadline:
			t.Fatalf("%d renewals while the peer refresh hangs, want 3: the refresh holds the renewals up", i)
		}
	}
}

// hangingList is a client whose lists of Leases hang until release closes.
type hangingList struct {
	kubernetes.Interface
	listed, release chan struct{}
}

func (c hangingList) CoordinationV1() coordinationv1client.CoordinationV1Interface {
	return hangingCoordination{c.Interface.CoordinationV1(), c}
}

type hangingCoordination struct {
	coordinationv1client.CoordinationV1Interface
	c hangingList
}

func (c hangingCoordination) Leases(ns string) coordinationv1client.LeaseInterface {
	return hangingLeases{c.CoordinationV1Interface.Leases(ns), c.c}
}

type hangingLeases struct {
	coordinationv1client.LeaseInterface
	c hangingList
}

func (l hangingLeases) List(ctx context.Context, o metav1.ListOptions) (*coordinationv1.LeaseList, error) {
	signal(l.c.listed)
	<-l.c.release
	return l.LeaseInterface.List(ctx, o)
}
