package kubelet

import (
	"strconv"
	"strings"
	"time"
)

// Layout says where a CSI driver mounts a volume on the node.
type Layout int

const (
	// LayoutGlobalMount: NodeStageVolume mounts on kubelet's staging path
	// (…/globalmount) and NodePublishVolume binds it onto the publish target.
	LayoutGlobalMount Layout = iota
	// LayoutVolumeIDDir: NodeStageVolume mounts one directory below
	// kubelet's staging path, at <stagingTargetPath>/<volumeID>, and
	// NodePublishVolume binds from there (ceph-csi RBD).
	LayoutVolumeIDDir
	// LayoutPublishOnly: no staging mount; NodePublishVolume mounts the
	// publish target itself (a network mount, a FUSE mount served from
	// the pod) or binds it from a mount outside the kubelet root.
	LayoutPublishOnly
)

var layoutNames = [...]string{"globalmount", "globalmount/<volumeID>", "publish-only"}

func (l Layout) String() string {
	if int(l) < len(layoutNames) {
		return layoutNames[l]
	}
	return "layout(" + strconv.Itoa(int(l)) + ")"
}

// MarshalText makes a Layout read as its name in JSON.
func (l Layout) MarshalText() ([]byte, error) { return []byte(l.String()), nil }

// DaemonHome says where the process that serves a volume's filesystem
// lives, and so whether restarting the CSI node plugin kills it and whether
// a NodeStageVolume through the plugin can start it again.
type DaemonHome int

const (
	// DaemonUnknown: the driver or its mounter is not catalogued.
	DaemonUnknown DaemonHome = iota
	// DaemonKernel: a kernel client (nfs, cifs, ceph, krbd, a cloud disk);
	// no userspace daemon to die.
	DaemonKernel
	// DaemonNodePlugin: a FUSE or NBD daemon started by the node plugin in
	// its own container: a plugin restart kills it, a re-stage starts it.
	DaemonNodePlugin
	// DaemonHostService: a daemon run by the host's init (systemd) or a
	// proxy on the host at the plugin's request: it survives a plugin
	// restart, and a re-stage asks for it again.
	DaemonHostService
	// DaemonMountPod: a FUSE daemon in a pod of its own that the driver
	// manages (JuiceFS mount pods): the node plugin does not own it, and
	// re-staging through the plugin does not restart it.
	DaemonMountPod
	// DaemonAppSidecar: a FUSE daemon in a sidecar container of the
	// application pod itself (GCS FUSE): only the pod can restart it.
	DaemonAppSidecar
	// DaemonEnginePod: a block device served by the storage system's own
	// engine pod (Longhorn's instance manager).
	DaemonEnginePod
)

var daemonNames = [...]string{"unknown", "kernel", "node-plugin", "host-service", "mount-pod", "app-sidecar", "engine-pod"}

func (d DaemonHome) String() string {
	if int(d) < len(daemonNames) {
		return daemonNames[d]
	}
	return "daemon(" + strconv.Itoa(int(d)) + ")"
}

// MarshalText makes a DaemonHome read as its name in JSON.
func (d DaemonHome) MarshalText() ([]byte, error) { return []byte(d.String()), nil }

// Mounter is one way a driver serves its volumes, told apart by the
// filesystem type the mount table shows.
type Mounter struct {
	// Name is the mounter's name (krbd, rbd-nbd, ceph-fuse, s3fs...).
	Name string
	// FSTypes are the mount table's filesystem types of this mounter and
	// Sources its mount sources; an entry ending in "*" matches by prefix.
	// An empty list matches anything.
	FSTypes []string
	Sources []string
	Daemon  DaemonHome
}

func matchAny(pats []string, s string) bool {
	if len(pats) == 0 {
		return true
	}
	for _, p := range pats {
		if pre, ok := strings.CutSuffix(p, "*"); ok && strings.HasPrefix(s, pre) || p == s {
			return true
		}
	}
	return false
}

// Driver is a catalogued CSI driver: how it lays out its mounts and where
// the daemons that serve them live, read from the driver's own source
// (docs/drivers.md cites the files).
type Driver struct {
	// Name is the driver's usual CSI name; Match decides.
	Name string
	// Project is the driver's project (ceph-csi RBD, JuiceFS CSI...).
	Project string
	Layout  Layout
	// Mounters are the driver's ways of serving a volume, first match
	// wins.
	Mounters []Mounter
	// Restage: mountmedic's re-stage (unmount kubelet's staging path and
	// publish targets, NodeStageVolume and NodePublishVolume through the
	// node plugin) can bring a dead volume of this driver back. False
	// when the daemon is out of the plugin's reach or the driver stages
	// where mountmedic does not unmount.
	Restage bool
	// Why says what a re-stage cannot heal, for a report; empty when
	// Restage.
	Why string
	// Reattach: NodeStageVolume with volumeContext ReattachContextKey
	// "true" gives the NBD device a volume is staged on a fresh daemon and
	// leaves its mounts as they are (ceph-csi internal/rbd/nodeserver.go,
	// NodeStageVolume -> healerStageTransaction, which runs `rbd-nbd
	// attach --device` for the device its stash recorded). Such a volume on
	// an NBD device is repaired by re-attaching, Restage or not.
	Reattach bool
	// Recovery, for a driver whose daemon lives out of the node plugin's
	// reach, says who brings a dead one back and what the agent does when
	// nobody has; nil otherwise.
	Recovery *Recovery
	// match reports whether a CSI driver name is this driver's.
	match func(name string) bool
}

// Match reports whether name is this driver's CSI name.
func (d *Driver) Match(name string) bool { return d.match(name) }

// Mounter says which of the driver's mounters serves a filesystem of
// fsType mounted from source, and so where its daemon lives.
func (d *Driver) Mounter(fsType, source string) (Mounter, bool) {
	for _, m := range d.Mounters {
		if matchAny(m.FSTypes, fsType) && matchAny(m.Sources, source) {
			return m, true
		}
	}
	return Mounter{}, false
}

// Escalation is what the agent does about a volume whose daemon, out of the
// node plugin's reach, is still dead after its Recovery's grace.
type Escalation int

const (
	// EscalateNone: report only.
	EscalateNone Escalation = iota
	// EscalateEvict: evict the volume's pods that a controller owns
	// (PodDisruptionBudgets respected; never a pod no controller owns),
	// so that their replacements are published afresh.
	EscalateEvict
)

var escalationNames = [...]string{"report", "evict"}

func (e Escalation) String() string {
	if int(e) < len(escalationNames) {
		return escalationNames[e]
	}
	return "escalation(" + strconv.Itoa(int(e)) + ")"
}

// MarshalText makes an Escalation read as its name in JSON.
func (e Escalation) MarshalText() ([]byte, error) { return []byte(e.String()), nil }

// Recovery is how a dead daemon out of the node plugin's reach comes back,
// read from the driver's source (docs/drivers.md cites the files). A
// re-stage through the node plugin is never among its steps.
type Recovery struct {
	// By says who restarts the daemon and restores the pods' mounts, or
	// that nothing does.
	By string
	// Grace is how long the agent leaves a dead volume to By before it
	// escalates (0: nothing recovers it by itself).
	Grace time.Duration
	// Then is the agent's escalation once Grace has passed; opt-in
	// (agent.Config.EscalateOutOfReach).
	Then Escalation
}

func named(names ...string) func(string) bool {
	return func(n string) bool {
		for _, want := range names {
			if n == want {
				return true
			}
		}
		return false
	}
}

// ReattachContextKey is the volumeContext key that makes ceph-csi's
// NodeStageVolume re-attach instead of stage (internal/rbd/nodeserver.go,
// volHealerCtx; its own healer sets it, internal/rbd/rbd_healer.go).
const ReattachContextKey = "volumeHealerContext"

// suffixed matches a name or any "<prefix>.<name>": ceph-csi's driver name
// is set per deployment, Rook's being "<namespace>.rbd.csi.ceph.com".
func suffixed(name string) func(string) bool {
	return func(n string) bool { return n == name || strings.HasSuffix(n, "."+name) }
}

// blockFS are the filesystem types a block driver formats volumes with.
var blockFS = []string{"ext4", "ext3", "ext2", "xfs", "btrfs"}

// catalogue is every driver mountmedic knows the layout of.
var catalogue = []Driver{
	{
		Name: "rbd.csi.ceph.com", Project: "ceph-csi RBD", Layout: LayoutVolumeIDDir,
		Mounters: []Mounter{
			{Name: "rbd-nbd", Sources: []string{"/dev/nbd*"}, Daemon: DaemonNodePlugin},
			{Name: "krbd", Sources: []string{"/dev/rbd*"}, Daemon: DaemonKernel},
		},
		Why:      "ceph-csi stages in <staging path>/<volume ID>, which a re-stage of kubelet's staging path does not unmount, and NodeStageVolume answers OK while that mount stands; rbd-nbd volumes are repaired by re-attaching their device through the plugin",
		Reattach: true,
		match:    suffixed("rbd.csi.ceph.com"),
	},
	{
		Name: "cephfs.csi.ceph.com", Project: "ceph-csi CephFS", Layout: LayoutGlobalMount,
		Mounters: []Mounter{
			{Name: "ceph-fuse", FSTypes: []string{"fuse.ceph-fuse"}, Daemon: DaemonNodePlugin},
			{Name: "kernel", FSTypes: []string{"ceph"}, Daemon: DaemonKernel},
		},
		Restage: true, match: suffixed("cephfs.csi.ceph.com"),
	},
	{
		Name: "csi.juicefs.com", Project: "JuiceFS CSI", Layout: LayoutPublishOnly,
		Mounters: []Mounter{{Name: "juicefs", FSTypes: []string{"fuse.juicefs"}, Daemon: DaemonMountPod}},
		Why:      "JuiceFS runs its FUSE daemon in a mount pod the driver manages and binds the publish target from it; re-staging through the node plugin does not restart a mount pod",
		// pkg/juicefs/mount/builder/common.go (restartPolicy Always),
		// pkg/controller/pod_driver.go (podReadyHandler -> recover ->
		// recoverTarget), cmd/main.go (--enable-manager), pkg/config/config.go
		// (ReconcilerInterval 5 s).
		Recovery: &Recovery{
			By:    "kubelet restarts the mount pod's container (restartPolicy Always) and JuiceFS's pod manager (node plugin --enable-manager) binds the publish targets again; a container sees that only with HostToContainer propagation",
			Grace: 2 * time.Minute, Then: EscalateEvict,
		},
		match: named("csi.juicefs.com"),
	},
	{
		Name: "gcsfuse.csi.storage.gke.io", Project: "Cloud Storage FUSE CSI", Layout: LayoutPublishOnly,
		Mounters: []Mounter{{Name: "gcsfuse", FSTypes: []string{"fuse.gcsfuse"}, Daemon: DaemonAppSidecar}},
		Why:      "gcsfuse runs in a sidecar container of the application pod, which receives the FUSE file descriptor the node plugin opened; only restarting the pod restarts it",
		// pkg/csi_mounter/csi_mounter.go: the node plugin closes its copy
		// of the descriptor after handing it over, so a sidecar restarted
		// alone cannot mount again; pkg/csi_driver/node.go opens a new one
		// only in the NodePublishVolume of a new pod.
		Recovery: &Recovery{
			By:   "nothing: a restarted sidecar has no FUSE descriptor to serve the mount with, and the node plugin opens a new one only for a new pod",
			Then: EscalateEvict,
		},
		match: named("gcsfuse.csi.storage.gke.io"),
	},
	{
		Name: "blob.csi.azure.com", Project: "Azure Blob CSI", Layout: LayoutGlobalMount,
		Mounters: []Mounter{
			{Name: "blobfuse2", FSTypes: []string{"fuse", "fuse.*"}, Daemon: DaemonHostService},
			{Name: "nfs", FSTypes: []string{"nfs", "nfs4"}, Daemon: DaemonKernel},
		},
		Restage: true, match: named("blob.csi.azure.com"),
	},
	{
		Name: "seaweedfs-csi-driver", Project: "SeaweedFS CSI", Layout: LayoutGlobalMount,
		Mounters: []Mounter{{Name: "weed mount", Daemon: DaemonNodePlugin}},
		Restage:  true, match: named("seaweedfs-csi-driver"),
	},
	{
		Name: "ru.yandex.s3.csi", Project: "k8s-csi-s3", Layout: LayoutGlobalMount,
		Mounters: []Mounter{
			{Name: "geesefs", FSTypes: []string{"fuse.geesefs"}, Daemon: DaemonHostService},
			{Name: "s3fs", FSTypes: []string{"fuse.s3fs"}, Daemon: DaemonNodePlugin},
			{Name: "rclone", FSTypes: []string{"fuse.rclone"}, Daemon: DaemonNodePlugin},
		},
		Restage: true, match: named("ru.yandex.s3.csi"),
	},
	{
		Name: "nfs.csi.k8s.io", Project: "csi-driver-nfs", Layout: LayoutPublishOnly,
		Mounters: []Mounter{{Name: "nfs", FSTypes: []string{"nfs", "nfs4"}, Daemon: DaemonKernel}},
		Restage:  true, match: named("nfs.csi.k8s.io"),
	},
	{
		Name: "smb.csi.k8s.io", Project: "csi-driver-smb", Layout: LayoutGlobalMount,
		Mounters: []Mounter{{Name: "cifs", Daemon: DaemonKernel}},
		Restage:  true, match: named("smb.csi.k8s.io"),
	},
	{
		Name: "driver.longhorn.io", Project: "Longhorn", Layout: LayoutGlobalMount,
		Mounters: []Mounter{{Name: "longhorn engine", Daemon: DaemonEnginePod}},
		Why:      "a Longhorn volume's device is served by its engine in an instance-manager pod; re-staging through the node plugin does not bring a dead engine back",
		// longhorn-manager controller/kubernetes_pod_controller.go
		// (handlePodDeletionIfVolumeRequestRemount), types/setting.go
		// (auto-delete-pod-when-volume-detached-unexpectedly, default true).
		Recovery: &Recovery{
			By:    "longhorn-manager salvages the volume and deletes its pods that a controller owns (setting auto-delete-pod-when-volume-detached-unexpectedly, on by default)",
			Grace: 2 * time.Minute, Then: EscalateEvict,
		},
		match: named("driver.longhorn.io"),
	},
	{
		Name: "ebs.csi.aws.com", Project: "AWS EBS CSI", Layout: LayoutGlobalMount,
		Mounters: []Mounter{{Name: "block", FSTypes: blockFS, Daemon: DaemonKernel}},
		Restage:  true, match: named("ebs.csi.aws.com"),
	},
	{
		Name: "pd.csi.storage.gke.io", Project: "GCE PD CSI", Layout: LayoutGlobalMount,
		Mounters: []Mounter{{Name: "block", FSTypes: blockFS, Daemon: DaemonKernel}},
		Restage:  true, match: named("pd.csi.storage.gke.io"),
	},
}

// LookupDriver returns the catalogue entry of a CSI driver name.
func LookupDriver(name string) (*Driver, bool) {
	if name == "" {
		return nil, false
	}
	for i := range catalogue {
		if catalogue[i].match(name) {
			return &catalogue[i], true
		}
	}
	return nil, false
}

// Catalogue returns the catalogued drivers, in a fixed order.
func Catalogue() []Driver {
	return append([]Driver(nil), catalogue...)
}

// GuessPublishOnly names the catalogued driver that publishes without a
// staging mount and mounts fsType, when exactly one does: a captured table
// does not name the driver of such a publish target (vol_data.json beside
// it does), but its filesystem type often tells. For display only.
func GuessPublishOnly(fsType string) (*Driver, bool) {
	var pick *Driver
	for i := range catalogue {
		d := &catalogue[i]
		if d.Layout != LayoutPublishOnly {
			continue
		}
		for _, m := range d.Mounters {
			if len(m.FSTypes) > 0 && matchAny(m.FSTypes, fsType) {
				if pick != nil && pick != d {
					return nil, false
				}
				pick = d
			}
		}
	}
	return pick, pick != nil
}
