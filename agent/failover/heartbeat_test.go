package failover

import (
	"context"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/agent/kubeclient"
	"github.com/mountmedic/mountmedic/scripts/kubetest"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// hbLab runs real heartbeats (goroutines, each with its own TCP proxy to a
// real kube-apiserver, under deploy/rbac.yaml's ServiceAccount, and its own
// peer endpoint on loopback) for the tests of the heartbeat alone: no
// controller, no kubelet.
type hbLab struct {
	agents atomic.Int32
	c      *kubetest.Cluster
	sa     *rest.Config
	key    string // peer key file
}

func startHBLab(t *testing.T) *hbLab {
	c := kubetest.Start(t, kubetest.Options{Controllers: kubetest.DefaultControllers})
	deploy, err := filepath.Abs("../../deploy")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"namespace.yaml", "serviceaccount.yaml", "rbac.yaml"} {
		if out, err := c.Kubectl("apply", "-f", filepath.Join(deploy, f)); err != nil {
			t.Fatalf("kubectl apply deploy/%s: %v\n%s", f, err, out)
		}
	}
	return &hbLab{c: c, sa: c.ServiceAccountConfig(t, agentNS, "mountmedic"), key: writeKey(t, testKey)}
}

// hbConfig is a heartbeat configuration with test timings and the peer
// check on.
func (l *hbLab) hbConfig() Config {
	c := DefaultConfig()
	c.Enabled = true
	c.Namespace = agentNS
	c.HeartbeatInterval = time.Second
	c.FenceAfter = 4 * time.Second
	c.FenceStopGrace = time.Second
	c.APITimeout = 2 * time.Second
	c.PeerKeyFile = l.key
	c.PeerListen = "127.0.0.1:0"
	c.PeerAdvertise = ""
	c.Peers = 3
	c.PeerTimeout = 500 * time.Millisecond
	c.PeerRefresh = time.Second
	return c
}

// hbNode is one node's agent heartbeat.
type hbNode struct {
	requests *requestCounter
	name     string
	proxy    *lab.TCPProxy
	fence    *recordingFence
	hb       *Heartbeat
	reg      *prometheus.Registry
	offset   atomic.Int64 // added to the boot clock: a simulated suspend
	// throttled answers the heartbeat's Lease writes 429, as API Priority
	// and Fairness does to a flooded flow; its other calls go through.
	throttled atomic.Bool
	// throttledAll answers every request of the agent's clients 429 but
	// the readiness probes, which API Priority and Fairness exempts: the
	// ServiceAccount's flows flooded with a stolen token, for an agent
	// that makes all its calls with that ServiceAccount
	// (--identity=serviceaccount).
	throttledAll atomic.Bool
	cancel       context.CancelFunc
	done         chan struct{}
}

// node creates a Node and runs its heartbeat with cfg; the test's cleanup
// stops it (a clean stop releases the Lease) and deletes the Node.
func (l *hbLab) node(t *testing.T, name string, cfg Config) *hbNode {
	t.Helper()
	ctx := context.Background()
	if _, err := l.c.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create node %s: %v", name, err)
	}
	u, err := url.Parse(l.sa.Host)
	if err != nil {
		t.Fatal(err)
	}
	n := &hbNode{name: name, proxy: lab.StartTCPProxy(t, u.Host), fence: &recordingFence{}, reg: prometheus.NewRegistry(),
		requests: &requestCounter{counts: map[string]int{}}}
	cfg.NodeName, cfg.Identity = name, "agent-"+name
	// Each agent on a loopback address of its own, as nodes have theirs
	// (the peer endpoints limit each source address).
	cfg.PeerListen = fmt.Sprintf("127.0.1.%d:0", 1+l.agents.Add(1)%250)
	sa := rest.CopyConfig(l.sa)
	sa.Host = "https://" + n.proxy.Addr()
	sa.WrapTransport = func(rt http.RoundTripper) http.RoundTripper {
		return n.requests.wrap(n.throttleAll(n.throttleLeases(rt)))
	}
	// Everything but the Lease as the node, as the agent does.
	nodeCfg := l.c.NodeConfig(t, name)
	nodeCfg.Host = "https://" + n.proxy.Addr()
	nodeCfg.WrapTransport = func(rt http.RoundTripper) http.RoundTripper { return n.requests.wrap(n.throttleAll(rt)) }
	// The agent's own clientset, with only the groups it calls.
	client, err := kubeclient.New(nodeCfg)
	if err != nil {
		t.Fatal(err)
	}
	leases, err := NewHeartbeatClient(sa)
	if err != nil {
		t.Fatal(err)
	}
	factory := informers.NewSharedInformerFactoryWithOptions(client, 0, informers.WithTweakListOptions(func(o *metav1.ListOptions) {
		o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", name).String()
	}))
	hb, err := NewHeartbeat(cfg, client, leases, factory.Core().V1().Pods().Informer(), n.fence, n.fence, n.reg)
	if err != nil {
		t.Fatalf("NewHeartbeat: %v", err)
	}
	hb.boot = func() time.Duration { return bootClock() + time.Duration(n.offset.Load()) }
	n.hb = hb
	runCtx, cancel := context.WithCancel(context.Background())
	n.cancel, n.done = cancel, make(chan struct{})
	factory.Start(runCtx.Done())
	go func() {
		defer close(n.done)
		_ = hb.Run(klog.NewContext(runCtx, klog.Background().WithValues("sim", name)))
		factory.Shutdown()
	}()
	t.Cleanup(func() {
		n.proxy.Restore() // a clean stop releases the Lease
		n.stop()
		// Not left for the garbage collector: a later case must not pick
		// this agent as a peer.
		_ = l.c.Client.CoordinationV1().Leases(agentNS).Delete(context.Background(), name, metav1.DeleteOptions{})
		_ = l.c.Client.CoreV1().Nodes().Delete(context.Background(), name, metav1.DeleteOptions{})
	})
	return n
}

func (n *hbNode) stop() {
	if n.cancel != nil {
		n.cancel()
		<-n.done
		n.cancel = nil
	}
}

func (n *hbNode) metric(t *testing.T, name string, labels map[string]string) float64 {
	t.Helper()
	return metric(t, n.reg, name, labels)
}

func (n *hbNode) fences(t *testing.T) float64 {
	return n.metric(t, "mountmedic_failover_fences_total", nil)
}

func (n *hbNode) verdicts(t *testing.T, v peerVerdict) float64 {
	return n.metric(t, "mountmedic_failover_peer_checks_total", map[string]string{"verdict": v.String()})
}

func (n *hbNode) peerNames() []string {
	n.hb.mu.Lock()
	defer n.hb.mu.Unlock()
	var out []string
	for _, p := range n.hb.peers {
		out = append(out, p.Node)
	}
	slices.Sort(out)
	return out
}

func (n *hbNode) fenced() bool {
	n.hb.mu.Lock()
	defer n.hb.mu.Unlock()
	return n.hb.isFenced
}

func (n *hbNode) renewing() bool {
	n.hb.mu.Lock()
	defer n.hb.mu.Unlock()
	return n.hb.lastAttemptOK
}

// waitPeers waits until every node renews and knows as many of the others
// as it asks as peers (and no one else).
func waitPeers(t *testing.T, nodes ...*hbNode) {
	t.Helper()
	var names []string
	for _, n := range nodes {
		names = append(names, n.name)
	}
	err := waitFor(context.Background(), 30*time.Second, func(context.Context) (bool, error) {
		for _, n := range nodes {
			peers := n.peerNames()
			if !n.renewing() || len(peers) != min(len(nodes)-1, n.hb.cfg.Peers) {
				return false, nil
			}
			for _, p := range peers {
				if !slices.Contains(names, p) {
					return false, nil
				}
			}
		}
		return true, nil
	})
	if err != nil {
		for _, n := range nodes {
			t.Logf("%s: renewing %v, peers %v", n.name, n.renewing(), n.peerNames())
		}
		t.Fatalf("wait for the heartbeats and their peers: %v", err)
	}
}

// TestHeartbeat runs heartbeats against a real kube-apiserver (and the
// controller manager's garbage collector). The outage case stops the API
// server and runs last.
func TestHeartbeat(t *testing.T) {
	l := startHBLab(t)
	t.Run("lease owned by its node", func(t *testing.T) { testLeaseOwner(t, l) })
	t.Run("partitioned alone fences", func(t *testing.T) { testPartitionedAlone(t, l) })
	t.Run("hostile peers do not hold a fence", func(t *testing.T) { testHostilePeers(t, l) })
	t.Run("peers' heartbeat flow throttled: the cut-off node fences", func(t *testing.T) { testThrottledFlow(t, l, false) })
	t.Run("peers' every flow throttled: the cut-off node fences", func(t *testing.T) { testThrottledFlow(t, l, true) })
	t.Run("suspend fences", func(t *testing.T) { testSuspend(t, l) })
	t.Run("steady state requests", func(t *testing.T) { testSteadyRequests(t, l) })
	t.Run("api server stopped: no fence", func(t *testing.T) { testAPIServerStopped(t, l, 4, 0) })
	// Anyone on the pod network floods every peer endpoint during the
	// outage (45 unauthenticated checks a second each, which spent the
	// endpoint's whole budget before checks were authenticated first).
	t.Run("api server stopped, peers flooded: no fence", func(t *testing.T) { testAPIServerStopped(t, l, 8, 45) })
}

func testLeaseOwner(t *testing.T, l *hbLab) {
	ctx := context.Background()
	n := l.node(t, "owner-a", l.hbConfig())
	node, err := l.c.Client.CoreV1().Nodes().Get(ctx, n.name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	var lease *metav1.ObjectMeta
	err = waitFor(ctx, 20*time.Second, func(ctx context.Context) (bool, error) {
		got, err := l.c.Client.CoordinationV1().Leases(agentNS).Get(ctx, n.name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		lease = &got.ObjectMeta
		return len(got.OwnerReferences) == 1, nil
	})
	if err != nil {
		t.Fatalf("wait for the heartbeat Lease's owner reference: %v (lease %+v)", err, lease)
	}
	ref := lease.OwnerReferences[0]
	if ref.APIVersion != "v1" || ref.Kind != "Node" || ref.Name != n.name || ref.UID != node.UID || ref.BlockOwnerDeletion != nil || ref.Controller != nil {
		t.Errorf("owner reference = %+v, want Node %s uid %s without blockOwnerDeletion", ref, n.name, node.UID)
	}
	if lease.Labels[PeerShardLabel] != peerShard(n.name) || lease.Annotations[PeerAddressAnnotation] == "" {
		t.Errorf("lease labels %v annotations %v: want the peer shard and address", lease.Labels, lease.Annotations)
	}
	// The Node goes (the agent with it): the garbage collector deletes the
	// Lease.
	n.stop()
	if err := l.c.Client.CoreV1().Nodes().Delete(ctx, n.name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	err = waitFor(ctx, 60*time.Second, func(ctx context.Context) (bool, error) {
		_, err := l.c.Client.CoordinationV1().Leases(agentNS).Get(ctx, n.name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	})
	if err != nil {
		t.Errorf("heartbeat Lease of a deleted Node not collected: %v", err)
	}
}

func testPartitionedAlone(t *testing.T, l *hbLab) {
	cfg := l.hbConfig()
	var nodes []*hbNode
	for i := range 4 {
		nodes = append(nodes, l.node(t, fmt.Sprintf("part-%c", 'a'+i), cfg))
	}
	waitPeers(t, nodes...)
	victim := nodes[0]
	victim.proxy.Cut() // only its connections to the API server
	err := waitFor(context.Background(), 30*time.Second, func(context.Context) (bool, error) { return victim.fenced(), nil })
	if err != nil {
		t.Fatalf("node cut off alone did not fence: %v (peer checks: outage %v, isolated %v)", err,
			victim.verdicts(t, verdictOutage), victim.verdicts(t, verdictIsolated))
	}
	if got := victim.verdicts(t, verdictPeerRenews); got < 1 {
		t.Errorf("peer_checks_total{verdict=peer_renews} = %v, want the fence decided because a peer renews", got)
	}
	if got := victim.verdicts(t, verdictOutage); got != 0 {
		t.Errorf("peer_checks_total{verdict=outage} = %v on a node cut off alone, want 0", got)
	}
	for _, n := range nodes[1:] {
		if n.fences(t) != 0 {
			t.Errorf("%s fenced, but only %s was cut off", n.name, victim.name)
		}
	}
	victim.proxy.Restore()
	err = waitFor(context.Background(), 30*time.Second, func(context.Context) (bool, error) { return !victim.fenced(), nil })
	if err != nil {
		t.Errorf("fence not lifted once the node reached the API server again: %v", err)
	}
}

// testHostilePeers: a node cut off alone whose peers' addresses now answer
// for someone else (an IP reused by a hostile pod): every answer says
// "outage", none authenticates. The node must fence as isolated.
func testHostilePeers(t *testing.T, l *hbLab) {
	cfg := l.hbConfig()
	cfg.PeerRefresh = time.Hour // keep the peers the test sets
	other := writeKey(t, "another-key-another-key-another-key-0000")
	ok, err := readPeerKey(other)
	if err != nil {
		t.Fatal(err)
	}
	victim := l.node(t, "hostile-a", cfg)
	honest := l.node(t, "hostile-b", cfg)
	if err := waitFor(context.Background(), 30*time.Second, func(context.Context) (bool, error) {
		return victim.renewing() && honest.renewing(), nil
	}); err != nil {
		t.Fatalf("wait for the heartbeats: %v", err)
	}
	// A genuine "cannot renew" answer of b, recorded to be replayed.
	k, _ := readPeerKey(l.key)
	honest.proxy.Cut()
	_ = waitFor(context.Background(), 10*time.Second, func(context.Context) (bool, error) { return !honest.renewing(), nil })
	honest.hb.mu.Lock()
	addrB := honest.hb.peerAddr
	honest.hb.mu.Unlock()
	recorded, err := newPeerClient("recorder", l.key, time.Second).ask(context.Background(), k, peerInfo{Node: honest.name, Addr: addrB})
	if err != nil || recorded.CanRenew {
		t.Fatalf("record b's answer: %+v %v, want cannot renew", recorded, err)
	}
	honest.stop()
	peers := []peerInfo{
		{Node: "hostile-c", Addr: hostileEndpoint(t, func(n string) peerAnswer { return peerAnswer{Node: "hostile-c", Nonce: n} })},
		{Node: "hostile-d", Addr: hostileEndpoint(t, func(n string) peerAnswer {
			return peerAnswer{Node: "hostile-d", Nonce: n, MAC: peerMAC(ok, n, "hostile-d", false)}
		})},
		{Node: honest.name, Addr: hostileEndpoint(t, func(n string) peerAnswer { return *recorded })},
	}
	victim.hb.mu.Lock()
	victim.hb.peers = peers
	victim.hb.mu.Unlock()

	victim.proxy.Cut()
	err = waitFor(context.Background(), 30*time.Second, func(context.Context) (bool, error) { return victim.fenced(), nil })
	if err != nil {
		t.Fatalf("node cut off, hostile peers answering outage: no fence: %v (outage verdicts %v)", err, victim.verdicts(t, verdictOutage))
	}
	if got := victim.verdicts(t, verdictIsolated); got < 1 {
		t.Errorf("peer_checks_total{verdict=isolated} = %v, want the hostile answers discarded", got)
	}
	if got := victim.metric(t, "mountmedic_failover_peer_answers_rejected_total", nil); got < 3 {
		t.Errorf("peer_answers_rejected_total = %v, want the 3 hostile answers counted", got)
	}
	if got := victim.verdicts(t, verdictOutage); got != 0 {
		t.Errorf("peer_checks_total{verdict=outage} = %v, want 0: a hostile answer held the fence", got)
	}
}

// testSuspend: the node sleeps (the boot clock jumps; the monotonic clock
// would not have moved) past FenceAfter while its peers renew: it fences.
func testSuspend(t *testing.T, l *hbLab) {
	cfg := l.hbConfig()
	var nodes []*hbNode
	for i := range 3 {
		nodes = append(nodes, l.node(t, fmt.Sprintf("suspend-%c", 'a'+i), cfg))
	}
	waitPeers(t, nodes...)
	victim := nodes[0]
	victim.offset.Add(int64(2 * cfg.FenceAfter))
	err := waitFor(context.Background(), 20*time.Second, func(context.Context) (bool, error) { return victim.fences(t) >= 1, nil })
	if err != nil {
		t.Fatalf("node resumed after 2x FenceAfter of suspend did not fence: %v", err)
	}
	if got := victim.verdicts(t, verdictPeerRenews); got < 1 {
		t.Errorf("peer_checks_total{verdict=peer_renews} = %v, want 1", got)
	}
	err = waitFor(context.Background(), 20*time.Second, func(context.Context) (bool, error) { return !victim.fenced(), nil })
	if err != nil {
		t.Errorf("fence not lifted after the resumed node renewed: %v", err)
	}
	for _, n := range nodes[1:] {
		if n.fences(t) != 0 {
			t.Errorf("%s fenced, but only %s was suspended", n.name, victim.name)
		}
	}
}

// testAPIServerStopped stops kube-apiserver for twice the fence window
// with several heartbeats running: every one holds, none fences, and all
// renew again once it is back.
func testAPIServerStopped(t *testing.T, l *hbLab, n, flood int) {
	cfg := l.hbConfig()
	cfg.Peers = n - 1
	// No fence is an availability claim, made for the shipped peer
	// timeout: a check that misses one peer's answer fences (safety
	// first), and the lab's 500 ms misses them under a loaded CI
	// machine's scheduling, not under the outage or the flood.
	// The lab's ratios stay: fence after four beats, so that a peer
	// whose last renewal just succeeded no longer says it can renew
	// (FenceAfter/2) when the asker's window ends.
	cfg.PeerTimeout = DefaultConfig().PeerTimeout
	cfg.HeartbeatInterval = cfg.PeerTimeout + cfg.PeerTimeout/4
	cfg.FenceAfter = 4 * cfg.HeartbeatInterval
	var nodes []*hbNode
	prefix := "outage"
	if flood > 0 {
		prefix = "flood"
	}
	for i := range n {
		nodes = append(nodes, l.node(t, fmt.Sprintf("%s-%c", prefix, 'a'+i), cfg))
	}
	waitPeers(t, nodes...)
	down := 2 * (cfg.FenceAfter + 6*time.Second) // twice the window a controller with a 6 s margin waits
	var sent func() int64
	stopFlood := func() {}
	if flood > 0 {
		var targets []peerInfo
		for _, n := range nodes {
			n.hb.mu.Lock()
			targets = append(targets, peerInfo{Node: n.name, Addr: n.hb.peerAddr})
			n.hb.mu.Unlock()
		}
		ctx, stop := context.WithCancel(context.Background())
		defer stop()
		sent = floodPeers(ctx, targets, flood)
		stopFlood = stop
	}
	l.c.StopAPIServer()
	time.Sleep(down)
	// The flood covers the outage. While the lab's API server starts again
	// (about 20 s here, beside the 8 agents), a flood that went on left one
	// or two peers unanswered for some askers, which then fenced (safe);
	// the claim under test is the outage's.
	stopFlood()
	if sent != nil {
		t.Logf("flood: %d unauthenticated checks sent to %d peer endpoints during the %s outage", sent(), len(nodes), down)
	}
	if err := l.c.StartAPIServer(); err != nil {
		t.Fatalf("start kube-apiserver again: %v", err)
	}
	err := waitFor(context.Background(), 60*time.Second, func(context.Context) (bool, error) {
		for _, n := range nodes {
			if !n.renewing() {
				return false, nil
			}
		}
		return true, nil
	})
	if err != nil {
		t.Errorf("heartbeats not renewing after the API server came back: %v", err)
	}
	fenced := 0
	defer func() {
		t.Logf("nodes fenced during an API server outage of %s (flood %d/s per peer): %d of %d", down, flood, fenced, len(nodes))
	}()
	for _, n := range nodes {
		if n.fences(t) != 0 {
			fenced++
		}
		if got := n.fences(t); got != 0 {
			t.Errorf("%s fenced %v times during an API server outage of %s (outage verdicts %v, other verdicts: isolated %v not_unanimous %v peer_renews %v)",
				n.name, got, down, n.verdicts(t, verdictOutage), n.verdicts(t, verdictIsolated), n.verdicts(t, verdictNotUnanimous), n.verdicts(t, verdictPeerRenews))
		}
		if got := n.verdicts(t, verdictOutage); got < 1 {
			t.Errorf("%s: peer_checks_total{verdict=outage} = %v, want the outage seen", n.name, got)
		}
		if got := n.metric(t, "mountmedic_failover_outage_hold", nil); got != 0 {
			t.Errorf("%s: outage_hold = %v after the API server returned, want 0", n.name, got)
		}
	}
}

// throttleAll answers every request but the readiness probes 429 while
// n.throttledAll is set.
func (n *hbNode) throttleAll(rt http.RoundTripper) http.RoundTripper {
	return roundTripperFunc(func(req *http.Request) (*http.Response, error) {
		if n.throttledAll.Load() && !slices.Contains([]string{"/readyz", "/livez", "/healthz"}, req.URL.Path) {
			return &http.Response{StatusCode: http.StatusTooManyRequests, Status: "429 Too Many Requests", Request: req,
				Header: http.Header{"Content-Type": {"text/plain"}}, Body: http.NoBody}, nil
		}
		return rt.RoundTrip(req)
	})
}

// throttleLeases answers Lease writes 429 while n.throttled is set.
func (n *hbNode) throttleLeases(rt http.RoundTripper) http.RoundTripper {
	return roundTripperFunc(func(req *http.Request) (*http.Response, error) {
		if n.throttled.Load() && req.Method != http.MethodGet && strings.Contains(req.URL.Path, "/leases") {
			return &http.Response{StatusCode: http.StatusTooManyRequests, Status: "429 Too Many Requests", Request: req,
				Header: http.Header{"Content-Type": {"text/plain"}}, Body: http.NoBody}, nil
		}
		return rt.RoundTrip(req)
	})
}

// testThrottledFlow: every other agent's heartbeat writes are throttled
// (a flooded API Priority and Fairness flow) while the API server answers
// them otherwise, and one node is cut off. Its peers must not vouch for an
// outage: the API server serves the controller, which fails the cut-off
// node over. It fences.
//
// With all (every request of the peers' agents throttled but the
// APF-exempt readiness probe, as a flood of the agents' ServiceAccount
// does to an agent running with --identity=serviceaccount), the same.
func testThrottledFlow(t *testing.T, l *hbLab, all bool) {
	cfg := l.hbConfig()
	var nodes []*hbNode
	prefix := "apf-"
	if all {
		prefix = "apf-all-"
	}
	for i := range 4 {
		nodes = append(nodes, l.node(t, fmt.Sprintf("%s%c", prefix, 'a'+i), cfg))
	}
	waitPeers(t, nodes...)
	victim := nodes[0]
	for _, n := range nodes[1:] {
		n.throttled.Store(true)
		n.throttledAll.Store(all)
	}
	victim.proxy.Cut()
	err := waitFor(context.Background(), 30*time.Second, func(context.Context) (bool, error) { return victim.fenced(), nil })
	if err != nil {
		t.Fatalf("node cut off while its peers' heartbeat writes are throttled did not fence: %v (peer checks: outage %v, peer_renews %v, isolated %v)", err,
			victim.verdicts(t, verdictOutage), victim.verdicts(t, verdictPeerRenews), victim.verdicts(t, verdictIsolated))
	}
	if got := victim.verdicts(t, verdictOutage); got != 0 {
		t.Errorf("peer_checks_total{verdict=outage} = %v: peers whose API server answers vouched for an outage", got)
	}
	for _, n := range nodes[1:] {
		n.throttled.Store(false)
		n.throttledAll.Store(false)
	}
	victim.proxy.Restore()
}

// requestCounter counts a client's requests by method and path kind.
type requestCounter struct {
	mu     sync.Mutex
	counts map[string]int
}

func (c *requestCounter) wrap(rt http.RoundTripper) http.RoundTripper {
	return roundTripperFunc(func(req *http.Request) (*http.Response, error) {
		kind := "other"
		switch {
		case strings.Contains(req.URL.Path, "/leases"):
			kind = "leases"
		case strings.Contains(req.URL.Path, "/nodes/"):
			kind = "nodes"
		case strings.Contains(req.URL.Path, "/pods"):
			kind = "pods"
		}
		if req.URL.Query().Get("watch") == "true" {
			kind += " watch"
		}
		c.mu.Lock()
		c.counts[req.Method+" "+kind]++
		c.mu.Unlock()
		return rt.RoundTrip(req)
	})
}

func (c *requestCounter) snapshot() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return maps.Clone(c.counts)
}

type roundTripperFunc func(*http.Request) (*http.Response, error)

func (f roundTripperFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// testSteadyRequests counts what a heartbeat asks of the API server once
// it runs: one Lease update per renewal and nothing else (its peers are
// listed again only every PeerRefresh). The figures are logged per
// renewal, not per second: the test asserts counts, never timings.
func testSteadyRequests(t *testing.T, l *hbLab) {
	cfg := l.hbConfig()
	cfg.Peers = 2
	cfg.PeerRefresh = time.Hour
	var nodes []*hbNode
	for i := range 3 {
		nodes = append(nodes, l.node(t, fmt.Sprintf("steady-%c", 'a'+i), cfg))
	}
	waitPeers(t, nodes...)
	// The owner reference is on the Lease: the start-up reads are over.
	time.Sleep(2 * cfg.HeartbeatInterval)
	before := make([]map[string]int, len(nodes))
	renewals := make([]float64, len(nodes))
	for i, n := range nodes {
		before[i] = n.requests.snapshot()
		renewals[i] = n.metric(t, "mountmedic_failover_heartbeat_renewals_total", map[string]string{"result": resultSuccess})
	}
	time.Sleep(10 * cfg.HeartbeatInterval)
	for i, n := range nodes {
		after := n.requests.snapshot()
		got := n.metric(t, "mountmedic_failover_heartbeat_renewals_total", map[string]string{"result": resultSuccess}) - renewals[i]
		diff := map[string]int{}
		for k, v := range after {
			if d := v - before[i][k]; d != 0 {
				diff[k] = d
			}
		}
		t.Logf("%s: %v renewals, requests %v", n.name, got, diff)
		if got < 1 {
			t.Errorf("%s: no renewal in 10 intervals", n.name)
			continue
		}
		// The request counter and the renewal metric are read one after
		// the other, at each end of the window, while renewals go on: a
		// renewal in flight at either end can fall in the window on one
		// count and outside it on the other (a PUT counted before the
		// first read whose success is counted after it: 9 PUTs for 10
		// renewals). So one apart is one renewal; a second request per
		// renewal would show twice as many.
		if d := diff["PUT leases"] - int(got); d < -1 || d > 1 {
			t.Errorf("%s: %d Lease updates for %v renewals, want one each", n.name, diff["PUT leases"], got)
		}
		for k, v := range diff {
			if k != "PUT leases" && !strings.HasSuffix(k, " watch") {
				t.Errorf("%s: %d requests %s at steady state, want none (the pod informer's watch aside)", n.name, v, k)
			}
		}
	}
}
