package agent

import (
	"context"
	"errors"
	"fmt"
	dto "github.com/prometheus/client_model/go"
	"net/http"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"
	"k8s.io/utils/ptr"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/probe/kubelet"
	"github.com/mountmedic/mountmedic/remount"
)

// The ladder's rules as unit tests: a run (Agent.run) over a fake
// clientset and a fake repairer, no root and no API server. The root tests
// (driver_test.go, agent_test.go) run the same rules against a real
// kube-apiserver, a real CSI driver and real mounts.

// fakeRepairer answers each tier with the outcome set for it (Healed when
// none is) and records the tiers called. It only plans when dryRun is set.
type fakeRepairer struct {
	mu       sync.Mutex
	outcomes map[remount.Tier]remount.Outcome
	dryRun   bool
	calls    []string
}

func (r *fakeRepairer) do(tier remount.Tier) remount.Outcome {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, tier.String())
	if o, ok := r.outcomes[tier]; ok {
		return o
	}
	return remount.Outcome{Tier: tier, Healed: true, Actions: []remount.Action{{Op: remount.Op("stage")}}}
}

func (r *fakeRepairer) Restage(context.Context, *remount.Volume) remount.Outcome {
	return r.do(remount.TierRestage)
}

func (r *fakeRepairer) LiveSwap(context.Context, *remount.Volume) remount.Outcome {
	return r.do(remount.TierLiveSwap)
}

func (r *fakeRepairer) Restart(context.Context, *remount.Volume) remount.Outcome {
	return r.do(remount.TierRestart)
}

func (r *fakeRepairer) Unmount(context.Context, *remount.Volume) remount.Outcome {
	return r.do(remount.TierUnmount)
}

func (r *fakeRepairer) Guard(context.Context, string) remount.Action { return remount.Action{} }

func (r *fakeRepairer) DryRun() bool { return r.dryRun }

// take returns the tiers called since the last take.
func (r *fakeRepairer) take() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	c := r.calls
	r.calls = nil
	return c
}

// eventsOn returns the reasons and notes of the events f got on the object
// named name (namespace/name), in order.
func eventsOn(f *fakeRecorder, name string) (reasons, notes []string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, e := range f.events {
		if e.regarding == name {
			reasons, notes = append(reasons, e.reason), append(notes, e.note)
		}
	}
	return reasons, notes
}

// Fixtures of a ladder case: one Running pod on the node with a CSI PVC.
const (
	ladderNode   = "node-1"
	ladderDriver = "fake.csi.example.com"
	ladderPV     = "pv-1"
)

// ladderCase is an agent over a fake clientset with one broken CSI volume
// and the job of its run.
type ladderCase struct {
	a   *Agent
	rep *fakeRepairer
	ev  *fakeRecorder
	cs  *fake.Clientset
	pod *corev1.Pod
	pvc *corev1.PersistentVolumeClaim
	j   *job
}

type ladderOptions struct {
	tiers remount.TierSet
	// private: the container sees the volume through its own bind (no
	// HostToContainer propagation), so only a live swap or a restart
	// reaches it after a re-stage.
	private bool
	// optOut annotates the claim with OptOutAnnotation=false.
	optOut bool
	dryRun bool
	caps   DriverCapsFunc
}

func newLadderCase(t *testing.T, o ladderOptions) *ladderCase {
	t.Helper()
	running := corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: metav1.NewTime(time.Unix(1, 0))}}
	mount := corev1.VolumeMount{Name: "data", MountPath: "/data"}
	if !o.private {
		mount.MountPropagation = ptr.To(corev1.MountPropagationHostToContainer)
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "apps", Name: "web-0", UID: "uid-web-0"},
		Spec: corev1.PodSpec{
			NodeName:   ladderNode,
			Containers: []corev1.Container{{Name: "app", Image: "busybox", VolumeMounts: []corev1.VolumeMount{mount}}},
			Volumes: []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{
				PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: "data"}}}},
		},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, ContainerStatuses: []corev1.ContainerStatus{
			{Name: "app", ContainerID: "containerd://c1", State: running}}},
	}
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: "apps", Name: "data"},
		Spec:       corev1.PersistentVolumeClaimSpec{VolumeName: ladderPV},
		Status:     corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound},
	}
	if o.optOut {
		pvc.Annotations = map[string]string{OptOutAnnotation: "false"}
	}
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: ladderPV},
		Spec: corev1.PersistentVolumeSpec{
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			ClaimRef:    &corev1.ObjectReference{Namespace: "apps", Name: "data"},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver: ladderDriver, VolumeHandle: "handle-1"}},
		},
	}
	driver := &storagev1.CSIDriver{ObjectMeta: metav1.ObjectMeta{Name: ladderDriver},
		Spec: storagev1.CSIDriverSpec{AttachRequired: ptr.To(false)}}
	cs := fake.NewClientset(pod, pvc, pv, driver)

	cfg := DefaultConfig()
	cfg.NodeName, cfg.KubeletRoot, cfg.MetricsAddr, cfg.Version = ladderNode, "/var/lib/kubelet", "", "test"
	cfg.NodeCondition = false
	cfg.DryRun = o.dryRun
	cfg.RepairUnknownDrivers = true
	if o.tiers != 0 {
		cfg.Tiers = o.tiers
	}
	if o.caps == nil {
		o.caps = func(context.Context, string) (kubelet.NodeCapabilities, error) {
			return kubelet.NodeCapabilities{StageUnstage: true}, nil
		}
	}
	rep := &fakeRepairer{outcomes: map[remount.Tier]remount.Outcome{}, dryRun: o.dryRun}
	ev := &fakeRecorder{}
	a, err := New(cfg, Deps{Client: cs, Repairer: rep, Events: ev, DriverCaps: o.caps})
	if err != nil {
		t.Fatal(err)
	}
	// Each run reads the pods anew.
	a.nodePods.maxAge = 0

	dead := &probe.Mount{ID: 42, Path: "/var/lib/kubelet/pods/uid-web-0/volumes/kubernetes.io~csi/pv-1/mount",
		Target: kubelet.Target{Kind: kubelet.KindPublish, PodUID: string(pod.UID)}}
	bv := &brokenVolume{key: ladderDriver + "/handle-1", csi: true, driver: ladderDriver, volumeHandle: "handle-1",
		state: probe.Disconnected, mounts: []*probe.Mount{dead},
		pods: map[string]*podUse{string(pod.UID): {uid: string(pod.UID), specName: ladderPV, dead: []*probe.Mount{dead}}}}
	j := &job{key: bv.key, vol: bv, active: []*corev1.Pod{pod}, excluded: map[*corev1.Pod]string{}, since: time.Now()}
	return &ladderCase{a: a, rep: rep, ev: ev, cs: cs, pod: pod, pvc: pvc, j: j}
}

// run runs the job and checks how it ended and which tiers it called.
func (c *ladderCase) run(t *testing.T, want outcome, tiers ...string) jobResult {
	t.Helper()
	res := c.a.run(context.Background(), c.j)
	if res.outcome != want {
		reasons, notes := eventsOn(c.ev, "apps/web-0")
		t.Errorf("run outcome = %v, want %v (events %v: %q)", res.outcome, want, reasons, notes)
	}
	if got := c.rep.take(); !slices.Equal(got, tiers) {
		t.Errorf("tiers called = %v, want %v", got, tiers)
	}
	return res
}

// wantEvents checks the reasons of the events on the pod, in order, and
// that the last one's note contains each of notes.
func (c *ladderCase) wantEvents(t *testing.T, reasons []Reason, notes ...string) {
	t.Helper()
	got, gotNotes := eventsOn(c.ev, "apps/web-0")
	want := make([]string, len(reasons))
	for i, r := range reasons {
		want[i] = string(r)
	}
	if !slices.Equal(got, want) {
		t.Errorf("events on the pod = %v, want %v (notes %q)", got, want, gotNotes)
		return
	}
	last := gotNotes[len(gotNotes)-1]
	for _, n := range notes {
		if !strings.Contains(last, n) {
			t.Errorf("last event %q does not say %q", last, n)
		}
	}
}

// unavailable makes the fake API server answer verb on resource with 503.
func (c *ladderCase) unavailable(verb, resource string) {
	c.cs.PrependReactor(verb, resource, func(k8stesting.Action) (bool, runtime.Object, error) {
		return true, nil, apierrors.NewServiceUnavailable("the API server is down (test)")
	})
}

func TestLadderHeals(t *testing.T) {
	c := newLadderCase(t, ladderOptions{})
	c.run(t, outcomeHealed, "restage")
	c.wantEvents(t, []Reason{ReasonVolumeBroken, ReasonVolumeRepaired}, "repaired by restage")
}

func TestLadderEscalates(t *testing.T) {
	c := newLadderCase(t, ladderOptions{})
	c.rep.outcomes[remount.TierRestage] = remount.Outcome{Err: errors.New("stage failed (test)")}
	c.run(t, outcomeHealed, "restage", "liveswap")
	c.wantEvents(t, []Reason{ReasonVolumeBroken, ReasonRepairEscalated, ReasonVolumeRepaired}, "repaired by liveswap")
}

func TestLadderFailsWhenNoTierHeals(t *testing.T) {
	c := newLadderCase(t, ladderOptions{tiers: remount.NewTierSet(remount.TierRestage, remount.TierRestart)})
	for _, tier := range []remount.Tier{remount.TierRestage, remount.TierRestart} {
		c.rep.outcomes[tier] = remount.Outcome{Err: fmt.Errorf("%s failed (test)", tier)}
	}
	c.run(t, outcomeFailed, "restage", "restart")
	c.wantEvents(t, []Reason{ReasonVolumeBroken, ReasonRepairEscalated, ReasonNotRepaired}, "no further tier is enabled")
}

func TestLadderWaitsForADriverThatIsDown(t *testing.T) {
	t.Run("a tier finds it down", func(t *testing.T) {
		c := newLadderCase(t, ladderOptions{})
		c.rep.outcomes[remount.TierRestage] = remount.Outcome{Err: fmt.Errorf("dial: %w", remount.ErrDriverUnavailable)}
		c.run(t, outcomeDriverDown, "restage")
		c.wantEvents(t, []Reason{ReasonVolumeBroken, ReasonDriverDown}, "as soon as it registers again")
		c.wantDriverUnavailable(t)
	})
	t.Run("its capabilities cannot be read", func(t *testing.T) {
		c := newLadderCase(t, ladderOptions{caps: func(context.Context, string) (kubelet.NodeCapabilities, error) {
			return kubelet.NodeCapabilities{}, fmt.Errorf("no socket: %w", remount.ErrDriverUnavailable)
		}})
		c.run(t, outcomeDriverDown)
		c.wantEvents(t, []Reason{ReasonVolumeBroken, ReasonDriverDown})
		c.wantDriverUnavailable(t)
	})
}

// TestLadderWaitsForABackendThatIsDown: the driver answered and the
// volume's device did not (remount.ErrBackendUnavailable, which matches
// ErrDriverUnavailable too): one BackendDown event that names the backend,
// the run waits without escalating, and the driver is not called down.
func TestLadderWaitsForABackendThatIsDown(t *testing.T) {
	c := newLadderCase(t, ladderOptions{})
	c.rep.outcomes[remount.TierRestage] = remount.Outcome{Err: fmt.Errorf("/dev/nbd0 after the re-attach: hung (test): %w, %w",
		remount.ErrBackendUnavailable, remount.ErrDriverUnavailable)}
	c.run(t, outcomeWaiting, "restage")
	c.wantEvents(t, []Reason{ReasonVolumeBroken, ReasonBackendDown}, "storage behind it is down", "nothing escalated")
	var m dto.Metric
	if err := c.a.metrics.repairs.WithLabelValues(remount.TierRestage.String(), resultBackendUnavailable).Write(&m); err != nil {
		t.Fatal(err)
	}
	if n := m.GetCounter().GetValue(); n != 1 {
		t.Errorf("repairs_total{restage,backend_unavailable} = %v, want 1", n)
	}
	m.Reset()
	if err := c.a.metrics.driverUp.WithLabelValues(ladderDriver).Write(&m); err != nil {
		t.Fatal(err)
	}
	if v := m.GetGauge().GetValue(); v != 1 {
		t.Errorf("driver_up{%s} = %v, want 1: the driver answered", ladderDriver, v)
	}
	// The volume stays down: the next run says nothing again.
	c.run(t, outcomeWaiting, "restage")
	c.wantEvents(t, []Reason{ReasonVolumeBroken, ReasonBackendDown})
}

// wantDriverUnavailable: the run's DriverDown is counted as one attempt of
// the first rung that found the driver unavailable, whichever step
// noticed (the alert on failing repairs reads it).
func (c *ladderCase) wantDriverUnavailable(t *testing.T) {
	t.Helper()
	var m dto.Metric
	if err := c.a.metrics.repairs.WithLabelValues(remount.TierRestage.String(), resultDriverUnavailable).Write(&m); err != nil {
		t.Fatal(err)
	}
	if n := m.GetCounter().GetValue(); n != 1 {
		t.Errorf("repairs_total{restage,driver_unavailable} = %v, want 1", n)
	}
}

func TestLadderWaitsForTheAPIServer(t *testing.T) {
	for name, tc := range map[string]struct{ verb, resource string }{
		"the claim cannot be read":         {"get", "persistentvolumeclaims"},
		"the pods cannot be read afresh":   {"list", "pods"},
		"the driver object cannot be read": {"get", "csidrivers"},
	} {
		t.Run(name, func(t *testing.T) {
			c := newLadderCase(t, ladderOptions{})
			c.unavailable(tc.verb, tc.resource)
			c.run(t, outcomeWaiting)
			c.wantEvents(t, []Reason{ReasonVolumeBroken, ReasonNotRepaired}, "repair waits")
		})
	}
}

func TestLadderLeavesAnOptedOutClaim(t *testing.T) {
	c := newLadderCase(t, ladderOptions{optOut: true})
	c.run(t, outcomeIgnored)
	c.wantEvents(t, []Reason{ReasonVolumeBroken, ReasonRepairOptedOut}, OptOutAnnotation)
}

func TestLadderDryRunReportsThePlan(t *testing.T) {
	c := newLadderCase(t, ladderOptions{dryRun: true})
	c.rep.outcomes[remount.TierRestage] = remount.Outcome{Actions: []remount.Action{
		{Op: remount.Op("stage"), Path: "/var/lib/kubelet/plugins/kubernetes.io/csi/x/globalmount", DryRun: true}}}
	c.run(t, outcomeWaiting, "restage")
	c.wantEvents(t, []Reason{ReasonVolumeBroken, ReasonWouldRepair}, dryRunPrefix, "would restage", "plugins/kubernetes.io/csi/x/globalmount")
}

// TestLadderLeavesAResidual: the re-stage heals the host, but the
// container sees the volume through its own bind and the live swap fails:
// the run leaves a residual, and the next run resumes at the live swap.
func TestLadderLeavesAResidual(t *testing.T) {
	c := newLadderCase(t, ladderOptions{private: true, tiers: remount.NewTierSet(remount.TierRestage, remount.TierLiveSwap)})
	c.rep.outcomes[remount.TierLiveSwap] = remount.Outcome{Err: errors.New("swap failed (test)")}
	res := c.run(t, outcomeFailed, "restage", "liveswap")
	c.wantEvents(t, []Reason{ReasonVolumeBroken, ReasonRepairEscalated, ReasonNotRepaired}, "liveswap did not heal")
	if res.residual == nil {
		t.Fatal("a run that healed the host but not the container left no residual")
	}
	if ids := res.residual.r.ownBinds[string(c.pod.UID)]; !slices.Equal(ids, []string{"c1"}) {
		t.Errorf("residual's own binds = %v, want [c1]", ids)
	}

	// The next run resumes it, past the re-stage.
	delete(c.rep.outcomes, remount.TierLiveSwap)
	c.j.resume = res.residual
	res = c.run(t, outcomeHealed, "liveswap")
	if res.residual != nil {
		t.Errorf("a healed resume left a residual")
	}
}

// TestLadderSaysWhenNoTierReachesTheContainers: the re-stage alone is
// enabled and the container holds its own bind: never "repaired".
func TestLadderSaysWhenNoTierReachesTheContainers(t *testing.T) {
	c := newLadderCase(t, ladderOptions{private: true, tiers: remount.NewTierSet(remount.TierRestage)})
	c.run(t, outcomeIgnored, "restage")
	c.wantEvents(t, []Reason{ReasonVolumeBroken, ReasonNotRepaired}, "restart the pods")
}

// statusError is an API error with an HTTP code, for unreachable.
func statusError(code int) error {
	return &apierrors.StatusError{ErrStatus: metav1.Status{Code: int32(code), Reason: metav1.StatusReason(http.StatusText(code))}}
}

func TestUnreachable(t *testing.T) {
	for name, tc := range map[string]struct {
		err  error
		want bool
	}{
		"network":   {errors.New("dial tcp: connection refused"), true},
		"503":       {statusError(http.StatusServiceUnavailable), true},
		"429":       {statusError(http.StatusTooManyRequests), true},
		"not found": {apierrors.NewNotFound(schema.GroupResource{Resource: "pods"}, "p"), false},
		"forbidden": {apierrors.NewForbidden(schema.GroupResource{Resource: "pods"}, "p", errors.New("no")), false},
	} {
		if got := unreachable(tc.err); got != tc.want {
			t.Errorf("%s: unreachable(%v) = %v, want %v", name, tc.err, got, tc.want)
		}
	}
}

// TestPrepareSortsThePods: the loop's job for a broken volume repairs the
// running pods and leaves out, with why, the pods opted out, filtered out
// or fenced; pods being deleted get the unmount tier; a Pending pod whose
// publish target is not mounted yet is kubelet at work, not broken.
func TestPrepareSortsThePods(t *testing.T) {
	c := newLadderCase(t, ladderOptions{})
	c.a.cfg.ExcludeNamespaces = []string{"kube-system"}
	c.a.fenced = func(uid string) bool { return uid == "uid-fenced" }
	idx := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{uidIndex: func(obj any) ([]string, error) {
		return []string{string(obj.(*corev1.Pod).UID)}, nil
	}})
	c.a.pods = podsByUID{idx: idx}
	bv := c.j.vol
	bv.pods = map[string]*podUse{}
	add := func(name, ns string, mutate func(*corev1.Pod)) {
		p := c.pod.DeepCopy()
		p.Name, p.Namespace, p.UID = name, ns, types.UID("uid-"+name)
		if mutate != nil {
			mutate(p)
		}
		if err := idx.Add(p); err != nil {
			t.Fatal(err)
		}
		m := &probe.Mount{ID: 7, Path: "/var/lib/kubelet/pods/" + string(p.UID) + "/volumes/kubernetes.io~csi/pv-1/mount",
			Target: kubelet.Target{Kind: kubelet.KindPublish, PodUID: string(p.UID)}}
		bv.pods[string(p.UID)] = &podUse{uid: string(p.UID), specName: ladderPV, dead: []*probe.Mount{m}}
	}
	add("active", "apps", nil)
	add("optout", "apps", func(p *corev1.Pod) { p.Annotations = map[string]string{OptOutAnnotation: "false"} })
	add("system", "kube-system", nil)
	add("fenced", "apps", nil)
	add("deleting", "apps", func(p *corev1.Pod) { p.DeletionTimestamp = ptr.To(metav1.Now()) })
	add("starting", "apps", func(p *corev1.Pod) { p.Status.Phase = corev1.PodPending })
	bv.pods["uid-starting"].dead[0].ID = 0 // vol_data.json written, not yet published
	bv.pods["uid-gone"] = &podUse{uid: "uid-gone"}

	j := c.a.prepare(bv)
	if j == nil {
		t.Fatal("prepare = nil for a volume with known pods")
	}
	names := func(pods []*corev1.Pod) []string {
		var out []string
		for _, p := range pods {
			out = append(out, p.Name)
		}
		slices.Sort(out)
		return out
	}
	if got := names(j.active); !slices.Equal(got, []string{"active"}) {
		t.Errorf("active = %v, want [active]", got)
	}
	if got := names(j.terminating); !slices.Equal(got, []string{"deleting"}) {
		t.Errorf("terminating = %v, want [deleting]", got)
	}
	why := map[string]string{}
	for p, w := range j.excluded {
		why[p.Name] = w
	}
	for name, says := range map[string]string{"optout": OptOutAnnotation, "system": "excluded", "fenced": "fenced"} {
		if !strings.Contains(why[name], says) {
			t.Errorf("excluded[%s] = %q, want it to say %q", name, why[name], says)
		}
	}
	if len(why) != 3 {
		t.Errorf("excluded = %v, want optout, system and fenced only", why)
	}
	if j.skip != "" {
		t.Errorf("skip = %q for a volume to repair", j.skip)
	}

	// Raw block volumes and drivers outside --drivers are reported only.
	bv.block = true
	if j := c.a.prepare(bv); j == nil || !strings.Contains(j.skip, "raw block") {
		t.Errorf("prepare(raw block).skip = %v, want it reported, not repaired", j)
	}
	bv.block = false
	c.a.cfg.Drivers = []string{"other.csi.example.com"}
	if j := c.a.prepare(bv); j == nil || !strings.Contains(j.skip, "--drivers") {
		t.Errorf("prepare(driver not in --drivers).skip = %v, want it reported, not repaired", j)
	}
	// No pod the informer knows: nothing to do.
	bv.pods = map[string]*podUse{"uid-gone": {uid: "uid-gone"}}
	if j := c.a.prepare(bv); j != nil {
		t.Errorf("prepare(pods unknown) = %+v, want nil", j)
	}
}

// TestTerminatingUnmountKnowsTheVolumesUsers: the unmount tier of a
// terminating pod is told every pod that uses the volume, so that the
// abort of a hung connection never takes one of their processes for the
// daemon.
func TestTerminatingUnmountKnowsTheVolumesUsers(t *testing.T) {
	dead := []*probe.Mount{{ID: 7, Path: "/var/lib/kubelet/pods/uid-a/volumes/kubernetes.io~csi/pv-1/mount"}}
	j := &job{vol: &brokenVolume{pods: map[string]*podUse{"uid-a": {uid: "uid-a"}, "uid-b": {uid: "uid-b"}}}}
	got := volumeUsers(j, "uid-a", dead)
	var uids []string
	for _, p := range got {
		uids = append(uids, string(p.Publish.PodUID))
	}
	slices.Sort(uids)
	if !slices.Equal(uids, []string{"uid-a", "uid-b"}) {
		t.Errorf("users = %v, want [uid-a uid-b]", uids)
	}
	if got[0].Publish.PodUID != "uid-a" || len(got[0].Dead) != 1 || len(got[1].Dead) != 0 {
		t.Errorf("only the terminating pod's dead mounts are to be unmounted: %+v", got)
	}
}
