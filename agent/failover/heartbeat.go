package failover

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	"github.com/mountmedic/mountmedic/agent/kubeclient"
)

// fenceTarget is a pod the fence stops, as it was known before the fence
// (the API server may not answer during one).
type fenceTarget struct {
	UID       string
	Namespace string
	Name      string
}

func (t fenceTarget) String() string {
	if t.Name == "" {
		return "pod uid " + t.UID
	}
	return t.Namespace + "/" + t.Name
}

// Heartbeat is the node side of the duty: it renews this node's heartbeat
// Lease every HeartbeatInterval (jittered), and when it has not managed to
// for FenceAfter it runs a peer check (peer.go) and, unless every peer it
// asks cannot renew either (an API server outage), fences the node: it
// stops the containers of every pod the controller could fail over (and
// those it cannot rule out) and lazily unmounts their volumes, and keeps
// stopping them while the fence lasts. When a renewal succeeds again it
// lifts the fence and deletes the fenced pods that are still there (same
// UID, still on this node) and that the policy fails over, so that their
// controllers recreate them with fresh mounts: such a pod never resumes in
// place on an unmounted volume. A pod fenced without a controller (the plan
// was not known) is left to the operator, with an error log.
//
// Its Lease advertises FenceAfter as leaseDurationSeconds: the promise the
// controller relies on. On a clean stop it releases the Lease (clears the
// holder), which withdraws the promise, so the controller does not fail the
// node over on the heartbeat's silence alone. The Lease is owned by the
// Node (garbage collected with it) and carries the agent's peer address.
//
// Silence is measured on CLOCK_BOOTTIME, so that a suspend counts: a node
// resumed after FenceAfter fences (when its peers can renew) before its
// first renewal is written.
type Heartbeat struct {
	cfg Config
	// client makes the node's other calls (the Node, pods, claims); leases
	// writes and lists the heartbeat Lease only, with its own rate limiter
	// and connections (NewHeartbeatClient).
	client     kubernetes.Interface
	leases     kubernetes.Interface
	containers ContainerStopper
	volumes    VolumeUnmounter
	metrics    *heartbeatMetrics
	// now is the wall clock (the Lease's renewTime); boot the clock silence
	// is measured on (CLOCK_BOOTTIME).
	now  func() time.Time
	boot func() time.Duration
	// jitter returns the wait before the next renewal.
	jitter func(time.Duration) time.Duration
	rand   *rand.Rand
	// checkEvery is the fence check period.
	checkEvery time.Duration

	peerClient  *peerClient // nil: no peer check (no key file)
	peerMetrics *peerMetrics

	claims *claimCache

	// decide serializes the fence decisions (the check loop's and the
	// renewal's own after a suspend) and the fence's lifting.
	decide sync.Mutex

	mu            sync.Mutex
	lease         *coordinationv1.Lease
	lastOK        time.Duration // boot clock: start of the last successful renewal
	lastAttemptOK bool
	// lastAPIOK is when a read with the node's client last succeeded after
	// a failed renewal (boot clock; apiOKSet once there was one).
	lastAPIOK     time.Duration
	apiOKSet      bool
	held          bool          // past FenceAfter, not fenced: an outage
	lastPeerCheck time.Duration // boot clock
	lastRefence   time.Duration // boot clock
	peers         []peerInfo
	peerAddr      string // advertised in the Lease
	nodeUID       types.UID
	plan          []fenceTarget
	planSynced    bool
	// sent are the pods of every plan a write since the last successful
	// one carried, and of that one: what the Lease may hold now. The fence
	// stops them all, so that the controller never moves a pod the node
	// did not fence.
	sent     []fenceTarget
	fenced   []fenceTarget
	isFenced bool
	renewed  chan struct{} // a renewal succeeded
	// apiDue and peersDue wake the peer loop: a renewal failed (probe the
	// API with the node's identity), peers are due to be picked again.
	apiDue, peersDue chan struct{}
	// peerWait is the wait until the next peer refresh, set by the peer
	// loop (peerWaitSet until the renew loop took it).
	peerWait    time.Duration
	peerWaitSet bool
	// degraded is why the peer check cannot hold a fence ("" if it can).
	degraded string
	// rec writes events about this node (nil: none).
	rec eventRecorder
	// podInf is the informer of this node's pods; its owner starts and
	// stops it.
	podInf cache.SharedIndexInformer
}

// heartbeatJitter is the largest share of HeartbeatInterval added to each
// wait between renewals: a renewal every [interval, 1.1 interval], never
// more often than the interval (kubelet's node lease writes once per 10 s).
const heartbeatJitter = 0.1

// NewHeartbeatClient returns the client the heartbeat writes its Lease
// with: a copy of rc with its own rate limiter (QPS 5, burst 10: the
// heartbeat makes one write per interval) and its own connections, so that
// a renewal never waits behind the agent's other calls. rc is the identity
// the Lease is written with (the agent's ServiceAccount).
func NewHeartbeatClient(rc *rest.Config) (kubernetes.Interface, error) {
	cl, err := ownClient(rc, "heartbeat")
	if err != nil {
		return nil, fmt.Errorf("heartbeat client: %w", err)
	}
	return cl, nil
}

// NewHeartbeat prepares the node side. client makes the node's calls (its
// Node, pods, claims, deleting a fenced pod); leases, made by
// NewHeartbeatClient, writes the heartbeat Lease and lists the peers'.
// containers and volumes do the fencing (a *NodeFence does both); reg
// receives the metrics (nil: none).
//
// pods is an informer of the pods bound to cfg.NodeName, which its owner
// starts and stops: the agent's (agent.(*Agent).PodInformer), so that the
// node's pods are watched once.
func NewHeartbeat(cfg Config, client, leases kubernetes.Interface, pods cache.SharedIndexInformer, containers ContainerStopper, volumes VolumeUnmounter, reg prometheus.Registerer) (*Heartbeat, error) {
	if !cfg.Enabled {
		return nil, errors.New("failover heartbeat: the duty is disabled (--failover=false)")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if client == nil || leases == nil || pods == nil || containers == nil || volumes == nil {
		return nil, errors.New("failover heartbeat needs a Kubernetes client, a heartbeat client, a pod informer, a container stopper and a volume unmounter")
	}
	m, err := newHeartbeatMetrics(reg)
	if err != nil {
		return nil, err
	}
	pm, err := newPeerMetrics(reg)
	if err != nil {
		return nil, err
	}
	// The renewals' jitter and the peer loop's shard draw run on their own
	// goroutines: one source, locked.
	r := rand.New(&lockedSource{src: rand.NewPCG(rand.Uint64(), rand.Uint64())})
	h := &Heartbeat{
		cfg: cfg, client: client, leases: leases, podInf: pods, containers: containers, volumes: volumes, metrics: m,
		peerMetrics: pm,
		now:         time.Now, boot: bootClock, rand: r, checkEvery: time.Second,
		claims:  newClaimCache(claimReader{client: client, timeout: cfg.APITimeout}),
		renewed: make(chan struct{}, 1),
		apiDue:  make(chan struct{}, 1), peersDue: make(chan struct{}, 1),
	}
	h.jitter = func(d time.Duration) time.Duration { return jittered(d, h.rand.Float64()) }
	if cfg.PeerKeyFile != "" {
		h.peerClient = newPeerClient(cfg.NodeName, cfg.PeerKeyFile, cfg.PeerTimeout)
		// An agent that listens on one address asks from it too: the peer
		// endpoints limit each source address.
		if host, _, err := net.SplitHostPort(cfg.PeerListen); err == nil {
			if ip := net.ParseIP(host); ip != nil && !ip.IsUnspecified() {
				h.peerClient.askFrom(ip)
			}
		}
	}
	return h, nil
}

// jittered is d plus up to heartbeatJitter of it, for u in [0, 1).
func jittered(d time.Duration, u float64) time.Duration {
	return d + time.Duration(float64(d)*heartbeatJitter*u)
}

// Fenced reports whether the pod with UID podUID is fenced now. The agent's
// repair loop must leave a fenced pod's volumes alone: re-publishing them
// would undo the fence.
func (h *Heartbeat) Fenced(podUID string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.isFenced || h.cfg.DryRun {
		return false
	}
	return slices.ContainsFunc(h.fenced, func(t fenceTarget) bool { return t.UID == podUID })
}

// Run renews the heartbeat and fences when due, until ctx ends. It returns
// an error only when it cannot start.
func (h *Heartbeat) Run(ctx context.Context) error {
	logger := klog.FromContext(ctx).WithValues("node", h.cfg.NodeName, "lease", klog.KRef(h.cfg.Namespace, h.cfg.NodeName))
	ctx = klog.NewContext(ctx, logger)

	if h.rec == nil {
		b := events.NewBroadcaster(kubeclient.NodeEventSink{EventSink: &events.EventSinkImpl{Interface: h.client.EventsV1()}, Node: h.cfg.NodeName})
		if err := b.StartRecordingToSinkWithContext(ctx); err != nil {
			logger.Error(err, "Cannot record failover events; logging only")
		} else {
			defer b.Shutdown()
			h.rec = b.NewRecorder(scheme.Scheme, NodeReportingController)
		}
	}
	stopPeers := func() {}
	if h.peerClient != nil {
		if _, err := readPeerKey(h.cfg.PeerKeyFile); err != nil {
			logger.Error(err, "Failover peer key unusable now: until it is, peer checks count every peer as silent and an API server outage fences this node")
		}
		addr, stop, err := h.servePeers(ctx)
		if err != nil {
			return err
		}
		stopPeers = stop
		if addr == "" {
			logger.Error(nil, "No address to advertise for the failover peer endpoint (set POD_IP or --failover-peer-advertise): peers cannot ask this agent")
		}
		h.mu.Lock()
		h.peerAddr = addr
		h.mu.Unlock()
	} else {
		logger.Error(nil, "No --failover-peer-key-file: no peer check, so an API server outage longer than --failover-fence-after fences this node's RWO pods")
		h.peerMetrics.degraded.WithLabelValues(degradedNoKey).Set(1)
		h.degraded = degradedNoKey
		h.nodeEvent(corev1.EventTypeWarning, ReasonPeerCheckDegraded, "Failover peer check off (no peer key): an API server outage longer than %s fences this node's pods with ReadWriteOnce volumes", h.cfg.FenceAfter)
	}
	defer stopPeers()
	logger.Info("Starting failover heartbeat", "interval", h.cfg.HeartbeatInterval, "fenceAfter", h.cfg.FenceAfter,
		"fenceStopGrace", h.cfg.FenceStopGrace, "peerCheck", h.peerClient != nil, "peerAddress", h.peerAddr, "dryRun", h.cfg.DryRun)

	// Until its first renewal an agent cannot know how long ago its
	// predecessor's promise lapsed (a crash, a restart on a partitioned
	// node): it fences if it cannot renew within two intervals.
	h.mu.Lock()
	h.lastOK = h.boot() - h.cfg.FenceAfter + 2*h.cfg.HeartbeatInterval
	h.mu.Unlock()

	var wg sync.WaitGroup
	wg.Go(func() { h.renewLoop(ctx, h.podInf.HasSynced) })
	if h.peerClient != nil {
		wg.Go(func() { h.peerLoop(ctx) })
	}
	h.checkLoop(ctx)
	wg.Wait()
	h.shutdown(klog.NewContext(context.WithoutCancel(ctx), logger))
	return nil
}

func (h *Heartbeat) renewLoop(ctx context.Context, synced func() bool) {
	logger := klog.FromContext(ctx)
	t := time.NewTimer(0)
	defer t.Stop()
	failures := 0
	var nextPeers time.Duration // boot clock
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if err := h.renew(ctx); err != nil {
			h.metrics.renewals.WithLabelValues(resultFailure).Inc()
			failures++
			if ctx.Err() == nil {
				// The first failure in a row is Info; the fence itself
				// logs at error level.
				logger.Info("Heartbeat renewal failed", "err", err, "failuresInARow", failures)
			}
			if h.peerClient != nil {
				signal(h.apiDue)
			}
		} else {
			h.metrics.renewals.WithLabelValues(resultSuccess).Inc()
			if failures > 0 {
				logger.Info("Heartbeat renewed again", "afterFailures", failures)
			}
			failures = 0
			signal(h.renewed)
			h.ensureNodeUID(ctx)
			if h.peerClient != nil && h.boot() >= nextPeers {
				// The peer loop sets the next time once it knows how
				// many peers it found; until then, not again.
				nextPeers = h.boot() + h.cfg.PeerRefresh
				signal(h.peersDue)
			}
			if d, ok := h.takePeerWait(); ok {
				nextPeers = h.boot() + d
			}
			if synced() {
				h.refreshPlan(ctx)
			}
		}
		t.Reset(h.jitter(h.cfg.HeartbeatInterval))
	}
}

// signal wakes the loop waiting on ch, unless it has a wake-up pending.
func signal(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// peerLoop does the peer check's API calls and probes beside the renewals,
// never in their way: a slow list of the heartbeat Leases, or peers slow
// to answer, must not delay the next renewal. After a failed renewal it
// probes the API server's readiness (canRenew); when peers are due
// it picks them again and probes them.
func (h *Heartbeat) peerLoop(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			return
		case <-h.apiDue:
			h.probeAPI(ctx)
		case <-h.peersDue:
			wait := h.cfg.PeerRefresh
			if h.refreshPeers(ctx) < h.cfg.Peers {
				// A young cluster, or the agents are still starting:
				// look again sooner (a minute with the defaults).
				wait = min(wait, 6*h.cfg.HeartbeatInterval)
			}
			h.mu.Lock()
			h.peerWait, h.peerWaitSet = h.jitter(wait), true
			h.mu.Unlock()
			h.probePeers(ctx)
		}
	}
}

// takePeerWait returns the wait until the next peer refresh that the peer
// loop set since the last call, if any.
func (h *Heartbeat) takePeerWait() (time.Duration, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	d, ok := h.peerWait, h.peerWaitSet
	h.peerWaitSet = false
	return d, ok
}

// ensureNodeUID reads the Node's UID once, for the Lease's owner reference
// (the next renewal adds it), so that the Lease goes with its Node.
func (h *Heartbeat) ensureNodeUID(ctx context.Context) {
	h.mu.Lock()
	known := h.nodeUID != ""
	h.mu.Unlock()
	if known {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, h.cfg.APITimeout)
	defer cancel()
	node, err := h.client.CoreV1().Nodes().Get(ctx, h.cfg.NodeName, metav1.GetOptions{})
	if err != nil {
		klog.FromContext(ctx).V(2).Info("Cannot read this node for the heartbeat Lease's owner; the Lease is written without one", "err", err)
		return
	}
	h.mu.Lock()
	h.nodeUID = node.UID
	h.mu.Unlock()
}

// renew writes the heartbeat Lease once. Success moves lastOK to the time
// the attempt started: the API server wrote the renewal at that time or
// later, so the controller, which counts from when it saw the change,
// always waits at least FenceAfter past the agent's own deadline.
//
// A renewal that starts past FenceAfter without the fence decided (the
// process did not run: a suspend, a paused VM) decides it first: the
// controller may have failed the node over meanwhile.
func (h *Heartbeat) renew(ctx context.Context) error {
	start, wall := h.boot(), h.now()
	h.mu.Lock()
	lapsed := start-h.lastOK >= h.cfg.FenceAfter && !h.isFenced && !h.held
	h.mu.Unlock()
	if lapsed {
		h.lapse(ctx)
	}
	err := h.write(ctx, wall)
	h.mu.Lock()
	h.lastAttemptOK = err == nil
	wasHeld := false
	if err == nil {
		if start > h.lastOK {
			h.lastOK = start
		}
		wasHeld, h.held = h.held, false
	}
	h.mu.Unlock()
	if err != nil {
		return err
	}
	if wasHeld {
		h.peerMetrics.held.Set(0)
		klog.FromContext(ctx).Info("Heartbeat renewed after an outage its peers shared: no fence")
	}
	h.metrics.lastOK.Set(float64(wall.UnixNano()) / 1e9)
	return nil
}

// write creates or updates the Lease. An attempt may take longer than the
// interval (a slow answer still counts from the attempt's start, which is
// safe): a deadline of one interval made a loaded API server look dead.
func (h *Heartbeat) write(ctx context.Context, wall time.Time) error {
	ctx, cancel := context.WithTimeout(ctx, min(h.cfg.APITimeout, h.cfg.FenceAfter/2))
	defer cancel()
	leases := h.leases.CoordinationV1().Leases(h.cfg.Namespace)

	h.mu.Lock()
	cur := h.lease
	var plan []fenceTarget
	// A dry-run agent stops nothing, so it publishes no plan: the
	// controller moves no pod of its node.
	if h.planSynced && !h.cfg.DryRun {
		plan = slices.Clone(h.plan)
		if plan == nil {
			plan = []fenceTarget{}
		}
	}
	// Whatever happens to this write, the Lease may carry its plan from
	// now on (a write that timed out may have landed), and so the fence,
	// if it stands, covers it too.
	h.sent = unionTargets(h.sent, plan)
	if h.isFenced {
		h.fenced = unionTargets(h.fenced, plan)
	}
	h.mu.Unlock()
	var got *coordinationv1.Lease
	var err error
	for attempt := 0; attempt < 2; attempt++ {
		if cur == nil {
			cur, err = leases.Get(ctx, h.cfg.NodeName, metav1.GetOptions{})
			if apierrors.IsNotFound(err) {
				got, err = leases.Create(ctx, h.leaseSpec(&coordinationv1.Lease{}, wall, plan), metav1.CreateOptions{})
				break
			}
			if err != nil {
				return fmt.Errorf("get heartbeat lease: %w", err)
			}
		}
		got, err = leases.Update(ctx, h.leaseSpec(cur.DeepCopy(), wall, plan), metav1.UpdateOptions{})
		if apierrors.IsConflict(err) {
			cur = nil
			continue
		}
		break
	}
	if err != nil {
		h.mu.Lock()
		if apierrors.IsConflict(err) || apierrors.IsNotFound(err) {
			h.lease = nil
		}
		if apierrors.IsNotFound(err) {
			// Collected with a Node of the same name (recreated): read
			// the owner again.
			h.nodeUID = ""
		}
		h.mu.Unlock()
		return fmt.Errorf("renew heartbeat lease: %w", err)
	}
	h.mu.Lock()
	h.lease = got
	// Every write is conditioned on the resourceVersion: none sent before
	// this one can land after it, so the Lease holds this plan alone.
	h.sent = plan
	h.mu.Unlock()
	return nil
}

// leaseSpec fills l as this node's heartbeat, renewed at now, publishing
// plan as its fence plan (nil: not known yet, none published).
func (h *Heartbeat) leaseSpec(l *coordinationv1.Lease, now time.Time, plan []fenceTarget) *coordinationv1.Lease {
	l.Name, l.Namespace = h.cfg.NodeName, h.cfg.Namespace
	if l.Labels == nil {
		l.Labels = map[string]string{}
	}
	l.Labels[HeartbeatLabel] = HeartbeatLabelValue
	l.Labels["app.kubernetes.io/name"] = "mountmedic"
	l.Labels[PeerShardLabel] = peerShard(h.cfg.NodeName)
	h.mu.Lock()
	addr, uid := h.peerAddr, h.nodeUID
	h.mu.Unlock()
	if addr != "" {
		if l.Annotations == nil {
			l.Annotations = map[string]string{}
		}
		l.Annotations[PeerAddressAnnotation] = addr
	} else {
		delete(l.Annotations, PeerAddressAnnotation)
	}
	if plan != nil {
		if l.Annotations == nil {
			l.Annotations = map[string]string{}
		}
		l.Annotations[FencePlanAnnotation] = encodeFencePlan(h.fenceDeadline(), plan)
	} else {
		delete(l.Annotations, FencePlanAnnotation)
	}
	if uid != "" {
		// Owned by the Node, so that it is collected with it. No
		// blockOwnerDeletion: nothing waits on a heartbeat.
		owner := metav1.OwnerReference{APIVersion: "v1", Kind: "Node", Name: h.cfg.NodeName, UID: uid}
		refs := slices.DeleteFunc(l.OwnerReferences, func(r metav1.OwnerReference) bool { return r.Kind == "Node" && r.APIVersion == "v1" })
		l.OwnerReferences = append(refs, owner)
	}
	if l.Spec.HolderIdentity == nil || *l.Spec.HolderIdentity != h.cfg.Identity {
		l.Spec.AcquireTime = &metav1.MicroTime{Time: now}
		if l.Spec.LeaseTransitions == nil {
			l.Spec.LeaseTransitions = ptr.To[int32](0)
		} else {
			l.Spec.LeaseTransitions = ptr.To(*l.Spec.LeaseTransitions + 1)
		}
	}
	l.Spec.HolderIdentity = ptr.To(h.cfg.Identity)
	// The promise, as the plan states it: the controller's watch keeps no
	// annotations, so its view and its fresh reads agree.
	l.Spec.LeaseDurationSeconds = ptr.To(int32((h.fenceDeadline() + time.Second - 1) / time.Second))
	l.Spec.RenewTime = &metav1.MicroTime{Time: now}
	return l
}

// fenceDeadline is the deadline the plan promises, counted from the
// renewal that carries it: the fence starts FenceAfter after the last
// renewal, or, with a peer check, once the check has ended, which may take
// twice PeerTimeout (its budget for peers that ask to be asked again).
func (h *Heartbeat) fenceDeadline() time.Duration {
	d := h.cfg.FenceAfter
	if h.peerClient != nil {
		d += 2 * h.cfg.PeerTimeout
	}
	return d
}

// refreshPlan recomputes the pods a fence would stop: the pods of this node
// the controller could fail over, and those it cannot rule out because a
// claim could not be read.
func (h *Heartbeat) refreshPlan(ctx context.Context) {
	var plan []fenceTarget
	for _, obj := range h.podInf.GetIndexer().List() {
		pod, ok := obj.(*corev1.Pod)
		if !ok || pod.Spec.NodeName != h.cfg.NodeName {
			continue
		}
		d := h.cfg.decide(pod, h.claims.read(ctx, pod))
		if d.Eligible || d.Uncertain {
			plan = append(plan, fenceTarget{UID: string(pod.UID), Namespace: pod.Namespace, Name: pod.Name})
		}
	}
	// Every pod of the node was read: the claims none uses any more go.
	h.claims.sweep()
	slices.SortFunc(plan, func(a, b fenceTarget) int {
		return cmp.Or(strings.Compare(a.Namespace, b.Namespace), strings.Compare(a.Name, b.Name), strings.Compare(a.UID, b.UID))
	})
	h.mu.Lock()
	h.plan, h.planSynced = plan, true
	h.mu.Unlock()
}

func (h *Heartbeat) checkLoop(ctx context.Context) {
	t := time.NewTicker(h.checkEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-h.renewed:
		}
		now := h.boot()
		h.mu.Lock()
		silent, fenced, lastRefence := now-h.lastOK, h.isFenced, h.lastRefence
		h.mu.Unlock()
		switch {
		case !fenced && silent >= h.cfg.FenceAfter:
			h.lapse(ctx)
		case fenced && silent < h.cfg.FenceAfter:
			h.decide.Lock()
			h.unfence(ctx)
			h.decide.Unlock()
		case fenced && now-lastRefence >= h.cfg.HeartbeatInterval:
			// kubelet restarts stopped containers (onto the unmounted
			// directories): keep stopping them while the fence lasts.
			h.refence(ctx)
		}
	}
}

// lapse decides what a heartbeat past FenceAfter means: unless every peer
// asked cannot renew either (an outage: hold, and ask again every
// HeartbeatInterval), fence.
func (h *Heartbeat) lapse(ctx context.Context) {
	logger := klog.FromContext(ctx)
	h.decide.Lock()
	defer h.decide.Unlock()
	now := h.boot()
	h.mu.Lock()
	silent, fenced, held, lastCheck := now-h.lastOK, h.isFenced, h.held, h.lastPeerCheck
	h.mu.Unlock()
	if fenced || silent < h.cfg.FenceAfter || (held && now-lastCheck < h.cfg.HeartbeatInterval) {
		return
	}
	v, tally := h.askPeers(ctx)
	h.peerMetrics.checks.WithLabelValues(v.String()).Inc()
	h.mu.Lock()
	h.lastPeerCheck = h.boot()
	if v == verdictOutage {
		h.held = true
	}
	h.mu.Unlock()
	if v == verdictOutage {
		h.peerMetrics.held.Set(1)
		if !held {
			logger.Error(nil, "Heartbeat not renewed, but every peer asked cannot renew either: an API server outage, not fencing",
				"silent", silent.Round(time.Second), "fenceAfter", h.cfg.FenceAfter, "peersAsked", tally.Asked, "peersCannot", tally.Cannot)
		}
		return
	}
	if held {
		h.peerMetrics.held.Set(0)
	}
	if held && v == verdictPeerRenews {
		// The outage is over for a peer. Nobody could act on this node's
		// silence during it (that is what holding relies on), so the
		// promise runs again from the last check that found the outage:
		// if this node still cannot renew FenceAfter later while a peer
		// can, it fences. Without this, the nodes that reconnect last
		// after an outage would all fence, and their pods be deleted.
		h.mu.Lock()
		h.lastOK = max(h.lastOK, lastCheck)
		h.held = false
		h.mu.Unlock()
		logger.Info("A peer renews again after the outage: this node fences if it cannot renew within --failover-fence-after",
			"fenceAfter", h.cfg.FenceAfter)
		return
	}
	h.fence(ctx, silent, v, tally)
}

// fence stops and unmounts the planned pods.
func (h *Heartbeat) fence(ctx context.Context, silent time.Duration, v peerVerdict, tally peerTally) {
	logger := klog.FromContext(ctx)
	h.mu.Lock()
	// The plan now, and every plan the Lease may hold: the controller
	// moves only pods of the published one, so each of them is fenced.
	targets, synced := unionTargets(h.plan, h.sent), h.planSynced
	h.mu.Unlock()
	if !synced {
		// Never reached the API server: fence every pod with a CSI
		// volume mounted, since none can be ruled out.
		uids, err := h.volumes.MountedPods(ctx)
		if err != nil {
			logger.Error(err, "Fence: cannot list the pods with CSI volumes; fencing none")
		}
		for _, uid := range uids {
			targets = unionTargets(targets, []fenceTarget{{UID: uid}})
		}
	}
	h.mu.Lock()
	h.fenced, h.isFenced, h.held = targets, true, false
	h.lastRefence = h.boot()
	h.mu.Unlock()
	h.metrics.fenced.Set(1)
	h.metrics.fences.Inc()
	names := make([]string, 0, len(targets))
	for _, t := range targets {
		names = append(names, t.String())
	}
	logger.Error(nil, "Heartbeat not renewed: fencing this node's pods with ReadWriteOnce volumes", "silent", silent.Round(time.Second),
		"fenceAfter", h.cfg.FenceAfter, "peerVerdict", v.String(), "peersAsked", tally.Asked, "peersCanRenew", tally.CanRenew,
		"peersCannot", tally.Cannot, "peerAnswersRejected", tally.Rejected, "pods", names, "planKnown", synced, "dryRun", h.cfg.DryRun)
	h.stopAll(ctx, targets)
}

func (h *Heartbeat) refence(ctx context.Context) {
	h.mu.Lock()
	targets := slices.Clone(h.fenced)
	h.lastRefence = h.boot()
	h.mu.Unlock()
	h.stopAll(ctx, targets)
}

// stopAll stops the containers of every target, all at once (each stop
// may take the whole grace period, and the fence must end within the
// controller's margin), then unmounts their volumes: one CRI connection
// and one read of the mount table for the whole round.
func (h *Heartbeat) stopAll(ctx context.Context, targets []fenceTarget) {
	logger := klog.FromContext(ctx)
	if h.cfg.DryRun {
		for _, t := range targets {
			logger.Info("[dry-run] Would stop the containers of the pod and unmount its volumes", "pod", t.String(), "podUID", t.UID)
		}
		return
	}
	if len(targets) == 0 {
		return
	}
	uids := make([]string, len(targets))
	for i, t := range targets {
		uids[i] = t.UID
	}
	for i, r := range h.containers.StopPodContainers(ctx, uids, h.cfg.FenceStopGrace) {
		t := targets[i]
		if r.Err != nil {
			logger.Error(r.Err, "Fence: stopping containers failed", "pod", t.String(), "podUID", t.UID)
		} else if r.N > 0 {
			logger.Info("Fence: stopped containers", "pod", t.String(), "podUID", t.UID, "containers", r.N)
		}
	}
	for i, r := range h.volumes.UnmountPodVolumes(ctx, uids) {
		t := targets[i]
		if r.Err != nil {
			logger.Error(r.Err, "Fence: unmounting volumes failed", "pod", t.String(), "podUID", t.UID)
		} else if r.N > 0 {
			logger.Info("Fence: unmounted volumes lazily", "pod", t.String(), "podUID", t.UID, "mounts", r.N)
		}
	}
}

// unfence lifts the fence after a successful renewal and deletes the
// fenced pods still on this node that the policy fails over (a controller
// owns them and recreates them with fresh mounts). A fenced pod the policy
// would not fail over (no controller, a DaemonSet's, a static pod...) was
// fenced only because the plan was not known; it is never deleted: the
// operator is told to restart it.
func (h *Heartbeat) unfence(ctx context.Context) {
	logger := klog.FromContext(ctx)
	h.mu.Lock()
	targets := slices.Clone(h.fenced)
	h.fenced, h.isFenced = nil, false
	h.mu.Unlock()
	h.metrics.fenced.Set(0)
	logger.Info("Heartbeat renewed: lifting the fence; fenced pods still here that a controller owns are deleted for it to recreate them", "pods", len(targets), "dryRun", h.cfg.DryRun)
	for _, t := range h.named(ctx, targets) {
		pod := h.podByUID(ctx, t)
		if pod == nil {
			logger.V(2).Info("Fenced pod is gone (failed over or deleted)", "pod", t.String(), "podUID", t.UID)
			continue
		}
		if d := h.cfg.decide(pod, h.claims.read(ctx, pod)); !d.Eligible && !d.Uncertain {
			logger.Error(nil, "Fenced pod not deleted, as mountmedic never fails it over: its containers were stopped and its volumes unmounted; restart it by hand (delete the pod) so that it gets fresh mounts",
				"pod", klog.KObj(pod), "podUID", pod.UID, "reason", d.Reason)
			continue
		}
		if h.cfg.DryRun {
			logger.Info("[dry-run] Would delete the fenced pod", "pod", klog.KObj(pod), "podUID", pod.UID)
			continue
		}
		cctx, cancel := context.WithTimeout(ctx, h.cfg.APITimeout)
		err := h.client.CoreV1().Pods(pod.Namespace).Delete(cctx, pod.Name, metav1.DeleteOptions{
			Preconditions: &metav1.Preconditions{UID: ptr.To(pod.UID)},
		})
		cancel()
		switch {
		case err == nil:
			logger.Info("Deleted fenced pod for its controller to recreate it with fresh mounts", "pod", klog.KObj(pod), "podUID", pod.UID)
		case apierrors.IsNotFound(err) || apierrors.IsConflict(err):
			logger.V(2).Info("Fenced pod is gone (failed over or deleted)", "pod", klog.KObj(pod), "podUID", pod.UID)
		default:
			logger.Error(err, "Deleting fenced pod failed: delete it by hand, its volumes are unmounted", "pod", klog.KObj(pod), "podUID", pod.UID)
		}
	}
}

// named fills in the names of targets fenced by UID alone (the API server
// was never reached, so the pod informer may not have synced yet): from one
// list of the node's pods, which the API server answers now that a renewal
// succeeded, else from the informer.
func (h *Heartbeat) named(ctx context.Context, targets []fenceTarget) []fenceTarget {
	if !slices.ContainsFunc(targets, func(t fenceTarget) bool { return t.Name == "" }) {
		return targets
	}
	byUID := make(map[string]*corev1.Pod)
	cctx, cancel := context.WithTimeout(ctx, h.cfg.APITimeout)
	list, err := h.client.CoreV1().Pods(metav1.NamespaceAll).List(cctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("spec.nodeName", h.cfg.NodeName).String()})
	cancel()
	if err == nil {
		for i := range list.Items {
			byUID[string(list.Items[i].UID)] = &list.Items[i]
		}
	} else {
		klog.FromContext(ctx).Info("Cannot list this node's pods to name the fenced ones; using the pod informer", "err", err)
		for _, obj := range h.podInf.GetIndexer().List() {
			if p, ok := obj.(*corev1.Pod); ok {
				byUID[string(p.UID)] = p
			}
		}
	}
	out := slices.Clone(targets)
	for i, t := range out {
		if p := byUID[t.UID]; t.Name == "" && p != nil {
			out[i].Namespace, out[i].Name = p.Namespace, p.Name
		}
	}
	return out
}

// podByUID finds a fenced pod that is still on this node with the same UID.
func (h *Heartbeat) podByUID(ctx context.Context, t fenceTarget) *corev1.Pod {
	if t.Name == "" {
		return nil
	}
	cctx, cancel := context.WithTimeout(ctx, h.cfg.APITimeout)
	defer cancel()
	pod, err := h.client.CoreV1().Pods(t.Namespace).Get(cctx, t.Name, metav1.GetOptions{})
	if err != nil || pod.UID != types.UID(t.UID) || pod.Spec.NodeName != h.cfg.NodeName {
		return nil
	}
	return pod
}

// shutdown releases the Lease, withdrawing the fence promise. If it cannot
// (the API server does not answer) and the heartbeat is already silent,
// the node may be partitioned and the promise cannot be kept after exit:
// it fences before returning.
func (h *Heartbeat) shutdown(ctx context.Context) {
	logger := klog.FromContext(ctx)
	err := h.release(ctx)
	if err == nil {
		logger.Info("Released the heartbeat lease")
		return
	}
	h.mu.Lock()
	silent, fenced := h.boot()-h.lastOK, h.isFenced
	h.mu.Unlock()
	if fenced || silent < 2*h.cfg.HeartbeatInterval {
		logger.Error(err, "Could not release the heartbeat lease", "silent", silent.Round(time.Second), "fenced", fenced)
		return
	}
	logger.Error(err, "Could not release the heartbeat lease while it is silent: fencing before exit")
	fctx, cancel := context.WithTimeout(ctx, h.cfg.FenceStopGrace+10*time.Second)
	defer cancel()
	h.fence(fctx, silent, verdictShutdown, peerTally{})
}

func (h *Heartbeat) release(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	h.mu.Lock()
	cur := h.lease
	h.mu.Unlock()
	if cur == nil {
		return errors.New("heartbeat lease never written or lost")
	}
	l := cur.DeepCopy()
	l.Spec.HolderIdentity = nil
	l.Spec.RenewTime = &metav1.MicroTime{Time: h.now()}
	_, err := h.leases.CoordinationV1().Leases(h.cfg.Namespace).Update(ctx, l, metav1.UpdateOptions{})
	return err
}

// claimCache keeps what the policy read of each claim. Access modes and
// StorageClass do not change once a claim is bound; unbound claims and
// failed reads are read again. sweep drops the claims not read since the
// previous sweep.
type claimCache struct {
	r    claimReader
	mu   sync.Mutex
	m    map[string]claimInfo // namespace/name
	used map[string]bool      // read since the last sweep
}

func newClaimCache(r claimReader) *claimCache {
	return &claimCache{r: r, m: make(map[string]claimInfo), used: make(map[string]bool)}
}

// read returns what is known of every claim of pod and its PV, reading
// those not cached. Errors are kept per claim.
func (c *claimCache) read(ctx context.Context, pod *corev1.Pod) map[string]claimInfo {
	out := make(map[string]claimInfo)
	for _, name := range claimNames(pod) {
		if _, done := out[name]; done {
			continue
		}
		key := pod.Namespace + "/" + name
		c.mu.Lock()
		info, ok := c.m[key]
		c.used[key] = true
		c.mu.Unlock()
		if !ok || info.Err != nil || info.PV == "" {
			info = c.r.claim(ctx, pod.Namespace, name)
			c.mu.Lock()
			c.m[key] = info
			c.mu.Unlock()
		}
		out[name] = info
	}
	return out
}

// sweep drops the claims not read since the previous sweep: those no pod
// looked at since uses.
func (c *claimCache) sweep() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for k := range c.m {
		if !c.used[k] {
			delete(c.m, k)
		}
	}
	clear(c.used)
}

// Events the heartbeat writes on its Node, as the node's agent
// (NodeReportingController).
const (
	ReasonPeerCheckDegraded = "FailoverPeerCheckDegraded"
	ReasonPeerCheckOK       = "FailoverPeerCheckOK"
)

// nodeEvent writes an event about this node.
func (h *Heartbeat) nodeEvent(eventtype, reason, format string, args ...any) {
	if h.rec == nil {
		return
	}
	h.mu.Lock()
	uid := h.nodeUID
	h.mu.Unlock()
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: h.cfg.NodeName, UID: uid}}
	h.rec.Eventf(node, nil, eventtype, reason, "PeerCheck", format, args...)
}

// lockedSource is a rand.Source for several goroutines: rand.Rand keeps no
// state of its own, so a Rand over it is safe to share.
type lockedSource struct {
	mu  sync.Mutex
	src rand.Source
}

func (s *lockedSource) Uint64() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.src.Uint64()
}
