package failover

import (
	"bytes"
	"context"
	"crypto/hmac"
	crand "crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"os"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/util/flowcontrol"
	"k8s.io/klog/v2"
)

// The peer check: an agent that cannot renew its heartbeat for FenceAfter
// asks a few other agents, over the pod network, whether THEY can renew
// theirs, before it fences:
//
//   - any peer can: the API server works, the problem is this node's
//     (partitioned, suspended, throttled alone): fence;
//   - every peer asked (at least two) answers that it cannot either: the API
//     server is down or throttled for everyone, the controller cannot act
//     either: hold, do not fence, ask again every HeartbeatInterval;
//   - otherwise (no peer known, none answers, some do not): this node may
//     be cut off with a few neighbours: fence.
//
// Unanimity of the peers asked (not of those that answered) is what keeps
// a group of nodes cut off together (a rack, a zone) from holding on each
// other's word: a peer outside the group does not answer, and one such
// peer among those asked is enough to fence. A node of a group holding a
// share f of the nodes holds only if all its peers were picked inside the
// group: f^Peers (7 peers: 0.002% at f = 0.2, 0.8% at f = 0.5). The rest
// of the way is the controller's: it must stand down when that many nodes
// look dead at once.
//
// Hostile actors. A pod on the network that answers "I cannot renew either"
// at a peer's address (an IP reused by a new pod after the agent moved, a
// spoofed address) would stop a fence: every answer carries an HMAC-SHA256,
// under a key shared by the agents (a Secret mounted in the DaemonSet), of
// a fresh random nonce the asker chose, the answering node's name (which
// must be the one the asker took the address from) and the answer. Without
// the key, or replaying an answer to another nonce or from another node, an
// answer is rejected and counts as no answer. Someone who holds the key (a
// node's root, a stolen agent credential) can forge the answers of the
// addresses it can answer at; every peer asked must say "cannot renew" to
// hold, so such a node cannot stop a fence unless all the others already
// agree. A forged "I can renew" only makes a node fence, which is the safe
// side.

const (
	// PeerAddressAnnotation on a heartbeat Lease is host:port of its
	// agent's peer endpoint.
	PeerAddressAnnotation = "failover.mountmedic.io/peer-address"
	// PeerShardLabel spreads the heartbeat Leases over peerShards groups,
	// so that an agent lists one group (a few hundred Leases at 5,000
	// nodes) to pick its peers from, not all of them.
	PeerShardLabel = "failover.mountmedic.io/peer-shard"

	peerPath   = "/failover/v1/can-renew"
	peerShards = 16
	// minHoldPeers is the fewest peers whose word holds a fence.
	minHoldPeers = 2
	// minPeerKey is the shortest key accepted (bytes of the file).
	minPeerKey = 32
	// peerMACContext separates these MACs from any other use of the key;
	// peerRequestContext the requests' from the answers'.
	peerMACContext     = "mountmedic-failover-peer-v1"
	peerRequestContext = "mountmedic-failover-peer-request-v2"
)

// peerVerdict is the outcome of a peer check.
type peerVerdict int

const (
	// verdictPeerRenews: a peer can renew; this node fences.
	verdictPeerRenews peerVerdict = iota
	// verdictOutage: every peer asked (at least minHoldPeers) cannot renew
	// either; this node holds.
	verdictOutage
	// verdictIsolated: no peer answered; this node fences.
	verdictIsolated
	// verdictNotUnanimous: some peers cannot renew, others do not answer
	// (or too few were asked); this node fences.
	verdictNotUnanimous
	// verdictNoPeers: no peer known (the API server never listed any);
	// this node fences.
	verdictNoPeers
	// verdictDisabled: no peer key; this node fences (the behaviour without
	// a peer check).
	verdictDisabled
	// verdictShutdown: the agent stops while silent and cannot release its
	// Lease; nobody would fence after it exits, so it fences (no peer
	// check, not counted in the metric).
	verdictShutdown
)

var peerVerdicts = []peerVerdict{verdictPeerRenews, verdictOutage, verdictIsolated, verdictNotUnanimous, verdictNoPeers, verdictDisabled}

func (v peerVerdict) String() string {
	switch v {
	case verdictPeerRenews:
		return "peer_renews"
	case verdictOutage:
		return "outage"
	case verdictIsolated:
		return "isolated"
	case verdictNotUnanimous:
		return "not_unanimous"
	case verdictNoPeers:
		return "no_peers"
	case verdictDisabled:
		return "disabled"
	case verdictShutdown:
		return "shutdown"
	}
	return "unknown"
}

// peerTally counts the answers of one peer check.
type peerTally struct {
	Asked    int // peers asked
	CanRenew int // valid answers "I can renew"
	Cannot   int // valid answers "I cannot renew"
	Rejected int // answers that failed authentication (also not counted as answers)
}

// judgePeers turns a tally into a verdict.
func judgePeers(t peerTally) peerVerdict {
	switch {
	case t.Asked == 0:
		return verdictNoPeers
	case t.CanRenew > 0:
		return verdictPeerRenews
	case t.Asked >= minHoldPeers && t.Cannot == t.Asked:
		return verdictOutage
	case t.Cannot == 0:
		return verdictIsolated
	}
	return verdictNotUnanimous
}

// peerInfo is a peer the agent may ask.
type peerInfo struct {
	Node string
	Addr string // host:port
}

// peerAnswer is what the peer endpoint returns.
type peerAnswer struct {
	Node     string `json:"node"`
	Nonce    string `json:"nonce"`
	CanRenew bool   `json:"canRenew"`
	MAC      string `json:"mac"`
}

// peerMAC authenticates an answer: HMAC-SHA256 under key of the context,
// the asker's nonce, the answering node and the answer.
func peerMAC(key []byte, nonce, node string, canRenew bool) string {
	m := hmac.New(sha256.New, key)
	for _, s := range []string{peerMACContext, nonce, node, strconv.FormatBool(canRenew)} {
		m.Write([]byte(s))
		m.Write([]byte{0})
	}
	return hex.EncodeToString(m.Sum(nil))
}

// readPeerKey reads the shared peer key; whitespace around it is ignored.
// It is read at each use, so a rotated Secret takes effect without a
// restart (kubelet updates the mounted file).
func readPeerKey(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read peer key: %w", err)
	}
	b = bytes.TrimSpace(b)
	if len(b) < minPeerKey {
		return nil, fmt.Errorf("peer key %s holds %d bytes, want at least %d (e.g. openssl rand -hex 32)", path, len(b), minPeerKey)
	}
	return b, nil
}

// peerMetrics are the peer check's collectors.
type peerMetrics struct {
	checks   *prometheus.CounterVec
	held     prometheus.Gauge
	rejected prometheus.Counter
	refused  prometheus.Counter
	degraded *prometheus.GaugeVec
}

// Why the peer check cannot hold a fence through an outage, as
// mountmedic_failover_peer_check_degraded labels it.
const (
	degradedNoKey       = "no_key"
	degradedNoPeers     = "no_peers"
	degradedUnreachable = "unreachable"
)

var degradedReasons = []string{degradedNoKey, degradedNoPeers, degradedUnreachable}

func newPeerMetrics(reg prometheus.Registerer) (*peerMetrics, error) {
	m := &peerMetrics{
		checks: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mountmedic_failover_peer_checks_total",
			Help: "Peer checks made because the heartbeat could not be renewed for --failover-fence-after, by verdict: peer_renews, isolated, not_unanimous, no_peers, disabled (the node fences) or outage (it holds).",
		}, []string{"verdict"}),
		held: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "mountmedic_failover_outage_hold",
			Help: "1 while this node does not fence although its heartbeat is past --failover-fence-after, because every peer it asked cannot renew either (an API server outage).",
		}),
		rejected: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "mountmedic_failover_peer_answers_rejected_total",
			Help: "Peer answers that failed authentication (wrong key, replayed, from another node): each is someone answering at a peer's address without the peer key.",
		}),
		refused: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "mountmedic_failover_peer_requests_refused_total",
			Help: "Peer checks this agent's endpoint refused before any work: not authenticated with the peer key, or a replayed nonce.",
		}),
		degraded: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "mountmedic_failover_peer_check_degraded",
			Help: "1 while the peer check cannot hold a fence through an API server outage, by reason: no_key (no peer key), no_peers (fewer than 2 peers known), unreachable (no peer answered the last probe). An outage longer than --failover-fence-after then fences this node.",
		}, []string{"reason"}),
	}
	for _, v := range peerVerdicts {
		m.checks.WithLabelValues(v.String())
	}
	for _, r := range degradedReasons {
		m.degraded.WithLabelValues(r)
	}
	if err := register(reg, m.checks, m.held, m.rejected, m.refused, m.degraded); err != nil {
		return nil, err
	}
	return m, nil
}

// peerShard is the shard label value of a node.
func peerShard(node string) string {
	h := fnv.New32a()
	h.Write([]byte(node))
	return strconv.Itoa(int(h.Sum32() % peerShards))
}

// peerServer answers other agents' peer checks. What a request may cost
// is bounded before it is read: each source address has a token bucket,
// spent by every request from it, authenticated or not, so a flood from a
// pod spends its own address's tokens and nobody else's. Then the MAC over
// the request's nonce, timestamp, sender and the node asked is checked
// (one HMAC); a timestamp outside peerMaxSkew of this node's clock or a
// nonce answered before is refused, so a captured request cannot be
// replayed, then or later; and only then does the request spend a token of
// the endpoint's bucket, which only authenticated checks reach.
type peerServer struct {
	node     string
	keyFile  string
	canRenew func() bool
	// limit bounds the authenticated checks the endpoint answers;
	// perSource each source address's requests.
	limit     flowcontrol.RateLimiter
	perSource func() flowcontrol.RateLimiter
	key       *keyCache
	// rejected counts requests refused before any work (nil: not
	// counted).
	rejected prometheus.Counter
	now      func() time.Time

	mu      sync.Mutex
	sources map[string]*sourceState
	// overflow is the bucket the sources share once peerMaxTracked are
	// tracked.
	overflow  flowcontrol.RateLimiter
	lastSweep time.Time
	// nonces answered within peerNonceTTL, and the same in the order they
	// came (times ascending), so that expiry pops from the front.
	nonces     map[string]time.Time
	nonceOrder []nonceSeen
}

// sourceState is one source address's bucket and when it last asked.
type sourceState struct {
	limit flowcontrol.RateLimiter
	last  time.Time
}

type nonceSeen struct {
	nonce string
	at    time.Time
}

// Peer endpoint limits: an agent asks each of its peers once per check,
// at most once a HeartbeatInterval during an outage; a node is the peer of
// about Peers others.
const (
	peerQPS, peerBurst             = 50, 100
	peerSourceQPS, peerSourceBurst = 2, 10
	// peerMaxSkew is how far a request's timestamp may be from the
	// answering node's clock (nodes keep theirs within a second or so
	// with NTP).
	peerMaxSkew = 30 * time.Second
	// peerNonceTTL: a nonce is remembered this long, past the whole span
	// of timestamps accepted, so that a replay is refused either way.
	peerNonceTTL = 2*peerMaxSkew + 10*time.Second
	// peerMaxTracked bounds the sources and nonces remembered. The
	// endpoint's bucket admits at most peerQPS*peerNonceTTL + peerBurst
	// nonces (3,600 + 100) in a TTL: the bound is never reached by them.
	peerMaxTracked = 20000
	// peerSourceIdle: a source silent this long is forgotten.
	peerSourceIdle = time.Minute
)

// newPeerServer is the endpoint an agent serves, with its limits.
func newPeerServer(node, keyFile string, canRenew func() bool) *peerServer {
	return &peerServer{node: node, keyFile: keyFile, canRenew: canRenew,
		limit: flowcontrol.NewTokenBucketRateLimiter(peerQPS, peerBurst),
		perSource: func() flowcontrol.RateLimiter {
			return flowcontrol.NewTokenBucketRateLimiter(peerSourceQPS, peerSourceBurst)
		},
		overflow: flowcontrol.NewTokenBucketRateLimiter(peerSourceQPS, peerSourceBurst),
		key:      &keyCache{path: keyFile}, now: time.Now,
		sources: map[string]*sourceState{}, nonces: map[string]time.Time{}}
}

func (s *peerServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != peerPath || r.Method != http.MethodGet {
		http.NotFound(w, r)
		return
	}
	now := s.now()
	src, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		src = r.RemoteAddr
	}
	s.mu.Lock()
	s.expireNonces(now)
	ok := s.source(src, now).TryAccept()
	s.mu.Unlock()
	if !ok {
		s.busy(w)
		return
	}
	q := r.URL.Query()
	nonce, from, auth, ts := q.Get("nonce"), q.Get("from"), q.Get("auth"), q.Get("ts")
	if b, err := hex.DecodeString(nonce); err != nil || len(b) != 32 {
		http.Error(w, "nonce: want 32 random bytes in hex", http.StatusBadRequest)
		return
	}
	if from == "" || len(from) > 253 {
		http.Error(w, "from: want the asking node's name", http.StatusBadRequest)
		return
	}
	sent, err := strconv.ParseInt(ts, 10, 64)
	if err != nil {
		http.Error(w, "ts: want the asking node's clock in Unix seconds", http.StatusBadRequest)
		return
	}
	key, err := s.key.get()
	if err != nil {
		http.Error(w, "no peer key", http.StatusServiceUnavailable)
		return
	}
	if !hmac.Equal([]byte(auth), []byte(peerRequestMAC(key, nonce, ts, from, s.node))) {
		s.refuse()
		http.Error(w, "request not authenticated with the peer key", http.StatusUnauthorized)
		return
	}
	if skew := now.Sub(time.Unix(sent, 0)); skew > peerMaxSkew || skew < -peerMaxSkew {
		s.refuse()
		http.Error(w, fmt.Sprintf("timestamp %d is %s from this node's clock (at most %s): a replay, or a clock to fix", sent, skew.Round(time.Second), peerMaxSkew), http.StatusUnauthorized)
		return
	}
	s.mu.Lock()
	if _, seen := s.nonces[nonce]; seen {
		s.mu.Unlock()
		s.refuse()
		http.Error(w, "nonce already answered (a replay)", http.StatusUnauthorized)
		return
	}
	ok = len(s.nonces) < peerMaxTracked && s.limit.TryAccept()
	if ok {
		s.nonces[nonce] = now
		s.nonceOrder = append(s.nonceOrder, nonceSeen{nonce: nonce, at: now})
	}
	s.mu.Unlock()
	if !ok {
		s.busy(w)
		return
	}
	ans := peerAnswer{Node: s.node, Nonce: nonce, CanRenew: s.canRenew()}
	ans.MAC = peerMAC(key, ans.Nonce, ans.Node, ans.CanRenew)
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(ans)
}

// busy answers 429: "ask again", not silence; the asker retries within its
// check.
func (s *peerServer) busy(w http.ResponseWriter) {
	w.Header().Set("Retry-After", "1")
	http.Error(w, "too many peer checks", http.StatusTooManyRequests)
}

func (s *peerServer) refuse() {
	if s.rejected != nil {
		s.rejected.Inc()
	}
}

// source returns the bucket of the source address src. The sources idle
// for peerSourceIdle are forgotten at most once a second; past
// peerMaxTracked, new sources share one bucket. s.mu is held.
func (s *peerServer) source(src string, now time.Time) flowcontrol.RateLimiter {
	st := s.sources[src]
	if st == nil {
		if len(s.sources) >= peerMaxTracked && now.Sub(s.lastSweep) >= time.Second {
			s.lastSweep = now
			for k, v := range s.sources {
				if now.Sub(v.last) > peerSourceIdle {
					delete(s.sources, k)
				}
			}
		}
		if len(s.sources) >= peerMaxTracked {
			return s.overflow
		}
		st = &sourceState{limit: s.perSource()}
		s.sources[src] = st
	}
	st.last = now
	return st.limit
}

// expireNonces forgets the nonces older than peerNonceTTL: those at the
// front of the order. Each nonce is popped once, so the work per request
// is constant on average. s.mu is held.
func (s *peerServer) expireNonces(now time.Time) {
	i := 0
	for i < len(s.nonceOrder) && now.Sub(s.nonceOrder[i].at) > peerNonceTTL {
		delete(s.nonces, s.nonceOrder[i].nonce)
		i++
	}
	if i > 0 {
		s.nonceOrder = slices.Delete(s.nonceOrder, 0, i)
	}
}

// peerRequestMAC authenticates a check: HMAC-SHA256 under key of the
// request context, the nonce, the sender's clock (ts, Unix seconds), the
// asking node and the node asked (a request to one peer cannot be
// replayed at another, nor later than peerMaxSkew).
func peerRequestMAC(key []byte, nonce, ts, from, to string) string {
	m := hmac.New(sha256.New, key)
	for _, s := range []string{peerRequestContext, nonce, ts, from, to} {
		m.Write([]byte(s))
		m.Write([]byte{0})
	}
	return hex.EncodeToString(m.Sum(nil))
}

// keyCache reads the peer key at most once a second: a flood does not
// read the file per request, and a rotated Secret takes effect within a
// second of kubelet updating the file.
type keyCache struct {
	path string
	mu   sync.Mutex
	at   time.Time
	key  []byte
	err  error
}

func (c *keyCache) get() ([]byte, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if now := time.Now(); now.Sub(c.at) > time.Second {
		c.key, c.err = readPeerKey(c.path)
		c.at = now
	}
	return c.key, c.err
}

// peerClient asks peers.
type peerClient struct {
	self    string
	keyFile string
	timeout time.Duration
	// retryPause is the wait before asking a busy peer again.
	retryPause time.Duration
	http       *http.Client
}

// askFrom makes the client's connections start from ip.
func (c *peerClient) askFrom(ip net.IP) {
	c.http.Transport.(*http.Transport).DialContext = (&net.Dialer{Timeout: c.timeout, LocalAddr: &net.TCPAddr{IP: ip}}).DialContext
}

func newPeerClient(self, keyFile string, timeout time.Duration) *peerClient {
	return &peerClient{self: self, keyFile: keyFile, timeout: timeout, retryPause: min(timeout/4, 250*time.Millisecond), http: &http.Client{
		// Never through an HTTP proxy from the environment: peers are
		// pod IPs.
		Transport: &http.Transport{Proxy: nil, DialContext: (&net.Dialer{Timeout: timeout}).DialContext,
			DisableKeepAlives: true, ResponseHeaderTimeout: timeout},
		Timeout: timeout,
		CheckRedirect: func(*http.Request, []*http.Request) error {
			return errors.New("peer endpoints do not redirect")
		},
	}}
}

// check asks every peer at once and tallies their valid answers. A peer
// that answers 429 or 503, or not in time, is asked again until the check's
// budget (twice the peer timeout) runs out: busy is not silent.
func (c *peerClient) check(ctx context.Context, peers []peerInfo, m *peerMetrics) peerTally {
	logger := klog.FromContext(ctx)
	t := peerTally{Asked: len(peers)}
	key, err := readPeerKey(c.keyFile)
	if err != nil {
		logger.Error(err, "Peer check impossible: no peer key; counting every peer as silent")
		return t
	}
	type result struct {
		p   peerInfo
		ans *peerAnswer
		err error
	}
	results := make(chan result, len(peers))
	var wg sync.WaitGroup
	budget, cancel := context.WithTimeout(ctx, 2*c.timeout)
	defer cancel()
	for _, p := range peers {
		wg.Go(func() {
			ans, err := c.askUntil(budget, key, p)
			results <- result{p, ans, err}
		})
	}
	wg.Wait()
	close(results)
	for r := range results {
		var rej *rejectedError
		switch {
		case errors.As(r.err, &rej):
			t.Rejected++
			m.rejected.Inc()
			logger.Error(r.err, "Peer answer rejected: someone without the peer key answers at this peer's address", "peer", r.p.Node, "address", r.p.Addr)
		case r.err != nil:
			logger.V(2).Info("Peer did not answer", "peer", r.p.Node, "address", r.p.Addr, "err", r.err)
		case r.ans.CanRenew:
			t.CanRenew++
		default:
			t.Cannot++
		}
	}
	return t
}

// askUntil asks one peer until it gives an answer (valid or rejected), it
// refuses the request, or ctx ends.
func (c *peerClient) askUntil(ctx context.Context, key []byte, p peerInfo) (*peerAnswer, error) {
	for {
		ans, err := c.ask(ctx, key, p)
		var rej *rejectedError
		var busy *busyError
		switch {
		case err == nil, errors.As(err, &rej):
			return ans, err
		case !errors.As(err, &busy) && !errors.Is(err, context.DeadlineExceeded) && !isTimeout(err):
			return nil, err
		}
		select {
		case <-ctx.Done():
			return nil, err
		case <-time.After(c.retryPause):
		}
	}
}

// busyError is a peer asking to be asked again (429, 503).
type busyError struct{ status string }

func (e *busyError) Error() string { return "peer busy: " + e.status }

func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// rejectedError is an answer that failed authentication.
type rejectedError struct{ reason string }

func (e *rejectedError) Error() string { return "peer answer rejected: " + e.reason }

// ask asks one peer with a fresh nonce and checks its answer.
func (c *peerClient) ask(ctx context.Context, key []byte, p peerInfo) (*peerAnswer, error) {
	raw := make([]byte, 32)
	if _, err := crand.Read(raw); err != nil {
		return nil, fmt.Errorf("nonce: %w", err)
	}
	nonce := hex.EncodeToString(raw)
	ctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	ts := strconv.FormatInt(time.Now().Unix(), 10)
	u := url.URL{Scheme: "http", Host: p.Addr, Path: peerPath, RawQuery: url.Values{
		"nonce": {nonce}, "ts": {ts}, "from": {c.self}, "auth": {peerRequestMAC(key, nonce, ts, c.self, p.Node)}}.Encode()}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return nil, fmt.Errorf("peer request: %w", err)
	}
	resp, err := c.http.Do(req)
	if err != nil {
		return nil, fmt.Errorf("ask peer: %w", err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 4096))
	if err != nil {
		return nil, fmt.Errorf("read peer answer: %w", err)
	}
	switch resp.StatusCode {
	case http.StatusOK:
	case http.StatusTooManyRequests, http.StatusServiceUnavailable:
		return nil, &busyError{status: resp.Status}
	default:
		return nil, fmt.Errorf("peer answered %s", resp.Status)
	}
	var ans peerAnswer
	if err := json.Unmarshal(body, &ans); err != nil {
		return nil, &rejectedError{reason: "not a peer answer: " + err.Error()}
	}
	switch {
	case ans.Nonce != nonce:
		return nil, &rejectedError{reason: "answer to another nonce (a replay)"}
	case ans.Node != p.Node:
		return nil, &rejectedError{reason: fmt.Sprintf("answer from node %q, asked node %q", ans.Node, p.Node)}
	case !hmac.Equal([]byte(ans.MAC), []byte(peerMAC(key, ans.Nonce, ans.Node, ans.CanRenew))):
		return nil, &rejectedError{reason: "MAC does not match the peer key"}
	}
	return &ans, nil
}

// pickPeers chooses up to n peers at random among the heartbeat Leases
// listed: held (not released), renewed lately (Stale: a node whose
// heartbeat stopped is dead or fenced, no witness: asked during an outage it
// would not answer and make the asker fence), with a peer address, not self.
func pickPeers(self string, leases []leaseView, n int, r *rand.Rand) []peerInfo {
	var cands []peerInfo
	for _, l := range leases {
		if l.Name == self || !l.Held || l.Stale || l.Addr == "" {
			continue
		}
		cands = append(cands, peerInfo{Node: l.Name, Addr: l.Addr})
	}
	r.Shuffle(len(cands), func(i, j int) { cands[i], cands[j] = cands[j], cands[i] })
	if len(cands) > n {
		cands = cands[:n]
	}
	return cands
}

// leaseView is what pickPeers needs of a heartbeat Lease.
type leaseView struct {
	Name  string
	Held  bool
	Stale bool
	Addr  string
}

// listPeerLeases lists the heartbeat Leases of one shard (all of them if
// shard is ""), from the API server's watch cache (resourceVersion 0: no
// etcd read).
func (h *Heartbeat) listPeerLeases(ctx context.Context, shard string) ([]leaseView, error) {
	set := labels.Set{HeartbeatLabel: HeartbeatLabelValue}
	if shard != "" {
		set[PeerShardLabel] = shard
	}
	ctx, cancel := context.WithTimeout(ctx, h.cfg.APITimeout)
	defer cancel()
	list, err := h.leases.CoordinationV1().Leases(h.cfg.Namespace).List(ctx, metav1.ListOptions{
		LabelSelector: labels.SelectorFromSet(set).String(), ResourceVersion: "0"})
	if err != nil {
		return nil, fmt.Errorf("list heartbeat leases: %w", err)
	}
	out := make([]leaseView, 0, len(list.Items))
	// renewTime is the writer's wall clock: compared with ours, with room for
	// skew (twice the fence window).
	now := time.Now()
	for _, l := range list.Items {
		stale := l.Spec.RenewTime == nil || now.Sub(l.Spec.RenewTime.Time) > 2*h.cfg.FenceAfter
		out = append(out, leaseView{Name: l.Name, Held: l.Spec.HolderIdentity != nil && *l.Spec.HolderIdentity != "",
			Stale: stale, Addr: l.Annotations[PeerAddressAnnotation]})
	}
	return out, nil
}

// refreshPeers picks this node's peers again: from one random shard of the
// heartbeat Leases, or from all of them when that shard has too few. It
// returns how many peers are known.
func (h *Heartbeat) refreshPeers(ctx context.Context) int {
	logger := klog.FromContext(ctx)
	shard := strconv.Itoa(h.rand.IntN(peerShards))
	leases, err := h.listPeerLeases(ctx, shard)
	if err == nil && len(pickPeers(h.cfg.NodeName, leases, h.cfg.Peers, h.rand)) < h.cfg.Peers {
		leases, err = h.listPeerLeases(ctx, "")
	}
	if err != nil {
		logger.Info("Cannot refresh the failover peers; keeping the ones known", "err", err)
		h.mu.Lock()
		defer h.mu.Unlock()
		return len(h.peers)
	}
	peers := pickPeers(h.cfg.NodeName, leases, h.cfg.Peers, h.rand)
	h.mu.Lock()
	h.peers = peers
	h.mu.Unlock()
	names := make([]string, len(peers))
	for i, p := range peers {
		names[i] = p.Node
	}
	logger.V(2).Info("Failover peers picked", "peers", names)
	return len(peers)
}

// canRenew is this agent's answer to a peer: the API server answers it,
// recently: its last renewal attempt succeeded, or, when its heartbeat
// writes fail, its readiness probe did (probeAPI). Only an API server that
// answers neither is an outage: heartbeat writes throttled or refused for
// every agent (a flooded flow) while the API server serves the controller
// must not make a partitioned node hold its fence.
func (h *Heartbeat) canRenew() bool {
	now := h.boot()
	h.mu.Lock()
	defer h.mu.Unlock()
	return (h.lastAttemptOK && now-h.lastOK < h.cfg.FenceAfter/2) ||
		(h.apiOKSet && now-h.lastAPIOK < h.cfg.FenceAfter/2)
}

// probeAPI asks the API server's /readyz with the node's client after a
// failed renewal and records when the API server answered. API Priority
// and Fairness puts /readyz in the exempt priority level for every user
// (the suggested FlowSchema "probes"): no flood of any flow, and no
// stolen agent token, can throttle it, whereas every other request of the
// agent's ServiceAccount (--identity=serviceaccount) shares that one
// user's flows with whoever holds its token. Readiness includes etcd's
// health: an API server that cannot write answers 500, not "can renew".
// An answer that is an authentication or authorization refusal still
// comes from a serving API server.
func (h *Heartbeat) probeAPI(ctx context.Context) {
	start := h.boot()
	ctx, cancel := context.WithTimeout(ctx, min(h.cfg.APITimeout, h.cfg.FenceAfter/4))
	defer cancel()
	var code int
	// The core group's REST client: the agent's clientset
	// (agent/kubeclient) carries only the groups it calls.
	h.client.CoreV1().RESTClient().Get().AbsPath("/readyz").Do(ctx).StatusCode(&code)
	if !apiServes(code) {
		return
	}
	h.mu.Lock()
	h.lastAPIOK, h.apiOKSet = start, true
	h.mu.Unlock()
}

// apiServes tells a readiness answer (HTTP status, 0: none) of an API
// server that serves requests: ready, or refusing this caller's
// credentials. 429 (throttled) and 5xx (not ready, etcd down, shutting
// down) are not.
func apiServes(code int) bool {
	return code == http.StatusOK || code == http.StatusUnauthorized || code == http.StatusForbidden
}

// askPeers runs one peer check and returns its verdict.
func (h *Heartbeat) askPeers(ctx context.Context) (peerVerdict, peerTally) {
	if h.peerClient == nil {
		return verdictDisabled, peerTally{}
	}
	h.mu.Lock()
	peers := append([]peerInfo(nil), h.peers...)
	h.mu.Unlock()
	t := h.peerClient.check(ctx, peers, h.peerMetrics)
	return judgePeers(t), t
}

// servePeers listens on PeerListen; it returns the advertised address.
func (h *Heartbeat) servePeers(ctx context.Context) (string, func(), error) {
	ln, err := net.Listen("tcp", h.cfg.PeerListen)
	if err != nil {
		return "", nil, fmt.Errorf("failover peer endpoint --failover-peer-listen %s: %w", h.cfg.PeerListen, err)
	}
	_, port, _ := net.SplitHostPort(ln.Addr().String())
	host := h.cfg.PeerAdvertise
	if host == "" {
		if ip := ln.Addr().(*net.TCPAddr).IP; !ip.IsUnspecified() {
			host = ip.String()
		}
	}
	ps := newPeerServer(h.cfg.NodeName, h.cfg.PeerKeyFile, h.canRenew)
	ps.rejected = h.peerMetrics.refused
	srv := &http.Server{
		Handler:           ps,
		ReadHeaderTimeout: 2 * time.Second,
		ReadTimeout:       2 * time.Second,
		WriteTimeout:      2 * time.Second,
		MaxHeaderBytes:    4096,
		BaseContext:       func(net.Listener) context.Context { return ctx },
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			klog.FromContext(ctx).Error(err, "Failover peer endpoint stopped")
		}
	}()
	stop := func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
		defer cancel()
		_ = srv.Shutdown(sctx)
		<-done
	}
	if host == "" {
		return "", stop, nil
	}
	return net.JoinHostPort(host, port), stop, nil
}

// probePeers asks the peers while the heartbeat renews, to learn before an
// outage whether the peer check could hold a fence through one: with no
// key, fewer than two peers known or none answering (a default-deny
// NetworkPolicy, a wrong key), an outage longer than FenceAfter fences this
// node. A change is logged and reported in an event on the Node and in
// mountmedic_failover_peer_check_degraded.
func (h *Heartbeat) probePeers(ctx context.Context) {
	reason, detail := "", ""
	h.mu.Lock()
	peers := slices.Clone(h.peers)
	h.mu.Unlock()
	switch _, err := readPeerKey(h.cfg.PeerKeyFile); {
	case h.peerClient == nil:
		reason, detail = degradedNoKey, "no --failover-peer-key-file"
	case err != nil:
		reason, detail = degradedNoKey, err.Error()
	case len(peers) < minHoldPeers:
		reason, detail = degradedNoPeers, fmt.Sprintf("%d peers known, want at least %d (peers are agents with a held, fresh heartbeat Lease and a peer address)", len(peers), minHoldPeers)
	default:
		t := h.peerClient.check(ctx, peers, h.peerMetrics)
		if t.CanRenew+t.Cannot == 0 {
			reason, detail = degradedUnreachable, fmt.Sprintf("none of %d peers answered (%d answers rejected): a NetworkPolicy blocking the peer port, or agents with another key", t.Asked, t.Rejected)
		}
	}
	for _, r := range degradedReasons {
		v := 0.0
		if r == reason {
			v = 1
		}
		h.peerMetrics.degraded.WithLabelValues(r).Set(v)
	}
	h.mu.Lock()
	prev := h.degraded
	h.degraded = reason
	h.mu.Unlock()
	if prev == reason {
		return
	}
	logger := klog.FromContext(ctx)
	if reason == "" {
		logger.Info("Failover peer check works again: an API server outage holds the fence", "peers", len(peers))
		h.nodeEvent(corev1.EventTypeNormal, ReasonPeerCheckOK, "Failover peer check works: %d peers answer; an API server outage no longer fences this node", len(peers))
		return
	}
	logger.Error(nil, "Failover peer check cannot hold a fence: an API server outage longer than --failover-fence-after fences this node's RWO pods", "reason", reason, "detail", detail)
	h.nodeEvent(corev1.EventTypeWarning, ReasonPeerCheckDegraded, "Failover peer check cannot hold a fence (%s: %s): an API server outage longer than %s fences this node's pods with ReadWriteOnce volumes", reason, detail, h.cfg.FenceAfter)
}
