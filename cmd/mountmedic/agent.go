package main

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/agent"
	"github.com/mountmedic/mountmedic/agent/failover"
	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/remount"
)

// agentFlags are the agent command's flags; everything but the tier list
// binds straight into agent.Config.
type agentFlags struct {
	cfg      agent.Config
	tiers    []string
	failover failover.Config
}

func newAgentCommand() *cobra.Command {
	f := &agentFlags{cfg: agent.DefaultConfig(), tiers: agent.DefaultTiers, failover: failover.DefaultConfig()}
	f.cfg.NodeName = os.Getenv("NODE_NAME")
	cmd := &cobra.Command{
		Use:   "agent",
		Short: "Run the node agent: watch, probe and repair this node's pod volume mounts",
		Long: `agent is the long-running process of the mountmedic DaemonSet. It keeps the
node's mount table classified, probes every kubelet volume mount, and repairs
dead ones through the repair ladder (--tiers, least disruptive first):

  restage   lazily unmount the dead mounts and send NodeStageVolume and
            NodePublishVolume again through the CSI driver's socket
  liveswap  put the fresh mount into each running container's mount namespace
  restart   stop the containers through the CRI; kubelet starts them again
  evict     evict controller-owned pods through the Eviction API (PDBs respected)
  unmount   lazily unmount the dead mounts of pods that are terminating
  delete, force-delete   opt-in: delete with a UID precondition; force-delete
            pods stuck terminating

It reads pods of this node only (a field selector on spec.nodeName) and gets
PersistentVolumes, claims, CSIDrivers, VolumeAttachments and Secrets by name
when a repair needs them. With --dry-run it decides, records events (marked
[dry-run]) and metrics, and changes nothing.

With --failover (off by default) it also renews a heartbeat Lease for its
node and fences the node's pods with ReadWriteOnce volumes when it loses the
API server for --failover-fence-after. The cluster side, which moves such
pods off nodes confirmed dead, is ` + "`mountmedic controller`" + `, a Deployment of its
own (deploy/controller/); agents never campaign for it (see agent/failover
and deploy/README.md before enabling it).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runAgent(cmd, f)
		},
	}
	bindAgentFlags(cmd.Flags(), f)
	f.failover.AddFlags(cmd.Flags())
	return cmd
}

func bindAgentFlags(fl *pflag.FlagSet, f *agentFlags) {
	c := &f.cfg
	fl.StringVar(&c.NodeName, "node-name", c.NodeName, "this node's name (default $NODE_NAME, from the downward API)")
	fl.StringVar(&c.Kubeconfig, "kubeconfig", "", "kubeconfig file; empty uses the in-cluster service account")
	fl.StringVar(&c.KubeletRoot, "kubelet-root", c.KubeletRoot, "kubelet root directory (kubelet --root-dir)")
	fl.StringVar(&c.HostTable, "host-table", c.HostTable, "mount table to watch and probe (/proc/1/mountinfo with hostPID)")
	fl.DurationVar(&c.ProbeInterval, "probe-interval", c.ProbeInterval, "time between probe cycles (jittered by 10%)")
	fl.DurationVar(&c.ProbeTimeout, "probe-timeout", c.ProbeTimeout, "deadline of each probe; past it a mount is Hung")
	fl.IntVar(&c.ProbeParallel, "probe-parallel", c.ProbeParallel, "probes run at once in a cycle")
	fl.IntVar(&c.Strikes, "strikes", c.Strikes, "consecutive broken probe cycles before a repair (a definitely dead FUSE connection, and a driver that just came back, act at once)")
	fl.DurationVar(&c.Resync, "resync", c.Resync, "re-read the mount table and retry volumes waiting for their driver at least this often")
	fl.DurationVar(&c.BackoffBase, "backoff-base", c.BackoffBase, "first wait after a failed repair of a volume (doubles per failure)")
	fl.DurationVar(&c.BackoffMax, "backoff-max", c.BackoffMax, "longest wait between repairs of a volume")
	fl.StringSliceVar(&f.tiers, "tiers", f.tiers, "repair tiers to enable, comma-separated: "+strings.Join(agent.AllTiers, ", "))
	fl.IntVar(&c.MaxConcurrentRepairs, "max-concurrent-repairs", c.MaxConcurrentRepairs, "repairs running at once on this node")
	fl.IntVar(&c.MaxEvictions, "max-evictions", c.MaxEvictions, "evictions and deletions allowed per --eviction-window on this node (0 disables them)")
	fl.DurationVar(&c.EvictionWindow, "eviction-window", c.EvictionWindow, "sliding window of --max-evictions")
	fl.StringSliceVar(&c.EvictOwnerKinds, "evict-owner-kinds", c.EvictOwnerKinds, "controller kinds whose pods may be evicted or deleted")
	fl.DurationVar(&c.ForceDeleteAfter, "force-delete-after", c.ForceDeleteAfter, "how long past its deletion time a pod must be stuck before the force-delete tier acts")
	fl.StringSliceVar(&c.Drivers, "drivers", nil, "repair only volumes of these CSI drivers (default all; others are still probed and reported)")
	fl.StringSliceVar(&c.IncludeNamespaces, "include-namespaces", nil, "repair only pods in these namespaces (default all)")
	fl.StringSliceVar(&c.ExcludeNamespaces, "exclude-namespaces", nil, "never repair pods in these namespaces")
	fl.BoolVar(&c.DryRun, "dry-run", false, "decide and report (events marked [dry-run], metrics), change nothing")
	fl.StringVar(&c.MetricsAddr, "metrics-addr", c.MetricsAddr, "address of /metrics, /healthz and /readyz; empty disables them")
	fl.StringVar(&c.CRISocket, "cri-socket", c.CRISocket, "container runtime socket, for the restart and live-swap tiers")
	fl.DurationVar(&c.APITimeout, "api-timeout", c.APITimeout, "deadline of each API server call")
	fl.IntVar(&c.CacheSize, "cache-size", c.CacheSize, "PV/PVC/CSIDriver/VolumeAttachment objects kept for repairs while the API server is unreachable")
	fl.DurationVar(&c.CacheTTL, "cache-ttl", c.CacheTTL, "how long a cached object is used without asking the API server")
}

// agentConfig turns the flags into a checked agent.Config.
func agentConfig(f *agentFlags) (agent.Config, error) {
	cfg := f.cfg
	tiers, err := agent.ParseTiers(f.tiers)
	if err != nil {
		return cfg, fmt.Errorf("--tiers: %w", err)
	}
	cfg.Tiers = tiers
	cfg.Version = version
	if err := cfg.Validate(); err != nil {
		return cfg, err
	}
	return cfg, nil
}

func runAgent(cmd *cobra.Command, f *agentFlags) error {
	cfg, err := agentConfig(f)
	if err != nil {
		return err
	}
	fcfg := f.failover
	fcfg.NodeName = cfg.NodeName
	fcfg.DryRun = fcfg.DryRun || cfg.DryRun
	if err := fcfg.Validate(); err != nil {
		return err
	}
	client, err := agent.NewClient(cfg.Kubeconfig, version)
	if err != nil {
		return err
	}
	repairer, err := remount.New(remount.Config{
		KubeletRoot: cfg.KubeletRoot,
		DryRun:      cfg.DryRun,
		CRIEndpoint: cfg.CRISocket,
		Parallel:    cfg.MaxConcurrentRepairs,
		Probe:       probe.Config{Timeout: cfg.ProbeTimeout},
	})
	if err != nil {
		return fmt.Errorf("--kubelet-root: %w", err)
	}
	defer repairer.Close()
	deps := agent.Deps{Client: client, Repairer: repairer, Registry: prometheus.NewRegistry()}

	ctx, cancel := context.WithCancel(cmd.Context())
	defer cancel()
	var (
		wg      sync.WaitGroup
		dutyErr error
		once    sync.Once
	)
	// The agent is made first: the heartbeat reads its pod informer (one
	// watch of the node's pods), and the agent leaves the pods the
	// heartbeat fenced alone. hb is set before either runs.
	var hb *failover.Heartbeat
	if fcfg.Enabled {
		deps.Fenced = func(podUID string) bool { return hb.Fenced(podUID) }
	}
	a, err := agent.New(cfg, deps)
	if err != nil {
		return err
	}
	var duties []func(context.Context) error
	if fcfg.Enabled {
		fence := &failover.NodeFence{CRIEndpoint: cfg.CRISocket, KubeletRoot: cfg.KubeletRoot,
			HostTable: cfg.HostTable, DryRun: fcfg.DryRun}
		if hb, err = failover.NewHeartbeat(fcfg, client, a.PodInformer(), fence, fence, deps.Registry); err != nil {
			return err
		}
		duties = append(duties, hb.Run)
	}
	for _, run := range duties {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := run(ctx); err != nil && ctx.Err() == nil {
				klog.FromContext(ctx).Error(err, "Failover duty stopped")
				once.Do(func() { dutyErr = fmt.Errorf("failover duty: %w", err) })
				cancel() // a node agent without its heartbeat must not go on as if it had one
			}
		}()
	}
	err = a.Run(ctx)
	cancel()
	wg.Wait()
	if err != nil {
		return err
	}
	return dutyErr
}
