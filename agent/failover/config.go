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
	// ModeForceDelete force-deletes the fenced eligible pods (and, with
	// ForceDetach, their VolumeAttachments on the dead node), without a
	// taint. For clusters that
	// do not want the taint (it evicts every pod of the node). The
	// attach/detach controller notices a deleted VolumeAttachment only at
	// its next state sync (--attach-detach-reconcile-sync-period, default
	// 1 minute), so this mode is slower than ModeTaint.
	ModeForceDelete Mode = "force-delete"
)

// Modes lists the modes, for flag help and errors.
var Modes = []Mode{ModeTaint, ModeForceDelete}

// Policy is the eligibility rules both halves apply: the controller fails
// over only the pods they admit, and a fencing node stops exactly those
// (decide). Give the agents and the controller the same lists.
type Policy struct {
	// IncludeNamespaces, when not empty, limits failover to pods in these
	// namespaces; ExcludeNamespaces are never failed over.
	IncludeNamespaces []string
	ExcludeNamespaces []string
	// IncludeStorageClasses, when not empty, limits failover to volumes of
	// these StorageClasses; ExcludeStorageClasses never count.
	IncludeStorageClasses []string
	ExcludeStorageClasses []string
}

// addFlags binds the policy's flags.
func (p *Policy) addFlags(fl *pflag.FlagSet) {
	fl.StringSliceVar(&p.IncludeNamespaces, "failover-include-namespaces", p.IncludeNamespaces, "fail over only pods in these namespaces (default all)")
	fl.StringSliceVar(&p.ExcludeNamespaces, "failover-exclude-namespaces", p.ExcludeNamespaces, "never fail over pods in these namespaces")
	fl.StringSliceVar(&p.IncludeStorageClasses, "failover-include-storage-classes", p.IncludeStorageClasses, "fail over only pods with ReadWriteOnce volumes of these StorageClasses (default all)")
	fl.StringSliceVar(&p.ExcludeStorageClasses, "failover-exclude-storage-classes", p.ExcludeStorageClasses, "volumes of these StorageClasses never make a pod eligible")
}

// validate checks the lists.
func (p *Policy) validate(bad func(format string, args ...any)) {
	for _, ns := range slices.Concat(p.IncludeNamespaces, p.ExcludeNamespaces) {
		if msgs := validation.IsDNS1123Label(ns); len(msgs) > 0 {
			bad("namespace %q in --failover-include-namespaces/--failover-exclude-namespaces: %s", ns, strings.Join(msgs, "; "))
		}
	}
	for _, ns := range p.IncludeNamespaces {
		if slices.Contains(p.ExcludeNamespaces, ns) {
			bad("namespace %q is in both --failover-include-namespaces and --failover-exclude-namespaces: keep it in one", ns)
		}
	}
	for _, sc := range slices.Concat(p.IncludeStorageClasses, p.ExcludeStorageClasses) {
		if msgs := validation.IsDNS1123Subdomain(sc); len(msgs) > 0 {
			bad("StorageClass %q in --failover-include-storage-classes/--failover-exclude-storage-classes: %s", sc, strings.Join(msgs, "; "))
		}
	}
	for _, sc := range p.IncludeStorageClasses {
		if slices.Contains(p.ExcludeStorageClasses, sc) {
			bad("StorageClass %q is in both --failover-include-storage-classes and --failover-exclude-storage-classes: keep it in one", sc)
		}
	}
}

// Config is the node side of the duty (the heartbeat and the fence, in
// every agent). cmd/mountmedic binds its flags with AddFlags; start from
// DefaultConfig and call Validate. The cluster side has its own
// ControllerConfig: agents never judge other nodes.
type Config struct {
	// Enabled turns the node side on (--failover). Off by default: the
	// node stops containers when it loses the API server for FenceAfter,
	// which a cluster must choose knowingly.
	Enabled bool

	// NodeName is this node, for the heartbeat (the agent's --node-name).
	NodeName string
	// Namespace holds the heartbeat Leases (--failover-namespace, default
	// $POD_NAMESPACE, else "mountmedic").
	Namespace string
	// Identity names this agent in the heartbeat Lease it holds (default
	// $POD_NAME, else the host name).
	Identity string

	// HeartbeatInterval is how often each agent renews its node's heartbeat
	// Lease; each wait adds up to 10% of jitter, so an agent writes no more
	// often than this (kubelet's node lease: once per 10 s).
	HeartbeatInterval time.Duration
	// FenceAfter: an agent that has not renewed its heartbeat for this long
	// (counted from the start of its last successful renewal) fences: it
	// stops the containers of the pods the controller could fail over and
	// lazily unmounts their volumes. Its heartbeat Lease advertises it as
	// leaseDurationSeconds, which is what the controller waits for.
	FenceAfter time.Duration
	// FenceStopGrace is the grace period a fenced container gets after
	// SIGTERM.
	FenceStopGrace time.Duration
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

	// Policy: which pods a fence stops (those the controller may fail over).
	Policy

	// DryRun reports what the fence would stop and stops nothing. The
	// heartbeat is still renewed.
	DryRun bool
	// APITimeout bounds each API call.
	APITimeout time.Duration
}

// Defaults of the flags.
const (
	DefaultNamespace   = "mountmedic"
	DefaultLeaderLease = "mountmedic-failover-leader"
	// DefaultStandDownShare: from this share of not-Ready nodes (and more
	// than two of them) the controller fails no node over. kube's node
	// lifecycle controller stops evicting a zone at 0.55
	// (--unhealthy-zone-threshold); ours is lower because of the agents'
	// peer check: a node of a group cut off together (a share f of the
	// nodes) holds its fence, wrongly, only when every one of its Peers (7)
	// peers is in the group, f^7: below 0.2, about 1e-5 per node, 0.013
	// nodes in a 5,000-node cluster losing 1,000 at once; at 0.55, 1.5%
	// (about 40 nodes), each a possible second writer.
	DefaultStandDownShare = 0.2
)

// podEnv returns the namespace and identity the downward API gives.
func podEnv() (ns, id string) {
	ns = os.Getenv("POD_NAMESPACE")
	if ns == "" {
		ns = DefaultNamespace
	}
	id = os.Getenv("POD_NAME")
	if id == "" {
		id, _ = os.Hostname()
	}
	return ns, id
}

// DefaultConfig returns the defaults the agent's flags start from.
func DefaultConfig() Config {
	ns, id := podEnv()
	return Config{
		NodeName:          os.Getenv("NODE_NAME"),
		Namespace:         ns,
		Identity:          id,
		HeartbeatInterval: 10 * time.Second,
		FenceAfter:        30 * time.Second,
		FenceStopGrace:    5 * time.Second,
		PeerListen:        ":9810",
		PeerAdvertise:     os.Getenv("POD_IP"),
		Peers:             7,
		PeerTimeout:       2 * time.Second,
		PeerRefresh:       10 * time.Minute,
		APITimeout:        10 * time.Second,
	}
}

// AddFlags binds the node side's flags (all but NodeName, which the
// agent's --node-name gives) into c. Call it on the agent command's flag
// set after DefaultConfig.
func (c *Config) AddFlags(fl *pflag.FlagSet) {
	fl.BoolVar(&c.Enabled, "failover", c.Enabled, "run the node side of the failover duty: renew this node's heartbeat Lease and fence this node's pods with ReadWriteOnce volumes when it cannot (the cluster side is the mountmedic controller command)")
	fl.StringVar(&c.Namespace, "failover-namespace", c.Namespace, "namespace of the heartbeat Leases (the default comes from $POD_NAMESPACE)")
	fl.StringVar(&c.Identity, "failover-identity", c.Identity, "this agent's name in the heartbeat Lease it holds (the default comes from $POD_NAME)")
	fl.DurationVar(&c.HeartbeatInterval, "failover-heartbeat-interval", c.HeartbeatInterval, "how often each agent renews its node's heartbeat Lease")
	fl.DurationVar(&c.FenceAfter, "failover-fence-after", c.FenceAfter, "an agent that cannot renew its heartbeat for this long stops the containers of pods with ReadWriteOnce volumes and unmounts them")
	fl.StringVar(&c.PeerKeyFile, "failover-peer-key-file", c.PeerKeyFile, "key (at least 32 bytes) the agents authenticate peer-check answers with; empty: no peer check, so an API server outage longer than --failover-fence-after fences every node")
	fl.StringVar(&c.PeerListen, "failover-peer-listen", c.PeerListen, "address of the peer-check endpoint other agents ask when they cannot renew their heartbeat")
	fl.StringVar(&c.PeerAdvertise, "failover-peer-advertise", c.PeerAdvertise, "host other agents reach this one at (the default comes from $POD_IP)")
	fl.IntVar(&c.Peers, "failover-peers", c.Peers, "peers an agent asks before it fences; it holds (an outage) only while every one of them answers that it cannot renew either")
	fl.DurationVar(&c.PeerTimeout, "failover-peer-timeout", c.PeerTimeout, "deadline of a peer's answer")
	fl.DurationVar(&c.PeerRefresh, "failover-peer-refresh", c.PeerRefresh, "how often an agent picks its peers again from the heartbeat Leases")
	fl.DurationVar(&c.FenceStopGrace, "failover-fence-stop-grace", c.FenceStopGrace, "grace period of a container stopped by fencing")
	c.Policy.addFlags(fl)
	fl.BoolVar(&c.DryRun, "failover-dry-run", c.DryRun, "report what a fence would stop, stop nothing")
	fl.DurationVar(&c.APITimeout, "failover-api-timeout", c.APITimeout, "deadline of each API call of the failover heartbeat")
}

// ControllerConfig is the cluster side of the duty: `mountmedic
// controller`, a Deployment whose replicas elect one leader among
// themselves. cmd/mountmedic binds its flags with AddFlags; start from
// DefaultControllerConfig and call Validate. The flag names are those the
// agent had when it ran the controller, so the same values carry over.
type ControllerConfig struct {
	// Namespace holds the agents' heartbeat Leases and the leader election
	// Lease.
	Namespace string
	// Identity names this replica in the leader Lease.
	Identity string
	// LeaderLease is the name of the leader election Lease.
	LeaderLease string
	// LeaseDuration, RenewDeadline and RetryPeriod tune leader election.
	LeaseDuration time.Duration
	RenewDeadline time.Duration
	RetryPeriod   time.Duration

	// Mode is taint (default) or force-delete.
	Mode Mode
	// DeletePods, in taint mode, also force-deletes the eligible pods once
	// they are terminating (the pod garbage collector would do it within
	// its 20 s period).
	DeletePods bool
	// ForceDetach: when the controller force-deletes a node's fenced pods
	// itself (force-delete mode, or taint mode on a node it may not
	// taint), it also deletes their VolumeAttachments on the node, so that
	// the replacement attaches at the attach/detach controller's next sync
	// instead of after its 6 minute wait. Off by default; the admission
	// policy deploy/controller/ ships refuses the deletion unless its
	// parameter allows it too.
	ForceDetach bool

	// FenceAfter is the least fence window the controller assumes for a
	// heartbeat: a Lease advertising a longer one (leaseDurationSeconds)
	// is waited for that long. Give the agents' --failover-fence-after.
	FenceAfter time.Duration
	// FenceMargin is added to the fence window: the controller acts only
	// when a heartbeat has not changed for max(FenceAfter, the Lease's
	// leaseDurationSeconds) + FenceMargin by its own clock. It must cover
	// the time fencing takes (the agents' stop grace and the unmounts) and
	// the agent's check period.
	FenceMargin time.Duration
	// KubeletGrace: the controller acts only when the node's kubelet Lease
	// (and its Ready heartbeat) has not changed for this long by its own
	// clock, besides the Ready condition not being True.
	KubeletGrace time.Duration
	// TrustShutdownTaint lets the cloud provider's
	// node.cloudprovider.kubernetes.io/shutdown taint stand in for a stale
	// heartbeat. Off by default: a hibernated instance carries it too and
	// resumes with its containers running and unfenced.
	TrustShutdownTaint bool

	// MaxNodes is how many nodes may be in failover at once (acted on, with
	// eligible pods still on them). A zone outage then fails nodes over one
	// batch at a time instead of all at once.
	MaxNodes int
	// StandDownShare: while at least this share of the judged nodes (and
	// more than two), or all of them, are not Ready, the controller acts on
	// none (a disrupted zone or a control-plane problem looks like that;
	// kube's node lifecycle controller stops evicting likewise).
	StandDownShare float64
	// NodeSelector limits the duty to nodes with these labels (a label
	// selector; empty means every node).
	NodeSelector string

	// Policy: which pods are failed over. The agents' lists must match.
	Policy

	// DryRun decides and reports (events and logs say what would happen,
	// metrics count dry_run), and changes nothing: no taint, no deletion.
	DryRun bool
	// APITimeout bounds each API call.
	APITimeout time.Duration
	// Recheck is how often a node in failover, or one deferred, is looked
	// at again (the other nodes are judged on their own events and when
	// their evidence comes of age).
	Recheck time.Duration
	// ReleaseCode is how often the controller gives the kernel back the
	// pages of its own executable it no longer uses (coldpages.Release),
	// the first time 30 s after start; 0 never.
	ReleaseCode time.Duration
}

// DefaultControllerConfig returns the defaults the controller's flags
// start from. With Kubernetes' default --node-monitor-grace-period of 50 s,
// a dead node is failed over about 50-55 s after it died: the fence window
// (30 s + 15 s) ends before kubelet's Ready condition turns Unknown.
func DefaultControllerConfig() ControllerConfig {
	ns, id := podEnv()
	return ControllerConfig{
		Namespace:      ns,
		Identity:       id,
		LeaderLease:    DefaultLeaderLease,
		LeaseDuration:  15 * time.Second,
		RenewDeadline:  10 * time.Second,
		RetryPeriod:    2 * time.Second,
		Mode:           ModeTaint,
		DeletePods:     true,
		FenceAfter:     30 * time.Second,
		FenceMargin:    15 * time.Second,
		KubeletGrace:   40 * time.Second,
		MaxNodes:       1,
		StandDownShare: DefaultStandDownShare,
		APITimeout:     10 * time.Second,
		Recheck:        2 * time.Second,
		ReleaseCode:    5 * time.Minute,
	}
}

// AddFlags binds the controller's flags into c.
func (c *ControllerConfig) AddFlags(fl *pflag.FlagSet) {
	fl.StringVar(&c.Namespace, "failover-namespace", c.Namespace, "namespace of the agents' heartbeat Leases and of the leader election Lease (the default comes from $POD_NAMESPACE)")
	fl.StringVar(&c.Identity, "failover-identity", c.Identity, "this replica's name in the leader Lease (the default comes from $POD_NAME)")
	fl.StringVar(&c.LeaderLease, "failover-leader-lease", c.LeaderLease, "name of the leader election Lease")
	fl.DurationVar(&c.LeaseDuration, "failover-leader-lease-duration", c.LeaseDuration, "leader election lease duration")
	fl.DurationVar(&c.RenewDeadline, "failover-leader-renew-deadline", c.RenewDeadline, "leader election renew deadline")
	fl.DurationVar(&c.RetryPeriod, "failover-leader-retry-period", c.RetryPeriod, "leader election retry period")
	fl.Var(newModeValue(&c.Mode), "failover-mode", "how to fail a dead node over: taint (node.kubernetes.io/out-of-service) or force-delete (pods and VolumeAttachments)")
	fl.BoolVar(&c.ForceDetach, "failover-force-detach", c.ForceDetach, "when force-deleting a dead node's fenced pods (force-delete mode, or a node the taint would strip of unfenced pods), also delete their VolumeAttachments on it instead of waiting for the attach/detach controller's 6m")
	fl.BoolVar(&c.DeletePods, "failover-delete-pods", c.DeletePods, "in taint mode, force-delete the eligible pods as soon as they are terminating instead of waiting for the pod garbage collector's 20s period")
	fl.DurationVar(&c.FenceAfter, "failover-fence-after", c.FenceAfter, "the agents' --failover-fence-after: the least time a heartbeat must be silent (a Lease advertising more is waited for longer)")
	fl.DurationVar(&c.FenceMargin, "failover-fence-margin", c.FenceMargin, "extra time the controller waits past the fence window before acting (covers the time fencing takes)")
	fl.DurationVar(&c.KubeletGrace, "failover-kubelet-grace", c.KubeletGrace, "the node's kubelet Lease must not have changed for this long, besides the node being NotReady")
	fl.BoolVar(&c.TrustShutdownTaint, "failover-trust-shutdown-taint", c.TrustShutdownTaint, "accept the cloud provider's node.cloudprovider.kubernetes.io/shutdown taint in place of a stale heartbeat (a hibernated node carries it too, unfenced)")
	fl.IntVar(&c.MaxNodes, "failover-max-nodes", c.MaxNodes, "nodes that may be in failover at once")
	fl.Float64Var(&c.StandDownShare, "failover-stand-down-share", c.StandDownShare, "fail no node over while at least this share of the judged nodes (and more than two), or all of them, look dead (not Ready, kubelet silent); keep it at or below 0.25 with the agents' peer check (a group cut off together must not be failed over)")
	fl.StringVar(&c.NodeSelector, "failover-node-selector", c.NodeSelector, "label selector of the nodes to fail over (default all)")
	c.Policy.addFlags(fl)
	fl.BoolVar(&c.DryRun, "failover-dry-run", c.DryRun, "decide and report (events, logs, metrics), taint and delete nothing")
	fl.DurationVar(&c.APITimeout, "failover-api-timeout", c.APITimeout, "deadline of each API call of the controller")
	fl.DurationVar(&c.ReleaseCode, "release-code-interval", c.ReleaseCode, "how often to give the kernel back the pages of the controller's own executable that it no longer uses (most of its start-up's: they stay in the page cache), first 30s after start (0: never)")
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
func (c *ControllerConfig) FenceWindow(leaseSeconds int32) time.Duration {
	w := c.FenceAfter
	if d := time.Duration(leaseSeconds) * time.Second; d > w {
		w = d
	}
	return w + c.FenceMargin
}

// Validate checks the node side's configuration; each error names the flag
// and the fix. A disabled configuration is not checked.
func (c Config) Validate() error {
	if !c.Enabled {
		return nil
	}
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if c.NodeName == "" {
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
	positive := func(flag string, d time.Duration) {
		if d <= 0 {
			bad("--%s %s: must be positive", flag, d)
		}
	}
	positive("failover-heartbeat-interval", c.HeartbeatInterval)
	positive("failover-fence-after", c.FenceAfter)
	positive("failover-fence-stop-grace", c.FenceStopGrace)
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
	if c.HeartbeatInterval > 0 && c.FenceAfter > 0 && c.FenceAfter < 2*c.HeartbeatInterval {
		bad("--failover-fence-after %s is below two --failover-heartbeat-interval (%s): one lost renewal would fence; raise --failover-fence-after", c.FenceAfter, c.HeartbeatInterval)
	}
	if c.FenceAfter > 0 && c.FenceAfter%time.Second != 0 {
		bad("--failover-fence-after %s: give whole seconds (the heartbeat Lease advertises it in seconds)", c.FenceAfter)
	}
	c.Policy.validate(bad)
	return errors.Join(errs...)
}

// Validate checks the controller's configuration; each error names the
// flag and the fix.
func (c ControllerConfig) Validate() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if msgs := validation.IsDNS1123Label(c.Namespace); len(msgs) > 0 {
		bad("--failover-namespace %q: %s; give the agents' namespace (POD_NAMESPACE)", c.Namespace, strings.Join(msgs, "; "))
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
	positive("failover-fence-after", c.FenceAfter)
	positive("failover-fence-margin", c.FenceMargin)
	positive("failover-kubelet-grace", c.KubeletGrace)
	positive("failover-leader-lease-duration", c.LeaseDuration)
	positive("failover-leader-renew-deadline", c.RenewDeadline)
	positive("failover-leader-retry-period", c.RetryPeriod)
	positive("failover-api-timeout", c.APITimeout)
	if c.ReleaseCode < 0 {
		bad("--release-code-interval %s: must not be negative (0 never releases)", c.ReleaseCode)
	}
	if c.Recheck <= 0 {
		bad("failover Recheck %s: must be positive", c.Recheck)
	}
	// The margin must cover the fence itself: one check period, the
	// agents' stop grace (5 s by default) and the CRI and unmounts.
	if c.FenceMargin > 0 && c.FenceMargin < 6*time.Second {
		bad("--failover-fence-margin %s: must be at least 6s (the agents' --failover-fence-stop-grace plus the time fencing takes)", c.FenceMargin)
	}
	if c.LeaseDuration > 0 && c.RenewDeadline >= c.LeaseDuration {
		bad("--failover-leader-renew-deadline %s must be below --failover-leader-lease-duration %s", c.RenewDeadline, c.LeaseDuration)
	}
	if c.RetryPeriod > 0 && c.RenewDeadline > 0 && c.RetryPeriod >= c.RenewDeadline {
		bad("--failover-leader-retry-period %s must be below --failover-leader-renew-deadline %s", c.RetryPeriod, c.RenewDeadline)
	}
	if c.MaxNodes < 1 {
		bad("--failover-max-nodes %d: must be at least 1 (do not run the controller to turn fail-over off)", c.MaxNodes)
	}
	if c.StandDownShare <= 0 || c.StandDownShare > 1 {
		bad("--failover-stand-down-share %v: give a share above 0 and at most 1 (1 stands down only when every node looks dead)", c.StandDownShare)
	}
	if _, err := labels.Parse(c.NodeSelector); err != nil {
		bad("--failover-node-selector %q: %v", c.NodeSelector, err)
	}
	c.Policy.validate(bad)
	return errors.Join(errs...)
}
