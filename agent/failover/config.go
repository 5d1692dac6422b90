package failover

import (
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/spf13/pflag"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/validation"
)

// Mode is how the controller fails a dead node's pods over.
type Mode string

const (
	// ModeTaint applies node.kubernetes.io/out-of-service=mountmedic:NoExecute
	// (KEP-2268): the taint eviction controller and the pod garbage
	// collector delete the node's pods, and the attach/detach controller
	// detaches their volumes at once instead of after its 6 minute wait.
	// With DeletePods the controller force-deletes the eligible pods itself
	// as soon as the taint eviction controller has marked them terminating,
	// so that they do not wait for the pod garbage collector's 20 s period.
	// (Not before: the taint eviction controller deletes by name, and would
	// delete a StatefulSet's replacement, which has the same name.)
	ModeTaint Mode = "taint"
	// ModeForceDelete force-deletes the eligible pods and deletes their
	// VolumeAttachments on the dead node, without a taint. For clusters that
	// do not want the taint (it evicts every pod of the node). The
	// attach/detach controller notices a deleted VolumeAttachment only at
	// its next state sync (--attach-detach-reconcile-sync-period, default
	// 1 minute), so this mode is slower than ModeTaint.
	ModeForceDelete Mode = "force-delete"
)

// Modes lists the modes, for flag help and errors.
var Modes = []Mode{ModeTaint, ModeForceDelete}

// Config is the failover duty's configuration. cmd/mountmedic binds its
// flags with AddFlags; start from DefaultConfig and call Validate.
//
// The same binary runs the node side (NewHeartbeat, on every node) and the
// cluster side (NewController, one active instance through leader
// election), and both must agree on the fence window and the eligibility
// rules: give every agent the same flags.
type Config struct {
	// Enabled turns the whole duty on (--failover). Off by default: the
	// node side stops containers when it loses the API server for
	// FenceAfter, which a cluster must choose knowingly.
	Enabled bool

	// NodeName is this node, for the heartbeat (the agent's --node-name).
	NodeName string
	// Namespace holds the heartbeat Leases and the leader election Lease
	// (--failover-namespace, default $POD_NAMESPACE, else "mountmedic").
	Namespace string
	// Identity names this instance in the Leases it holds (default
	// $POD_NAME, else the host name).
	Identity string
	// LeaderLease is the name of the leader election Lease.
	LeaderLease string
	// Candidate: this agent runs a Controller and campaigns for the leader
	// Lease. Every candidate reads the Lease each RetryPeriod, so in large
	// clusters make only a few agents candidates (one DaemonSet with
	// --failover-leader-candidate=false and one, on a few nodes, with true).
	Candidate bool

	// Mode is taint (default) or force-delete.
	Mode Mode
	// DeletePods, in taint mode, also force-deletes the eligible pods once
	// they are terminating (the pod garbage collector would do it within
	// its 20 s period).
	DeletePods bool

	// HeartbeatInterval is how often each agent renews its node's heartbeat
	// Lease; each wait adds up to 10% of jitter, so an agent writes no more
	// often than this (kubelet's node lease: once per 10 s).
	HeartbeatInterval time.Duration
	// FenceAfter: an agent that has not renewed its heartbeat for this long
	// (counted from the start of its last successful renewal) fences: it
	// stops the containers of the pods the controller could fail over and
	// lazily unmounts their volumes. Its heartbeat Lease advertises it as
	// leaseDurationSeconds.
	FenceAfter time.Duration
	// PeerKeyFile holds the key the agents authenticate their peer-check
	// answers with (a Secret mounted in the DaemonSet). Empty: no peer
	// check, an agent that cannot renew for FenceAfter fences even when
	// the API server is down for every node.
	PeerKeyFile string
	// PeerListen is the address of the peer endpoint (the DaemonSet is not
	// hostNetwork: peers reach it at the pod IP).
	PeerListen string
	// PeerAdvertise is the host other agents reach this one at (default
	// $POD_IP); the heartbeat Lease carries it with PeerListen's port.
	PeerAdvertise string
	// Peers is how many peers an agent asks; every one of them must answer
	// that it cannot renew either for the agent to hold its fence.
	Peers int
	// PeerTimeout bounds each peer's answer.
	PeerTimeout time.Duration
	// PeerRefresh is how often (jittered) an agent picks its peers again
	// from the heartbeat Leases (one list of one shard, from the watch
	// cache).
	PeerRefresh time.Duration
	// FenceStopGrace is the grace period a fenced container gets after
	// SIGTERM.
	FenceStopGrace time.Duration
	// FenceMargin is added to the fence window on the cluster side: the
	// controller acts only when a heartbeat has not changed for
	// max(FenceAfter, the Lease's leaseDurationSeconds) + FenceMargin by its
	// own clock. It must cover the time fencing takes (FenceStopGrace and
	// the unmounts) and the agent's check period.
	FenceMargin time.Duration
	// KubeletGrace: the controller acts only when the node's kubelet Lease
	// (and its Ready heartbeat) has not changed for this long by its own
	// clock, besides the Ready condition not being True.
	KubeletGrace time.Duration
	// TrustShutdownTaint lets the cloud provider's
	// node.cloudprovider.kubernetes.io/shutdown taint stand in for a stale
	// heartbeat. Off by default: cloud providers also set it on a
	// hibernated or suspended instance, which resumes with its containers
	// and mounts as they were, unfenced.
	TrustShutdownTaint bool

	// MaxNodes is how many nodes may be in failover at once (acted on, with
	// eligible pods still on them). A zone outage then fails nodes over one
	// batch at a time instead of all at once.
	MaxNodes int
	// NodeSelector limits the duty to nodes with these labels (a label
	// selector; empty means every node).
	NodeSelector string

	// IncludeNamespaces, when not empty, limits failover to pods in these
	// namespaces; ExcludeNamespaces are never failed over.
	IncludeNamespaces []string
	ExcludeNamespaces []string
	// IncludeStorageClasses, when not empty, limits failover to volumes of
	// these StorageClasses; ExcludeStorageClasses never count.
	IncludeStorageClasses []string
	ExcludeStorageClasses []string

	// DryRun decides and reports (events and logs say what would happen,
	// metrics count dry_run), and changes nothing: no taint, no deletion,
	// no fence. The heartbeat is still renewed.
	DryRun bool

	// LeaseDuration, RenewDeadline and RetryPeriod tune leader election.
	LeaseDuration time.Duration
	RenewDeadline time.Duration
	RetryPeriod   time.Duration
	// APITimeout bounds each API call.
	APITimeout time.Duration
	// EvalInterval is how often the leader re-judges every node (evidence
	// ages with time, not only with events).
	EvalInterval time.Duration
}

// Defaults of the flags.
const (
	DefaultNamespace   = "mountmedic"
	DefaultLeaderLease = "mountmedic-failover-leader"
)

// DefaultConfig returns the defaults the flags start from. With
// Kubernetes' default --node-monitor-grace-period of 50 s, a dead node is
// failed over about 50-55 s after it died: the fence window (30 s + 15 s)
// ends before kubelet's Ready condition turns Unknown.
func DefaultConfig() Config {
	ns := os.Getenv("POD_NAMESPACE")
	if ns == "" {
		ns = DefaultNamespace
	}
	id := os.Getenv("POD_NAME")
	if id == "" {
		id, _ = os.Hostname()
	}
	return Config{
		NodeName:           os.Getenv("NODE_NAME"),
		Namespace:          ns,
		Identity:           id,
		LeaderLease:        DefaultLeaderLease,
		Candidate:          true,
		Mode:               ModeTaint,
		DeletePods:         true,
		HeartbeatInterval:  10 * time.Second,
		FenceAfter:         30 * time.Second,
		FenceStopGrace:     5 * time.Second,
		FenceMargin:        15 * time.Second,
		KubeletGrace:       40 * time.Second,
		TrustShutdownTaint: false,
		PeerListen:         ":9810",
		PeerAdvertise:      os.Getenv("POD_IP"),
		Peers:              7,
		PeerTimeout:        2 * time.Second,
		PeerRefresh:        10 * time.Minute,
		MaxNodes:           1,
		LeaseDuration:      15 * time.Second,
		RenewDeadline:      10 * time.Second,
		RetryPeriod:        2 * time.Second,
		APITimeout:         10 * time.Second,
		EvalInterval:       time.Second,
	}
}

// AddFlags binds the failover flags (all but NodeName, which the agent's
// --node-name gives) into c. Call it on the agent command's flag set after
// DefaultConfig.
func (c *Config) AddFlags(fl *pflag.FlagSet) {
	fl.BoolVar(&c.Enabled, "failover", c.Enabled, "run the node failover duty: renew this node's heartbeat, fence when it cannot, and (the elected leader) fail pods with ReadWriteOnce volumes over from dead nodes")
	fl.StringVar(&c.Namespace, "failover-namespace", c.Namespace, "namespace of the heartbeat and leader election Leases (the default comes from $POD_NAMESPACE)")
	fl.StringVar(&c.Identity, "failover-identity", c.Identity, "this instance's name in the Leases it holds (the default comes from $POD_NAME)")
	fl.StringVar(&c.LeaderLease, "failover-leader-lease", c.LeaderLease, "name of the leader election Lease")
	fl.BoolVar(&c.Candidate, "failover-leader-candidate", c.Candidate, "run the cluster side here too: campaign for the leader Lease and, when elected, fail dead nodes over")
	fl.Var(newModeValue(&c.Mode), "failover-mode", "how to fail a dead node over: taint (node.kubernetes.io/out-of-service) or force-delete (pods and VolumeAttachments)")
	fl.BoolVar(&c.DeletePods, "failover-delete-pods", c.DeletePods, "in taint mode, force-delete the eligible pods as soon as they are terminating instead of waiting for the pod garbage collector's 20s period")
	fl.DurationVar(&c.HeartbeatInterval, "failover-heartbeat-interval", c.HeartbeatInterval, "how often each agent renews its node's heartbeat Lease")
	fl.DurationVar(&c.FenceAfter, "failover-fence-after", c.FenceAfter, "an agent that cannot renew its heartbeat for this long stops the containers of pods with ReadWriteOnce volumes and unmounts them")
	fl.StringVar(&c.PeerKeyFile, "failover-peer-key-file", c.PeerKeyFile, "key (at least 32 bytes) the agents authenticate peer-check answers with; empty: no peer check, so an API server outage longer than --failover-fence-after fences every node")
	fl.StringVar(&c.PeerListen, "failover-peer-listen", c.PeerListen, "address of the peer-check endpoint other agents ask when they cannot renew their heartbeat")
	fl.StringVar(&c.PeerAdvertise, "failover-peer-advertise", c.PeerAdvertise, "host other agents reach this one at (the default comes from $POD_IP)")
	fl.IntVar(&c.Peers, "failover-peers", c.Peers, "peers an agent asks before it fences; it holds (an outage) only while every one of them answers that it cannot renew either")
	fl.DurationVar(&c.PeerTimeout, "failover-peer-timeout", c.PeerTimeout, "deadline of a peer's answer")
	fl.DurationVar(&c.PeerRefresh, "failover-peer-refresh", c.PeerRefresh, "how often an agent picks its peers again from the heartbeat Leases")
	fl.DurationVar(&c.FenceStopGrace, "failover-fence-stop-grace", c.FenceStopGrace, "grace period of a container stopped by fencing")
	fl.DurationVar(&c.FenceMargin, "failover-fence-margin", c.FenceMargin, "extra time the controller waits past the fence window before acting (covers the time fencing takes)")
	fl.DurationVar(&c.KubeletGrace, "failover-kubelet-grace", c.KubeletGrace, "the node's kubelet Lease must not have changed for this long, besides the node being NotReady")
	fl.BoolVar(&c.TrustShutdownTaint, "failover-trust-shutdown-taint", c.TrustShutdownTaint, "accept the cloud provider's node.cloudprovider.kubernetes.io/shutdown taint in place of a stale heartbeat (a hibernated instance carries it too and resumes unfenced)")
	fl.IntVar(&c.MaxNodes, "failover-max-nodes", c.MaxNodes, "nodes that may be in failover at once")
	fl.StringVar(&c.NodeSelector, "failover-node-selector", c.NodeSelector, "label selector of the nodes to fail over (default all)")
	fl.StringSliceVar(&c.IncludeNamespaces, "failover-include-namespaces", c.IncludeNamespaces, "fail over only pods in these namespaces (default all)")
	fl.StringSliceVar(&c.ExcludeNamespaces, "failover-exclude-namespaces", c.ExcludeNamespaces, "never fail over pods in these namespaces")
	fl.StringSliceVar(&c.IncludeStorageClasses, "failover-include-storage-classes", c.IncludeStorageClasses, "fail over only pods with ReadWriteOnce volumes of these StorageClasses (default all)")
	fl.StringSliceVar(&c.ExcludeStorageClasses, "failover-exclude-storage-classes", c.ExcludeStorageClasses, "volumes of these StorageClasses never make a pod eligible")
	fl.BoolVar(&c.DryRun, "failover-dry-run", c.DryRun, "decide and report (events, logs, metrics), taint, delete and fence nothing")
	fl.DurationVar(&c.LeaseDuration, "failover-leader-lease-duration", c.LeaseDuration, "leader election lease duration")
	fl.DurationVar(&c.RenewDeadline, "failover-leader-renew-deadline", c.RenewDeadline, "leader election renew deadline")
	fl.DurationVar(&c.RetryPeriod, "failover-leader-retry-period", c.RetryPeriod, "leader election retry period")
	fl.DurationVar(&c.APITimeout, "failover-api-timeout", c.APITimeout, "deadline of each API call of the failover duty")
}

// modeValue is a pflag.Value for Mode.
type modeValue struct{ m *Mode }

func newModeValue(m *Mode) *modeValue { return &modeValue{m: m} }

func (v *modeValue) String() string {
	if v.m == nil {
		return ""
	}
	return string(*v.m)
}

func (v *modeValue) Set(s string) error {
	m := Mode(strings.TrimSpace(s))
	if !slices.Contains(Modes, m) {
		return fmt.Errorf("unknown mode %q: use %s or %s", s, ModeTaint, ModeForceDelete)
	}
	*v.m = m
	return nil
}

func (v *modeValue) Type() string { return "mode" }

// FenceWindow is how long the controller waits after a heartbeat stopped
// changing, for a Lease that advertises leaseSeconds (0: not advertised).
func (c *Config) FenceWindow(leaseSeconds int32) time.Duration {
	w := c.FenceAfter
	if d := time.Duration(leaseSeconds) * time.Second; d > w {
		w = d
	}
	return w + c.FenceMargin
}

// Validate checks the configuration; each error names the flag and the fix.
// A disabled configuration is not checked.
func (c Config) Validate() error { return c.validate(true) }

// validate checks the configuration; the controller alone needs no node
// name.
func (c Config) validate(needNode bool) error {
	if !c.Enabled {
		return nil
	}
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if !needNode && c.NodeName == "" {
		// The controller runs anywhere.
	} else if c.NodeName == "" {
		bad("--node-name is empty: the failover heartbeat needs this node's name (NODE_NAME from the downward API)")
	} else if msgs := validation.IsDNS1123Subdomain(c.NodeName); len(msgs) > 0 {
		bad("--node-name %q is not a node name: %s", c.NodeName, strings.Join(msgs, "; "))
	}
	if msgs := validation.IsDNS1123Label(c.Namespace); len(msgs) > 0 {
		bad("--failover-namespace %q: %s; give the agent's namespace (POD_NAMESPACE)", c.Namespace, strings.Join(msgs, "; "))
	}
	if c.Identity == "" {
		bad("--failover-identity is empty: set POD_NAME from the downward API or pass a unique name")
	}
	if msgs := validation.IsDNS1123Subdomain(c.LeaderLease); len(msgs) > 0 {
		bad("--failover-leader-lease %q: %s", c.LeaderLease, strings.Join(msgs, "; "))
	}
	if !slices.Contains(Modes, c.Mode) {
		bad("--failover-mode %q: use %s or %s", c.Mode, ModeTaint, ModeForceDelete)
	}
	positive := func(flag string, d time.Duration) {
		if d <= 0 {
			bad("--%s %s: must be positive", flag, d)
		}
	}
	positive("failover-heartbeat-interval", c.HeartbeatInterval)
	positive("failover-fence-after", c.FenceAfter)
	positive("failover-fence-stop-grace", c.FenceStopGrace)
	positive("failover-fence-margin", c.FenceMargin)
	positive("failover-kubelet-grace", c.KubeletGrace)
	positive("failover-leader-lease-duration", c.LeaseDuration)
	positive("failover-leader-renew-deadline", c.RenewDeadline)
	positive("failover-leader-retry-period", c.RetryPeriod)
	positive("failover-api-timeout", c.APITimeout)
	if c.PeerKeyFile != "" {
		if c.Peers < 1 {
			bad("--failover-peers %d: must be at least 1 with --failover-peer-key-file", c.Peers)
		}
		positive("failover-peer-timeout", c.PeerTimeout)
		positive("failover-peer-refresh", c.PeerRefresh)
		if c.PeerTimeout >= c.HeartbeatInterval && c.HeartbeatInterval > 0 {
			bad("--failover-peer-timeout %s must be below --failover-heartbeat-interval %s: a peer check must end before the next renewal", c.PeerTimeout, c.HeartbeatInterval)
		}
		if _, _, err := net.SplitHostPort(c.PeerListen); err != nil {
			bad("--failover-peer-listen %q: %v; give host:port, e.g. :9810", c.PeerListen, err)
		}
	}
	if c.EvalInterval <= 0 {
		bad("failover EvalInterval %s: must be positive", c.EvalInterval)
	}
	if c.HeartbeatInterval > 0 && c.FenceAfter > 0 && c.FenceAfter < 2*c.HeartbeatInterval {
		bad("--failover-fence-after %s is below two --failover-heartbeat-interval (%s): one lost renewal would fence; raise --failover-fence-after", c.FenceAfter, c.HeartbeatInterval)
	}
	if c.FenceAfter > 0 && c.FenceAfter%time.Second != 0 {
		bad("--failover-fence-after %s: give whole seconds (the heartbeat Lease advertises it in seconds)", c.FenceAfter)
	}
	// Fencing must end inside the margin: one check period (a second), the
	// stop grace, and time for the CRI and the unmounts.
	if c.FenceStopGrace > 0 && c.FenceMargin > 0 && c.FenceMargin < c.FenceStopGrace+5*time.Second {
		bad("--failover-fence-margin %s must exceed --failover-fence-stop-grace %s by at least 5s (the time fencing takes): raise the margin or lower the grace", c.FenceMargin, c.FenceStopGrace)
	}
	if c.LeaseDuration > 0 && c.RenewDeadline >= c.LeaseDuration {
		bad("--failover-leader-renew-deadline %s must be below --failover-leader-lease-duration %s", c.RenewDeadline, c.LeaseDuration)
	}
	if c.RetryPeriod > 0 && c.RenewDeadline > 0 && c.RetryPeriod >= c.RenewDeadline {
		bad("--failover-leader-retry-period %s must be below --failover-leader-renew-deadline %s", c.RetryPeriod, c.RenewDeadline)
	}
	if c.MaxNodes < 1 {
		bad("--failover-max-nodes %d: must be at least 1 (turn the duty off with --failover=false)", c.MaxNodes)
	}
	if _, err := labels.Parse(c.NodeSelector); err != nil {
		bad("--failover-node-selector %q: %v", c.NodeSelector, err)
	}
	for _, ns := range slices.Concat(c.IncludeNamespaces, c.ExcludeNamespaces) {
		if msgs := validation.IsDNS1123Label(ns); len(msgs) > 0 {
			bad("namespace %q in --failover-include-namespaces/--failover-exclude-namespaces: %s", ns, strings.Join(msgs, "; "))
		}
	}
	for _, ns := range c.IncludeNamespaces {
		if slices.Contains(c.ExcludeNamespaces, ns) {
			bad("namespace %q is in both --failover-include-namespaces and --failover-exclude-namespaces: keep it in one", ns)
		}
	}
	for _, sc := range slices.Concat(c.IncludeStorageClasses, c.ExcludeStorageClasses) {
		if msgs := validation.IsDNS1123Subdomain(sc); len(msgs) > 0 {
			bad("StorageClass %q in --failover-include-storage-classes/--failover-exclude-storage-classes: %s", sc, strings.Join(msgs, "; "))
		}
	}
	for _, sc := range c.IncludeStorageClasses {
		if slices.Contains(c.ExcludeStorageClasses, sc) {
			bad("StorageClass %q is in both --failover-include-storage-classes and --failover-exclude-storage-classes: keep it in one", sc)
		}
	}
	return errors.Join(errs...)
}
