package remount

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/mountmedic/mountmedic/probe"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// Defaults of a Repairer's Config.
const (
	defaultParallel       = 4
	defaultRestartTimeout = 2 * time.Minute
	// freshLookupTimeout bounds the lookup of a subPath below a fresh
	// publish target. A fresh filesystem may rightly take long to answer
	// its first lookup (a fresh ceph-fuse waits for the capabilities the
	// dead client held until the MDS drops its session: 30-60 s), so the
	// bound only keeps a fresh daemon that never answers from holding a
	// repair worker for good.
	freshLookupTimeout = 2 * time.Minute
	// restartPoll is how often Restart asks the runtime whether a stopped
	// container runs again.
	restartPoll = 200 * time.Millisecond
)

// Config configures a Repairer. Zero fields take the defaults.
type Config struct {
	// KubeletRoot is kubelet's --root-dir (probe.DefaultKubeletRoot when
	// empty): nothing outside it is ever unmounted, mounted on or
	// published to. It must be the resolved path, not a symlink.
	KubeletRoot string
	// DryRun: every tier resolves and checks its paths, asks the driver
	// whether it answers and the runtime what runs, and reports the plan
	// (actions with DryRun set); it mounts, unmounts, aborts, stages,
	// publishes and stops nothing, and never reports Healed.
	DryRun bool
	// ProcDir is where procfs is mounted; "/proc" when empty.
	ProcDir string
	// FusectlDir is where the fuse control filesystem is (or gets)
	// mounted; defaultFusectlDir when empty.
	FusectlDir string
	// CRIEndpoint is the container runtime's CRI socket
	// (unix:///run/containerd/containerd.sock). Optional: without it the
	// restart tier fails and container processes are found through their
	// cgroups only.
	CRIEndpoint string
	CRI         CRIOptions
	CSI         CSIOptions
	// Parallel bounds the volumes repaired at once, across all calls;
	// defaultParallel when zero.
	Parallel int
	// Prober verifies repairs and tells whether the probe that found a
	// volume Hung is still blocked: the process's one prober, the one that
	// found the volumes broken (the agent's). Nil makes one from Probe and
	// ProbeSys, which then knows of no earlier probe.
	Prober Prober
	// Probe configures the prober made when Prober is nil: Timeout is the
	// deadline of each probe (probe.DefaultConfig's when zero).
	Probe probe.Config
	// RestartTimeout bounds Restart's wait for the runtime to run a stopped
	// container again; defaultRestartTimeout when zero.
	RestartTimeout time.Duration
	// StopGrace is the time a stopped container has to exit after
	// SIGTERM; defaultStopGrace when zero.
	StopGrace time.Duration

	// Table is the process's reader of our mount table, shared with the
	// agent's loop: repairs that read the whole table (kernels without
	// statmount) take its reads. Used only when it reads our own mount
	// namespace (<ProcDir>/self/mountinfo) under KubeletRoot; nil, or
	// another table, gives the Repairer a reader of its own.
	Table *probe.TableReader
	// MaxTableSize caps the bytes of a mount table a repair reads (see
	// probe.Options.MaxSize) when it has a reader of its own.
	MaxTableSize int64

	// TransientRetries is how many times a tier runs again after a
	// transient failure (Transient) before it gives up; 2 when zero, none
	// when negative.
	TransientRetries int
	// TransientBackoff is the wait before the first run again, doubled for
	// each next one; 250ms when zero.
	TransientBackoff time.Duration

	// Seams for tests; nil fields take the real thing.

	// Sys are the operations that change mounts.
	Sys Syscalls
	// ProbeSys are the verification probes (Statfs and StatxSync) of the
	// prober made when Prober is nil.
	ProbeSys probe.Syscalls
	// FindDriver finds a driver's socket (FindDriver).
	FindDriver func(ctx context.Context, kubeletRoot, driver string) (Endpoint, error)
}

// Prober is what a Repairer needs of the process's prober (a
// *probe.Prober): probes of a path on the host and inside a container's
// root, and whether a probe of a device is still blocked past its deadline.
type Prober interface {
	CheckPath(ctx context.Context, path string) (probe.State, error)
	CheckIn(ctx context.Context, root, path string) (probe.State, error)
	Stuck(dev probe.Dev) bool
}

// Repairer carries out the node-side rungs of the repair ladder on one
// broken CSI volume at a time: Restage, LiveSwap, Restart, and Unmount for
// pods being deleted. It keeps a CSI client per driver endpoint and a CRI
// client, and is safe for concurrent use; calls for the same volume must
// not overlap (the agent runs one repair per volume at a time).
type Repairer struct {
	cfg     Config
	root    string
	procDir string
	sem     chan struct{}
	prober  Prober
	procs   procCache
	table   *probe.TableReader
	built   builtTable
	lookup  lookups
	checks  checkFlights
	lookups lookupFlights
	// lookupTimeout is freshLookupTimeout (tests shorten it).
	lookupTimeout time.Duration

	mu        sync.Mutex
	endpoints map[string]Endpoint   // driver -> endpoint
	clients   map[string]*CSIClient // endpoint path -> client
	cri       *CRIClient
	// fusectlDir is where fusectl is read once FusectlDir found it;
	// fusectlRelease closes a detached mount of it.
	fusectlDir     string
	fusectlRelease func()
	// servers is the scan of /dev/fuse holders the aborts share.
	servers ServerIndex
}

// New checks cfg and returns a Repairer. No socket is dialled until a tier
// needs it.
func New(cfg Config) (*Repairer, error) {
	if cfg.KubeletRoot == "" {
		cfg.KubeletRoot = probe.DefaultKubeletRoot
	}
	if !filepath.IsAbs(cfg.KubeletRoot) {
		return nil, fmt.Errorf("kubelet root %q is not an absolute path: set it to kubelet's --root-dir", cfg.KubeletRoot)
	}
	root := filepath.Clean(cfg.KubeletRoot)
	if fi, err := os.Lstat(root); err == nil && fi.Mode()&fs.ModeSymlink != 0 {
		real, _ := filepath.EvalSymlinks(root)
		return nil, fmt.Errorf("kubelet root %s is a symlink to %s: set the resolved path, as the mount table shows it", root, real)
	}
	if cfg.ProcDir == "" {
		cfg.ProcDir = "/proc"
	}
	if cfg.FusectlDir == "" {
		cfg.FusectlDir = defaultFusectlDir
	}
	if cfg.Parallel <= 0 {
		cfg.Parallel = defaultParallel
	}
	if cfg.Probe.Timeout <= 0 {
		cfg.Probe.Timeout = probe.DefaultConfig().Timeout
	}
	if cfg.RestartTimeout <= 0 {
		cfg.RestartTimeout = defaultRestartTimeout
	}
	if cfg.StopGrace <= 0 {
		cfg.StopGrace = defaultStopGrace
	}
	if cfg.FindDriver == nil {
		cfg.FindDriver = FindDriver
	}
	host := probe.HostSyscalls()
	if cfg.ProbeSys.Statfs == nil {
		cfg.ProbeSys.Statfs = host.Statfs
	}
	if cfg.ProbeSys.StatxSync == nil {
		cfg.ProbeSys.StatxSync = host.StatxSync
	}
	cfg.CSI = cfg.CSI.withDefaults()
	if cfg.Prober == nil {
		cfg.Prober = probe.NewProberWith(cfg.Probe, cfg.ProbeSys)
	}
	table := cfg.Table
	if !ownTable(table, cfg.ProcDir, root) {
		table = probe.NewTableReader(filepath.Join(cfg.ProcDir, "thread-self", "mountinfo"), probe.Options{Root: root, MaxSize: cfg.MaxTableSize})
	}
	return &Repairer{
		lookupTimeout: freshLookupTimeout,
		cfg:           cfg,
		root:          root,
		procDir:       cfg.ProcDir,
		table:         table,
		sem:           make(chan struct{}, cfg.Parallel),
		prober:        cfg.Prober,
		endpoints:     map[string]Endpoint{},
		clients:       map[string]*CSIClient{},
	}, nil
}

// Close closes the CSI and CRI connections.
func (r *Repairer) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	var errs []error
	for p, c := range r.clients {
		errs = append(errs, c.Close())
		delete(r.clients, p)
	}
	if r.cri != nil {
		errs = append(errs, r.cri.Close())
		r.cri = nil
	}
	if r.fusectlRelease != nil {
		r.fusectlRelease()
		r.fusectlRelease = nil
	}
	return errors.Join(errs...)
}

// DryRun reports whether the Repairer only plans (Config.DryRun).
func (r *Repairer) DryRun() bool { return r.cfg.DryRun }

// FusectlDir returns where the Repairer reads the fuse control
// filesystem: Config.FusectlDir when fusectl is mounted there, else a
// detached fusectl mount it keeps until Close (Unmounter.MountFusectl),
// which leaves every mount table as it was. A dry-run Repairer mounts
// nothing: it answers only where fusectl is mounted.
func (r *Repairer) FusectlDir(ctx context.Context) (string, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.fusectlRelease != nil {
		return r.fusectlDir, nil
	}
	u := &Unmounter{Root: r.root, DryRun: r.cfg.DryRun, FusectlDir: r.cfg.FusectlDir, ProcDir: r.procDir, Sys: r.cfg.Sys}
	dir, release, acts, err := u.MountFusectl(ctx)
	switch {
	case err != nil:
		release()
		return "", err
	case r.cfg.DryRun && len(acts) > 0:
		return "", fmt.Errorf("the fuse control filesystem is not mounted at %s, and a dry run mounts nothing", r.cfg.FusectlDir)
	}
	r.fusectlDir, r.fusectlRelease = dir, release
	return dir, nil
}

func (r *Repairer) unmounter() *Unmounter {
	dir := r.cfg.FusectlDir
	if !r.cfg.DryRun {
		if d, err := r.FusectlDir(context.Background()); err == nil {
			dir = d
		}
	}
	return &Unmounter{Root: r.root, DryRun: r.cfg.DryRun, FusectlDir: dir, ProcDir: r.procDir, Sys: r.cfg.Sys, Servers: &r.servers}
}

// acquire takes one of the Parallel slots.
func (r *Repairer) acquire(ctx context.Context) (func(), error) {
	select {
	case r.sem <- struct{}{}:
		return func() { <-r.sem }, nil
	case <-ctx.Done():
		return func() {}, fmt.Errorf("wait for a repair slot: %w", ctx.Err())
	}
}

// csiClient returns the client of the driver's endpoint, finding the
// endpoint again when refind is set or none is known.
func (r *Repairer) csiClient(ctx context.Context, driver string, refind bool) (*CSIClient, error) {
	r.mu.Lock()
	ep, ok := r.endpoints[driver]
	r.mu.Unlock()
	if !ok || refind {
		var err error
		if ep, err = r.cfg.FindDriver(ctx, r.root, driver); err != nil {
			r.mu.Lock()
			delete(r.endpoints, driver)
			r.mu.Unlock()
			return nil, err
		}
		r.mu.Lock()
		r.endpoints[driver] = ep
		r.mu.Unlock()
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if c := r.clients[ep.Path]; c != nil {
		return c, nil
	}
	c, err := DialCSI(ctx, ep.Path, r.cfg.CSI)
	if err != nil {
		return nil, err
	}
	r.clients[ep.Path] = c
	return c, nil
}

// checkDriver asks the driver for its node capabilities through the cached
// endpoint; when that fails as if the driver were down, it finds the
// endpoint again (the driver may have registered elsewhere) and asks once
// more. A driver that is not registered is unavailable (FindDriver): it may
// be restarting.
func (r *Repairer) checkDriver(ctx context.Context, driver string) (*CSIClient, kubelet.NodeCapabilities, error) {
	c, err := r.csiClient(ctx, driver, false)
	var caps kubelet.NodeCapabilities
	if err == nil {
		caps, err = c.NodeGetCapabilities(ctx)
	}
	if errors.Is(err, ErrDriverUnavailable) {
		c, err = r.csiClient(ctx, driver, true)
		if err == nil {
			caps, err = c.NodeGetCapabilities(ctx)
		}
	}
	return c, caps, err
}

// Capabilities returns the node capabilities of the CSI driver named
// driver, asked every time through the endpoint and client the Repairer
// keeps for the driver (the endpoint is found again when the driver does not
// answer there). Errors match ErrDriverUnavailable when the driver is down
// or not registered: retry later.
func (r *Repairer) Capabilities(ctx context.Context, driver string) (kubelet.NodeCapabilities, error) {
	_, caps, err := r.checkDriver(ctx, driver)
	if err != nil {
		return kubelet.NodeCapabilities{}, fmt.Errorf("node capabilities of csi driver %q: %w", driver, err)
	}
	return caps, nil
}

// criClient dials the runtime once.
func (r *Repairer) criClient(ctx context.Context) (*CRIClient, error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.cri != nil {
		return r.cri, nil
	}
	if r.cfg.CRIEndpoint == "" {
		return nil, errors.New("no CRI endpoint configured: set the container runtime's socket")
	}
	c, err := DialCRI(ctx, r.cfg.CRIEndpoint, r.cfg.CRI)
	if err != nil {
		return nil, err
	}
	r.cri = c
	return c, nil
}

// run is one tier call: the slot, the outcome and its log line.
func (r *Repairer) run(ctx context.Context, tier Tier, v *Volume, body func(context.Context, *Outcome)) Outcome {
	start := time.Now()
	o := Outcome{Tier: tier}
	logger := klog.FromContext(ctx).WithValues("tier", tier.String())
	if v != nil {
		logger = logger.WithValues("driver", v.Driver, "volumeHandle", v.VolumeHandle)
	}
	ctx = klog.NewContext(ctx, logger)
	// A transient failure runs the body again (again: bounded, with
	// backoff), outside the parallel slot; the actions of every attempt
	// are kept, the error is the last one's.
	var done []Action
	for n := 0; ; n++ {
		o = Outcome{Tier: tier}
		release, err := r.acquire(ctx)
		if err != nil {
			o.Err = err
		} else {
			body(ctx, &o)
		}
		release()
		retry := r.again(ctx, &o, n)
		o.Actions = append(done, o.Actions...)
		if !retry {
			break
		}
		done = append(o.Actions, Action{Op: opRetry, Path: tier.String(),
			Detail: fmt.Sprintf("transient failure (%v): run %d of at most %d", o.Err, n+2, r.retries()+1)})
	}
	if r.cfg.DryRun {
		o.Healed = false
	}
	o.Took = time.Since(start)
	logger.V(2).Info("Repair tier finished", "healed", o.Healed, "dryRun", r.cfg.DryRun, "actions", len(o.Actions), "took", o.Took, "err", o.Err)
	return o
}

// Restage is tier 1: it brings the volume back on the host. It reads the
// mount table, checks every path (openSafe) and asks the driver whether it
// answers (NodeGetCapabilities) before it changes anything; then it aborts
// a hung FUSE connection, lazily unmounts the dead subPath binds, publish
// targets and staging mount (deepest first), and sends NodeStageVolume and
// NodePublishVolume. For a pod whose containers receive host mounts
// (HostToContainer, Bidirectional), the dead publish target stays and the
// fresh mount is bound over it, which reaches those containers. Healed
// means the staging path, every publish target and those containers' views
// answer a probe; containers with private mounts and subPaths are LiveSwap's.
func (r *Repairer) Restage(ctx context.Context, v *Volume) Outcome {
	return r.run(ctx, TierRestage, v, func(ctx context.Context, o *Outcome) {
		h, err := r.repairHost(ctx, v)
		o.Actions = h.actions
		if err != nil {
			o.Err = err
			return
		}
		r.conclude(ctx, o, h.places(), h.refusedErr())
	})
}

// conclude verifies the places (not in dry-run) and sets Healed and Err
// from the actions, the verification and the other errors.
func (r *Repairer) conclude(ctx context.Context, o *Outcome, places []place, errs ...error) {
	errs = append([]error{actionsErr(o.Actions)}, errs...)
	if r.cfg.DryRun {
		o.Err = errors.Join(errs...)
		return
	}
	acts, verr := r.verify(ctx, places)
	o.Actions = append(o.Actions, acts...)
	o.Err = errors.Join(append(errs, verr)...)
	o.Healed = o.Err == nil
}

// LiveSwap is tier 2: it first does what Restage does when the host still
// has dead mounts, then replaces the dead mount inside each running
// container that still shows it (private mounts, subPaths, and containers
// the host repair did not reach) with a clone of the pod's fresh publish
// target or of its subPath directory (swapper, read-only kept), and reports
// the processes that still hold the dead mount. Healed means the host
// places and each container's view (/proc/<pid>/root/<mountPath>) answer a
// probe and no container shows the dead mount any more.
func (r *Repairer) LiveSwap(ctx context.Context, v *Volume) Outcome {
	return r.run(ctx, TierLiveSwap, v, func(ctx context.Context, o *Outcome) {
		h, err := r.repairHost(ctx, v)
		o.Actions = h.actions
		if err != nil {
			o.Err = err
			return
		}
		var look []*podPlan
		for _, p := range h.pods {
			if p.refused == nil && p.procs == nil && len(p.pv.Containers) > 0 {
				look = append(look, p)
			}
		}
		o.Actions = append(o.Actions, r.findProcs(ctx, look)...)
		sw := &swapper{Root: r.root, ProcDir: r.procDir, DryRun: r.cfg.DryRun, Sys: r.cfg.Sys}
		places := h.places()
		errs := []error{h.refusedErr()}
		devs := h.dead.list()
		for _, p := range h.pods {
			if p.refused != nil || len(p.pv.Containers) == 0 {
				continue
			}
			if p.procs == nil || len(p.procs.pids) == 0 {
				errs = append(errs, fmt.Errorf("pod %s: no process of its containers found (by cgroup%s): cannot swap or verify", p.uid, r.criHint()))
				continue
			}
			if err := h.fresh(ctx, p); err != nil {
				errs = append(errs, err)
				continue
			}
			ctrs := p.procs.containerPIDs()
			if len(ctrs) == 0 {
				errs = append(errs, fmt.Errorf("pod %s: no container of the pod named by its cgroups%s: cannot swap", p.uid, r.criHint()))
				continue
			}
			// Only the containers' own mount namespaces: never one that a
			// process of the pod made (unshare), where a swapped mount
			// would not be locked.
			targets, err := planSwap(r.procDir, ctrs, devs, p.deadRoot, p.target)
			if err != nil {
				errs = append(errs, fmt.Errorf("pod %s: %w", p.uid, err))
			}
			acts, _ := sw.Swap(ctx, targets)
			o.Actions = append(o.Actions, acts...)
			detached := make(map[int]probe.Dev, len(targets))
			for _, t := range targets {
				detached[t.MountID] = t.Dev
				places = append(places, containerPlace(r.procDir, t.Pid, t.ContainerPath))
			}
			for _, c := range p.pv.Containers {
				if pid, ok := p.procs.byContainer[c.ContainerID]; ok && c.MountPath != "" {
					places = append(places, containerPlace(r.procDir, pid, c.MountPath))
				}
			}
			if !r.cfg.DryRun {
				o.Actions = append(o.Actions, r.holders(ctx, p, devs, detached)...)
			}
		}
		if r.cfg.DryRun {
			r.conclude(ctx, o, nil, errs...)
			return
		}
		// Nothing dead may be left in view.
		for _, p := range h.pods {
			if p.refused != nil || p.procs == nil || len(p.procs.pids) == 0 {
				continue
			}
			left, _ := planSwap(r.procDir, p.procs.containerPIDs(), devs, p.deadRoot, p.target)
			for _, t := range left {
				errs = append(errs, fmt.Errorf("pod %s: %s still shows dead mount %d", p.uid, t.label(), t.MountID))
			}
		}
		r.conclude(ctx, o, places, errs...)
	})
}

func (r *Repairer) criHint() string {
	if r.cfg.CRIEndpoint == "" {
		return "; no CRI endpoint to ask"
	}
	return " and through the CRI"
}

// holders reports the pod's processes that still hold one of the dead
// filesystems devs (open files, working directories on it; the mounts the
// swap detached are known by their IDs): they keep failing after the swap,
// as the actions say.
func (r *Repairer) holders(ctx context.Context, p *podPlan, devs []probe.Dev, detached map[int]probe.Dev) []Action {
	hs, err := findHolders(ctx, r.procDir, p.procs.pids, devs, detached)
	var out []Action
	if err != nil {
		out = append(out, Action{Op: opHolder, Path: "pod " + string(p.uid), Err: err})
	}
	for _, h := range hs {
		out = append(out, Action{Op: opHolder, Path: fmt.Sprintf("pid %d", h.Pid),
			Detail: h.String() + ": still on the dead filesystem " + h.Dev.String() + ", its calls there keep failing"})
	}
	return out
}

// Restart is tier 3: it first does what Restage does when the host still
// has dead mounts (which includes unmounting the dead subPath binds, so that
// kubelet binds them afresh: it reuses a bind that is there), then stops
// the pod's containers that mount the volume through the CRI, for kubelet
// to start them again on the fresh mounts. Healed means the runtime shows
// each of them running again (a new container, or a higher attempt) within
// RestartTimeout and its view of the volume answers a probe.
func (r *Repairer) Restart(ctx context.Context, v *Volume) Outcome {
	return r.run(ctx, TierRestart, v, func(ctx context.Context, o *Outcome) {
		h, err := r.repairHost(ctx, v)
		o.Actions = h.actions
		if err != nil {
			o.Err = err
			return
		}
		cri, err := r.criClient(ctx)
		if err != nil {
			o.Err = fmt.Errorf("restart containers: %w", err)
			return
		}
		rs := &Restarter{CRI: cri, Grace: r.cfg.StopGrace, DryRun: r.cfg.DryRun}
		// A wait is a container stopped, until the runtime runs it again.
		type wait struct {
			p      *podPlan
			before Container
		}
		var waits []wait
		errs := []error{h.refusedErr()}
		for _, p := range h.pods {
			if p.refused != nil || len(p.pv.Containers) == 0 {
				continue
			}
			if err := h.fresh(ctx, p); err != nil {
				errs = append(errs, err)
				continue
			}
			var names []string
			for _, c := range p.pv.Containers {
				if c.Container != "" && !slices.Contains(names, c.Container) {
					names = append(names, c.Container)
				}
			}
			stopped, acts, _ := rs.Restart(ctx, string(p.uid), names...)
			o.Actions = append(o.Actions, acts...)
			for _, c := range stopped {
				waits = append(waits, wait{p: p, before: c})
			}
		}
		if r.cfg.DryRun {
			r.conclude(ctx, o, nil, errs...)
			return
		}
		places := h.places()
		deadline := time.Now().Add(r.cfg.RestartTimeout)
		start := time.Now()
		for len(waits) > 0 {
			var pending []wait
			byPod := map[string][]Container{}
			for _, w := range waits {
				uid := string(w.p.uid)
				if _, ok := byPod[uid]; !ok {
					ctrs, err := cri.podContainers(ctx, uid)
					if err != nil {
						r.logWait(ctx, err)
					}
					byPod[uid] = ctrs
				}
				name := w.before.Name
				i := slices.IndexFunc(byPod[uid], func(c Container) bool {
					return c.Name == name && (c.ID != w.before.ID || c.Attempt > w.before.Attempt)
				})
				if i < 0 {
					pending = append(pending, w)
					continue
				}
				now := byPod[uid][i]
				a := Action{Op: opWaitRunning, Path: now.ID, Took: time.Since(start),
					Detail: fmt.Sprintf("container %s of pod %s runs again (attempt %d, was %d)", name, uid, now.Attempt, w.before.Attempt)}
				pid, err := cri.containerPID(ctx, now.ID)
				if err != nil {
					a.Err = fmt.Errorf("container %s of pod %s: find its process to verify: %w", name, uid, err)
				} else {
					for _, c := range w.p.pv.Containers {
						if c.Container == name && c.MountPath != "" {
							places = append(places, containerPlace(r.procDir, pid, c.MountPath))
						}
					}
				}
				o.Actions = append(o.Actions, a)
			}
			waits = pending
			if len(waits) == 0 {
				break
			}
			if time.Now().After(deadline) {
				for _, w := range waits {
					err := fmt.Errorf("container %s of pod %s is not running again after %s: the restart cannot be verified", w.before.Name, w.p.uid, r.cfg.RestartTimeout)
					o.Actions = append(o.Actions, Action{Op: opWaitRunning, Path: w.before.ID, Err: err, Took: time.Since(start)})
				}
				break
			}
			select {
			case <-ctx.Done():
				errs = append(errs, fmt.Errorf("wait for restarted containers: %w", ctx.Err()))
				waits = nil
			case <-time.After(restartPoll):
			}
		}
		r.conclude(ctx, o, places, errs...)
	})
}

func (r *Repairer) logWait(ctx context.Context, err error) {
	klog.FromContext(ctx).V(4).Info("Listing containers while waiting for a restart failed", "err", err)
}

// Unmount lazily unmounts the dead mounts of pods being deleted (their
// publish targets and subPath binds, each dead mount of a stack from the
// top down), aborting a hung FUSE connection first, so that kubelet can
// finish tearing them down; the staging mount is left to kubelet. Healed
// means no dead mount is left on those paths.
func (r *Repairer) Unmount(ctx context.Context, v *Volume) Outcome {
	return r.run(ctx, TierUnmount, v, func(ctx context.Context, o *Outcome) {
		if v == nil {
			o.Err = errors.New("unmount: no volume given")
			return
		}
		dead := deadDevs(v)
		u := r.unmounter()
		u.Users, u.Home = v.users(), v.daemonHome()
		var paths []string
		for _, p := range v.Pods {
			for _, m := range p.Dead {
				if m != nil && m.Path != "" && !slices.Contains(paths, filepath.Clean(m.Path)) {
					paths = append(paths, filepath.Clean(m.Path))
				}
			}
		}
		table, err := r.readStacks(paths)
		if err != nil {
			o.Err = err
			return
		}
		// A mount on a device reported broken that answers now is not
		// the broken one (Repairer.stillBroken): it is left alone. Only
		// FUSE filesystems, as in confirmDead; the guard answers, and
		// goes like a dead mount.
		for _, dev := range dead.list() {
			for _, path := range paths {
				if top := table.top(path); top != nil && top.Dev == dev {
					if !top.Guard && table.fuse(dev) && !r.stillBroken(ctx, v, path) {
						delete(dead, dev)
						o.Actions = append(o.Actions, answering(path, top, r.cfg.DryRun))
					}
					break
				}
			}
		}
		if v.Hung {
			// Only a connection mounted at these pods' own dead paths:
			// the device number may be another volume's by now.
			for _, dev := range dead.list() {
				if at := table.fuseMountOn(dev, paths); at != nil {
					acts, _ := u.AbortFUSE(ctx, dev, at)
					o.Actions = append(o.Actions, acts...)
				}
			}
		}
		slices.SortStableFunc(paths, func(a, b string) int {
			if d := depth(b) - depth(a); d != 0 {
				return d
			}
			return strings.Compare(a, b)
		})
		for _, path := range paths {
			acts, _ := table.unmountDead(ctx, u, path, dead)
			o.Actions = append(o.Actions, acts...)
		}
		o.Err = actionsErr(o.Actions)
		if r.cfg.DryRun || o.Err != nil {
			return
		}
		after, err := r.readStacks(paths)
		if err != nil {
			o.Err = err
			return
		}
		var errs []error
		for _, path := range paths {
			if left := after.deadTop(path, dead); len(left) > 0 {
				errs = append(errs, fmt.Errorf("dead mount %d is still on top at %s", left[0].ID, path))
			}
		}
		o.Err = errors.Join(errs...)
		o.Healed = o.Err == nil
	})
}
