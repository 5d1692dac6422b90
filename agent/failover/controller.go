package failover

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/time/rate"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	coordinationlisters "k8s.io/client-go/listers/coordination/v1"
	corelisters "k8s.io/client-go/listers/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/events"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/agent/coldpages"
	"github.com/mountmedic/mountmedic/agent/kubeclient"
)

// ReportingController names the controller in the events it writes;
// deploy/controller/failover-events-policy.yaml admits them only from its
// ServiceAccount.
const ReportingController = "mountmedic.io/failover"

// Event reasons.
const (
	ReasonFailedOver       = "FailedOver"
	ReasonFailoverFailed   = "FailoverFailed"
	ReasonFailoverDeferred = "FailoverDeferred"
	ReasonFailoverHeld     = "FailoverHeld"
	ReasonNodeRecovered    = "FailoverEnded"
	ReasonOperatorTaint    = "OutOfServiceByOperator"
	// ReasonFailoverLeft is on a pod with a ReadWriteOnce volume that
	// stays on a dead node: not eligible, or not in the node's fence plan.
	ReasonFailoverLeft = "FailoverLeft"
	// ReasonStandDown and ReasonStandDownOver are on the leader Lease:
	// too many nodes are not Ready at once to fail any over, and no longer.
	ReasonStandDown     = "FailoverStandDown"
	ReasonStandDownOver = "FailoverStandDownOver"
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

// Controller is the cluster side of the duty, run by `mountmedic
// controller` (a Deployment; agents never run it). Its replicas elect one
// leader through the Lease ControllerConfig.LeaderLease; the leader watches
// the nodes in scope, their kubelet Leases and their heartbeat Leases
// (stripped to the fields it reads), judges a node when one of them changes
// or when its evidence comes of age (a work queue, one key per node, with
// per-node backoff), re-reads the node and both Leases from the API server
// before it acts, and fails confirmed-dead nodes over, at most MaxNodes at
// a time, standing down while too many nodes are not Ready at once. The
// standbys keep no state: everything a new leader needs is on the API
// server (the taint or mark on the node), so a leader change mid-failover
// repeats nothing.
type Controller struct {
	cfg    ControllerConfig
	client kubernetes.Interface
	// leases renews the leader Lease (NewLeaderElectionClient).
	leases   kubernetes.Interface
	metrics  *controllerMetrics
	selector labels.Selector
	now      func() time.Time
	rec      eventRecorder
	claims   *claimCache
	// watchHook, when set (tests), wraps the list-watch of each informer
	// ("nodes", "kubelet-leases", "heartbeat-leases"): a test makes one
	// lag to show that the fresh reads catch it.
	watchHook func(kind string, lw cache.ListerWatcher) cache.ListerWatcher
}

// The controller's client rate, `mountmedic controller`'s --kube-api-qps
// and --kube-api-burst defaults: leader election has a client of its own
// (NewLeaderElectionClient), so this is the events, fresh reads, lists of a
// dead node's pods, taints and deletions.
const (
	DefaultControllerQPS   = 20
	DefaultControllerBurst = 40
)

// NewLeaderElectionClient returns the client the controller renews its
// leader Lease with: a copy of rc with its own rate limiter (QPS 5, burst
// 10: a renewal every RetryPeriod) and its own connections, so that a
// renewal never waits behind the leader's own work. Sharing one rate
// limiter, a burst of work (a new term announcing every node that is not
// Ready after an API-server outage, with fresh reads and events) queued
// the renewals behind it; a renewal late past RenewDeadline loses the
// lease, and the next term announces every node again. kube-controller-
// manager gives its leader election a client of its own for the same
// reason.
func NewLeaderElectionClient(rc *rest.Config) (kubernetes.Interface, error) {
	cl, err := ownClient(rc, "leader-election")
	if err != nil {
		return nil, fmt.Errorf("leader election client: %w", err)
	}
	return cl, nil
}

// ownClient is a copy of rc with a rate limiter of its own (QPS 5, burst
// 10) and connections of its own; suffix is added to its user agent.
func ownClient(rc *rest.Config, suffix string) (kubernetes.Interface, error) {
	c := rest.CopyConfig(rc)
	c.QPS, c.Burst, c.RateLimiter = 5, 10, nil
	// A dialer of its own gives the client its own transport (client-go
	// shares one transport between configs with the same TLS settings).
	c.Dial = (&net.Dialer{Timeout: 10 * time.Second, KeepAlive: 30 * time.Second}).DialContext
	if c.UserAgent != "" {
		c.UserAgent += " " + suffix
	}
	return kubeclient.New(c)
}

// NewController prepares the cluster side. client makes its calls (watches,
// events, fresh reads, pod lists, taints, deletions); leases, made by
// NewLeaderElectionClient, renews the leader Lease. reg receives the
// metrics (nil: none).
func NewController(cfg ControllerConfig, client, leases kubernetes.Interface, reg prometheus.Registerer) (*Controller, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if client == nil || leases == nil {
		return nil, errors.New("failover controller needs a Kubernetes client and a leader election client (NewLeaderElectionClient)")
	}
	sel, err := labels.Parse(cfg.NodeSelector)
	if err != nil {
		return nil, fmt.Errorf("--failover-node-selector %q: %w", cfg.NodeSelector, err)
	}
	m, err := newControllerMetrics(reg)
	if err != nil {
		return nil, err
	}
	return &Controller{cfg: cfg, client: client, leases: leases, metrics: m, selector: sel, now: time.Now,
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
		"kubeletGrace", c.cfg.KubeletGrace, "maxNodes", c.cfg.MaxNodes, "standDownShare", c.cfg.StandDownShare, "nodeSelector", c.cfg.NodeSelector,
		"trustShutdownTaint", c.cfg.TrustShutdownTaint, "dryRun", c.cfg.DryRun)
	if c.rec == nil {
		b := events.NewBroadcaster(&events.EventSinkImpl{Interface: c.client.EventsV1()})
		if err := b.StartRecordingToSinkWithContext(ctx); err != nil {
			return fmt.Errorf("start event recorder: %w", err)
		}
		defer b.Shutdown()
		c.rec = b.NewRecorder(scheme.Scheme, ReportingController)
	}
	if c.cfg.ReleaseCode > 0 {
		rctx, stop := context.WithCancel(ctx)
		released := make(chan struct{})
		defer func() {
			stop()
			<-released
		}()
		go func() {
			defer close(released)
			n := 0
			coldpages.Every(rctx, releaseCodeFirst, c.cfg.ReleaseCode, func(res coldpages.Result, err error) {
				coldpages.Log(logger, n, res, err)
				n++
			})
		}()
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

// releaseCodeFirst is when the controller first gives back the pages of its
// executable it no longer uses: start-up, and the first list of every
// node and Lease, are done by then.
const releaseCodeFirst = 30 * time.Second

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
		Client:     c.leases.CoordinationV1(),
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
	// leftReported: the pods this outage leaves on the node were reported.
	leftReported bool
	// planHeld: a dead node with nothing planned to move was reported.
	planHeld bool
}

// term is one leadership term: the watches, the queue and what the leader
// remembers. Only the worker goroutine touches obs, state, dead, failing
// and standingDown.
type term struct {
	c         *Controller
	nodes     corelisters.NodeLister
	kubelet   coordinationlisters.LeaseNamespaceLister
	heartbeat coordinationlisters.LeaseNamespaceLister
	informers []cache.SharedIndexInformer
	queue     workqueue.TypedRateLimitingInterface[string]
	sight     *sight
	isLeader  func() bool

	obs   *observer
	state map[string]*nodeState
	// dead are the judged nodes that look dead: not Ready, kubelet silent
	// for KubeletGrace (cached view);
	// failing those in failover (acted on, eligible pods left).
	dead, failing map[string]bool
	standingDown  bool
	// regains is the sight's count when the worker last restarted the
	// silence clocks.
	regains int
}

// regainKey is a queue key no node has (node names are DNS subdomains): it
// wakes the worker when sight returns.
const regainKey = "/regained"

// newTerm builds the term's informers (not started) and queue.
func (c *Controller) newTerm(isLeader func() bool) *term {
	t := &term{c: c, isLeader: isLeader, obs: newObserver(), state: map[string]*nodeState{},
		dead: map[string]bool{}, failing: map[string]bool{}, sight: newSight(c.now)}
	// Per node: an exponential backoff after a failed action, 1 s to 2 min;
	// overall, at most 10 retries a second (a burst of 50).
	t.queue = workqueue.NewTypedRateLimitingQueueWithConfig(
		workqueue.NewTypedMaxOfRateLimiter(
			workqueue.NewTypedItemExponentialFailureRateLimiter[string](time.Second, 2*time.Minute),
			&workqueue.TypedBucketRateLimiter[string]{Limiter: rate.NewLimiter(rate.Limit(10), 50)}),
		workqueue.TypedRateLimitingQueueConfig[string]{Name: "mountmedic_failover"})
	t.sight.regained = func() { t.queue.Add(regainKey) }

	hook := func(kind string, lw cache.ListerWatcher) cache.ListerWatcher {
		if c.watchHook != nil {
			return c.watchHook(kind, lw)
		}
		return lw
	}
	sel := c.cfg.NodeSelector
	nodes := c.client.CoreV1().Nodes()
	nodeInf := t.informer(hook("nodes", t.sight.listWatch(
		func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.LabelSelector = sel
			return nodes.List(ctx, o)
		},
		func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.LabelSelector = sel
			return nodes.Watch(ctx, o)
		})), &corev1.Node{}, stripNode)
	t.nodes = corelisters.NewNodeLister(nodeInf.GetIndexer())

	leaseInf := func(kind, ns, selector string) cache.SharedIndexInformer {
		leases := c.client.CoordinationV1().Leases(ns)
		return t.informer(hook(kind, t.sight.listWatch(
			func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
				o.LabelSelector = selector
				return leases.List(ctx, o)
			},
			func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
				o.LabelSelector = selector
				return leases.Watch(ctx, o)
			})), &coordinationv1.Lease{}, stripLease)
	}
	t.kubelet = coordinationlisters.NewLeaseLister(leaseInf("kubelet-leases", KubeletLeaseNamespace, "").GetIndexer()).Leases(KubeletLeaseNamespace)
	hbSel := labels.SelectorFromSet(labels.Set{HeartbeatLabel: HeartbeatLabelValue}).String()
	t.heartbeat = coordinationlisters.NewLeaseLister(leaseInf("heartbeat-leases", c.cfg.Namespace, hbSel).GetIndexer()).Leases(c.cfg.Namespace)
	return t
}

// informer makes an informer whose every event queues the node it names
// (a Node, or a Lease named after its node).
func (t *term) informer(lw cache.ListerWatcher, obj runtime.Object, transform cache.TransformFunc) cache.SharedIndexInformer {
	inf := cache.NewSharedIndexInformerWithOptions(lw, obj, cache.SharedIndexInformerOptions{})
	_ = inf.SetTransform(transform) // cannot fail before Run
	enqueue := func(obj any) {
		if tomb, ok := obj.(cache.DeletedFinalStateUnknown); ok {
			obj = tomb.Obj
		}
		if m, err := meta.Accessor(obj); err == nil {
			t.queue.Add(m.GetName())
		}
	}
	_, _ = inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    enqueue,
		UpdateFunc: func(_, n any) { enqueue(n) },
		DeleteFunc: enqueue,
	})
	t.informers = append(t.informers, inf)
	return inf
}

// lead runs the leader's term until ctx ends.
func (c *Controller) lead(ctx context.Context, isLeader func() bool) {
	logger := klog.FromContext(ctx)
	c.metrics.leader.Set(1)
	defer c.metrics.leader.Set(0)
	defer c.metrics.inFailover.Set(0)
	defer c.metrics.standDown.Set(0)
	defer c.metrics.nodesDead.Set(0)
	defer c.metrics.nodesJudged.Set(0)
	logger.Info("Became the failover leader; judging nodes only after watching them for a full window")

	t := c.newTerm(isLeader)
	defer t.queue.ShutDown()
	var wg sync.WaitGroup
	defer wg.Wait()
	ictx, stop := context.WithCancel(ctx)
	defer stop()
	for _, inf := range t.informers {
		wg.Go(func() { inf.RunWithContext(ictx) })
	}
	for _, inf := range t.informers {
		if !cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
			if ctx.Err() == nil {
				logger.Error(nil, "Failover informer did not sync")
			}
			return
		}
	}
	go func() {
		<-ctx.Done()
		t.queue.ShutDown()
	}()
	for t.next(ctx) {
	}
	logger.Info("Stopped leading the failover duty")
}

// next processes one queued node; false once the queue shuts down.
func (t *term) next(ctx context.Context) bool {
	name, quit := t.queue.Get()
	if quit {
		return false
	}
	defer t.queue.Done(name)
	if ctx.Err() != nil {
		return false
	}
	t.process(ctx, name)
	return true
}

// errRetry asks for the node to be judged again after its backoff.
var errRetry = errors.New("retry after backoff")

// process judges one node from the informers' view and acts on it.
func (t *term) process(ctx context.Context, name string) {
	c := t.c
	now := c.now()
	t.checkSight(ctx, now)
	if name == regainKey {
		return
	}
	logger := klog.FromContext(ctx).WithValues("node", klog.KRef("", name))
	ctx = klog.NewContext(ctx, logger)
	node, err := t.nodes.Get(name)
	if err != nil {
		// Gone, or out of the selector's scope.
		t.forget(name)
		t.updateStandDown(ctx)
		return
	}
	kl, _ := t.kubelet.Get(name)
	hb, _ := t.heartbeat.Get(name)
	ev := c.cfg.gather(t.obs, node, kl, hb, now)
	j := c.cfg.judge(ev)
	st := t.state[name]
	if st == nil {
		st = &nodeState{}
		t.state[name] = st
	}
	err = t.handle(ctx, node, ev, j, st, now)
	t.updateStandDown(ctx)
	c.metrics.inFailover.Set(float64(len(t.failing)))
	if errors.Is(err, errRetry) {
		t.queue.AddRateLimited(name)
		return
	}
	t.queue.Forget(name)
}

// handle is process's decision for one node; errRetry asks for a retry
// after the node's backoff.
func (t *term) handle(ctx context.Context, node *corev1.Node, ev evidence, j judgement, st *nodeState, now time.Time) error {
	c := t.c
	logger := klog.FromContext(ctx)
	name := node.Name
	marked := ev.OutOfService == oosOurs || ev.ForceMarked
	// A node that looks dead counts towards the stand-down: Ready Unknown
	// (the node lifecycle controller's mark of a silent kubelet) and its
	// kubelet silent for KubeletGrace. Nodes that die together turn so
	// together, before any of them is confirmed dead (the heartbeat's window
	// is longer). A node NotReady whose kubelet shows life (no network
	// plugin, a kubelet reporting a problem) is not dying and does not
	// count; kube's node lifecycle controller counts every NotReady node,
	// which on a cluster whose nodes are NotReady for such reasons would
	// stand the controller down for good (found by the e2e node, which has
	// no CNI plugin).
	if ev.Ready == corev1.ConditionUnknown && ev.KubeletSilent >= c.cfg.KubeletGrace {
		t.dead[name] = true
	} else {
		delete(t.dead, name)
	}
	switch {
	case marked && ev.Ready == corev1.ConditionTrue:
		delete(t.failing, name)
		*st = nodeState{verdict: verdictAlive}
		if !c.recover(ctx, node, ev) {
			return errRetry
		}
		return nil
	case marked:
		st.verdict, st.announced = verdictDead, true
		if !st.done {
			done, err := t.continueFailover(ctx, node, ev)
			if err != nil {
				t.failing[name] = true
				return err
			}
			st.done = done
		}
		if st.done {
			delete(t.failing, name)
		} else {
			t.failing[name] = true
			t.queue.AddAfter(name, c.cfg.Recheck)
		}
		return nil
	case st.dryRunActed && ev.Ready != corev1.ConditionTrue:
		t.failing[name] = true
		return nil
	}
	delete(t.failing, name)
	if j.verdict != st.verdict {
		st.deferred, st.dryRunActed, st.nextCheck = false, false, time.Time{}
		st.leftReported, st.planHeld = false, false
	}
	if j.verdict != st.verdict || j.code != st.code {
		st.verdict, st.code, st.announced = j.verdict, j.code, false
	}
	switch j.verdict {
	case verdictDead:
		return t.consider(ctx, node, ev, j, st, now)
	case verdictAlive:
		if !st.announced {
			logger.V(4).Info("Node alive", ev.keysAndValues()...)
			st.announced = true
		}
	default:
		if !st.announced {
			st.announced = true
			logger.Info("Not failing the node over", append([]any{"verdict", j.verdict.String(), "reason", j.why}, ev.keysAndValues()...)...)
			reason := ReasonFailoverHeld
			if j.verdict == verdictOperator {
				reason = ReasonOperatorTaint
			}
			c.event(node, nil, corev1.EventTypeNormal, reason, actionJudge, "Not failing over: %s. Evidence: %s", j.why, ev)
		}
		if d := c.cfg.comesOfAge(ev); d > 0 {
			// Nothing else may happen to this node: judge it again when
			// its silence could be long enough.
			t.queue.AddAfter(name, d+50*time.Millisecond)
		}
	}
	return nil
}

// comesOfAge is how long until a node that is not Ready could be judged
// dead if nothing changes (0: it cannot, or it is not waiting).
func (c *ControllerConfig) comesOfAge(ev evidence) time.Duration {
	if ev.Ready == corev1.ConditionTrue || ev.OutOfService == oosOther {
		return 0
	}
	d := c.KubeletGrace - ev.KubeletSilent
	if ev.Heartbeat == heartbeatHeld {
		d = max(d, ev.FenceWindow-ev.HeartbeatSilent)
	}
	return max(d, 0)
}

// forget drops a node that left the cluster or the scope.
func (t *term) forget(name string) {
	delete(t.state, name)
	delete(t.dead, name)
	delete(t.failing, name)
	t.obs.forgetNode(name)
	t.queue.Forget(name)
}

// checkSight restarts every silence clock once the watches see the API
// server again after they lost it.
func (t *term) checkSight(ctx context.Context, now time.Time) {
	_, since, regains := t.sight.state()
	if regains == t.regains {
		return
	}
	t.regains = regains
	t.obs.restartAll(now)
	t.c.metrics.sightRegained.Inc()
	klog.FromContext(ctx).Info("Watching the API server again after losing it: no silence before now counts; every node must stay silent a full window again",
		"blindSince", since.Format(time.RFC3339), "blindFor", now.Sub(since).Round(time.Second).String(), "nodes", len(t.state))
}

// standDown says whether too many judged nodes look dead (not Ready, kubelet
// silent) to
// act on any: more than two and at least StandDownShare of them, or all of
// them (kube's node lifecycle controller's partial and full disruption).
func (t *term) standDown() bool {
	dead, total := len(t.dead), len(t.state)
	if dead == 0 {
		return false
	}
	return (dead == total && total > 1) || (dead > 2 && float64(dead) >= t.c.cfg.StandDownShare*float64(total))
}

// updateStandDown reports a stand-down beginning or ending.
func (t *term) updateStandDown(ctx context.Context) {
	c := t.c
	c.metrics.nodesDead.Set(float64(len(t.dead)))
	c.metrics.nodesJudged.Set(float64(len(t.state)))
	sd := t.standDown()
	if sd == t.standingDown {
		return
	}
	t.standingDown = sd
	logger := klog.FromContext(ctx)
	lease := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Namespace: c.cfg.Namespace, Name: c.cfg.LeaderLease}}
	if sd {
		c.metrics.standDown.Set(1)
		c.metrics.standDowns.Inc()
		logger.Info("Standing down: too many nodes are not Ready at once to fail any over (a zone or control-plane problem looks like this)",
			"notReadyNodes", len(t.dead), "judgedNodes", len(t.state), "standDownShare", c.cfg.StandDownShare)
		c.event(lease, nil, corev1.EventTypeWarning, ReasonStandDown, actionJudge,
			"%d of %d judged nodes are not Ready (stand-down share %.2f): failing none over until fewer are", len(t.dead), len(t.state), c.cfg.StandDownShare)
		return
	}
	c.metrics.standDown.Set(0)
	logger.Info("Stand-down over: few enough nodes are not Ready", "notReadyNodes", len(t.dead), "judgedNodes", len(t.state))
	c.event(lease, nil, corev1.EventTypeNormal, ReasonStandDownOver, actionJudge,
		"%d of %d judged nodes are not Ready: failing dead nodes over again", len(t.dead), len(t.state))
}

// consider takes a node the informers say is dead towards a fail-over.
// Deferred nodes (blind, stand-down, cap, recheck time) cost no API call.
func (t *term) consider(ctx context.Context, node *corev1.Node, ev evidence, j judgement, st *nodeState, now time.Time) error {
	c := t.c
	logger := klog.FromContext(ctx)
	name := node.Name
	if blind, _, _ := t.sight.state(); blind {
		t.queue.AddAfter(name, c.cfg.Recheck)
		return nil
	}
	if t.standDown() {
		t.queue.AddAfter(name, c.cfg.Recheck)
		return nil
	}
	if now.Before(st.nextCheck) {
		t.queue.AddAfter(name, st.nextCheck.Sub(now))
		return nil
	}
	if len(t.failing) >= c.cfg.MaxNodes {
		if !st.deferred {
			st.deferred = true
			c.metrics.failovers.WithLabelValues(resultDeferred).Inc()
			logger.Info("Node is dead but --failover-max-nodes nodes are in failover already: deferring", append([]any{"inFailover", len(t.failing), "maxNodes", c.cfg.MaxNodes}, ev.keysAndValues()...)...)
			c.event(node, nil, corev1.EventTypeWarning, ReasonFailoverDeferred, actionJudge,
				"Node confirmed dead (%s) but %d node(s) are in failover already (--failover-max-nodes %d): waiting", ev, len(t.failing), c.cfg.MaxNodes)
		}
		t.queue.AddAfter(name, c.cfg.Recheck)
		return nil
	}
	pods, eligible, uncertain, err := c.nodePods(ctx, name)
	if err != nil {
		logger.Error(err, "List the pods of a dead node")
		return errRetry
	}
	if eligible == 0 {
		if !st.announced {
			st.announced = true
			logger.Info("Node is dead but runs no pod to fail over", append([]any{"reason", j.why, "uncertainPods", uncertain}, ev.keysAndValues()...)...)
			c.reportLeft(ctx, node, judgePods(pods, publishedPlan{}, false).left, st)
		}
		// A claim that could not be read is retried after the backoff;
		// otherwise the node is looked at again now and then.
		if uncertain > 0 {
			return errRetry
		}
		st.nextCheck = now.Add(30 * time.Second)
		t.queue.AddAfter(name, 30*time.Second)
		return nil
	}
	acted, err := t.act(ctx, candidate{node: node, ev: ev, why: j.why}, pods, st, now)
	if acted {
		t.failing[name] = true
		t.queue.AddAfter(name, c.cfg.Recheck)
	} else if err == nil && st.nextCheck.After(now) {
		t.queue.AddAfter(name, st.nextCheck.Sub(now))
	}
	return err
}

// candidate is a node judged dead and not yet acted on.
type candidate struct {
	node *corev1.Node
	ev   evidence
	why  string
}

// fresh reads the node and both its Leases from the API server (plain GETs:
// quorum reads, never the watch cache) and judges them with the leader's
// observer: a Lease whose fresh version differs from the one the informer
// gave was renewed meanwhile, which restarts its silence. It returns the
// fresh node, its evidence and the judgement.
func (t *term) fresh(ctx context.Context, name string, now time.Time) (*corev1.Node, evidence, judgement, publishedPlan, error) {
	c := t.c
	get := func(f func(context.Context) error) error {
		cctx, cancel := context.WithTimeout(ctx, c.cfg.APITimeout)
		defer cancel()
		return f(cctx)
	}
	var node *corev1.Node
	var kl, hb *coordinationv1.Lease
	err := get(func(ctx context.Context) (err error) {
		node, err = c.client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		return err
	})
	if err != nil {
		return nil, evidence{}, judgement{}, publishedPlan{}, fmt.Errorf("get node %s: %w", name, err)
	}
	err = get(func(ctx context.Context) (err error) {
		kl, err = c.client.CoordinationV1().Leases(KubeletLeaseNamespace).Get(ctx, name, metav1.GetOptions{})
		return err
	})
	if apierrors.IsNotFound(err) {
		kl, err = nil, nil
	}
	if err != nil {
		return nil, evidence{}, judgement{}, publishedPlan{}, fmt.Errorf("get kubelet lease %s/%s: %w", KubeletLeaseNamespace, name, err)
	}
	err = get(func(ctx context.Context) (err error) {
		hb, err = c.client.CoordinationV1().Leases(c.cfg.Namespace).Get(ctx, name, metav1.GetOptions{})
		return err
	})
	if apierrors.IsNotFound(err) || (err == nil && hb.Labels[HeartbeatLabel] != HeartbeatLabelValue) {
		hb, err = nil, nil
	}
	if err != nil {
		return nil, evidence{}, judgement{}, publishedPlan{}, fmt.Errorf("get heartbeat lease %s/%s: %w", c.cfg.Namespace, name, err)
	}
	// Read from the API server after now: what changed counts as seen
	// when the reads ended (gatherAt).
	seen := c.now()
	if seen.Before(now) {
		seen = now
	}
	ev := c.cfg.gatherAt(t.obs, node, kl, hb, now, seen)
	return node, ev, c.cfg.judge(ev), planOf(hb), nil
}

// confirm re-reads a node before a taint or a pod deletion and reports
// whether the fresh state still says dead; the fresh node carries the
// resourceVersion the action is conditioned on, and the fresh heartbeat
// Lease the fence plan whose deadline the verdict says has passed.
func (t *term) confirm(ctx context.Context, name string, now time.Time) (confirmed, error) {
	node, ev, j, plan, err := t.fresh(ctx, name, now)
	if err != nil {
		return confirmed{}, err
	}
	cf := confirmed{node: node, ev: ev, j: j, plan: plan, dead: j.verdict == verdictDead}
	if !cf.dead {
		t.c.metrics.freshRefusals.Inc()
		klog.FromContext(ctx).Info("Not acting: the node's fresh state from the API server does not confirm it dead (the watch was behind)",
			append([]any{"verdict", j.verdict.String(), "reason", j.why}, ev.keysAndValues()...)...)
	}
	return cf, nil
}

// confirmed is a node's fresh state.
type confirmed struct {
	node *corev1.Node
	ev   evidence
	j    judgement
	plan publishedPlan
	dead bool
}

// judgePods splits the node's pods by the fresh state's plan. A node the
// cloud provider reports shut down (TrustShutdownTaint) runs nothing: its
// plan does not limit.
func (cf confirmed) judgePods(pods []nodePod) failoverPlan {
	return judgePods(pods, cf.plan, cf.j.code == codeShutdown)
}

// eligiblePod is a pod of a dead node that the policy admits.
type eligiblePod struct {
	pod *corev1.Pod
	pvs []string
	// attachments are the VolumeAttachments of its CSI volumes on the
	// node, by name.
	attachments []volumeAttachment
}

// volumeAttachment names the attachment of a PV on a node.
type volumeAttachment struct{ name, pv string }

func podNames(pods []eligiblePod) []string {
	out := make([]string, 0, len(pods))
	for _, p := range pods {
		out = append(out, p.pod.Namespace+"/"+p.pod.Name)
	}
	return out
}

// nodePods lists the pods on node with the policy's decision for each, and
// counts those eligible now and those uncertain (a claim could not be read).
func (c *Controller) nodePods(ctx context.Context, node string) ([]nodePod, int, int, error) {
	cctx, cancel := context.WithTimeout(ctx, c.cfg.APITimeout)
	list, err := c.client.CoreV1().Pods(metav1.NamespaceAll).List(cctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + node})
	cancel()
	if err != nil {
		return nil, 0, 0, fmt.Errorf("list pods of node %s: %w", node, err)
	}
	var out []nodePod
	eligible, uncertain := 0, 0
	for i := range list.Items {
		pod := &list.Items[i]
		claims := c.claims.read(ctx, pod)
		np := nodePod{pod: pod, d: c.cfg.decide(pod, claims)}
		for _, info := range claims {
			if info.Err != nil || readWriteOnce(info.AccessModes) {
				np.rwo = true
			}
			if np.d.Eligible && info.Driver != "" && slices.Contains(np.d.PVs, info.PV) {
				np.attachments = append(np.attachments, volumeAttachment{name: attachmentName(info.VolumeHandle, info.Driver, node), pv: info.PV})
			}
		}
		switch {
		case np.d.Eligible:
			eligible++
		case np.d.Uncertain:
			uncertain++
			klog.FromContext(ctx).Info("Cannot tell whether a pod of a dead node is eligible; trying again", "pod", klog.KObj(pod))
		default:
			klog.FromContext(ctx).V(4).Info("Pod not failed over", "pod", klog.KObj(pod), "reason", np.d.Reason)
		}
		out = append(out, np)
	}
	c.claims.sweep()
	return out, eligible, uncertain, nil
}

// reportLeft makes the pods a fail-over leaves visible: an event on each
// and the pods_left metric, once per outage of the node.
func (c *Controller) reportLeft(ctx context.Context, node *corev1.Node, left []leftPod, st *nodeState) {
	if st.leftReported {
		return
	}
	st.leftReported = true
	logger := klog.FromContext(ctx)
	for _, l := range left {
		c.metrics.podsLeft.WithLabelValues(l.reason).Inc()
		logger.Info("Pod with a ReadWriteOnce volume stays on the dead node", "pod", klog.KObj(l.pod), "podUID", l.pod.UID, "reason", l.reason, "why", l.why)
		prefix := ""
		if c.cfg.DryRun {
			prefix = dryRunPrefix
		}
		c.event(l.pod, node, corev1.EventTypeWarning, ReasonFailoverLeft, actionJudge,
			"%sNode %s is dead but this pod stays there, not failed over: %s. Its ReadWriteOnce volumes stay attached to that node until it returns or someone deletes the pod", prefix, node.Name, l.why)
	}
}

// act fails a dead node over once its fresh state confirms it dead; it
// reports whether the node is in failover now. Only the pods in the fence
// plan the node last published move (judgePods). In taint mode, a node with
// a pod the taint would evict that the node never fenced is not tainted: it
// is marked and only its planned pods are force-deleted, as in force-delete
// mode.
func (t *term) act(ctx context.Context, cd candidate, all []nodePod, st *nodeState, now time.Time) (bool, error) {
	c := t.c
	logger := klog.FromContext(ctx)
	if !t.isLeader() {
		logger.Info("No longer the failover leader: not acting")
		return false, nil
	}
	cf, err := t.confirm(ctx, cd.node.Name, now)
	if err != nil {
		logger.Error(err, "Reading the node's fresh state before failing it over failed")
		return false, errRetry
	}
	if !cf.dead {
		// Judge it again when the fresh evidence could say dead: the
		// informers' view may not change before then (a silent node).
		st.verdict, st.announced = verdictSuspect, false
		t.queue.AddAfter(cd.node.Name, max(c.cfg.comesOfAge(cf.ev), c.cfg.Recheck)+50*time.Millisecond)
		return false, nil
	}
	cd.node, cd.ev, cd.why = cf.node, cf.ev, cf.j.why
	fp := cf.judgePods(all)
	c.reportLeft(ctx, cd.node, fp.left, st)
	if len(fp.move) == 0 {
		why := "no eligible pod of the node is in the fence plan it last published"
		switch {
		case cf.plan.Err != nil:
			why = fmt.Sprintf("its fence plan is unreadable (%v)", cf.plan.Err)
		case !cf.plan.Known && cf.j.code != codeShutdown:
			why = "the node published no fence plan (its agent never listed its pods, or predates fence plans)"
		}
		if !st.planHeld {
			st.planHeld = true
			logger.Info("Node is dead but nothing it fenced can move", append([]any{"why", why, "leftPods", len(fp.left)}, cd.ev.keysAndValues()...)...)
			c.event(cd.node, nil, corev1.EventTypeWarning, ReasonFailoverHeld, actionJudge, "Node confirmed dead (%s) but not failed over: %s", cd.why, why)
		}
		st.nextCheck = now.Add(30 * time.Second)
		if fp.uncertain > 0 {
			return false, errRetry
		}
		return false, nil
	}
	pods := fp.move
	names := podNames(pods)
	force := c.cfg.Mode == ModeForceDelete
	what := fmt.Sprintf("tainted %s=%s:NoExecute", TaintOutOfService, TaintValue)
	if c.cfg.Mode == ModeTaint && len(fp.taintBlockers) > 0 {
		force = true
		blockers := make([]string, 0, len(fp.taintBlockers))
		for _, p := range fp.taintBlockers {
			blockers = append(blockers, p.Namespace+"/"+p.Name)
		}
		what = fmt.Sprintf("did not taint the node (the taint would evict and force-detach %s, which the node never fenced) and force-deleted the fenced pods",
			joinNames(blockers))
	} else if force {
		what = "force-deleted the fenced pods"
	} else if c.cfg.DeletePods {
		what += " and force-deleted the pods"
	}
	if force && c.cfg.ForceDetach {
		what += " and their VolumeAttachments on the node"
	}
	sinceLife := cd.ev.KubeletSilent
	if cd.ev.Heartbeat == heartbeatHeld && cd.ev.HeartbeatSilent < sinceLife {
		sinceLife = cd.ev.HeartbeatSilent
	}
	kv := append([]any{"reason", cd.why, "mode", string(c.cfg.Mode), "forceDelete", force, "pods", names, "leftPods", len(fp.left),
		"sinceLastLife", sinceLife.Round(time.Second).String(), "dryRun", c.cfg.DryRun}, cd.ev.keysAndValues()...)
	if c.cfg.DryRun {
		logger.Info("[dry-run] Would fail the node over", kv...)
		c.event(cd.node, nil, corev1.EventTypeWarning, ReasonFailedOver, actionJudge, "%sWould have %s (%s): node confirmed dead: %s", dryRunPrefix, what, joinNames(names), cd.why)
		for _, p := range pods {
			c.event(p.pod, cd.node, corev1.EventTypeWarning, ReasonFailedOver, actionDelete, "%sWould fail this pod over from dead node %s: %s", dryRunPrefix, cd.node.Name, cd.why)
			c.metrics.podDeletions.WithLabelValues(resultDryRun).Inc()
		}
		c.metrics.failovers.WithLabelValues(resultDryRun).Inc()
		st.dryRunActed, st.announced = true, true
		return true, nil
	}
	if force {
		err = c.mark(ctx, cd.node, now)
	} else {
		err = c.taint(ctx, cd.node, now)
	}
	if err != nil {
		if apierrors.IsConflict(err) {
			// The node changed since the fresh read (perhaps another
			// leader acted): judge it again.
			logger.V(2).Info("Node changed while failing it over; judging it again", "err", err)
			return false, errRetry
		}
		c.metrics.failovers.WithLabelValues(resultFailure).Inc()
		logger.Error(err, "Failing the node over failed", kv...)
		c.event(cd.node, nil, corev1.EventTypeWarning, ReasonFailoverFailed, actionTaint, "Node confirmed dead (%s) but the fail-over failed: %v", cd.why, err)
		return false, errRetry
	}
	logger.Info("Failed the node over", kv...)
	c.metrics.failovers.WithLabelValues(resultSuccess).Inc()
	c.metrics.failedOver.set(cd.node.Name, now)
	c.metrics.deathToAct.Observe(sinceLife.Seconds())
	st.announced = true
	c.event(cd.node, nil, corev1.EventTypeWarning, ReasonFailedOver, actionTaint, "Node confirmed dead: %s. Evidence: %s. mountmedic %s (%s)", cd.why, cd.ev, what, joinNames(names))
	for _, p := range pods {
		c.event(p.pod, cd.node, corev1.EventTypeWarning, ReasonFailedOver, actionDelete, "Failing over from dead node %s (%s): %s", cd.node.Name, what, cd.why)
	}
	if force {
		t.deletePods(ctx, cd.node.Name, pods, true)
	}
	// In taint mode the pods are force-deleted by continueFailover once
	// terminating: the taint eviction controller deletes a pod by name
	// without a UID precondition, so a pod force-deleted before it acts
	// would have its replacement (same name, for a StatefulSet) deleted
	// in its place.
	return true, nil
}

// continueFailover carries on with a node failed over earlier (by this
// leader or a previous one) and reports whether no planned eligible pod is
// left on it. On a marked node (force-delete mode, or taint mode that
// could not taint) it force-deletes the planned pods still there; on a
// tainted one with DeletePods, those the taint eviction controller has
// marked terminating (what the pod garbage collector does every 20 s).
// Before it deletes, it re-reads the node: a node that shows life keeps its
// pods, and only the pods of the plan in the fresh heartbeat Lease move.
func (t *term) continueFailover(ctx context.Context, node *corev1.Node, ev evidence) (bool, error) {
	c := t.c
	all, eligible, uncertain, err := c.nodePods(ctx, node.Name)
	if err != nil {
		klog.FromContext(ctx).Error(err, "List the pods of a failed-over node")
		return false, errRetry
	}
	if eligible == 0 && uncertain == 0 {
		klog.FromContext(ctx).Info("Fail-over of the node is complete: no eligible pod is left on it")
		return true, nil
	}
	if c.cfg.DryRun || !t.isLeader() {
		return false, nil
	}
	cf, err := t.confirm(ctx, node.Name, c.now())
	if err != nil {
		klog.FromContext(ctx).Error(err, "Reading the node's fresh state before deleting its pods failed")
		return false, errRetry
	}
	if !cf.dead {
		return false, nil
	}
	fp := cf.judgePods(all)
	if len(fp.move) == 0 && fp.uncertain == 0 {
		klog.FromContext(ctx).Info("Fail-over of the node is complete: no pod of its fence plan is left on it", "leftPods", len(fp.left))
		return true, nil
	}
	var del []eligiblePod
	switch {
	case ev.ForceMarked:
		del = fp.move
	case c.cfg.DeletePods:
		for _, p := range fp.move {
			if p.pod.DeletionTimestamp != nil {
				del = append(del, p)
			}
		}
	}
	if len(del) > 0 {
		t.deletePods(ctx, node.Name, del, ev.ForceMarked)
	}
	return false, nil
}

// deletePods force-deletes the pods (UID preconditions: a pod recreated
// under the same name is never touched) and, in force-delete mode, their
// VolumeAttachments on node, read and deleted by name.
func (t *term) deletePods(ctx context.Context, node string, pods []eligiblePod, marked bool) {
	c := t.c
	logger := klog.FromContext(ctx)
	var vas []volumeAttachment
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
			vas = append(vas, p.attachments...)
		case apierrors.IsNotFound(err) || apierrors.IsConflict(err):
			vas = append(vas, p.attachments...)
		default:
			c.metrics.podDeletions.WithLabelValues(resultFailure).Inc()
			logger.Error(err, "Force-deleting a pod of a dead node failed", "pod", klog.KObj(p.pod), "podUID", uid)
		}
	}
	if !marked || !c.cfg.ForceDetach {
		return
	}
	for _, ref := range vas {
		if !t.isLeader() {
			return
		}
		cctx, cancel := context.WithTimeout(ctx, c.cfg.APITimeout)
		va, err := c.client.StorageV1().VolumeAttachments().Get(cctx, ref.name, metav1.GetOptions{})
		cancel()
		switch {
		case apierrors.IsNotFound(err):
			continue
		case err != nil:
			logger.Error(err, "Reading a VolumeAttachment of a dead node failed", "volumeAttachment", ref.name, "pv", ref.pv)
			continue
		}
		// The name is a hash of handle, driver and node: check that it is
		// what it should be before deleting it.
		if pv := va.Spec.Source.PersistentVolumeName; va.Spec.NodeName != node || pv == nil || *pv != ref.pv {
			logger.Info("VolumeAttachment under the expected name is not this node's attachment of the volume: left alone", "volumeAttachment", ref.name, "pv", ref.pv, "attachmentNode", va.Spec.NodeName)
			continue
		}
		cctx, cancel = context.WithTimeout(ctx, c.cfg.APITimeout)
		err = c.client.StorageV1().VolumeAttachments().Delete(cctx, va.Name, metav1.DeleteOptions{
			Preconditions: &metav1.Preconditions{UID: &va.UID},
		})
		cancel()
		if err != nil && !apierrors.IsNotFound(err) {
			logger.Error(err, "Deleting a VolumeAttachment of a dead node failed", "volumeAttachment", va.Name, "pv", ref.pv)
			continue
		}
		logger.V(2).Info("Deleted VolumeAttachment of a dead node", "volumeAttachment", va.Name, "pv", ref.pv)
	}
}

func joinNames(names []string) string {
	const max = 10
	if len(names) > max {
		return fmt.Sprintf("%s and %d more", strings.Join(names[:max], ", "), len(names)-max)
	}
	return strings.Join(names, ", ")
}

// recover removes the duty's taint or mark from a node that is Ready again.
// It reports false when that failed.
func (c *Controller) recover(ctx context.Context, node *corev1.Node, ev evidence) bool {
	logger := klog.FromContext(ctx)
	if c.cfg.DryRun {
		logger.Info("[dry-run] Would remove the failover taint: the node is Ready again")
		return true
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
		return false
	}
	c.metrics.recovered.Inc()
	logger.Info("Node is Ready again: removed the failover taint")
	c.event(node, nil, corev1.EventTypeNormal, ReasonNodeRecovered, actionUntaint, "Node is Ready again: removed the %s taint mountmedic applied", TaintOutOfService)
	return true
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
