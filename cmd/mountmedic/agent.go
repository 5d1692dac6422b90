package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/agent"
	"github.com/mountmedic/mountmedic/agent/failover"
	"github.com/mountmedic/mountmedic/remount"
)

// agentFlags are the agent command's flags; everything but the tier list
// binds straight into agent.Config.
type agentFlags struct {
	cfg      agent.Config
	tiers    []string
	failover failover.Config
	// identity is --identity: agent.IdentityNode or
	// agent.IdentityServiceAccount.
	identity string
}

func newAgentCommand() *cobra.Command {
	f := &agentFlags{cfg: agent.DefaultConfig(), tiers: agent.DefaultTiers.Names(), failover: failover.DefaultConfig(), identity: agent.IdentityNode}
	f.cfg.NodeName = os.Getenv("NODE_NAME")
	// The heartbeat identity is $POD_NAME, else the node's name, chosen at
	// run time: a default taken from the host name would print the
	// building machine's name in --help and in the docs made from it.
	if os.Getenv("POD_NAME") == "" {
		f.failover.Identity = ""
	}
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

With --identity=node (the default) it acts with its node's own identity, the
kubelet's credentials (--node-kubeconfig, system:node:<node>), which the API
server's Node authorizer and NodeRestriction confine to this node's objects:
it reads pods of this node only (a field selector on spec.nodeName) and gets
PersistentVolumes, claims, CSIDrivers, VolumeAttachments and Secrets by name
when a repair needs them. The ServiceAccount (--kubeconfig, default the pod's
token) is used only for the failover heartbeat Lease.

With --identity=serviceaccount every call goes with the ServiceAccount's
pod-bound token, which names this node; the admission policies of
deploy/identity/serviceaccount hold its writes to this node's objects (for
kubelets whose credentials the agent cannot use, such as EKS' exec plugin).
docs/security.md says what each mode can read and write.

With --dry-run it decides, records events (marked [dry-run]) and metrics, and
changes nothing.

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
	cmd.Flags().Lookup("failover-identity").Usage = "this agent's name in the heartbeat Lease it holds (default $POD_NAME, else the node's name)"
	return cmd
}

func bindAgentFlags(fl *pflag.FlagSet, f *agentFlags) {
	c := &f.cfg
	fl.StringVar(&c.NodeName, "node-name", c.NodeName, "this node's name (default $NODE_NAME, from the downward API)")
	fl.StringVar(&f.identity, "identity", f.identity, "whose credentials the agent acts with: node (the kubelet's, --node-kubeconfig) or serviceaccount (the pod's node-bound ServiceAccount token, --kubeconfig; needs deploy/identity/serviceaccount)")
	fl.StringVar(&c.NodeKubeconfig, "node-kubeconfig", c.NodeKubeconfig, "with --identity=node: kubeconfig of this node's own identity (the kubelet's, system:node:<node>), with which the agent makes every API call but the heartbeat Lease")
	fl.StringVar(&c.Kubeconfig, "kubeconfig", "", "kubeconfig of the agent's ServiceAccount (with --identity=node used only for the failover heartbeat Lease); empty uses the pod's in-cluster token")
	fl.StringVar(&c.ServiceAccountName, "service-account-name", c.ServiceAccountName, "name of the agent's ServiceAccount as its admission policies match it (the chart's fullnameOverride); the agent refuses to start as another")
	fl.StringVar(&c.KubeletRoot, "kubelet-root", c.KubeletRoot, "kubelet root directory (kubelet --root-dir)")
	fl.StringVar(&c.HostTable, "host-table", c.HostTable, "mount table to watch and probe (/proc/1/mountinfo with hostPID)")
	fl.Var((*sizeValue)(&c.MaxTableSize), "max-table-size", "read at most this much of a mount table (a quantity: 32Mi, 200M); raise it on a node that raised fs.mount-max")
	fl.DurationVar(&c.ProbeInterval, "probe-interval", c.ProbeInterval, "time between probe cycles (jittered by 10%)")
	fl.DurationVar(&c.ProbeTimeout, "probe-timeout", c.ProbeTimeout, "deadline of each probe; past it a mount is Hung")
	fl.IntVar(&c.ProbeParallel, "probe-parallel", c.ProbeParallel, "probes run at once in a cycle")
	fl.BoolVar(&c.WriteCheck, "write-check", c.WriteCheck, "also check that read-write block filesystems take writes (fsync and an unnamed file in their root, every probe): for kernels whose mount table does not show an ext4 shutdown (6.1); costs a journal write per probe, and a filesystem frozen longer than --probe-timeout reads as hung")
	fl.DurationVar(&c.StallPoll, "stall-poll", c.StallPoll, "how often to read each FUSE connection's waiting requests between cycles and probe a backend with requests waiting at once; at most 1,000 reads a second, so past 250 FUSE backends the polls stretch (0: off)")
	fl.IntVar(&c.Strikes, "strikes", c.Strikes, "consecutive broken probe cycles before a repair (a definitely dead FUSE connection, and a driver that just came back, act at once)")
	fl.DurationVar(&c.Resync, "resync", c.Resync, "re-read the mount table and retry volumes waiting for their driver at least this often")
	fl.DurationVar(&c.ReleaseCode, "release-code-interval", c.ReleaseCode, "how often to give the kernel back the pages of the agent's own executable that it no longer uses (most of its start-up's: they stay in the page cache), first 30s after start and 1m after the last repair of a burst, never during a repair (0: never)")
	fl.DurationVar(&c.BackoffBase, "backoff-base", c.BackoffBase, "first wait after a failed repair of a volume (doubles per failure)")
	fl.DurationVar(&c.BackoffMax, "backoff-max", c.BackoffMax, "longest wait between repairs of a volume")
	fl.StringSliceVar(&f.tiers, "tiers", f.tiers, "repair tiers to enable, comma-separated: "+strings.Join(remount.NewTierSet(remount.AllTiers()...).Names(), ", "))
	fl.IntVar(&c.MaxConcurrentRepairs, "max-concurrent-repairs", c.MaxConcurrentRepairs, "repairs running at once on this node (NBD re-attaches run beside them, up to 32 at once)")
	fl.IntVar(&c.MaxEvictions, "max-evictions", c.MaxEvictions, "evictions and deletions allowed per --eviction-window on this node (0 disables them)")
	fl.DurationVar(&c.EvictionWindow, "eviction-window", c.EvictionWindow, "sliding window of --max-evictions")
	fl.StringSliceVar(&c.EvictOwnerKinds, "evict-owner-kinds", c.EvictOwnerKinds, "controller kinds whose pods may be evicted or deleted")
	fl.DurationVar(&c.ForceDeleteAfter, "force-delete-after", c.ForceDeleteAfter, "how long past its deletion time a pod must be stuck before the force-delete tier acts")
	fl.StringSliceVar(&c.Drivers, "drivers", nil, "repair only volumes of these CSI drivers (default all; others are still probed and reported)")
	fl.BoolVar(&c.RepairUnknownDrivers, "repair-unknown-drivers", false, "repair volumes of CSI drivers mountmedic has not catalogued that stage below kubelet's staging path (default: probe and report them only; see docs/drivers.md)")
	fl.BoolVar(&c.EscalateOutOfReach, "escalate-out-of-reach", false, "for a catalogued driver whose dead daemon the node plugin cannot restart (a mount pod, a sidecar in the pod, an engine pod), evict the volume's controller-owned pods (PodDisruptionBudgets respected) once the catalogue's grace for the driver's own recovery has passed (default: report them only; see docs/drivers.md)")
	fl.StringSliceVar(&c.IncludeNamespaces, "include-namespaces", nil, "repair only pods in these namespaces (default all)")
	fl.StringSliceVar(&c.ExcludeNamespaces, "exclude-namespaces", nil, "never repair pods in these namespaces")
	fl.BoolVar(&c.DryRun, "dry-run", false, "decide and report (events marked [dry-run], metrics), change nothing")
	fl.BoolVar(&c.Guard, "guard", c.Guard, "mount a read-only empty tmpfs over a running pod's publish target that lost its mount, until the volume is repaired, so that writes fail instead of landing on the node's disk")
	fl.BoolVar(&c.NodeCondition, "node-condition", c.NodeCondition, "keep the PodVolumeMountsBroken condition on this node's Node object (True while pod volume mounts are broken)")
	fl.StringVar(&c.MetricsAddr, "metrics-addr", c.MetricsAddr, "address of /metrics, /healthz and /readyz; empty disables them")
	fl.StringVar(&c.CRISocket, "cri-socket", c.CRISocket, "container runtime socket, for the restart and live-swap tiers")
	fl.DurationVar(&c.APITimeout, "api-timeout", c.APITimeout, "deadline of each API server call")
	fl.Float32Var(&c.APIQPS, "kube-api-qps", c.APIQPS, "requests a second the agent sends with its node's identity (kubelet's default); a storage outage costs about one read per broken volume (its claim; the pods are read by one LIST a second, the PVs ahead of time)")
	fl.IntVar(&c.APIBurst, "kube-api-burst", c.APIBurst, "burst of --kube-api-qps (kubelet's default)")
	fl.IntVar(&c.CacheSize, "cache-size", c.CacheSize, "PV/PVC/CSIDriver/VolumeAttachment objects kept for repairs while the API server is unreachable")
	fl.DurationVar(&c.CacheTTL, "cache-ttl", c.CacheTTL, "how long a cached object is used without asking the API server")
}

// agentConfig turns the flags into a checked agent.Config.
func agentConfig(f *agentFlags) (agent.Config, error) {
	cfg := f.cfg
	tiers, err := remount.ParseTierSet(f.tiers)
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

// checkNodeIdentity asks the API server whether client is this node's own
// identity. Credentials that are not fail the start; an API server that
// does not answer within --api-timeout is let be (the agent detects and
// reports without it, and a certificate was already judged by
// NewNodeClient).
func checkNodeIdentity(ctx context.Context, client kubernetes.Interface, cfg agent.Config) error {
	cctx, cancel := context.WithTimeout(ctx, cfg.APITimeout)
	defer cancel()
	err := agent.CheckNodeIdentity(cctx, client, cfg.NodeName)
	switch {
	case errors.Is(err, agent.ErrNotNodeIdentity):
		return fmt.Errorf("--node-kubeconfig %s: %w", cfg.NodeKubeconfig, err)
	case apierrors.IsUnauthorized(err):
		return fmt.Errorf("--node-kubeconfig %s: the API server rejects these credentials (an expired or foreign client certificate?): %w", cfg.NodeKubeconfig, err)
	case err != nil:
		klog.FromContext(ctx).Info("Cannot check the node credentials now; going on", "err", err)
	}
	return nil
}

// checkNoExecPlugin refuses a node kubeconfig whose user is an exec
// credential plugin (EKS: aws-iam-authenticator): the agent's image has
// no such program, and client-go would fail every request later, one by
// one, instead of at start. A file that cannot be read is left to
// NewNodeClient, whose errors name the fix.
func checkNoExecPlugin(path string) error {
	raw, err := clientcmd.LoadFromFile(path)
	if err != nil {
		return nil
	}
	cc := clientcmd.NewNonInteractiveClientConfig(*raw, "", &clientcmd.ConfigOverrides{}, nil)
	rc, err := cc.ClientConfig()
	if err != nil || rc.ExecProvider == nil {
		return nil
	}
	return fmt.Errorf("--node-kubeconfig %s: kubelet's credentials come from the exec plugin %q (EKS' IAM authenticator), which the agent cannot run: run the agent with --identity=serviceaccount instead (the chart's identity=serviceaccount, the eks profiles' default; deploy/identity/serviceaccount)", path, rc.ExecProvider.Command)
}

// agentClient makes the client the agent acts with in the --identity
// mode and checks, with the API server, that it is this node's.
func agentClient(ctx context.Context, identity string, cfg agent.Config) (kubernetes.Interface, error) {
	switch identity {
	case agent.IdentityNode:
		if err := checkNoExecPlugin(cfg.NodeKubeconfig); err != nil {
			return nil, err
		}
		client, err := agent.NewNodeClient(cfg)
		if err != nil {
			return nil, err
		}
		return client, checkNodeIdentity(ctx, client, cfg)
	case agent.IdentityServiceAccount:
		rc, err := restConfig(cfg.Kubeconfig)
		if err != nil {
			return nil, fmt.Errorf("--identity=serviceaccount: %w", err)
		}
		client, err := agent.NewServiceAccountClient(cfg, rc)
		if err != nil {
			return nil, err
		}
		cctx, cancel := context.WithTimeout(ctx, cfg.APITimeout)
		defer cancel()
		err = agent.CheckServiceAccountIdentity(cctx, client, cfg.NodeName)
		switch {
		case errors.Is(err, agent.ErrNotNodeBound):
			return nil, fmt.Errorf("--identity=serviceaccount: %w", err)
		case apierrors.IsUnauthorized(err):
			return nil, fmt.Errorf("--identity=serviceaccount: the API server rejects the ServiceAccount token: %w", err)
		case err != nil:
			klog.FromContext(ctx).Info("Cannot check the ServiceAccount credentials now; going on", "err", err)
		}
		return client, nil
	default:
		return nil, fmt.Errorf("--identity %q: want %s or %s", identity, agent.IdentityNode, agent.IdentityServiceAccount)
	}
}

func runAgent(cmd *cobra.Command, f *agentFlags) error {
	cfg, err := agentConfig(f)
	if err != nil {
		return err
	}
	fcfg := f.failover
	fcfg.NodeName = cfg.NodeName
	if fcfg.Identity == "" && !cmd.Flags().Changed("failover-identity") {
		fcfg.Identity = cfg.NodeName
	}
	fcfg.DryRun = fcfg.DryRun || cfg.DryRun
	if err := fcfg.Validate(); err != nil {
		return err
	}
	if err := checkServiceAccountName(cfg); err != nil {
		return err
	}
	client, err := agentClient(cmd.Context(), f.identity, cfg)
	if err != nil {
		return err
	}
	// The ServiceAccount writes the failover heartbeat's Lease, on a
	// client of its own (rate limiter, connections): a renewal never waits
	// behind the agent's reads.
	var leases kubernetes.Interface
	if fcfg.Enabled {
		rc, err := restConfig(cfg.Kubeconfig)
		if err != nil {
			return err
		}
		rc.UserAgent = "mountmedic/" + version
		if leases, err = failover.NewHeartbeatClient(rc); err != nil {
			return err
		}
	}
	// One prober: the agent's probe cycles find the broken volumes, and the
	// repairer verifies its repairs with it and asks it whether the probe
	// that found a volume Hung is still blocked. One reader of the mount
	// table for the loop, the repairs and the stall watch.
	prober := agent.NewProber(cfg)
	table := agent.NewTableReader(cfg)
	repairer, err := remount.New(remount.Config{
		KubeletRoot:  cfg.KubeletRoot,
		DryRun:       cfg.DryRun,
		CRIEndpoint:  cfg.CRISocket,
		Parallel:     cfg.RepairSlots(),
		Prober:       prober,
		Table:        table,
		MaxTableSize: cfg.MaxTableSize,
	})
	if err != nil {
		return fmt.Errorf("--kubelet-root: %w", err)
	}
	defer repairer.Close()
	deps := agent.Deps{Client: client, Repairer: repairer, Prober: prober, Table: table, Registry: prometheus.NewRegistry()}
	if f.identity == agent.IdentityNode {
		// A node may not list events: the budget's rebuild lists them with
		// the ServiceAccount (deploy/rbac.yaml, mountmedic-agent-budget).
		deps.EventReader = eventReader(cmd.Context(), cfg)
	}

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
			HostTable: cfg.HostTable, DryRun: fcfg.DryRun, Guard: cfg.Guard}
		if hb, err = failover.NewHeartbeat(fcfg, client, leases, a.PodInformer(), fence, fence, deps.Registry); err != nil {
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

// checkServiceAccountName refuses to start as a ServiceAccount other than
// the one the admission policies match (agent.CheckServiceAccountName).
// Without ServiceAccount credentials (outside a pod, no --kubeconfig) there
// is nothing to check.
func checkServiceAccountName(cfg agent.Config) error {
	rc, err := restConfig(cfg.Kubeconfig)
	if err != nil {
		return nil
	}
	return agent.CheckServiceAccountName(rc, cfg.ServiceAccountName)
}

// restConfig loads the API server configuration of a ServiceAccount
// (the agent's heartbeat, the controller): in-cluster, or from --kubeconfig.
func restConfig(kubeconfig string) (*rest.Config, error) {
	if kubeconfig == "" {
		rc, err := rest.InClusterConfig()
		if err != nil {
			return nil, fmt.Errorf("in-cluster config: %w; outside a pod pass --kubeconfig", err)
		}
		return rc, nil
	}
	rc, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("--kubeconfig %s: %w", kubeconfig, err)
	}
	return rc, nil
}

// eventReader is the ServiceAccount's client for the eviction budget's
// rebuild in --identity=node; nil (the agent's own client) when there is
// no ServiceAccount configuration, which the agent's log then shows as a
// refused list.
func eventReader(ctx context.Context, cfg agent.Config) kubernetes.Interface {
	rc, err := restConfig(cfg.Kubeconfig)
	if err == nil {
		rc.UserAgent = "mountmedic/" + version
		var c kubernetes.Interface
		if c, err = kubernetes.NewForConfig(rc); err == nil {
			return c
		}
	}
	klog.FromContext(ctx).Info("No ServiceAccount client to rebuild the eviction budget with", "err", err)
	return nil
}
