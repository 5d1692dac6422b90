package failover

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	coordinationlisters "k8s.io/client-go/listers/coordination/v1"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/tools/events"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/klog/v2"
)

// ReportingController names the duty in the events it writes.
const ReportingController = "mountmedic.io/failover"

// Event reasons.
const (
	ReasonFailedOver       = "FailedOver"
	ReasonFailoverFailed   = "FailoverFailed"
	ReasonFailoverDeferred = "FailoverDeferred"
	ReasonFailoverHeld     = "FailoverHeld"
	ReasonNodeRecovered    = "FailoverEnded"
	ReasonOperatorTaint    = "OutOfServiceByOperator"
)

// Event actions.
const (
	actionTaint   = "Taint"
	actionMark    = "Mark"
	actionDelete  = "ForceDelete"
	actionUntaint = "Untaint"
	actionJudge   = "Judge"
)

// dryRunPrefix starts every event note of a dry run.
const dryRunPrefix = "[dry-run] "

// eventRecorder is what the controller needs of an events.k8s.io recorder.
type eventRecorder interface {
	Eventf(regarding runtime.Object, related runtime.Object, eventtype, reason, action, note string, args ...interface{})
}

// Controller is the cluster side of the duty. Every agent runs one; the one
// that holds the leader election Lease (Config.LeaderLease) judges every
// node in scope each EvalInterval and fails confirmed-dead nodes over, at
// most MaxNodes at a time. The others wait as standbys and keep no state:
// everything a new leader needs is on the API server (the taint or mark on
// the node), so a leader change mid-failover repeats nothing.
type Controller struct {
	cfg      Config
	client   kubernetes.Interface
	metrics  *controllerMetrics
	selector labels.Selector
	now      func() time.Time
	rec      eventRecorder
	claims   *claimCache
}

// NewController prepares the cluster side; reg receives the metrics (nil:
// none).
func NewController(cfg Config, client kubernetes.Interface, reg prometheus.Registerer) (*Controller, error) {
	if !cfg.Enabled {
		return nil, errors.New("failover controller: the duty is disabled (--failover=false)")
	}
	if err := cfg.validate(false); err != nil {
		return nil, err
	}
	if client == nil {
		return nil, errors.New("failover controller needs a Kubernetes client")
	}
	sel, err := labels.Parse(cfg.NodeSelector)
	if err != nil {
		return nil, fmt.Errorf("--failover-node-selector %q: %w", cfg.NodeSelector, err)
	}
	m, err := newControllerMetrics(reg)
	if err != nil {
		return nil, err
	}
	return &Controller{cfg: cfg, client: client, metrics: m, selector: sel, now: time.Now,
		claims: newClaimCache(claimReader{client: client, timeout: cfg.APITimeout})}, nil
}

// Run campaigns for the leader Lease and leads while it holds it, until ctx
// ends; then it stops acting first and releases the Lease after, so that
// two instances never act at once. It returns an error only when it cannot
// start.
func (c *Controller) Run(ctx context.Context) error {
	logger := klog.FromContext(ctx).WithValues("identity", c.cfg.Identity, "leaderLease", klog.KRef(c.cfg.Namespace, c.cfg.LeaderLease))
	ctx = klog.NewContext(ctx, logger)
	logger.Info("Starting failover controller", "mode", c.cfg.Mode, "fenceAfter", c.cfg.FenceAfter, "fenceMargin", c.cfg.FenceMargin,
		"kubeletGrace", c.cfg.KubeletGrace, "maxNodes", c.cfg.MaxNodes, "nodeSelector", c.cfg.NodeSelector, "dryRun", c.cfg.DryRun)
	if c.rec == nil {
		b := events.NewBroadcaster(&events.EventSinkImpl{Interface: c.client.EventsV1()})
		if err := b.StartRecordingToSinkWithContext(ctx); err != nil {
			return fmt.Errorf("start event recorder: %w", err)
		}
		defer b.Shutdown()
		c.rec = b.NewRecorder(scheme.Scheme, ReportingController)
	}
	for ctx.Err() == nil {
		if err := c.campaign(ctx); err != nil {
			return err
		}
		select {
		case <-ctx.Done():
		case <-time.After(c.cfg.RetryPeriod):
		}
	}
	return nil
}

// campaign runs one leader election until leadership is lost or ctx ends.
func (c *Controller) campaign(ctx context.Context) error {
	logger := klog.FromContext(ctx)
	// The elector's context ends only after the work has stopped: it
	// releases the Lease when it ends (ReleaseOnCancel).
	leCtx, leCancel := context.WithCancel(context.WithoutCancel(ctx))
	defer leCancel()

	var mu sync.Mutex
	var workDone chan struct{}
	var le *leaderelection.LeaderElector
	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Namespace: c.cfg.Namespace, Name: c.cfg.LeaderLease},
		Client:     c.client.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: c.cfg.Identity},
	}
	le, err := leaderelection.NewLeaderElector(leaderelection.LeaderElectionConfig{
		Lock:            lock,
		LeaseDuration:   c.cfg.LeaseDuration,
		RenewDeadline:   c.cfg.RenewDeadline,
		RetryPeriod:     c.cfg.RetryPeriod,
		ReleaseOnCancel: true,
		Name:            "mountmedic-failover",
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: func(lctx context.Context) {
				mu.Lock()
				if ctx.Err() != nil {
					mu.Unlock()
					return
				}
				done := make(chan struct{})
				workDone = done
				mu.Unlock()
				defer close(done)
				wctx, cancel := context.WithCancel(lctx)
				defer cancel()
				stop := context.AfterFunc(ctx, cancel)
				defer stop()
				c.lead(klog.NewContext(wctx, logger), le.IsLeader)
			},
			OnStoppedLeading: func() {},
		},
	})
	if err != nil {
		return fmt.Errorf("failover leader election: %w", err)
	}
	leDone := make(chan struct{})
	go func() {
		defer close(leDone)
		le.Run(leCtx)
	}()
	waitWork := func() {
		mu.Lock()
		d := workDone
		mu.Unlock()
		if d != nil {
			<-d
		}
	}
	select {
	case <-ctx.Done():
		// No new term starts now (OnStartedLeading checks ctx under mu);
		// wait for a running one to stop, then release.
		mu.Lock()
		mu.Unlock()
		waitWork()
		leCancel()
		<-leDone
	case <-leDone:
		waitWork()
		if ctx.Err() == nil {
			logger.Info("Lost the failover leader lease; standing by")
		}
	}
	return nil
}

// nodeState is what a leader remembers of a node during its term.
type nodeState struct {
	verdict verdict
	// code is the kind of reason of the verdict (judgement.code).
	code string
	// announced: the current verdict has been logged and, where due,
	// reported in an event.
	announced bool
	// deferred: a deferral was counted for this outage.
	deferred bool
	// done: the node was failed over and its eligible pods are gone.
	done bool
	// dryRunActed: a dry run "failed it over" during this outage.
	dryRunActed bool
	// nextCheck: a dead node with nothing to fail over is listed again
	// only after this.
	nextCheck time.Time
}

// term is one leadership term's view of the cluster.
type term struct {
	nodes     corelisters.NodeLister
	kubelet   coordinationlisters.LeaseNamespaceLister
	heartbeat coordinationlisters.LeaseNamespaceLister
	obs       *observer
	state     map[string]*nodeState
	isLeader  func() bool
}

// lead runs the leader's loop until ctx ends.
func (c *Controller) lead(ctx context.Context, isLeader func() bool) {
	logger := klog.FromContext(ctx)
	c.metrics.leader.Set(1)
	defer c.metrics.leader.Set(0)
	defer c.metrics.inFailover.Set(0)
	logger.Info("Became the failover leader; judging nodes only after watching them for a full window")

	nodeF := informers.NewSharedInformerFactoryWithOptions(c.client, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = c.cfg.NodeSelector }))
	kubeletF := informers.NewSharedInformerFactoryWithOptions(c.client, 0, informers.WithNamespace(KubeletLeaseNamespace))
	hbF := informers.NewSharedInformerFactoryWithOptions(c.client, 0, informers.WithNamespace(c.cfg.Namespace),
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.LabelSelector = labels.SelectorFromSet(labels.Set{HeartbeatLabel: HeartbeatLabelValue}).String()
		}))
	// The listers register their informers with the factories before
	// they start. Nodes are judged on the tick alone: an event-driven
	// evaluation would run on every renewal of every node's Leases.
	t := &term{
		nodes:     nodeF.Core().V1().Nodes().Lister(),
		kubelet:   kubeletF.Coordination().V1().Leases().Lister().Leases(KubeletLeaseNamespace),
		heartbeat: hbF.Coordination().V1().Leases().Lister().Leases(c.cfg.Namespace),
		obs:       newObserver(),
		state:     make(map[string]*nodeState),
		isLeader:  isLeader,
	}
	for _, f := range []informers.SharedInformerFactory{nodeF, kubeletF, hbF} {
		f.Start(ctx.Done())
		defer f.Shutdown()
	}
	for _, f := range []informers.SharedInformerFactory{nodeF, kubeletF, hbF} {
		for typ, ok := range f.WaitForCacheSync(ctx.Done()) {
			if !ok {
				if ctx.Err() == nil {
					logger.Error(nil, "Failover informer did not sync", "type", typ.String())
				}
				return
			}
		}
	}
	tick := time.NewTicker(c.cfg.EvalInterval)
	defer tick.Stop()
	for {
		c.evaluate(ctx, t)
		select {
		case <-ctx.Done():
			logger.Info("Stopped leading the failover duty")
			return
		case <-tick.C:
		}
	}
}

// candidate is a node judged dead and not yet acted on.
type candidate struct {
	node *corev1.Node
	ev   evidence
	why  string
}

// evaluate judges every node once and acts on what is due.
func (c *Controller) evaluate(ctx context.Context, t *term) {
	logger := klog.FromContext(ctx)
	now := c.now()
	all, err := t.nodes.List(c.selector)
	if err != nil {
		logger.Error(err, "List nodes from the informer")
		return
	}
	sort.Slice(all, func(i, j int) bool { return all[i].Name < all[j].Name })
	seen := make(map[string]bool, len(all))
	inFailover := 0
	var cands []candidate
	for _, node := range all {
		if ctx.Err() != nil {
			return
		}
		seen[node.Name] = true
		st := t.state[node.Name]
		if st == nil {
			st = &nodeState{}
			t.state[node.Name] = st
		}
		kl, _ := t.kubelet.Get(node.Name)
		hb, _ := t.heartbeat.Get(node.Name)
		ev := c.cfg.gather(t.obs, node, kl, hb, now)
		j := c.cfg.judge(ev)
		v, why := j.verdict, j.why
		nlog := logger.WithValues("node", klog.KObj(node))
		marked := ev.OutOfService == oosOurs || ev.ForceMarked

		switch {
		case marked && ev.Ready == corev1.ConditionTrue:
			c.recover(klog.NewContext(ctx, nlog), node, ev)
			*st = nodeState{verdict: verdictAlive}
			continue
		case marked:
			if !st.done {
				st.done = c.continueFailover(klog.NewContext(ctx, nlog), t, node)
			}
			if !st.done {
				inFailover++
			}
			st.verdict, st.announced = verdictDead, true
			continue
		case st.dryRunActed && ev.Ready != corev1.ConditionTrue:
			inFailover++
			continue
		}
		if v != st.verdict {
			st.deferred, st.dryRunActed, st.nextCheck = false, false, time.Time{}
		}
		if v != st.verdict || j.code != st.code {
			st.verdict, st.code, st.announced = v, j.code, false
		}
		switch v {
		case verdictDead:
			if !now.Before(st.nextCheck) {
				cands = append(cands, candidate{node: node, ev: ev, why: why})
			}
		case verdictAlive:
			if !st.announced {
				nlog.V(4).Info("Node alive", ev.keysAndValues()...)
				st.announced = true
			}
		default:
			if !st.announced {
				st.announced = true
				nlog.Info("Not failing the node over", append([]any{"verdict", v.String(), "reason", why}, ev.keysAndValues()...)...)
				reason := ReasonFailoverHeld
				if v == verdictOperator {
					reason = ReasonOperatorTaint
				}
				c.event(node, nil, corev1.EventTypeNormal, reason, actionJudge, "Not failing over: %s. Evidence: %s", why, ev)
			}
		}
	}
	for name := range t.state {
		if !seen[name] {
			delete(t.state, name)
			t.obs.forgetNode(name)
		}
	}

	for _, cd := range cands {
		if ctx.Err() != nil {
			return
		}
		st := t.state[cd.node.Name]
		if st.deferred && inFailover >= c.cfg.MaxNodes {
			// Still at the cap: its pods were listed when it was
			// deferred; they are listed again once it can be acted on.
			continue
		}
		nlog := logger.WithValues("node", klog.KObj(cd.node))
		pods, uncertain, err := c.eligiblePods(ctx, cd.node.Name)
		if err != nil {
			nlog.Error(err, "List the pods of a dead node")
			continue
		}
		if len(pods) == 0 {
			if !st.announced {
				st.announced = true
				nlog.Info("Node is dead but runs no pod to fail over", append([]any{"reason", cd.why, "uncertainPods", uncertain}, cd.ev.keysAndValues()...)...)
			}
			// A claim that could not be read is retried soon; otherwise
			// the node is looked at again now and then.
			if uncertain == 0 {
				st.nextCheck = now.Add(30 * time.Second)
			}
			continue
		}
		if inFailover >= c.cfg.MaxNodes {
			if !st.deferred {
				st.deferred = true
				c.metrics.failovers.WithLabelValues(resultDeferred).Inc()
				nlog.Info("Node is dead but --failover-max-nodes nodes are in failover already: deferring", append([]any{"inFailover", inFailover, "maxNodes", c.cfg.MaxNodes, "pods", podNames(pods)}, cd.ev.keysAndValues()...)...)
				c.event(cd.node, nil, corev1.EventTypeWarning, ReasonFailoverDeferred, actionJudge,
					"Node confirmed dead (%s) but %d node(s) are in failover already (--failover-max-nodes %d): waiting", cd.ev, inFailover, c.cfg.MaxNodes)
			}
			continue
		}
		if c.act(klog.NewContext(ctx, nlog), t, cd, pods, st, now) {
			inFailover++
		}
	}
	c.claims.sweep()
	c.metrics.inFailover.Set(float64(inFailover))
}

// eligiblePod is a pod of a dead node that the policy admits.
type eligiblePod struct {
	pod *corev1.Pod
	pvs []string
}

func podNames(pods []eligiblePod) []string {
	out := make([]string, 0, len(pods))
	for _, p := range pods {
		out = append(out, p.pod.Namespace+"/"+p.pod.Name)
	}
	return out
}

// eligiblePods lists the pods on node and keeps those the policy admits;
// uncertain counts pods whose claims could not be read.
func (c *Controller) eligiblePods(ctx context.Context, node string) ([]eligiblePod, int, error) {
	cctx, cancel := context.WithTimeout(ctx, c.cfg.APITimeout)
	list, err := c.client.CoreV1().Pods(metav1.NamespaceAll).List(cctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + node})
	cancel()
	if err != nil {
		return nil, 0, fmt.Errorf("list pods of node %s: %w", node, err)
	}
	var out []eligiblePod
	uncertain := 0
	for i := range list.Items {
		pod := &list.Items[i]
		d := c.cfg.decide(pod, c.claims.read(ctx, pod))
		switch {
		case d.Eligible:
			out = append(out, eligiblePod{pod: pod, pvs: d.PVs})
		case d.Uncertain:
			uncertain++
			klog.FromContext(ctx).Info("Cannot tell whether a pod of a dead node is eligible; trying again", "pod", klog.KObj(pod))
		default:
			klog.FromContext(ctx).V(4).Info("Pod not failed over", "pod", klog.KObj(pod), "reason", d.Reason)
		}
	}
	return out, uncertain, nil
}

// act fails a dead node over; it reports whether the node is in failover
// now.
func (c *Controller) act(ctx context.Context, t *term, cd candidate, pods []eligiblePod, st *nodeState, now time.Time) bool {
	logger := klog.FromContext(ctx)
	sinceLife := cd.ev.KubeletSilent
	if cd.ev.Heartbeat == heartbeatHeld && cd.ev.HeartbeatSilent < sinceLife {
		sinceLife = cd.ev.HeartbeatSilent
	}
	names := podNames(pods)
	what := fmt.Sprintf("tainted %s=%s:NoExecute", TaintOutOfService, TaintValue)
	if c.cfg.Mode == ModeForceDelete {
		what = "force-deleted the pods and their VolumeAttachments on the node"
	} else if c.cfg.DeletePods {
		what += " and force-deleted the pods"
	}
	kv := append([]any{"reason", cd.why, "mode", string(c.cfg.Mode), "pods", names, "sinceLastLife", sinceLife.Round(time.Second).String(), "dryRun", c.cfg.DryRun}, cd.ev.keysAndValues()...)
	if c.cfg.DryRun {
		logger.Info("[dry-run] Would fail the node over", kv...)
		c.event(cd.node, nil, corev1.EventTypeWarning, ReasonFailedOver, actionJudge, "%sWould have %s (%s): node confirmed dead: %s", dryRunPrefix, what, joinNames(names), cd.why)
		for _, p := range pods {
			c.event(p.pod, cd.node, corev1.EventTypeWarning, ReasonFailedOver, actionDelete, "%sWould fail this pod over from dead node %s: %s", dryRunPrefix, cd.node.Name, cd.why)
			c.metrics.podDeletions.WithLabelValues(resultDryRun).Inc()
		}
		c.metrics.failovers.WithLabelValues(resultDryRun).Inc()
		st.dryRunActed, st.announced = true, true
		return true
	}
	if !t.isLeader() {
		logger.Info("No longer the failover leader: not acting")
		return false
	}
	var err error
	if c.cfg.Mode == ModeForceDelete {
		err = c.mark(ctx, cd.node, now)
	} else {
		err = c.taint(ctx, cd.node, now)
	}
	if err != nil {
		if apierrors.IsConflict(err) {
			// The node changed under us (perhaps another leader acted):
			// judge it again from the informer's fresh copy.
			logger.V(2).Info("Node changed while failing it over; judging it again", "err", err)
			return false
		}
		c.metrics.failovers.WithLabelValues(resultFailure).Inc()
		logger.Error(err, "Failing the node over failed", kv...)
		c.event(cd.node, nil, corev1.EventTypeWarning, ReasonFailoverFailed, actionTaint, "Node confirmed dead (%s) but the fail-over failed: %v", cd.why, err)
		return false
	}
	logger.Info("Failed the node over", kv...)
	c.metrics.failovers.WithLabelValues(resultSuccess).Inc()
	c.metrics.deathToAct.Observe(sinceLife.Seconds())
	st.announced = true
	c.event(cd.node, nil, corev1.EventTypeWarning, ReasonFailedOver, actionTaint, "Node confirmed dead: %s. Evidence: %s. mountmedic %s (%s)", cd.why, cd.ev, what, joinNames(names))
	for _, p := range pods {
		c.event(p.pod, cd.node, corev1.EventTypeWarning, ReasonFailedOver, actionDelete, "Failing over from dead node %s (%s): %s", cd.node.Name, what, cd.why)
	}
	if c.cfg.Mode == ModeForceDelete {
		c.deletePods(ctx, t, cd.node.Name, pods)
	}
	// In taint mode the pods are force-deleted by continueFailover once
	// terminating: the taint eviction controller deletes a pod by name
	// without a UID precondition, so a pod force-deleted before it acts
	// would have its replacement (same name, for a StatefulSet) deleted
	// in its place.
	return true
}

func joinNames(names []string) string {
	const max = 10
	if len(names) > max {
		return fmt.Sprintf("%s and %d more", strings.Join(names[:max], ", "), len(names)-max)
	}
	return strings.Join(names, ", ")
}

// continueFailover carries on with a node failed over earlier (by this
// leader or a previous one) and reports whether no eligible pod is left on
// it. In force-delete mode it force-deletes eligible pods still there; in
// taint mode with DeletePods, those the taint eviction controller has
// marked terminating (what the pod garbage collector does every 20 s).
func (c *Controller) continueFailover(ctx context.Context, t *term, node *corev1.Node) bool {
	pods, uncertain, err := c.eligiblePods(ctx, node.Name)
	if err != nil {
		klog.FromContext(ctx).Error(err, "List the pods of a failed-over node")
		return false
	}
	if len(pods) == 0 && uncertain == 0 {
		klog.FromContext(ctx).Info("Fail-over of the node is complete: no eligible pod is left on it")
		return true
	}
	switch {
	case c.cfg.Mode == ModeForceDelete:
		c.deletePods(ctx, t, node.Name, pods)
	case c.cfg.DeletePods:
		var terminating []eligiblePod
		for _, p := range pods {
			if p.pod.DeletionTimestamp != nil {
				terminating = append(terminating, p)
			}
		}
		c.deletePods(ctx, t, node.Name, terminating)
	}
	return false
}

// deletePods force-deletes the pods (UID preconditions: a pod recreated
// under the same name is never touched) and, in force-delete mode, their
// VolumeAttachments on node.
func (c *Controller) deletePods(ctx context.Context, t *term, node string, pods []eligiblePod) {
	logger := klog.FromContext(ctx)
	var pvs []string
	for _, p := range pods {
		if !t.isLeader() {
			return
		}
		uid := p.pod.UID
		cctx, cancel := context.WithTimeout(ctx, c.cfg.APITimeout)
		err := c.client.CoreV1().Pods(p.pod.Namespace).Delete(cctx, p.pod.Name, metav1.DeleteOptions{
			GracePeriodSeconds: new(int64),
			Preconditions:      &metav1.Preconditions{UID: &uid},
		})
		cancel()
		switch {
		case err == nil:
			c.metrics.podDeletions.WithLabelValues(resultSuccess).Inc()
			logger.V(2).Info("Force-deleted pod of a dead node", "pod", klog.KObj(p.pod), "podUID", uid)
			pvs = append(pvs, p.pvs...)
		case apierrors.IsNotFound(err) || apierrors.IsConflict(err):
			pvs = append(pvs, p.pvs...)
		default:
			c.metrics.podDeletions.WithLabelValues(resultFailure).Inc()
			logger.Error(err, "Force-deleting a pod of a dead node failed", "pod", klog.KObj(p.pod), "podUID", uid)
		}
	}
	if c.cfg.Mode != ModeForceDelete || len(pvs) == 0 {
		return
	}
	cctx, cancel := context.WithTimeout(ctx, c.cfg.APITimeout)
	vas, err := c.client.StorageV1().VolumeAttachments().List(cctx, metav1.ListOptions{})
	cancel()
	if err != nil {
		logger.Error(err, "List VolumeAttachments of a dead node")
		return
	}
	for _, va := range vas.Items {
		pv := va.Spec.Source.PersistentVolumeName
		if va.Spec.NodeName != node || pv == nil || !slices.Contains(pvs, *pv) || !t.isLeader() {
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, c.cfg.APITimeout)
		err := c.client.StorageV1().VolumeAttachments().Delete(cctx, va.Name, metav1.DeleteOptions{
			Preconditions: &metav1.Preconditions{UID: &va.UID},
		})
		cancel()
		if err != nil && !apierrors.IsNotFound(err) {
			logger.Error(err, "Deleting a VolumeAttachment of a dead node failed", "volumeAttachment", va.Name, "pv", *pv)
			continue
		}
		logger.V(2).Info("Deleted VolumeAttachment of a dead node", "volumeAttachment", va.Name, "pv", *pv)
	}
}

// recover removes the duty's taint or mark from a node that is Ready again.
func (c *Controller) recover(ctx context.Context, node *corev1.Node, ev evidence) {
	logger := klog.FromContext(ctx)
	if c.cfg.DryRun {
		logger.Info("[dry-run] Would remove the failover taint: the node is Ready again")
		return
	}
	var err error
	if ev.OutOfService == oosOurs {
		var keep []corev1.Taint
		for _, t := range node.Spec.Taints {
			if !(t.Key == TaintOutOfService && t.Value == TaintValue) {
				keep = append(keep, t)
			}
		}
		err = c.patchNode(ctx, node, map[string]any{"spec": map[string]any{"taints": taintsOrEmpty(keep)}})
	}
	if err == nil && ev.ForceMarked {
		err = c.patchNode(ctx, node, map[string]any{"metadata": map[string]any{"annotations": map[string]any{FailedOverAnnotation: nil}}})
	}
	if err != nil {
		if !apierrors.IsConflict(err) {
			logger.Error(err, "Removing the failover taint from a recovered node failed")
		}
		return
	}
	c.metrics.recovered.Inc()
	logger.Info("Node is Ready again: removed the failover taint")
	c.event(node, nil, corev1.EventTypeNormal, ReasonNodeRecovered, actionUntaint, "Node is Ready again: removed the %s taint mountmedic applied", TaintOutOfService)
}

func taintsOrEmpty(t []corev1.Taint) []corev1.Taint {
	if t == nil {
		return []corev1.Taint{}
	}
	return t
}

// taint adds the out-of-service taint with the duty's value.
func (c *Controller) taint(ctx context.Context, node *corev1.Node, now time.Time) error {
	taints := slices.Clone(node.Spec.Taints)
	taints = append(taints, corev1.Taint{Key: TaintOutOfService, Value: TaintValue, Effect: corev1.TaintEffectNoExecute,
		TimeAdded: &metav1.Time{Time: now}})
	return c.patchNode(ctx, node, map[string]any{"spec": map[string]any{"taints": taints}})
}

// mark records a force-delete mode fail-over on the node.
func (c *Controller) mark(ctx context.Context, node *corev1.Node, now time.Time) error {
	return c.patchNode(ctx, node, map[string]any{"metadata": map[string]any{"annotations": map[string]any{
		FailedOverAnnotation: now.UTC().Format(time.RFC3339)}}})
}

// patchNode sends a JSON merge patch conditioned on the node's
// resourceVersion: if the node changed since it was judged, the patch
// fails with a conflict and nothing is applied twice.
func (c *Controller) patchNode(ctx context.Context, node *corev1.Node, patch map[string]any) error {
	meta, _ := patch["metadata"].(map[string]any)
	if meta == nil {
		meta = map[string]any{}
		patch["metadata"] = meta
	}
	meta["resourceVersion"] = node.ResourceVersion
	data, err := json.Marshal(patch)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, c.cfg.APITimeout)
	defer cancel()
	if _, err := c.client.CoreV1().Nodes().Patch(ctx, node.Name, types.MergePatchType, data, metav1.PatchOptions{}); err != nil {
		return fmt.Errorf("patch node %s: %w", node.Name, err)
	}
	return nil
}

// event sends an events.k8s.io event; a dry run's notes carry the prefix
// already.
func (c *Controller) event(regarding, related runtime.Object, eventtype, reason, action, format string, args ...any) {
	if c.rec == nil {
		return
	}
	note := fmt.Sprintf(format, args...)
	if len(note) > 1000 {
		note = note[:997] + "..."
	}
	c.rec.Eventf(regarding, related, eventtype, reason, action, "%s", note)
}
