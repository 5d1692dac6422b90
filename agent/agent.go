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
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/events"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/agent/coldpages"
	"github.com/mountmedic/mountmedic/agent/kubeclient"
	"github.com/mountmedic/mountmedic/probe"
)

// ReportingController names the agent in the events it writes.
const ReportingController = kubeclient.AgentReportingController

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
	// Prober probes backends; nil makes one from the configuration
	// (NewProber). The process has one: the Repairer verifies its repairs
	// with it too (remount.Config.Prober), and asks it whether the probe
	// that found a volume Hung is still blocked.
	Prober *probe.Prober
	// Table reads the mount table (cfg.HostTable) for the loop, shared with
	// the Repairer's reads of the whole table; nil makes one from the
	// configuration.
	Table *probe.TableReader
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
	// EventReader lists the agent's past eviction events at start to
	// rebuild the eviction budget (the ServiceAccount's client: a node's
	// identity may not list events); nil is Client.
	EventReader kubernetes.Interface
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
	// table is the one reader of the mount table: the loop's reads, the
	// Repairer's whole-table reads and (through current) the stall watch.
	table   *probe.TableReader
	kube    *kube
	caps    *capsCache
	metrics *metrics
	// condition writes the node condition; nil with --node-condition=false.
	condition *conditionWriter
	report    reporter
	notes     *noteBook
	budget    *budget
	// eventReader lists past eviction events (Deps.EventReader).
	eventReader kubernetes.Interface
	decider     *decider
	events      eventRecorder
	// limiter holds the events past the node's budget for a summary.
	limiter *limitedRecorder
	// gate holds the event writes while volumes wait for a repair slot
	// (the loop sets it).
	gate *eventGate

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
	// running counts the repair runs under way, reattaching those of them
	// that began with the re-attach rung (startRuns).
	running, reattaching int
	// broken and queue are the last probe cycle's broken volumes and the
	// keys it found due that no run has taken yet (owned by the loop).
	broken map[string]*brokenVolume
	queue  []string
	// ahead are the queued keys whose claims were read ahead (readAhead),
	// reading the reads in flight; each ends on aheadDone.
	ahead     map[string]bool
	reading   int
	aheadDone chan struct{}
	workers   sync.WaitGroup
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
		deps.Prober = NewProber(cfg)
	}
	if deps.Table == nil {
		deps.Table = NewTableReader(cfg)
	}
	a := &Agent{
		table:       deps.Table,
		cfg:         cfg,
		repairer:    deps.Repairer,
		client:      deps.Client,
		prober:      deps.Prober,
		kube:        &kube{client: deps.Client, cache: newObjectCache(cfg.CacheSize, cfg.CacheTTL, nil), timeout: cfg.APITimeout, pvs: newPVStore(deps.Client, cfg.APITimeout)},
		nodePods:    newNodePods(deps.Client, cfg.NodeName, cfg.APITimeout),
		caps:        newCapsCache(deps.DriverCaps),
		metrics:     newMetrics(cfg.Version, deps.Registry),
		notes:       newNoteBook(),
		budget:      newBudget(cfg.MaxEvictions, cfg.EvictionWindow, nil),
		eventReader: deps.EventReader,
		decider:     newDecider(&cfg),
		events:      deps.Events,
		driverOK:    make(map[string]bool),
		driverUp:    make(chan string, 16),
		stalled:     make(chan struct{}, 1),
		gate:        newEventGate(eventHoldMax, nil),
		fenced:      deps.Fenced,
		results:     make(chan jobResult, cfg.RepairSlots()),
		aheadDone:   make(chan struct{}, cfg.MaxConcurrentRepairs),
		release:     deps.ReleaseCode,
	}
	// The loop's reads say a bare globalmount is a lost staging only for
	// drivers that stage, as their capabilities say.
	a.table.SetDriverStages(a.caps.stages)
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
		sink := kubeclient.NodeEventSink{EventSink: &events.EventSinkImpl{Interface: a.client.EventsV1()}, Node: a.cfg.NodeName}
		b := events.NewBroadcaster(gatedSink{EventSink: sink, gate: a.gate})
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

	a.restoreBudget(ctx)
	a.nodePods.live(ctx)
	a.workers.Add(1)
	go func() {
		defer a.workers.Done()
		a.kube.pvs.run(ctx)
	}()
	a.watchStalls(ctx)
	a.watchNBD(ctx)
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
