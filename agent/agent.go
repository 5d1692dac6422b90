package agent

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/agent/coldpages"
	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// ReportingController names the agent in the events it writes.
const ReportingController = "mountmedic.io/agent"

// Deps are what Run needs from outside, injected so that tests (and the
// command) choose them.
type Deps struct {
	// Client talks to the API server. Required.
	Client kubernetes.Interface
	// Repairer acts on mounts (a *remount.Repairer). Nil runs the agent
	// without the restage, live swap, restart and unmount tiers: it detects,
	// reports and evicts only. A dry-run agent needs a dry-run repairer,
	// whose plans its events report.
	Repairer repairer
	// DriverCaps returns a CSI driver's node capabilities; nil uses the
	// Repairer's Capabilities (its per-driver clients) when it has them,
	// else DialDriverCaps(cfg.KubeletRoot).
	DriverCaps DriverCapsFunc
	// Prober probes backends; nil makes one from the configuration.
	Prober *probe.Prober
	// Events records events; nil starts an events.k8s.io broadcaster on
	// Client.
	Events eventRecorder
	// Registry is where the agent registers its metrics and that /metrics
	// serves; nil makes a private one. Pass one to serve other collectors
	// (the failover duty's) on the same endpoint.
	Registry *prometheus.Registry
	// Fenced reports pods the failover heartbeat has fenced (its node lost
	// the API server: their containers were stopped and their volumes
	// unmounted). They are never repaired while fenced: a re-stage would
	// put the volume back under a node that must not write to it. Nil
	// fences nothing.
	Fenced func(podUID string) bool
	// ReleaseCode gives the kernel back the pages of the executable the
	// process no longer uses (Config.ReleaseCode); nil is
	// coldpages.Release.
	ReleaseCode func() (coldpages.Result, error)
}

// Agent is the node agent. Make it with New, start it with Run.
type Agent struct {
	cfg      Config
	client   kubernetes.Interface
	repairer repairer
	prober   *probe.Prober
	kube     *kube
	caps     *capsCache
	metrics  *metrics
	// condition writes the node condition; nil with --node-condition=false.
	condition *conditionWriter
	report    reporter
	notes     *noteBook
	budget    *budget
	decider   *decider
	events    eventRecorder
	// limiter holds the events past the node's budget for a summary.
	limiter *limitedRecorder

	// The pod informer is made in New, started by Run, so
	// that /readyz (served before the informer starts) reads them safely.
	podInf cache.SharedIndexInformer
	pods   podsByUID
	synced func() bool

	scanned  atomic.Bool
	lastScan atomic.Int64 // unix nanoseconds

	fenced func(podUID string) bool
	// release is Deps.ReleaseCode.
	release func() (coldpages.Result, error)

	driverMu sync.Mutex
	driverOK map[string]bool
	checking atomic.Bool
	driverUp chan string

	// current is the inventory the loop probes, for the stall watch.
	current atomic.Pointer[probe.Inventory]
	// stalled: the stall watch saw a FUSE probe pass its deadline
	// between cycles.
	stalled chan struct{}

	// nodePods serves the runs' fresh reads of the node's pods.
	nodePods *nodePods

	results chan jobResult
	running int
	// broken and queue are the last probe cycle's broken volumes and the
	// keys it found due that no run has taken yet (owned by the loop).
	broken  map[string]*brokenVolume
	queue   []string
	workers sync.WaitGroup
}

// New checks the configuration and prepares an agent.
func New(cfg Config, deps Deps) (*Agent, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if deps.Client == nil {
		return nil, errors.New("agent needs a Kubernetes client")
	}
	if cfg.DryRun && deps.Repairer != nil {
		if dr, ok := deps.Repairer.(interface{ DryRun() bool }); !ok || !dr.DryRun() {
			return nil, errors.New("a dry-run agent needs a repairer that only plans (remount.Config.DryRun): refusing one that acts")
		}
	}
	if deps.DriverCaps == nil {
		if c, ok := deps.Repairer.(driverCapser); ok {
			deps.DriverCaps = c.Capabilities
		} else {
			deps.DriverCaps = DialDriverCaps(cfg.KubeletRoot)
		}
	}
	if deps.ReleaseCode == nil {
		deps.ReleaseCode = coldpages.Release
	}
	if deps.Prober == nil {
		pc := probe.DefaultConfig()
		pc.Timeout, pc.Parallel = cfg.ProbeTimeout, cfg.ProbeParallel
		deps.Prober = probe.NewProber(pc)
	}
	a := &Agent{
		cfg:      cfg,
		repairer: deps.Repairer,
		client:   deps.Client,
		prober:   deps.Prober,
		kube:     &kube{client: deps.Client, cache: newObjectCache(cfg.CacheSize, cfg.CacheTTL, nil), timeout: cfg.APITimeout, pvs: newPVStore(deps.Client, cfg.APITimeout)},
		nodePods: newNodePods(deps.Client, cfg.NodeName, cfg.APITimeout),
		caps:     newCapsCache(deps.DriverCaps),
		metrics:  newMetrics(cfg.Version, deps.Registry),
		notes:    newNoteBook(),
		budget:   newBudget(cfg.MaxEvictions, cfg.EvictionWindow, nil),
		decider:  newDecider(&cfg),
		events:   deps.Events,
		driverOK: make(map[string]bool),
		driverUp: make(chan string, 16),
		stalled:  make(chan struct{}, 1),
		fenced:   deps.Fenced,
		results:  make(chan jobResult, cfg.MaxConcurrentRepairs),
		release:  deps.ReleaseCode,
	}
	a.metrics.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{
		Name: "mountmedic_stall_probes_total",
		Help: "Probes the stall watch started between probe cycles because a FUSE connection had requests waiting (--stall-poll).",
	}, func() float64 { return float64(a.prober.StallProbes()) }))
	a.report = reporter{dryRun: cfg.DryRun}
	if deps.Events != nil {
		a.limiter = newLimitedRecorder(deps.Events, cfg.NodeName, nil)
		a.report.rec = a.limiter
	}
	if cfg.NodeCondition {
		a.condition = newConditionWriter(deps.Client, cfg.NodeName, cfg.APITimeout, a.metrics.reg)
	}
	inf, err := podInformer(a.client, cfg.NodeName)
	if err != nil {
		return nil, err
	}
	a.podInf, a.pods, a.synced = inf, podsByUID{idx: inf.GetIndexer()}, inf.HasSynced
	return a, nil
}

// PodInformer is the agent's informer of the pods bound to its node, for
// other duties of the same process (the failover heartbeat) to read instead
// of watching the same pods a second time. Run starts and stops it; a
// reader reads it once HasSynced.
func (a *Agent) PodInformer() cache.SharedIndexInformer { return a.podInf }

// Run runs the agent until ctx ends.
func Run(ctx context.Context, cfg Config, deps Deps) error {
	a, err := New(cfg, deps)
	if err != nil {
		return err
	}
	return a.Run(ctx)
}

// Handler serves /metrics, /healthz and /readyz.
func (a *Agent) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(a.metrics.reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		if err := a.healthy(time.Now()); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		switch {
		case !a.synced():
			http.Error(w, "pod informer not synced", http.StatusServiceUnavailable)
		case !a.scanned.Load():
			http.Error(w, "first scan not done", http.StatusServiceUnavailable)
		default:
			fmt.Fprintln(w, "ok")
		}
	})
	return mux
}

// healthy fails when no probe cycle ended for a long while: the loop is
// wedged.
func (a *Agent) healthy(now time.Time) error {
	last := a.lastScan.Load()
	if last == 0 {
		return nil // starting
	}
	limit := max(time.Minute, 10*(a.cfg.ProbeInterval+a.cfg.ProbeTimeout))
	if age := now.Sub(time.Unix(0, last)); age > limit {
		return fmt.Errorf("no probe cycle for %s", age.Round(time.Second))
	}
	return nil
}

// Run runs the agent until ctx ends. It returns an error only when it
// cannot start.
func (a *Agent) Run(ctx context.Context) error {
	logger := klog.FromContext(ctx).WithValues("node", a.cfg.NodeName)
	ctx = klog.NewContext(ctx, logger)
	logger.Info("Starting mountmedic agent", "kubeletRoot", a.cfg.KubeletRoot, "hostTable", a.cfg.HostTable,
		"probeInterval", a.cfg.ProbeInterval, "probeTimeout", a.cfg.ProbeTimeout, "strikes", a.cfg.Strikes,
		"tiers", a.cfg.Tiers.Names(), "dryRun", a.cfg.DryRun, "repairer", a.repairer != nil)

	var srv *http.Server
	if a.cfg.MetricsAddr != "" {
		ln, err := net.Listen("tcp", a.cfg.MetricsAddr)
		if err != nil {
			return fmt.Errorf("--metrics-addr %s: %w", a.cfg.MetricsAddr, err)
		}
		srv = &http.Server{Handler: a.Handler(), ReadHeaderTimeout: 10 * time.Second}
		go func() {
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				logger.Error(err, "Metrics server stopped")
			}
		}()
		logger.Info("Serving metrics", "addr", ln.Addr().String())
	}

	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	if a.events == nil {
		b := events.NewBroadcaster(&events.EventSinkImpl{Interface: a.client.EventsV1()})
		if err := b.StartRecordingToSinkWithContext(ctx); err != nil {
			return fmt.Errorf("start event recording: %w", err)
		}
		defer b.Shutdown()
		a.events = b.NewRecorder(scheme.Scheme, ReportingController)
		a.limiter = newLimitedRecorder(a.events, a.cfg.NodeName, nil)
		a.report.rec = a.limiter
	}

	informerDone := make(chan struct{})
	go func() {
		defer close(informerDone)
		a.podInf.RunWithContext(ctx)
	}()
	if a.condition != nil {
		a.workers.Add(1)
		go func() {
			defer a.workers.Done()
			a.condition.run(ctx)
		}()
	}

	tw, err := watchTable(ctx, a.cfg.HostTable)
	if err != nil {
		logger.Error(err, "Cannot watch the mount table; re-reading it at every resync only")
	}
	pw, err := watchPlugins(ctx, a.cfg.KubeletRoot)
	if err != nil {
		logger.Error(err, "Cannot watch driver registrations; a driver's return is noticed at resync only")
	}

	a.nodePods.live(ctx)
	a.workers.Add(1)
	go func() {
		defer a.workers.Done()
		a.kube.pvs.run(ctx)
	}()
	a.watchStalls(ctx)
	a.loop(ctx, tw, pw)

	cancel()
	a.workers.Wait()
	a.nodePods.wait()
	tw.Close()
	pw.Close()
	<-informerDone
	if srv != nil {
		sctx, scancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer scancel()
		_ = srv.Shutdown(sctx)
	}
	logger.Info("Stopped mountmedic agent")
	return nil
}

// loop is the agent's single decision goroutine: it owns the inventory and
// the decider; repair runs report back on a.results.
func (a *Agent) loop(ctx context.Context, tw *tableWatcher, pw *pluginWatcher) {
	logger := klog.FromContext(ctx)
	var inv *probe.Inventory
	dirty := true
	// probing: a cycle's probes are under way (reports brings them);
	// again: something asked for a cycle meanwhile.
	probing, again := false, false
	// pvsTracked: the PV store has been given a table read with the
	// informer synced.
	pvsTracked := false
	reports := make(chan probed, 1)
	probeTimer := time.NewTimer(0)
	defer probeTimer.Stop()
	resync := time.NewTicker(a.cfg.Resync)
	defer resync.Stop()
	summary := time.NewTicker(eventSummaryEvery)
	defer summary.Stop()
	defer a.limiter.flush(a.cfg.DryRun)
	// The executable's pages that only start-up used go back to the
	// kernel once it is done, a minute after the last repair run of a
	// burst, and every ReleaseCode while no repair runs.
	plan := releasePlan{every: a.cfg.ReleaseCode}
	var release <-chan time.Time
	releaseTimer := time.NewTimer(plan.first())
	defer releaseTimer.Stop()
	if plan.on() {
		release = releaseTimer.C
	}
	released := 0
	kick := func(driver string) {
		a.caps.forget(driver)
		for _, key := range a.decider.kick(driver, time.Now()) {
			a.notes.clear(key, noteDriverDown)
		}
		dirty = true
		probeTimer.Reset(0)
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-tw.Changes():
			dirty = true
		case <-summary.C:
			a.limiter.flush(a.cfg.DryRun)
		case <-release:
			now, next := plan.due(a.running)
			if now {
				a.releaseCode(ctx, released)
				released++
			}
			releaseTimer.Reset(next)
		case <-resync.C:
			dirty = true
			a.decider.resync()
			a.caps.forget("")
			if inv != nil {
				// Pods the informer lacked at the table's read have come since.
				a.kube.pvs.track(publishedPVs(inv, a.pods))
				drivers := volumeDrivers(inv)
				pw.Watch(ctx, drivers)
				a.checkDrivers(ctx, drivers)
			}
		case driver := <-pw.Events():
			logger.V(2).Info("CSI driver registered; probing its volumes now", "driver", driver)
			kick(driver)
		case driver := <-a.driverUp:
			logger.V(2).Info("CSI driver answers again; probing its volumes now", "driver", driver)
			kick(driver)
		case <-a.stalled:
			logger.V(2).Info("A FUSE backend's probe passed its deadline while requests wait on it; probing now")
			if probing {
				again = true
			} else {
				probeTimer.Reset(0)
			}
		case r := <-a.results:
			a.running--
			if a.running == 0 && plan.on() {
				releaseTimer.Reset(plan.afterRuns())
			}
			a.decider.finish(r.key, r.outcome, r.reachedEvict, time.Now())
			a.decider.setResidual(r.key, r.residual)
			if a.synced() {
				a.startRuns(ctx)
			}
		case <-probeTimer.C:
			if probing {
				again = true // a kick during a cycle: another one right after
				continue
			}
			start := time.Now()
			prev := inv
			if inv = a.readTable(ctx, inv, &dirty, pw); inv == nil {
				probeTimer.Reset(wait.Jitter(a.cfg.ProbeInterval, 0.1))
				continue
			}
			// The PVs of the node's volumes, read ahead of a repair: at
			// each new table once the informer has the node's pods.
			if (inv != prev || !pvsTracked) && a.synced() {
				a.kube.pvs.track(publishedPVs(inv, a.pods))
				pvsTracked = true
			}
			probing = true
			a.current.Store(inv)
			a.probeAsync(ctx, inv, start, reports)
		case p := <-reports:
			probing = false
			a.afterProbe(ctx, p)
			if again {
				again = false
				probeTimer.Reset(0)
			} else {
				probeTimer.Reset(wait.Jitter(a.cfg.ProbeInterval, 0.1))
			}
		}
	}
}

// releaseCodeFirst is when the agent first gives back the pages of its
// executable it no longer uses: start-up is done by then (the pod
// informer has synced on any API server that answers), and it is when the
// agent retries a release that a repair put off.
const releaseCodeFirst = 30 * time.Second

// releaseAfterRepairs is how long after the last repair run of a burst the
// agent gives back the pages of its executable it no longer uses.
const releaseAfterRepairs = time.Minute

// releasePlan is when the agent's loop gives back the pages of its
// executable it no longer uses (Config.ReleaseCode every, 0: never): once
// start-up is over, then every interval, a minute after the last repair
// run of a burst (what the runs touched, CSI and CRI clients and events,
// goes back; sooner when the interval is shorter), and never while a run
// is in flight: a release then is put off by releaseCodeFirst. Its times
// are for the loop's one timer.
type releasePlan struct{ every time.Duration }

// on: the agent releases at all.
func (p releasePlan) on() bool { return p.every > 0 }

// first is the timer's first wait.
func (p releasePlan) first() time.Duration { return min(releaseCodeFirst, p.every) }

// due is the timer's firing with running repair runs in flight: whether
// to release now, and the timer's next wait.
func (p releasePlan) due(running int) (now bool, next time.Duration) {
	if running > 0 {
		return false, releaseCodeFirst
	}
	return true, p.every
}

// afterRuns is the timer's wait once the last run in flight has ended.
func (p releasePlan) afterRuns() time.Duration { return min(releaseAfterRepairs, p.every) }

// releaseCode gives the kernel back the pages of the agent's executable it
// no longer uses (coldpages.Release); n counts the earlier releases.
func (a *Agent) releaseCode(ctx context.Context, n int) {
	res, err := a.release()
	coldpages.Log(klog.FromContext(ctx), n, res, err)
}

// watchStalls starts the prober's stall watch (Config.StallPoll) over the
// inventory the loop probes. It reads the fuse control filesystem where
// the repairer finds it: mounted already, or a detached mount of it that
// no mount table shows (remount.Repairer.FusectlDir; the host is left as
// found). A dry-run agent mounts nothing: it watches only when fusectl is
// mounted already.
func (a *Agent) watchStalls(ctx context.Context) {
	if a.cfg.StallPoll <= 0 {
		return
	}
	var dir string
	if m, ok := a.repairer.(interface {
		FusectlDir(context.Context) (string, error)
	}); ok && !a.cfg.DryRun {
		d, err := m.FusectlDir(ctx)
		if err != nil {
			klog.FromContext(ctx).Error(err, "Cannot read the fuse control filesystem: hung FUSE daemons are found by the probe cycles only")
		}
		dir = d
	}
	a.workers.Add(1)
	go func() {
		defer a.workers.Done()
		a.prober.WatchStallsAt(ctx, dir, a.cfg.StallPoll, a.current.Load, func() {
			select {
			case a.stalled <- struct{}{}:
			default:
			}
		})
	}()
}

// readTable re-reads the mount table when it changed (or, while the node has
// block-backed filesystems, when their super options changed) and returns
// the inventory to probe; nil while no table could ever be read.
func (a *Agent) readTable(ctx context.Context, inv *probe.Inventory, dirty *bool, pw *pluginWatcher) *probe.Inventory {
	logger := klog.FromContext(ctx)
	if !*dirty && inv != nil {
		// A block-backed filesystem reports a shutdown (ext4, xfs) or an
		// aborted journal (emergency_ro) only in its super options, and no
		// mount-table notification says they changed: while the node has
		// one, compare them every cycle (a table read, about 2.5 µs per
		// mount in the kernel) and take the whole table again only when
		// they changed.
		if changed, err := probe.SuperOptionsChanged(a.cfg.HostTable, inv); err != nil || changed {
			*dirty = true
		}
	}
	if inv != nil && !inv.Publishing.IsZero() && !time.Now().Before(inv.Publishing) {
		// A publish target was in kubelet's publish window: read again
		// whether it got mounted, as no table change may say so.
		*dirty = true
	}
	if *dirty || inv == nil {
		fresh, err := probe.ReadFile(a.cfg.HostTable, probe.Options{Root: a.cfg.KubeletRoot, Live: true})
		if err != nil {
			logger.Error(err, "Reading the mount table failed")
			if inv == nil {
				return nil
			}
		} else {
			first := inv == nil
			inv, *dirty = fresh, false
			drivers := volumeDrivers(inv)
			pw.Watch(ctx, drivers)
			if first {
				a.checkDrivers(ctx, drivers)
			}
		}
	}
	return inv
}

// probed is one probe cycle's report, from the goroutine that waited for
// it.
type probed struct {
	inv   *probe.Inventory
	rep   *probe.Report
	start time.Time
}

// probeAsync probes inv on its own goroutine and sends the report on out:
// the cycle's wait for its probes (up to a deadline and a quarter when a
// backend is slow or hangs) never holds up the loop, which goes on taking
// the ends of repair runs and starting the next ones.
func (a *Agent) probeAsync(ctx context.Context, inv *probe.Inventory, start time.Time, out chan<- probed) {
	a.workers.Add(1)
	go func() {
		defer a.workers.Done()
		out <- probed{inv: inv, rep: a.prober.Probe(ctx, inv), start: start}
	}()
}

// afterProbe updates the metrics and the decider from a probe cycle's
// report and starts the repair runs that are due.
func (a *Agent) afterProbe(ctx context.Context, p probed) {
	logger := klog.FromContext(ctx)
	inv, rep, start := p.inv, p.rep, p.start
	end := time.Now()
	a.metrics.observeScan(inv, rep, end.Sub(start), end)
	if a.condition != nil {
		a.condition.observe(rep)
	}
	a.lastScan.Store(end.UnixNano())
	a.scanned.Store(true)

	broken := groupBroken(rep)
	seen := make(map[string]sighting, len(broken))
	for k, v := range broken {
		seen[k] = sighting{driver: v.driver, certain: v.certain(), probed: start}
	}
	due := a.decider.observe(seen, end)
	a.notes.keep(func(key string) bool { _, ok := a.decider.vols[key]; return ok })
	if len(broken) > 0 {
		logger.V(4).Info("Probe cycle", "mounts", len(inv.Mounts), "broken", len(broken), "due", len(due), "running", a.running)
	}
	if !a.synced() {
		if len(due) > 0 {
			logger.V(2).Info("Pod informer not synced: repairs wait", "due", len(due))
		}
		return
	}
	a.broken, a.queue = broken, due
	a.guardNow(ctx, broken)
	a.startRuns(ctx)
}

// guardNow guards, before any run starts, the publish targets that lost
// their mount of the broken volumes no run is under way for, in every
// probe cycle and whether or not a run can repair them: a volume whose
// driver is down waits for the driver (or the resync) before its next run,
// and a container kubelet starts meanwhile must not write to the node's
// disk. A queued volume is guarded here before its run starts. A volume
// with a run under way is left to it: the guard must never land between
// the run's unmount and its NodePublishVolume (the driver would take the
// guard for the published volume).
func (a *Agent) guardNow(ctx context.Context, broken map[string]*brokenVolume) {
	if !a.cfg.Guard || a.repairer == nil {
		return
	}
	for key, bv := range broken {
		if st := a.decider.vols[key]; st != nil && st.inflight || !bv.unguarded() {
			continue
		}
		if j := a.prepare(bv); j != nil && (j.skip == "" || j.reported) {
			a.guardMissing(ctx, j)
		}
	}
}

// startRuns starts the repair runs of the queued due volumes, as many as
// MaxConcurrentRepairs allows. The loop calls it after each probe cycle and
// each time a run ends, so that a thousand volumes broken at once are
// repaired back to back, not a handful per probe cycle.
func (a *Agent) startRuns(ctx context.Context) {
	for len(a.queue) > 0 && a.running < a.cfg.MaxConcurrentRepairs {
		key := a.queue[0]
		a.queue = a.queue[1:]
		if st := a.decider.vols[key]; st == nil || st.inflight {
			continue // healed, or already under way since it was queued
		}
		var j *job
		if bv := a.broken[key]; bv != nil {
			j = a.prepare(bv)
		} else if rs := a.decider.residualOf(key); rs != nil {
			j = a.prepareResidual(ctx, key, rs)
		}
		if j == nil {
			continue
		}
		st := a.decider.start(key)
		j.floor, j.since, j.attempt = st.floor, st.since, st.attempts
		a.running++
		a.workers.Add(1)
		go func() {
			defer a.workers.Done()
			a.results <- a.run(ctx, j)
		}()
	}
}

// prepareResidual makes the job that resumes a residual: the volume is
// re-staged on the host, some running containers still see the dead mount
// through their own binds. It returns nil, and forgets the residual, when
// none of them runs any more (restarted onto the fresh mount, or their pods
// deleted or evicted); it returns nil and keeps the residual while every
// holder is in a pod the failover heartbeat fenced.
func (a *Agent) prepareResidual(ctx context.Context, key string, rs *residual) *job {
	var pods []*corev1.Pod
	fenced := 0
	holders, waiting := rs.holders(a.pods.get, time.Now())
	for _, p := range holders {
		if a.fenced != nil && a.fenced(string(p.UID)) {
			fenced++
			continue
		}
		pods = append(pods, p)
	}
	if len(pods) == 0 && fenced > 0 {
		// The fence stopped them, it did not heal them: the residual waits
		// until the fence lifts (and deletes those pods) or they run again.
		klog.FromContext(ctx).V(2).Info("Every container that holds the dead mount is in a fenced pod: waiting for the fence to lift", "volume", key, "pods", fenced)
		return nil
	}
	if len(pods) == 0 && waiting {
		// A container that had no Running status at the repair is not
		// reported yet: the residual looks again at the next cycle.
		return nil
	}
	if len(pods) == 0 {
		a.decider.setResidual(key, nil)
		if len(rs.r.ownBinds) == 0 {
			return nil // only unseen containers, none of which ran on the dead mount
		}
		klog.FromContext(ctx).V(2).Info("No running container holds the dead mount any more", "volume", key)
		a.report.claim(rs.r.pvc, nil, corev1.EventTypeNormal, ReasonVolumeRepaired, actionRepair,
			a.report.message("no running container holds the dead mount any more (restarted onto the fresh mount, or its pod replaced)"))
		return nil
	}
	return &job{key: key, vol: rs.vol, active: pods, excluded: make(map[*corev1.Pod]string), resume: rs}
}

// onlyUnpublished reports a pod whose only broken mounts of the volume are
// publish targets kubelet set up (vol_data.json) that are not mount points
// (no mount ID: the probe's Unmounted).
func onlyUnpublished(use *podUse) bool {
	if use == nil || len(use.dead) == 0 {
		return false
	}
	for _, m := range use.dead {
		if m == nil || m.ID != 0 || m.Target.Kind != kubelet.KindPublish {
			return false
		}
	}
	return true
}

// prepare sorts the pods of a broken volume into those to repair, those
// being deleted and those left alone, from the pod informer. It returns nil
// when no pod of the volume is known (mounts of a pod the API server no
// longer has, or a staging mount no pod uses).
func (a *Agent) prepare(bv *brokenVolume) *job {
	j := &job{key: bv.key, vol: bv, excluded: make(map[*corev1.Pod]string)}
	switch {
	case bv.block:
		j.skip = "raw block volumes are reported, not repaired"
	case bv.csi && !a.cfg.driverAllowed(bv.driver):
		j.skip = fmt.Sprintf("CSI driver %s is not in --drivers", bv.driver)
	case bv.csi:
		j.skip = notUnderstood(bv, a.cfg.RepairUnknownDrivers)
		j.reported = j.skip != ""
	}
	n := 0
	for _, uid := range bv.podUIDs() {
		pod := a.pods.get(uid)
		if pod == nil {
			continue
		}
		if pod.Status.Phase == corev1.PodPending && onlyUnpublished(bv.pods[uid]) {
			// kubelet writes vol_data.json before NodePublishVolume: a
			// Pending pod's publish target that is not mounted yet is
			// kubelet at work, and no container of the pod runs to write
			// there. Repairing it raced kubelet's setup in the e2e.
			continue
		}
		n++
		switch {
		case pod.DeletionTimestamp != nil || pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed:
			j.terminating = append(j.terminating, pod)
		case a.fenced != nil && a.fenced(string(pod.UID)):
			j.excluded[pod] = "the pod is fenced: this node lost its failover heartbeat, so its containers were stopped and its volumes unmounted; not repaired until the fence lifts"
		case !a.cfg.namespaceAllowed(pod.Namespace):
			j.excluded[pod] = fmt.Sprintf("namespace %s is excluded by --include-namespaces/--exclude-namespaces: not repaired", pod.Namespace)
		default:
			if out, complaint := optedOut(pod.Annotations); out {
				why := fmt.Sprintf("the pod has annotation %s=\"false\": not repaired", OptOutAnnotation)
				if complaint != "" {
					why = complaint
				}
				j.excluded[pod] = why
				continue
			}
			j.active = append(j.active, pod)
		}
	}
	if n == 0 {
		return nil
	}
	return j
}

// checkDrivers asks each driver for its capabilities in the background (at
// most one check at a time) to keep mountmedic_driver_up current and to
// notice a driver that came back without its socket being re-created.
func (a *Agent) checkDrivers(ctx context.Context, drivers []string) {
	if len(drivers) == 0 || !a.checking.CompareAndSwap(false, true) {
		return
	}
	a.workers.Add(1)
	go func() {
		defer a.workers.Done()
		defer a.checking.Store(false)
		for _, d := range drivers {
			cctx, cancel := context.WithTimeout(ctx, a.cfg.APITimeout)
			_, err := a.caps.get(cctx, d)
			cancel()
			if ctx.Err() != nil {
				return
			}
			up := err == nil
			if err != nil && !isDriverDown(err) {
				klog.FromContext(ctx).V(2).Info("CSI driver check failed", "driver", d, "err", err)
			}
			if a.setDriver(d, up) {
				select {
				case a.driverUp <- d:
				default:
				}
			}
		}
	}()
}

// setDriver records a driver's state and reports whether it just came back
// up after being seen down.
func (a *Agent) setDriver(driver string, up bool) bool {
	a.metrics.setDriverUp(driver, up)
	a.driverMu.Lock()
	defer a.driverMu.Unlock()
	was, seen := a.driverOK[driver]
	a.driverOK[driver] = up
	return seen && !was && up
}
