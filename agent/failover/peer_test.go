package failover

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/client-go/util/flowcontrol"
)

func TestJudgePeers(t *testing.T) {
	for name, tc := range map[string]struct {
		tally peerTally
		want  peerVerdict
	}{
		"no peers known":                       {peerTally{}, verdictNoPeers},
		"one peer renews among outage answers": {peerTally{Asked: 5, CanRenew: 1, Cannot: 4}, verdictPeerRenews},
		"all cannot":                           {peerTally{Asked: 7, Cannot: 7}, verdictOutage},
		// A peer that does not answer counts against a hold: a group cut
		// off together must not hold on its own members' word.
		"all but one cannot, one silent":  {peerTally{Asked: 7, Cannot: 6}, verdictNotUnanimous},
		"majority of asked is not enough": {peerTally{Asked: 5, Cannot: 3}, verdictNotUnanimous},
		"one peer is too few":             {peerTally{Asked: 1, Cannot: 1}, verdictNotUnanimous},
		"two peers both cannot":           {peerTally{Asked: 2, Cannot: 2}, verdictOutage},
		"nobody answers":                  {peerTally{Asked: 5}, verdictIsolated},
		"only rejected answers":           {peerTally{Asked: 3, Rejected: 3}, verdictIsolated},
		// One spoofer holding the key among honest silent peers.
		"one forged outage answer of five": {peerTally{Asked: 5, Cannot: 1}, verdictNotUnanimous},
	} {
		t.Run(name, func(t *testing.T) {
			if got := judgePeers(tc.tally); got != tc.want {
				t.Errorf("judgePeers(%+v) = %s, want %s", tc.tally, got, tc.want)
			}
		})
	}
}

// TestJittered: every wait between renewals lies in [interval, 1.1
// interval] (never more often than the interval, kubelet's node lease
// rate), and the heartbeat's waits are spread, not all equal.
func TestJittered(t *testing.T) {
	const d = 10 * time.Second
	for _, u := range []float64{0, 0.5, 0.999999} {
		if got := jittered(d, u); got < d || got > d+d/10 {
			t.Errorf("jittered(%s, %v) = %s, want in [%s, %s]", d, u, got, d, d+d/10)
		}
	}
	h := &Heartbeat{rand: rand.New(rand.NewPCG(1, 2))}
	seen := map[time.Duration]bool{}
	var sum time.Duration
	const n = 1000
	for range n {
		got := jittered(d, h.rand.Float64())
		if got < d || got > d+d/10 {
			t.Fatalf("wait %s outside [%s, %s]", got, d, d+d/10)
		}
		seen[got] = true
		sum += got
	}
	if len(seen) < n/2 {
		t.Errorf("%d distinct waits of %d: the waits are not jittered", len(seen), n)
	}
	if mean := sum / n; mean < d {
		t.Errorf("mean wait %s below the interval %s: more writes than kubelet's node lease", mean, d)
	}
}

func TestBootClock(t *testing.T) {
	a := bootClock()
	time.Sleep(10 * time.Millisecond)
	b := bootClock()
	if b <= a {
		t.Errorf("bootClock went from %s to %s, want it to advance", a, b)
	}
	// CLOCK_BOOTTIME counts from boot, like /proc/uptime.
	up, err := os.ReadFile("/proc/uptime")
	if err != nil {
		t.Skip(err)
	}
	secs, _, _ := strings.Cut(string(up), " ")
	d, err := time.ParseDuration(secs + "s")
	if err != nil {
		t.Fatal(err)
	}
	if diff := b - d; diff < -2*time.Second || diff > 2*time.Second {
		t.Errorf("bootClock = %s, /proc/uptime = %s: want the time since boot", b, d)
	}
}

// writeKey writes a peer key file.
func writeKey(t testing.TB, key string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "key")
	if err := os.WriteFile(path, []byte(key+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

const testKey = "0123456789abcdef0123456789abcdef-test-key"

// peerEndpoint serves a real peerServer for node with canRenew.
func peerEndpoint(t *testing.T, node, keyFile string, canRenew bool) string {
	t.Helper()
	srv := httptest.NewServer(newPeerServer(node, keyFile, func() bool { return canRenew }))
	t.Cleanup(srv.Close)
	return srv.Listener.Addr().String()
}

// hostileEndpoint answers every check with answer(nonce).
func hostileEndpoint(t *testing.T, answer func(nonce string) peerAnswer) string {
	t.Helper()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_ = json.NewEncoder(w).Encode(answer(r.URL.Query().Get("nonce")))
	}))
	t.Cleanup(srv.Close)
	return srv.Listener.Addr().String()
}

// closedAddr is a loopback address nobody listens on.
func closedAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// TestPeerCheck runs the peer protocol over real HTTP on loopback, with
// honest peers and the hostile actors it must reject: a pod answering
// "outage" without the key, with another key, an honest answer replayed
// to another nonce or altered, and a relay of another node's answer.
func TestPeerCheck(t *testing.T) {
	key := writeKey(t, testKey)
	other := writeKey(t, "another-key-another-key-another-key-0000")
	ctx := context.Background()

	// A genuine answer of node "b" to some earlier check, to replay.
	var recorded peerAnswer
	{
		c := newPeerClient("recorder", key, time.Second)
		k, _ := readPeerKey(key)
		ans, err := c.ask(ctx, k, peerInfo{Node: "b", Addr: peerEndpoint(t, "b", key, false)})
		if err != nil {
			t.Fatalf("ask an honest peer: %v", err)
		}
		recorded = *ans
	}
	honestB := peerEndpoint(t, "b", key, true)
	hostile := map[string]string{
		"no MAC": hostileEndpoint(t, func(n string) peerAnswer { return peerAnswer{Node: "h", Nonce: n} }),
		"other key": hostileEndpoint(t, func(n string) peerAnswer {
			k, _ := readPeerKey(other)
			return peerAnswer{Node: "h", Nonce: n, MAC: peerMAC(k, n, "h", false)}
		}),
		"replayed": hostileEndpoint(t, func(string) peerAnswer { return recorded }),
		"replayed to the new nonce": hostileEndpoint(t, func(n string) peerAnswer {
			a := recorded
			a.Nonce, a.Node = n, "h"
			return a
		}),
		"not JSON": func() string {
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = w.Write([]byte("outage")) }))
			t.Cleanup(srv.Close)
			return srv.Listener.Addr().String()
		}(),
	}
	// A relay: asked as node "h", it forwards the nonce to honest node b
	// (which cannot renew) and returns b's valid answer.
	cannotB := peerEndpoint(t, "b", key, false)
	hostile["relay of another node"] = hostileEndpoint(t, func(n string) peerAnswer {
		resp, err := http.Get("http://" + cannotB + peerPath + "?nonce=" + n)
		if err != nil {
			return peerAnswer{}
		}
		defer resp.Body.Close()
		var a peerAnswer
		_ = json.NewDecoder(resp.Body).Decode(&a)
		return a
	})

	m, err := newPeerMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	c := newPeerClient("a", key, time.Second)
	for name, addr := range hostile {
		t.Run(name, func(t *testing.T) {
			k, _ := readPeerKey(key)
			_, err := c.ask(ctx, k, peerInfo{Node: "h", Addr: addr})
			var rej *rejectedError
			if err == nil || !errors.As(err, &rej) {
				t.Errorf("ask hostile peer (%s): err = %v, want a rejection", name, err)
			}
		})
	}

	for name, tc := range map[string]struct {
		peers []peerInfo
		want  peerVerdict
	}{
		"three hostile outage answers, nobody honest": {[]peerInfo{
			{"h", hostile["no MAC"]}, {"h", hostile["other key"]}, {"h", hostile["replayed to the new nonce"]}}, verdictIsolated},
		"honest peer renews beside hostile ones": {[]peerInfo{
			{"h", hostile["no MAC"]}, {"h", hostile["other key"]}, {"b", honestB}}, verdictPeerRenews},
		"honest outage": {[]peerInfo{
			{"b", peerEndpoint(t, "b", key, false)}, {"c", peerEndpoint(t, "c", key, false)}, {"d", peerEndpoint(t, "d", key, false)}}, verdictOutage},
		"honest outage, one peer silent": {[]peerInfo{
			{"b", peerEndpoint(t, "b", key, false)}, {"c", peerEndpoint(t, "c", key, false)}, {"d", closedAddr(t)}}, verdictNotUnanimous},
		"honest outage minority, the rest silent": {[]peerInfo{
			{"b", peerEndpoint(t, "b", key, false)}, {"c", closedAddr(t)}, {"d", closedAddr(t)}}, verdictNotUnanimous},
		// A spoofer with the key (a stolen agent credential) can forge one
		// address's answer: the others' silence still fences.
		"one spoofer with the key": {[]peerInfo{
			{"x", peerEndpoint(t, "x", key, false)}, {"c", closedAddr(t)}, {"d", closedAddr(t)}}, verdictNotUnanimous},
		"peers answer with another key": {[]peerInfo{
			{"b", peerEndpoint(t, "b", other, false)}, {"c", peerEndpoint(t, "c", other, false)}}, verdictIsolated},
	} {
		t.Run(name, func(t *testing.T) {
			tally := c.check(ctx, tc.peers, m)
			if got := judgePeers(tally); got != tc.want {
				t.Errorf("verdict = %s (tally %+v), want %s", got, tally, tc.want)
			}
		})
	}
	if got := metric(t, prometheusGatherer(t, m), "mountmedic_failover_peer_answers_rejected_total", nil); got < 4 {
		t.Errorf("peer_answers_rejected_total = %v, want the hostile answers counted", got)
	}
}

// TestPeerServerLimits: what a request costs is bounded per source
// address before it is read, so a flood from one address (with or without
// the key) leaves the others their turns; unauthenticated, mis-addressed,
// replayed and stale checks are refused; only authenticated checks spend
// the endpoint's own tokens.
func TestPeerServerLimits(t *testing.T) {
	var calls atomic.Int32
	keyFile := writeKey(t, testKey)
	ps := newPeerServer("a", keyFile, func() bool { calls.Add(1); return true })
	ps.limit = flowcontrol.NewFakeAlwaysRateLimiter()
	clock := time.Now()
	ps.now = func() time.Time { return clock }
	// Buckets that refill only when the test says so.
	buckets := map[string]*countingLimiter{}
	ps.perSource = func() flowcontrol.RateLimiter { return &countingLimiter{left: 3} }
	key, _ := readPeerKey(keyFile)
	get := func(src, q string) int {
		r := httptest.NewRequest(http.MethodGet, peerPath+q, nil)
		r.RemoteAddr = src + ":40000"
		w := httptest.NewRecorder()
		ps.ServeHTTP(w, r)
		if l, ok := ps.sources[src]; ok {
			buckets[src] = l.limit.(*countingLimiter)
		}
		return w.Code
	}
	n := 0
	signedAt := func(from, to string, at time.Time) string {
		n++
		nonce := fmt.Sprintf("%064x", n)
		ts := strconv.FormatInt(at.Unix(), 10)
		return "?nonce=" + nonce + "&ts=" + ts + "&from=" + from + "&auth=" + peerRequestMAC(key, nonce, ts, from, to)
	}
	signed := func(from, to string) string { return signedAt(from, to, clock) }

	if code := get("10.0.0.1", "?nonce=abc&from=b&ts=1"); code != http.StatusBadRequest {
		t.Errorf("short nonce: status %d, want 400", code)
	}
	// A flood from one address, without the key: 401s, then 429s once its
	// bucket is spent; nothing answered.
	codes := map[int]int{}
	for range 50 {
		codes[get("10.0.0.66", "?nonce="+strings.Repeat("ab", 32)+"&ts=1&from=b&auth=00")]++
	}
	if codes[http.StatusUnauthorized] != 3 || codes[http.StatusTooManyRequests] != 47 {
		t.Errorf("50 unauthenticated checks from one address: %v, want 3 refused and 47 told to wait", codes)
	}
	// Another address asks, authenticated, while the flood goes on.
	if code := get("10.0.0.2", signed("b", "a")); code != http.StatusOK {
		t.Fatalf("an agent's check during another address's flood: status %d, want 200", code)
	}
	// The flooding address has the key too: a claimed new sender name
	// gets no new bucket.
	if code := get("10.0.0.66", signed("c", "a")); code != http.StatusTooManyRequests {
		t.Errorf("check under a new sender name from the flooding address: status %d, want 429", code)
	}
	// Mis-addressed, replayed and stale checks are refused.
	replay := signed("b", "a")
	for what, c := range map[string]struct {
		q    string
		want int
	}{
		"signed for another node": {signed("b", "other"), http.StatusUnauthorized},
		"first use":               {replay, http.StatusOK},
	} {
		if code := get("10.0.0.3", c.q); code != c.want {
			t.Errorf("%s: status %d, want %d", what, code, c.want)
		}
	}
	if code := get("10.0.0.4", replay); code != http.StatusUnauthorized {
		t.Errorf("replayed check from another address: status %d, want 401", code)
	}
	if code := get("10.0.0.4", signedAt("b", "a", clock.Add(-peerMaxSkew-time.Second))); code != http.StatusUnauthorized {
		t.Errorf("check signed %s ago: status %d, want 401", peerMaxSkew+time.Second, code)
	}
	if code := get("10.0.0.5", signedAt("b", "a", clock.Add(peerMaxSkew/2))); code != http.StatusOK {
		t.Errorf("check from a clock %s ahead: status %d, want 200", peerMaxSkew/2, code)
	}
	// Past the nonce's memory, its timestamp is past the skew: still
	// refused.
	clock = clock.Add(peerNonceTTL + time.Second)
	if code := get("10.0.0.6", replay); code != http.StatusUnauthorized {
		t.Errorf("check replayed after its nonce was forgotten: status %d, want 401", code)
	}
	if got := calls.Load(); got != 3 {
		t.Errorf("answered %d checks, want the 3 authenticated, fresh ones", got)
	}
	if len(ps.nonces) != 0 || len(ps.nonceOrder) != 0 {
		t.Errorf("%d nonces remembered past their TTL, want none", len(ps.nonces))
	}
}

// TestPeerServerBounded: the endpoint's memory of sources is bounded; past
// the bound, new sources share one bucket instead of growing it.
func TestPeerServerBounded(t *testing.T) {
	ps := newPeerServer("a", writeKey(t, testKey), func() bool { return true })
	clock := time.Now()
	for i := range peerMaxTracked + 100 {
		ps.source(fmt.Sprintf("10.%d.%d.%d", i>>16&255, i>>8&255, i&255), clock)
	}
	if len(ps.sources) != peerMaxTracked {
		t.Errorf("%d sources tracked, want at most %d", len(ps.sources), peerMaxTracked)
	}
	if got := ps.source("192.0.2.1", clock); got != ps.overflow {
		t.Errorf("a new source past the bound got its own bucket, want the shared one")
	}
	clock = clock.Add(peerSourceIdle + 2*time.Second)
	if got := ps.source("192.0.2.1", clock); got == ps.overflow || len(ps.sources) != 1 {
		t.Errorf("after every source went idle: %d sources tracked, new source shares the overflow bucket %t; want the idle ones forgotten", len(ps.sources), got == ps.overflow)
	}
}

// TestPeerServerSweep: the idle sweep of the source table, as
// docs/failover.md states it. Below the bound no source is forgotten; once
// the table is full, a new source sweeps it (at most once a second) and
// forgets only the sources silent for over peerSourceIdle; one still
// asking keeps its own bucket; while none is idle, new sources share the
// overflow bucket.
func TestPeerServerSweep(t *testing.T) {
	addr := func(i int) string { return fmt.Sprintf("10.%d.%d.%d", i>>16&255, i>>8&255, i&255) }
	start := time.Now()
	for _, tc := range []struct {
		name string
		// fill: how many sources ask at start; refresh: how many of them
		// (the first) ask again at refreshAt; then a new source asks at
		// newAt (and again at againAt, if set).
		fill, refresh     int
		refreshAt, newAt  time.Duration
		againAt           time.Duration
		wantTracked       int
		wantOverflow      bool
		wantAgainTracked  int
		wantAgainOverflow bool
		wantRefreshedKept bool
	}{
		{name: "below the bound idle sources stay", fill: 100, newAt: 10 * peerSourceIdle, wantTracked: 101},
		{name: "full and all active: the new source shares the overflow", fill: peerMaxTracked, newAt: peerSourceIdle, wantTracked: peerMaxTracked, wantOverflow: true},
		{name: "full, half idle: only the idle are forgotten", fill: peerMaxTracked, refresh: peerMaxTracked / 2, refreshAt: peerSourceIdle,
			newAt: peerSourceIdle + 2*time.Second, wantTracked: peerMaxTracked/2 + 1, wantRefreshedKept: true},
		{name: "at most one sweep a second", fill: peerMaxTracked, refresh: peerMaxTracked, refreshAt: time.Second,
			// The sweep at newAt forgets none; at againAt (half a second
			// later, all idle by then) no sweep runs yet.
			newAt: peerSourceIdle + 600*time.Millisecond, againAt: peerSourceIdle + 1100*time.Millisecond,
			wantTracked: peerMaxTracked, wantOverflow: true, wantAgainTracked: peerMaxTracked, wantAgainOverflow: true, wantRefreshedKept: true},
		{name: "a second after that sweep, the idle are forgotten", fill: peerMaxTracked, refresh: peerMaxTracked, refreshAt: time.Second,
			newAt: peerSourceIdle + 600*time.Millisecond, againAt: peerSourceIdle + 1700*time.Millisecond,
			wantTracked: peerMaxTracked, wantOverflow: true, wantAgainTracked: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ps := newPeerServer("a", writeKey(t, testKey), func() bool { return true })
			for i := range tc.fill {
				ps.source(addr(i), start)
			}
			var kept flowcontrol.RateLimiter
			if tc.refresh > 0 {
				kept = ps.sources[addr(0)].limit
				for i := range tc.refresh {
					ps.source(addr(i), start.Add(tc.refreshAt))
				}
			}
			got := ps.source("192.0.2.1", start.Add(tc.newAt))
			if len(ps.sources) != tc.wantTracked || (got == ps.overflow) != tc.wantOverflow {
				t.Errorf("new source at %s: %d tracked, shares the overflow %t; want %d, %t", tc.newAt, len(ps.sources), got == ps.overflow, tc.wantTracked, tc.wantOverflow)
			}
			if tc.againAt > 0 {
				got = ps.source("192.0.2.2", start.Add(tc.againAt))
				if len(ps.sources) != tc.wantAgainTracked || (got == ps.overflow) != tc.wantAgainOverflow {
					t.Errorf("new source at %s: %d tracked, shares the overflow %t; want %d, %t", tc.againAt, len(ps.sources), got == ps.overflow, tc.wantAgainTracked, tc.wantAgainOverflow)
				}
			}
			if tc.wantRefreshedKept {
				if st := ps.sources[addr(0)]; st == nil || st.limit != kept {
					t.Errorf("a source that kept asking lost its bucket to the sweep")
				}
			}
		})
	}
}

// TestAPIServes: which readiness answers count as "the API server serves":
// ready, or refusing the caller's credentials; never throttled, not
// ready, or no answer.
func TestAPIServes(t *testing.T) {
	for code, want := range map[int]bool{0: false, 200: true, 401: true, 403: true, 404: false, 429: false, 500: false, 503: false} {
		if got := apiServes(code); got != want {
			t.Errorf("apiServes(%d) = %v, want %v", code, got, want)
		}
	}
}

// countingLimiter accepts left times, then refuses.
type countingLimiter struct {
	flowcontrol.RateLimiter
	left int
}

func (l *countingLimiter) TryAccept() bool {
	if l.left == 0 {
		return false
	}
	l.left--
	return true
}

// prometheusGatherer registers the peer metrics on a registry to read them.
func prometheusGatherer(t *testing.T, m *peerMetrics) prometheus.Gatherer {
	t.Helper()
	reg := prometheus.NewRegistry()
	if err := reg.Register(m.rejected); err != nil {
		t.Fatal(err)
	}
	return reg
}

// TestPickPeers: only held, fresh Leases with an address, never self: a
// node whose heartbeat stopped (dead, fenced) is no witness of an outage.
func TestPickPeers(t *testing.T) {
	leases := []leaseView{
		{Name: "self", Held: true, Addr: "10.0.0.1:9810"},
		{Name: "ok-1", Held: true, Addr: "10.0.0.2:9810"},
		{Name: "ok-2", Held: true, Addr: "10.0.0.3:9810"},
		{Name: "released", Held: false, Addr: "10.0.0.4:9810"},
		{Name: "stale", Held: true, Stale: true, Addr: "10.0.0.5:9810"},
		{Name: "no-address", Held: true},
	}
	got := pickPeers("self", leases, 7, rand.New(rand.NewPCG(1, 2)))
	var names []string
	for _, p := range got {
		names = append(names, p.Node)
	}
	slices.Sort(names)
	if !slices.Equal(names, []string{"ok-1", "ok-2"}) {
		t.Errorf("pickPeers = %v, want [ok-1 ok-2]", names)
	}
	if got := pickPeers("self", append(leases, leaseView{Name: "ok-3", Held: true, Addr: "a:1"}), 2, rand.New(rand.NewPCG(3, 4))); len(got) != 2 {
		t.Errorf("pickPeers with n=2 gave %d peers", len(got))
	}
}

// TestPeerCheckFlooded: during an API server outage, anyone on the pod
// network sends about 45 unauthenticated checks a second to every peer's
// endpoint. The agents' own checks must still be answered: every peer
// says it cannot renew, the verdict is outage (hold), never isolated
// (fence), in every one of five checks.
func TestPeerCheckFlooded(t *testing.T) {
	if testing.Short() {
		// Seven seconds of a real flood: a proof test, left out of -short
		// (the fast rule tests); scripts/test.sh never passes -short.
		t.Skip("a 7 s flood of real peer servers; run without -short")
	}
	key := writeKey(t, testKey)
	var peers []peerInfo
	for i := range 7 {
		node := fmt.Sprintf("peer-%d", i)
		srv := httptest.NewServer(newPeerServer(node, key, func() bool { return false }))
		t.Cleanup(srv.Close)
		peers = append(peers, peerInfo{Node: node, Addr: srv.Listener.Addr().String()})
	}
	ctx, stop := context.WithCancel(context.Background())
	defer stop()
	flooded := floodPeers(ctx, peers, 45)
	time.Sleep(2 * time.Second) // the flood has spent any burst by now

	m, err := newPeerMetrics(prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	// The shipped peer timeout: a shorter one proves less and fails
	// under a loaded CI machine's scheduling, not under the flood.
	c := newPeerClient("asker", key, DefaultConfig().PeerTimeout)
	for i := range 5 {
		tally := c.check(ctx, peers, m)
		if got := judgePeers(tally); got != verdictOutage {
			t.Errorf("check %d under a flood of 45 GET/s per peer: verdict %s (tally %+v), want outage", i, got, tally)
		}
		time.Sleep(time.Second)
	}
	stop()
	t.Logf("flood requests sent: %d", flooded())
}

// floodPeers sends perSecond unauthenticated checks a second to each peer
// until ctx ends; it returns a function that counts them.
func floodPeers(ctx context.Context, peers []peerInfo, perSecond int) func() int64 {
	var sent atomic.Int64
	// From an address of its own, as a pod on the network has.
	client := &http.Client{Timeout: time.Second, Transport: &http.Transport{DialContext: loopbackDialer(250).DialContext}}
	for _, p := range peers {
		go func() {
			tick := time.NewTicker(time.Second / time.Duration(perSecond))
			defer tick.Stop()
			for {
				select {
				case <-ctx.Done():
					return
				case <-tick.C:
				}
				go func() {
					nonce := strings.Repeat("cd", 32)
					req, _ := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+p.Addr+peerPath+"?nonce="+nonce+"&from=flood", nil)
					if resp, err := client.Do(req); err == nil {
						resp.Body.Close()
					}
					sent.Add(1)
				}()
			}
		}()
	}
	return sent.Load
}

// loopbackDialer dials from 127.0.1.i: the agents of a test, all on this
// machine, each get a source address of their own, as nodes have (the
// peer endpoint's buckets are per source address).
func loopbackDialer(i int) *net.Dialer {
	return &net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 1, byte(i))}}
}
