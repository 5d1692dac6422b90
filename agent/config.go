package agent

import (
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/remount"
)

// OptOutAnnotation on a pod or a PersistentVolumeClaim, set to "false",
// keeps the agent from repairing the volumes it names (they are still
// probed, counted and reported).
const OptOutAnnotation = "mountmedic.io/repair"

// DefaultTiers are the tiers enabled by default: every one except the two
// deletions, which are opt-in.
var DefaultTiers = remount.NewTierSet(remount.TierReattach, remount.TierRestage, remount.TierLiveSwap, remount.TierRestart, remount.TierEvict, remount.TierUnmount)

// Config is the agent's configuration; cmd/mountmedic binds its flags into
// it. Start from DefaultConfig.
type Config struct {
	// NodeName is this node (--node-name, default $NODE_NAME).
	NodeName string
	// NodeKubeconfig is the kubeconfig of the node's own identity (the
	// kubelet's, system:node:<NodeName>): every API call of the agent but
	// the heartbeat Lease goes with it (see NewNodeClient).
	NodeKubeconfig string
	// Kubeconfig holds the agent's ServiceAccount credentials, used only
	// for the failover heartbeat Lease; empty means the pod's in-cluster
	// token.
	Kubeconfig string
	// ServiceAccountName is the name of the ServiceAccount the admission
	// policies the agent is installed with hold to its node
	// (--service-account-name; CheckServiceAccountName).
	ServiceAccountName string
	// KubeletRoot is kubelet's --root-dir.
	KubeletRoot string
	// HostTable is the mount table to watch: /proc/self/mountinfo when the
	// agent shares the host's mount namespace through a Bidirectional mount
	// of the kubelet root, /proc/1/mountinfo with hostPID.
	HostTable string
	// MaxTableSize caps the bytes of the mount table read (--max-table-size,
	// probe.Options.MaxSize); probe.DefaultMaxTableSize when 0.
	MaxTableSize int64

	ProbeInterval time.Duration
	ProbeTimeout  time.Duration
	// ProbeParallel bounds the probes run at once in a cycle.
	ProbeParallel int
	// WriteCheck probes read-write block filesystems for writes too
	// (probe.Config.WriteCheck): for kernels whose mount table hides an
	// ext4 shutdown. Off by default.
	WriteCheck bool
	// StallPoll is how often the agent reads each FUSE connection's count
	// of waiting requests between probe cycles, to probe a backend with
	// requests waiting at once (probe.Prober.WatchStalls); 0 turns it off.
	StallPoll time.Duration
	// Strikes is how many probe cycles in a row a volume must be broken
	// before it is repaired (a driver that just registered skips them).
	Strikes int
	// Resync re-reads the mount table and retries volumes whose driver is
	// down even when nothing woke the agent.
	Resync time.Duration
	// ReleaseCode is how often the agent gives the kernel back the pages
	// of its own executable it no longer uses (coldpages.Release): first
	// releaseCodeFirst after start, releaseAfterRepairs after the last
	// repair run of a burst, and at this interval, never while a repair
	// runs; 0 never.
	ReleaseCode time.Duration
	// BackoffBase and BackoffMax bound the per-volume exponential backoff
	// between repair attempts.
	BackoffBase time.Duration
	BackoffMax  time.Duration

	Tiers remount.TierSet
	// MaxConcurrentRepairs bounds the repairs running at once.
	MaxConcurrentRepairs int
	// MaxEvictions bounds evictions and deletions per EvictionWindow on this
	// node.
	MaxEvictions   int
	EvictionWindow time.Duration
	// EvictOwnerKinds are the controller kinds whose pods may be evicted.
	EvictOwnerKinds []string
	// ForceDeleteAfter is how long past its deletion deadline (deletion
	// timestamp) a pod must be stuck before a force delete (opt-in tier).
	ForceDeleteAfter time.Duration

	// Drivers, when not empty, limits repairs to these CSI drivers (other
	// volumes are still probed and reported).
	Drivers []string
	// RepairUnknownDrivers repairs volumes of CSI drivers that are not in
	// the driver catalogue (probe/kubelet) and stage below kubelet's
	// staging path, as if their layout were kubelet's plain one. Off, they
	// are probed and reported only.
	RepairUnknownDrivers bool
	// EscalateOutOfReach follows the driver catalogue's Recovery for a
	// catalogued driver whose dead daemon the node plugin cannot restart
	// (a mount pod, a sidecar in the application pod, an engine pod): once
	// its grace has passed, the escalation it names (eviction of the pods
	// a controller owns). Off, those volumes are reported only.
	EscalateOutOfReach bool
	// IncludeNamespaces, when not empty, limits repairs to pods in these
	// namespaces; ExcludeNamespaces are never repaired.
	IncludeNamespaces []string
	ExcludeNamespaces []string

	// DryRun: decide and report (events say "[dry-run]"), change nothing.
	DryRun bool
	// Guard mounts a read-only empty tmpfs over a pod's publish target
	// that lost its mount (remount.Repairer.Guard) while the volume waits
	// for its repair, so that writes fail instead of landing on the node's
	// disk.
	Guard bool
	// NodeCondition keeps the PodVolumeMountsBroken condition on the
	// agent's own Node (condition.go).
	NodeCondition bool
	// MetricsAddr serves /metrics, /healthz and /readyz; empty disables it.
	MetricsAddr string
	// CRISocket is the container runtime's socket, for the repairer's
	// restart and live-swap tiers.
	CRISocket string
	// APITimeout bounds each API call the agent makes.
	APITimeout time.Duration
	// APIQPS and APIBurst are the client-side rate limit of the agent's
	// node identity (kubelet's own defaults; see DefaultAPIQPS).
	APIQPS   float32
	APIBurst int
	// CacheSize and CacheTTL size the PV/PVC/CSIDriver/VolumeAttachment
	// cache.
	CacheSize int
	CacheTTL  time.Duration
	// Version is reported by mountmedic_build_info.
	Version string
}

// DefaultConfig returns the defaults the flags start from.
func DefaultConfig() Config {
	return Config{
		NodeKubeconfig:       DefaultNodeKubeconfig,
		ServiceAccountName:   DefaultServiceAccountName,
		KubeletRoot:          probe.DefaultKubeletRoot,
		HostTable:            "/proc/self/mountinfo",
		MaxTableSize:         probe.DefaultMaxTableSize,
		ProbeInterval:        2 * time.Second,
		ProbeTimeout:         2 * time.Second,
		ProbeParallel:        4,
		StallPoll:            probe.DefaultStallPoll,
		Strikes:              2,
		Resync:               30 * time.Second,
		ReleaseCode:          5 * time.Minute,
		BackoffBase:          time.Second,
		BackoffMax:           5 * time.Minute,
		Tiers:                DefaultTiers,
		MaxConcurrentRepairs: 4,
		MaxEvictions:         2,
		Guard:                true,
		EvictionWindow:       10 * time.Minute,
		EvictOwnerKinds:      []string{"ReplicaSet", "StatefulSet", "Job"},
		ForceDeleteAfter:     time.Minute,
		MetricsAddr:          ":9809",
		CRISocket:            "unix:///run/containerd/containerd.sock",
		APITimeout:           10 * time.Second,
		APIQPS:               DefaultAPIQPS,
		APIBurst:             DefaultAPIBurst,
		CacheSize:            256,
		CacheTTL:             5 * time.Minute,
		Version:              "dev",
		NodeCondition:        true,
	}
}

// Validate checks the configuration; each error names the flag and the fix.
func (c Config) Validate() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	switch {
	case c.NodeName == "":
		bad("--node-name is empty: pass this node's name, or set NODE_NAME from the downward API (fieldRef spec.nodeName)")
	default:
		if msgs := validation.IsDNS1123Subdomain(c.NodeName); len(msgs) > 0 {
			bad("--node-name %q is not a node name: %s", c.NodeName, strings.Join(msgs, "; "))
		}
	}
	if err := probe.CheckKubeletRoot(c.KubeletRoot, true); err != nil {
		bad("--kubelet-root: %w", err)
	}
	if !filepath.IsAbs(c.HostTable) {
		bad("--host-table %q: give an absolute path such as /proc/self/mountinfo or /proc/1/mountinfo", c.HostTable)
	}
	if c.MaxTableSize < 0 {
		bad("--max-table-size %d: give a positive size such as 32Mi", c.MaxTableSize)
	}
	positive := func(flag string, d time.Duration) {
		if d <= 0 {
			bad("--%s %s: must be positive", flag, d)
		}
	}
	positive("probe-interval", c.ProbeInterval)
	positive("probe-timeout", c.ProbeTimeout)
	positive("resync", c.Resync)
	positive("backoff-base", c.BackoffBase)
	positive("backoff-max", c.BackoffMax)
	positive("eviction-window", c.EvictionWindow)
	positive("api-timeout", c.APITimeout)
	positive("cache-ttl", c.CacheTTL)
	if c.APIQPS <= 0 {
		bad("--kube-api-qps %g: must be positive (kubelet's default is %d)", c.APIQPS, DefaultAPIQPS)
	}
	if c.APIBurst < 1 {
		bad("--kube-api-burst %d: must be at least 1 (kubelet's default is %d)", c.APIBurst, DefaultAPIBurst)
	}
	if c.ForceDeleteAfter < 0 {
		bad("--force-delete-after %s: must not be negative", c.ForceDeleteAfter)
	}
	if c.BackoffMax < c.BackoffBase {
		bad("--backoff-max %s is below --backoff-base %s: raise --backoff-max", c.BackoffMax, c.BackoffBase)
	}
	if c.Strikes < 1 {
		bad("--strikes %d: must be at least 1", c.Strikes)
	}
	if c.ReleaseCode < 0 {
		bad("--release-code-interval %s: must not be negative (0 never releases)", c.ReleaseCode)
	}
	if c.StallPoll < 0 {
		bad("--stall-poll %s: must not be negative (0 turns the stall watch off)", c.StallPoll)
	}
	if c.ProbeParallel < 1 {
		bad("--probe-parallel %d: must be at least 1", c.ProbeParallel)
	}
	if c.MaxConcurrentRepairs < 1 {
		bad("--max-concurrent-repairs %d: must be at least 1", c.MaxConcurrentRepairs)
	}
	if c.MaxEvictions < 0 {
		bad("--max-evictions %d: must not be negative (0 disables evictions and deletions)", c.MaxEvictions)
	}
	if c.CacheSize < 1 {
		bad("--cache-size %d: must be at least 1", c.CacheSize)
	}
	for _, k := range c.EvictOwnerKinds {
		if k == "" || strings.ContainsAny(k, " /,") {
			bad("--evict-owner-kinds has %q: give kinds such as ReplicaSet,StatefulSet,Job", k)
		}
		if k == "DaemonSet" {
			bad("--evict-owner-kinds has DaemonSet: its controller puts the pod back on the same node with the same volume; remove it")
		}
	}
	for _, d := range c.Drivers {
		if d == "" || strings.ContainsAny(d, "/ ") {
			bad("--drivers has %q: give CSI driver names such as ru.yandex.s3.csi", d)
		}
	}
	for _, ns := range slices.Concat(c.IncludeNamespaces, c.ExcludeNamespaces) {
		if msgs := validation.IsDNS1123Label(ns); len(msgs) > 0 {
			bad("namespace %q in --include-namespaces/--exclude-namespaces: %s", ns, strings.Join(msgs, "; "))
		}
	}
	for _, ns := range c.IncludeNamespaces {
		if slices.Contains(c.ExcludeNamespaces, ns) {
			bad("namespace %q is in both --include-namespaces and --exclude-namespaces: keep it in one", ns)
		}
	}
	if c.Tiers.Has(remount.TierForceDelete) && c.MaxEvictions == 0 {
		bad("--tiers force-delete with --max-evictions 0 can never act: raise --max-evictions or drop force-delete")
	}
	return errors.Join(errs...)
}

// namespaceAllowed applies the namespace lists.
func (c *Config) namespaceAllowed(ns string) bool {
	if slices.Contains(c.ExcludeNamespaces, ns) {
		return false
	}
	return len(c.IncludeNamespaces) == 0 || slices.Contains(c.IncludeNamespaces, ns)
}

// driverAllowed applies the driver list.
func (c *Config) driverAllowed(driver string) bool {
	return len(c.Drivers) == 0 || slices.Contains(c.Drivers, driver)
}
