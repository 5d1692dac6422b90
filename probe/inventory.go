package probe

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// DefaultKubeletRoot is kubelet's default --root-dir.
const DefaultKubeletRoot = "/var/lib/kubelet"

// Dev is a device number as mountinfo's major:minor field shows it.
type Dev struct {
	Major uint32 `json:"major"`
	Minor uint32 `json:"minor"`
}

func (d Dev) String() string { return fmt.Sprintf("%d:%d", d.Major, d.Minor) }

// Mount is one kubelet mount of the table, linked into the volume graph.
type Mount struct {
	ID       int    `json:"id"`
	ParentID int    `json:"parentID"`
	Dev      Dev    `json:"dev"`
	Root     string `json:"root"`
	Path     string `json:"path"`
	Options  string `json:"options"`
	// Optional holds mountinfo's optional fields (shared:N, master:N...).
	Optional     string         `json:"optional,omitempty"`
	FSType       string         `json:"fsType"`
	Source       string         `json:"source"`
	SuperOptions string         `json:"superOptions"`
	Target       kubelet.Target `json:"target"`
	// Driver and VolumeHandle come from vol_data.json beside a publish target
	// (live tables only) or from the staging path the mount derives from.
	Driver       string `json:"driver,omitempty"`
	VolumeHandle string `json:"volumeHandle,omitempty"`
	// From is the kubelet mount this one was bound from: a subPath bind's
	// publish target (or staging mount), a publish target's staging mount.
	// Linked by device number and mountinfo root, never by path.
	From *Mount `json:"-"`
	// Covered is set when another mount sits on the same mount point above
	// this one: the path reaches the upper mount, not this one.
	Covered bool `json:"covered,omitempty"`
	// Backend is the filesystem instance the mount shows.
	Backend *Backend `json:"-"`
	// Guard is set on mountmedic's guard: the read-only empty tmpfs the
	// agent mounts over a publish target or staging path that lost its
	// mount, so that writes there fail instead of landing on the node's
	// disk. Its volume is still Missing.
	Guard bool `json:"guard,omitempty"`
	// UniqueID is the mount's ID that the kernel never reuses (Linux 6.8
	// and later, from statx or statmount); 0 when not known. A mount table
	// read does not give it.
	UniqueID uint64 `json:"uniqueID,omitempty"`
}

// GuardSource is the mount source of mountmedic's guard (a tmpfs), by
// which the probe knows it.
const GuardSource = "mountmedic-guard"

// IsGuard reports whether a mount is mountmedic's guard over a publish
// target or a staging path.
func IsGuard(fsType, source string, t kubelet.Target) bool {
	return fsType == "tmpfs" && source == GuardSource && (t.Kind == kubelet.KindPublish || t.Kind == kubelet.KindStaging)
}

// Deleted reports whether the mount's root was removed from its filesystem
// (mountinfo shows "//deleted"): a subPath bind whose directory is gone.
func (m *Mount) Deleted() bool { return strings.HasSuffix(m.Root, "//deleted") }

// atomicWriterPlugins are the pod volume plugins kubelet fills with its
// atomic writer: an update writes a new ..<timestamp> directory and
// removes the old one, which a subPath bind keeps showing.
var atomicWriterPlugins = []string{"kubernetes.io~configmap", "kubernetes.io~secret", "kubernetes.io~projected", "kubernetes.io~downward-api"}

// ReplacedByUpdate reports a subPath bind of a ConfigMap, Secret,
// projected or downward API volume whose file kubelet replaced when the
// object was updated (kubernetes#68211): the bind still shows the old,
// removed file. Nothing is broken; the container sees the old content
// until it restarts.
//
// The volume is known by the pod volume the bind derives from (a tmpfs
// Secret or projected volume), or, for a ConfigMap (a directory on the
// node's disk), by the first /pods/<uid>/volumes/ of its root: what
// follows kubelet's path is the pod's own subPath, which a hostile pod
// could name ".../volumes/kubernetes.io~configmap/..." to pass a
// deleted directory of its emptyDir for an update.
func (m *Mount) ReplacedByUpdate() bool {
	if m.Target.Kind != kubelet.KindSubPath || !m.Deleted() {
		return false
	}
	if m.From != nil {
		return slices.Contains(atomicWriterPlugins, m.From.Target.Plugin)
	}
	prefix := "/pods/" + m.Target.PodUID + "/volumes/"
	i := strings.Index(m.Root, prefix)
	if i < 0 {
		return false
	}
	rest := m.Root[i+len(prefix):]
	for _, p := range atomicWriterPlugins {
		// <plugin>/<volume>/..<timestamp>/<file>: the atomic writer's
		// data directory.
		if strings.HasPrefix(rest, p+"/"+m.Target.Volume+"/..") {
			return true
		}
	}
	return false
}

// Catalogued returns the driver catalogue's entry of the mount's CSI
// driver and the mounter serving the mount's filesystem, when both are
// known.
func (m *Mount) Catalogued() (*kubelet.Driver, kubelet.Mounter, bool) {
	d, ok := kubelet.LookupDriver(m.Driver)
	if !ok {
		return nil, kubelet.Mounter{}, false
	}
	fsType, source := m.FSType, m.Source
	if m.Backend != nil {
		fsType, source = m.Backend.FSType, m.Backend.Source
	}
	mt, ok := d.Mounter(fsType, source)
	return d, mt, ok
}

// Daemon says where the daemon serving the mount lives, from the driver
// catalogue and the mount's filesystem; DaemonUnknown for a driver or
// mounter not catalogued. A publish target of a captured table that no
// staging mount names the driver of is matched by its filesystem type
// against the drivers that publish without staging.
func (m *Mount) Daemon() kubelet.DaemonHome {
	if _, mt, ok := m.Catalogued(); ok {
		return mt.Daemon
	}
	top := m
	for top.From != nil {
		top = top.From
	}
	if m.Driver != "" || m.Backend == nil || top.Target.Kind != kubelet.KindPublish {
		return kubelet.DaemonUnknown // staged, another plugin's, or not linked
	}
	if d, ok := kubelet.GuessPublishOnly(m.Backend.FSType); ok {
		if mt, ok := d.Mounter(m.Backend.FSType, m.Backend.Source); ok {
			return mt.Daemon
		}
	}
	return kubelet.DaemonUnknown
}

// BackendKind says what serves a filesystem.
type BackendKind int

const (
	// BackendOther is a virtual or local filesystem (tmpfs, overlay...).
	BackendOther BackendKind = iota
	// BackendFUSE is a FUSE connection served by a userspace daemon.
	BackendFUSE
	// BackendBlock is a filesystem on a block device (loop, nbd, rbd, sd...).
	BackendBlock
	// BackendNetwork is a kernel network filesystem (nfs, cifs, ceph...).
	BackendNetwork
)

var backendKindNames = [...]string{"other", "fuse", "block", "network"}

func (k BackendKind) String() string {
	if int(k) < len(backendKindNames) {
		return backendKindNames[k]
	}
	return "backend(" + strconv.Itoa(int(k)) + ")"
}

// MarshalText makes a BackendKind read as its name in JSON.
func (k BackendKind) MarshalText() ([]byte, error) { return []byte(k.String()), nil }

// Backend is one filesystem instance (one superblock, one device number)
// that kubelet mounts show. It is probed once per cycle for all of them.
type Backend struct {
	Dev          Dev         `json:"dev"`
	Kind         BackendKind `json:"kind"`
	FSType       string      `json:"fsType"`
	Source       string      `json:"source"`
	SuperOptions string      `json:"superOptions"`
	// Conn is the FUSE connection number: the minor of the device (FUSE
	// backends are major 0; FusectlConn in general), and the directory
	// name under /sys/fs/fuse/connections.
	Conn uint32 `json:"conn,omitempty"`
	// Device is the block device name (loop0, nbd3), from sysfs on live
	// tables.
	Device string `json:"device,omitempty"`
	// Backing is a loop device's backing file, from sysfs.
	Backing string `json:"backing,omitempty"`
	// Lower is the backend that holds Backing, when the mount table has it:
	// a loop device over a file on FUSE is an NBD-like chain.
	Lower *Backend `json:"-"`
	// DaemonPID is an NBD device's userspace daemon, from sysfs (0: none
	// known).
	DaemonPID int `json:"daemonPID,omitempty"`
	// Mounts are the kubelet mounts on this backend, staging mounts first.
	Mounts []*Mount `json:"-"`
}

// ProbePath is the path the prober checks for the backend: an uncovered
// staging mount when there is one, else the first uncovered mount. It is
// empty when every mount of the backend is covered.
func (b *Backend) ProbePath() string {
	if m := b.probeMount(); m != nil {
		return m.Path
	}
	return ""
}

func (b *Backend) probeMount() *Mount {
	for _, m := range b.Mounts {
		if !m.Covered && !m.Deleted() {
			return m
		}
	}
	return nil
}

// probeMountID is the mount ID of the mount at ProbePath, 0 when none.
func (b *Backend) probeMountID() int {
	if m := b.probeMount(); m != nil {
		return m.ID
	}
	return 0
}

// Inventory is a classified mount table.
type Inventory struct {
	// Root is the kubelet root the table was classified under.
	Root string `json:"root"`
	// Source names the table: a file path or /proc/<pid>/mountinfo.
	Source string `json:"source"`
	// Total is the number of mounts in the whole table.
	Total int `json:"total"`
	// OtherRoots are directories outside Root under which the table has
	// kubelet pod volume mounts (<dir>/pods/<uid>/volumes/...): kubelet
	// runs with another --root-dir there (at most a few are named).
	OtherRoots []string `json:"otherRoots,omitempty"`
	// Mounts are the kubelet mounts, sorted by path.
	Mounts []*Mount `json:"mounts"`
	// Backends are the filesystems under Mounts, in the order of their first
	// mount; chained lower backends (outside the kubelet root) are included
	// after them.
	Backends []*Backend `json:"-"`
	// Unmounted are CSI publish targets that kubelet set up (vol_data.json
	// is there) but that are not mount points: a pod writing there writes to
	// the node's disk; and staging mounts gone from under live publish
	// targets of their volume, from which the next pod would be published.
	// Only live inventories look for them.
	Unmounted []*Mount `json:"unmounted,omitempty"`
	// Strays are mount points in a staging directory that are not the
	// staging mount the driver's layout puts there (a pod with
	// Bidirectional propagation can mount anything there): reported,
	// never linked, probed or repaired.
	Strays []Stray `json:"strays,omitempty"`
	// StagingUnknown are the CSI drivers, not in the catalogue, whose
	// volumes have publish targets and no staging mount, and which did not
	// say whether they stage (Options.DriverStages): a lost staging mount
	// of theirs cannot be told from a driver that never stages, and is not
	// reported. Only live inventories look.
	StagingUnknown []string `json:"stagingUnknown,omitempty"`
	// Publishing is when the first publish target that is not mounted yet,
	// but whose vol_data.json kubelet wrote less than Options.PublishGrace
	// ago, leaves kubelet's publish window and counts as Unmounted if it is
	// still not mounted; zero when there is none. A reader of a live table
	// reads it again then: nothing in the mount table changes when a
	// publish never comes.
	Publishing time.Time `json:"-"`
}

// Options say how to read and link a mount table.
type Options struct {
	// Root is the kubelet root directory; DefaultKubeletRoot when empty.
	Root string
	// Live reads what the table does not hold from this host: vol_data.json
	// beside publish targets (through openat2 beneath Root, never following
	// a symlink), sysfs for block devices, and the pods directory for
	// publish targets that lost their mount. Leave it false for a captured
	// table from another machine: nothing but the table is read then.
	Live bool
	// SysfsDir is where sysfs is mounted; "/sys" when empty.
	SysfsDir string
	// MaxSize caps the bytes ReadTable reads of a table;
	// DefaultMaxTableSize when 0 or less.
	MaxSize int64
	// DriverStages says whether a CSI driver stages its volumes
	// (STAGE_UNSTAGE_VOLUME in NodeGetCapabilities), known false when it
	// cannot tell (the driver did not answer): a live read reports a bare
	// globalmount under live publish targets as a lost staging mount only
	// for a driver that stages. Without it, or when it does not know, the
	// driver catalogue decides, and a driver not in it is not reported.
	DriverStages func(driver string) (stages, known bool)
	// PublishGrace is how long after kubelet wrote a publish target's
	// vol_data.json an unmounted target is kubelet still publishing, not
	// a mount that went away: kubelet writes the file before it calls
	// NodePublishVolume. DefaultPublishGrace when 0; none when negative.
	PublishGrace time.Duration
}

// DefaultPublishGrace is kubelet's publish window: a publish target is
// reported Unmounted only once its vol_data.json is this old. NodePublish of
// a FUSE volume takes about a second; a slower one keeps its pod Pending, and
// the agent leaves a Pending pod's unpublished targets alone as well.
const DefaultPublishGrace = 15 * time.Second

func (o Options) publishGrace() time.Duration {
	switch {
	case o.PublishGrace == 0:
		return DefaultPublishGrace
	case o.PublishGrace < 0:
		return 0
	}
	return o.PublishGrace
}

func (o Options) root() string {
	if o.Root == "" {
		return DefaultKubeletRoot
	}
	return filepath.Clean(o.Root)
}

func (o Options) sysfs() string {
	if o.SysfsDir == "" {
		return "/sys"
	}
	return o.SysfsDir
}

// TableError is a mount table that cannot be parsed. It names the table and
// the line.
type TableError struct {
	Source string
	Line   int
	Text   string
	Err    error
}

func (e *TableError) Error() string {
	switch {
	case e.Line == 0:
		return fmt.Sprintf("mount table %s: %v", e.Source, e.Err)
	case e.Text == "":
		return fmt.Sprintf("mount table %s line %d: %v; give a file captured with `cat /proc/self/mountinfo`",
			e.Source, e.Line, e.Err)
	}
	return fmt.Sprintf("mount table %s line %d: %v (line: %q); give a file captured with `cat /proc/self/mountinfo`",
		e.Source, e.Line, e.Err, truncate(e.Text, 120))
}

func (e *TableError) Unwrap() error { return e.Err }

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// Build classifies parsed mountinfo entries and links the volume graph.
func Build(infos []*mountinfo.Info, source string, opts Options) *Inventory {
	return build(infos, len(infos), source, opts)
}

// build is Build of a table of total mounts of which infos holds the kubelet
// mounts, or all of them; a live table needs all of them (a loop device's
// backing file may lie on any mount).
func build(infos []*mountinfo.Info, total int, source string, opts Options) *Inventory {
	root := opts.root()
	inv := &Inventory{Root: root, Source: source, Total: total}

	covered := CoveredIDs(infos)
	for _, in := range infos {
		t, ok := kubelet.Classify(root, in.Mountpoint)
		if !ok {
			if why := kubelet.StrayPath(root, in.Mountpoint); why != "" {
				inv.Strays = append(inv.Strays, Stray{Path: in.Mountpoint, Why: why})
			}
			continue
		}
		if t.Sub != "" && t.HandleHash == "" {
			// A legacy or block staging path names no volume handle:
			// the directory below it is the volume's staging mount only
			// when vol_data.json says that is the volume ID.
			var why string
			if t, why = checkSub(root, t, opts.Live); why != "" {
				inv.Strays = append(inv.Strays, Stray{Path: in.Mountpoint, Why: why})
				continue
			}
		}
		m := &Mount{
			ID: in.ID, ParentID: in.Parent,
			Dev:  Dev{uint32(in.Major), uint32(in.Minor)},
			Root: in.Root, Path: in.Mountpoint, Options: in.Options, Optional: in.Optional,
			FSType: in.FSType, Source: in.Source, SuperOptions: in.VFSOptions,
			Target: t, Covered: covered[in.ID],
			Guard: IsGuard(in.FSType, in.Source, t),
		}
		inv.Mounts = append(inv.Mounts, m)
	}
	sort.SliceStable(inv.Mounts, func(i, j int) bool { return inv.Mounts[i].Path < inv.Mounts[j].Path })

	link(inv)
	backends(inv, infos, opts)
	if opts.Live {
		readVolData(inv)
		inv.Unmounted, inv.Publishing = findUnmounted(root, inv, time.Now(), opts)
	}
	return inv
}

// link sets Mount.From by device number and mountinfo root: a publish target
// derives from a staging mount whose root is its root or an ancestor of it,
// a subPath bind from its own pod's publish target on the same device (or a
// staging mount). Candidates are indexed so that thousands of binds of one
// filesystem cost linear time.
func link(inv *Inventory) {
	type devPod struct {
		dev Dev
		pod string
	}
	staging := make(map[Dev][]*Mount)
	publish := make(map[devPod][]*Mount)
	for _, m := range inv.Mounts {
		switch m.Target.Kind {
		case kubelet.KindStaging:
			staging[m.Dev] = append(staging[m.Dev], m)
		case kubelet.KindPublish, kubelet.KindPluginVolume:
			// A pod volume of another plugin (nfs, emptyDir, secret, an
			// in-tree iscsi disk) is what its subPath binds show too.
			k := devPod{m.Dev, m.Target.PodUID}
			publish[k] = append(publish[k], m)
		}
	}
	best := func(m *Mount, cands []*Mount) *Mount {
		var pick *Mount
		for _, c := range cands {
			if c == m || c.Deleted() || !rootContains(c.Root, m.Root) {
				continue
			}
			if pick == nil || len(c.Root) > len(pick.Root) || (len(c.Root) == len(pick.Root) && !c.Covered && pick.Covered) {
				pick = c
			}
		}
		return pick
	}
	for _, m := range inv.Mounts {
		switch m.Target.Kind {
		case kubelet.KindPublish:
			m.From = best(m, staging[m.Dev])
		case kubelet.KindPluginVolume:
			// An in-tree device plugin's pod volume binds its device mount.
			for _, c := range staging[m.Dev] {
				if c.Target.Plugin == m.Target.Plugin && rootContains(c.Root, m.Root) {
					m.From = c
					break
				}
			}
		case kubelet.KindSubPath:
			if m.From = best(m, publish[devPod{m.Dev, m.Target.PodUID}]); m.From == nil {
				m.From = best(m, staging[m.Dev])
			}
		}
	}
	for _, m := range inv.Mounts {
		if m.Target.Kind == kubelet.KindBlock && m.Target.Sub != "" {
			// A block volume staged below its staging path (checkSub).
			m.Driver, m.VolumeHandle = m.Target.Driver, m.Target.Sub
			continue
		}
		if m.Target.Kind == kubelet.KindStaging {
			m.Driver = m.Target.Driver
			// A driver that stages in <globalmount>/<volumeID> names the
			// volume handle in the path: kept when its hash is the
			// directory's.
			if t := m.Target; t.Sub != "" {
				// Classify or checkSub made sure it is the handle.
				m.VolumeHandle = t.Sub
			}
			continue
		}
		for s := m.From; s != nil; s = s.From {
			if s.Target.Kind == kubelet.KindStaging && s.Target.Driver != "" {
				m.Driver = s.Target.Driver
				break
			}
		}
	}
}

// Stray is a mount point under the kubelet root that looks like a staging
// mount and is not one.
type Stray struct {
	Path string `json:"path"`
	// Why says which rule it fails.
	Why string `json:"why"`
}

// checkSub checks a staging mount one directory below a legacy
// (pv/<pv>/globalmount) or block (volumeDevices/staging/<pv>) staging path,
// whose path names no volume handle, against the vol_data.json kubelet
// wrote for the PV: the directory must be its volume handle (the CSI volume
// ID) and the driver one that stages there. It returns the target with its
// driver, or why it is not the volume's staging mount. A captured table
// holds no vol_data.json, so there the mount is never taken for staging.
func checkSub(root string, t kubelet.Target, live bool) (kubelet.Target, string) {
	if !live {
		return t, "a directory below a staging path that names no volume handle: whether it is the volume ID is in vol_data.json, which a captured table does not hold"
	}
	dir := filepath.Join("plugins", "kubernetes.io", "csi", "pv", t.PV)
	if t.Kind == kubelet.KindBlock {
		// csi_block.go keeps a block volume's vol_data.json in
		// volumeDevices/<spec name>/data.
		dir = filepath.Join("plugins", "kubernetes.io", "csi", "volumeDevices", t.PV, "data")
	}
	vd, err := loadVolData(root, dir)
	switch {
	case err != nil:
		return t, fmt.Sprintf("no volume data to check it against: %v", err)
	case vd.VolumeHandle != t.Sub:
		return t, fmt.Sprintf("directory %q below the staging path is not PV %s's volume ID", t.Sub, t.PV)
	}
	if d, ok := kubelet.LookupDriver(vd.DriverName); ok && d.Layout != kubelet.LayoutVolumeIDDir {
		return t, fmt.Sprintf("%s (%s) stages on the staging path itself (layout %s), never below it", vd.DriverName, d.Project, d.Layout)
	}
	t.Driver = vd.DriverName
	return t, ""
}

// rootContains reports whether mountinfo root child is root parent or below
// it, by path segments.
func rootContains(parent, child string) bool {
	child = strings.TrimSuffix(child, "//deleted")
	if parent == "/" || parent == child {
		return true
	}
	return strings.HasPrefix(child, parent) && len(child) > len(parent) && child[len(parent)] == '/'
}

func backendKind(fsType string, major int) BackendKind {
	base, _, _ := strings.Cut(fsType, ".")
	switch {
	case base == "fuse" || base == "fuseblk":
		if base == "fuse" {
			return BackendFUSE
		}
		return BackendBlock
	case major != 0:
		return BackendBlock
	}
	switch base {
	case "nfs", "nfs4", "cifs", "smb3", "ceph", "glusterfs", "9p", "lustre", "gpfs", "beegfs", "afs":
		return BackendNetwork
	}
	return BackendOther
}

// backends groups kubelet mounts by device and, on live tables, reads what
// sysfs says of block devices.
func backends(inv *Inventory, infos []*mountinfo.Info, opts Options) {
	byDev := make(map[Dev]*Backend)
	// Staging mounts first so that a backend is probed through its staging
	// path when it has one.
	order := make([]*Mount, 0, len(inv.Mounts))
	for _, m := range inv.Mounts {
		if m.Target.Kind == kubelet.KindStaging {
			order = append(order, m)
		}
	}
	for _, m := range inv.Mounts {
		if m.Target.Kind != kubelet.KindStaging {
			order = append(order, m)
		}
	}
	for _, m := range order {
		b := byDev[m.Dev]
		if b == nil {
			b = &Backend{Dev: m.Dev, Kind: backendKind(m.FSType, int(m.Dev.Major)),
				FSType: m.FSType, Source: m.Source, SuperOptions: m.SuperOptions}
			if b.Kind == BackendFUSE {
				b.Conn = m.Dev.Minor
			}
			byDev[m.Dev] = b
			inv.Backends = append(inv.Backends, b)
		}
		b.Mounts = append(b.Mounts, m)
		m.Backend = b
	}
	if !opts.Live {
		return
	}
	sys := opts.sysfs()
	var lowers []*Backend
	for _, b := range inv.Backends {
		if b.Kind != BackendBlock || b.Dev.Major == 0 {
			continue
		}
		b.Device = blockName(sys, b.Dev)
		switch {
		case strings.HasPrefix(b.Device, "loop"):
			b.Backing = readTrim(filepath.Join(sys, "block", b.Device, "loop", "backing_file"))
		case strings.HasPrefix(b.Device, "nbd"):
			b.DaemonPID, _ = strconv.Atoi(readTrim(filepath.Join(sys, "block", b.Device, "pid")))
		}
		if b.Backing == "" {
			continue
		}
		if in := containing(infos, b.Backing); in != nil {
			d := Dev{uint32(in.Major), uint32(in.Minor)}
			lower := byDev[d]
			if lower == nil {
				lower = &Backend{Dev: d, Kind: backendKind(in.FSType, in.Major), FSType: in.FSType,
					Source: in.Source, SuperOptions: in.VFSOptions}
				if lower.Kind == BackendFUSE {
					lower.Conn = d.Minor
				}
				byDev[d] = lower
				lowers = append(lowers, lower)
			}
			b.Lower = lower
		}
	}
	inv.Backends = append(inv.Backends, lowers...)
}

// containing returns the mount whose mount point holds path: the longest
// mount point prefix, the last mounted when several share it.
func containing(infos []*mountinfo.Info, path string) *mountinfo.Info {
	path = strings.TrimSuffix(path, " (deleted)")
	var pick *mountinfo.Info
	for _, in := range infos {
		mp := in.Mountpoint
		if mp != "/" && path != mp && !(strings.HasPrefix(path, mp) && path[len(mp)] == '/') {
			continue
		}
		if pick == nil || len(mp) >= len(pick.Mountpoint) {
			pick = in
		}
	}
	return pick
}

func blockName(sys string, d Dev) string {
	target, err := os.Readlink(filepath.Join(sys, "dev", "block", d.String()))
	if err != nil {
		return ""
	}
	return filepath.Base(target)
}

func readTrim(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// volData is what kubelet writes beside a CSI publish target.
type volData struct {
	DriverName   string `json:"driverName"`
	VolumeHandle string `json:"volumeHandle"`
}

// readVolData fills Driver and VolumeHandle of publish targets from the
// vol_data.json kubelet keeps beside them.
func readVolData(inv *Inventory) {
	for _, m := range inv.Mounts {
		if m.Target.Kind != kubelet.KindPublish {
			continue
		}
		rel := strings.TrimPrefix(filepath.Dir(m.Path), inv.Root+"/")
		vd, err := loadVolData(inv.Root, rel)
		if err != nil {
			continue
		}
		if vd.DriverName != "" {
			m.Driver = vd.DriverName
		}
		m.VolumeHandle = vd.VolumeHandle
	}
	// Propagate to subPath binds and staging mounts of the same volume.
	for _, m := range inv.Mounts {
		if m.Target.Kind == kubelet.KindSubPath && m.From != nil && m.From.VolumeHandle != "" {
			m.VolumeHandle = m.From.VolumeHandle
			if m.Driver == "" {
				m.Driver = m.From.Driver
			}
		}
	}
}

func loadVolData(root, relDir string) (volData, error) {
	vd, _, err := loadVolDataAt(root, relDir)
	return vd, err
}

// loadVolDataAt is loadVolData that also says when kubelet wrote the file.
func loadVolDataAt(root, relDir string) (volData, time.Time, error) {
	var vd volData
	f, err := OpenBeneath(root, filepath.Join(relDir, kubelet.VolDataFile), unix.O_RDONLY)
	if err != nil {
		return vd, time.Time{}, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return vd, time.Time{}, err
	}
	vd, err = parseVolData(f)
	return vd, st.ModTime(), err
}

func parseVolData(f *os.File) (volData, error) {
	var vd volData
	b, err := io.ReadAll(io.LimitReader(f, 64<<10))
	if err != nil {
		return vd, fmt.Errorf("read %s: %w", f.Name(), err)
	}
	if err := json.Unmarshal(b, &vd); err != nil {
		return vd, fmt.Errorf("parse %s: %w", f.Name(), err)
	}
	return vd, nil
}

// OpenBeneath opens rel below the directory root with openat2, refusing any
// symlink and any path that would leave root. It never crosses into a mount
// below root either (RESOLVE_NO_XDEV is not set: kubelet's tree is made of
// mounts), but it never follows a link out of the tree.
func OpenBeneath(root, rel string, flags int) (*os.File, error) {
	dir, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return nil, fmt.Errorf("open kubelet root %s: %w", root, err)
	}
	defer unix.Close(dir)
	fd, err := unix.Openat2(dir, rel, &unix.OpenHow{
		Flags:   uint64(flags | unix.O_CLOEXEC | unix.O_NOFOLLOW),
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	})
	if err != nil {
		return nil, &os.PathError{Op: "openat2", Path: filepath.Join(root, rel), Err: err}
	}
	return os.NewFile(uintptr(fd), filepath.Join(root, rel)), nil
}

// findUnmounted lists CSI publish targets that kubelet set up (vol_data.json
// beside them) but that are not mount points in the table. A target whose
// vol_data.json is younger than grace is kubelet still publishing it: it is
// left out, and the earliest time one of those leaves the window is
// returned.
func findUnmounted(root string, inv *Inventory, now time.Time, opts Options) ([]*Mount, time.Time) {
	grace := opts.publishGrace()
	mounted := make(map[string]bool, len(inv.Mounts))
	for _, m := range inv.Mounts {
		mounted[m.Path] = true
		// A staging mount one directory below globalmount (ceph-csi RBD's
		// <stagingTargetPath>/<volumeID>) is the volume's staging mount:
		// globalmount itself is then never a mount point.
		mounted[kubelet.StagingDir(m.Target, m.Path)] = true
	}
	pods, err := readDirBeneath(root, "pods")
	if err != nil {
		return nil, time.Time{}
	}
	var out []*Mount
	var publishing time.Time
	for _, uid := range pods {
		rel := filepath.Join("pods", uid, "volumes", kubelet.CSIPluginDir)
		vols, err := readDirBeneath(root, rel)
		if err != nil {
			continue
		}
		for _, v := range vols {
			p := filepath.Join(root, rel, v, "mount")
			if mounted[p] {
				continue
			}
			vd, written, err := loadVolDataAt(root, filepath.Join(rel, v))
			if err != nil {
				continue
			}
			if until := written.Add(grace); now.Before(until) {
				if publishing.IsZero() || until.Before(publishing) {
					publishing = until
				}
				continue
			}
			// Only a target whose directory still exists would be written
			// to by the pod; kubelet removes it on teardown.
			f, err := OpenBeneath(root, filepath.Join(rel, v, "mount"), unix.O_PATH|unix.O_DIRECTORY)
			if err != nil {
				continue
			}
			f.Close()
			out = append(out, &Mount{Path: p, Driver: vd.DriverName, VolumeHandle: vd.VolumeHandle,
				Target: kubelet.Target{Kind: kubelet.KindPublish, PodUID: uid, Plugin: kubelet.CSIPluginDir, Volume: v}})
		}
	}
	return append(out, stagingUnmounted(root, inv, mounted, opts.DriverStages)...), publishing
}

// stagingUnmounted lists the staging mounts that are gone while publish
// targets of their volume are still mounted: kubelet staged the volume
// (vol_data.json beside globalmount) and publishes from it, but globalmount
// is no longer a mount point. A stale FUSE daemon that wakes up and unmounts
// its mountpoint path by name does this to a staging mount re-staged under
// it; the pods keep reading through their binds, and the next pod published
// there would get the bare directory on the node's disk. A publish target
// on the staging directory's own filesystem is no such evidence.
//
// kubelet makes globalmount and vol_data.json for every CSI volume, whether
// or not the driver stages (csi_attacher.go MountDevice): a driver that
// never stages leaves it bare. Whether a driver stages is asked of
// driverStages (its NodeGetCapabilities), else of the catalogue; a driver
// neither knows is not reported, and is named in inv.StagingUnknown.
func stagingUnmounted(root string, inv *Inventory, mounted map[string]bool, driverStages func(string) (bool, bool)) []*Mount {
	var out []*Mount
	seen := make(map[string]bool)
	for _, m := range inv.Mounts {
		if m.Target.Kind != kubelet.KindPublish || m.Driver == "" || m.VolumeHandle == "" || m.Guard {
			continue
		}
		if kubelet.CheckPathName("csi driver name", m.Driver) != nil {
			continue
		}
		p := kubelet.StagingPath(root, m.Driver, m.VolumeHandle)
		if mounted[p] || seen[p] {
			continue
		}
		seen[p] = true
		stages, known := false, false
		if driverStages != nil {
			stages, known = driverStages(m.Driver)
		}
		if d, ok := kubelet.LookupDriver(m.Driver); ok && !known {
			stages, known = d.Layout != kubelet.LayoutPublishOnly, true
		}
		if known && !stages {
			continue
		}
		rel := strings.TrimPrefix(filepath.Dir(p), root+"/")
		vd, err := loadVolData(root, rel)
		if err != nil || vd.VolumeHandle != m.VolumeHandle {
			continue
		}
		f, err := OpenBeneath(root, filepath.Join(rel, kubelet.GlobalMountDir), unix.O_PATH|unix.O_DIRECTORY)
		if err != nil {
			continue
		}
		var st unix.Stat_t
		err = unix.Fstat(int(f.Fd()), &st)
		f.Close()
		if err != nil || (Dev{Major: unix.Major(st.Dev), Minor: unix.Minor(st.Dev)}) == m.Dev {
			// The publish target shows the directory's own filesystem:
			// a bind of the bare directory (published while nothing was
			// staged there, or a driver that publishes that directory),
			// not a staging mount that was there and is gone.
			continue
		}
		if !known {
			if !slices.Contains(inv.StagingUnknown, m.Driver) {
				inv.StagingUnknown = append(inv.StagingUnknown, m.Driver)
			}
			continue
		}
		out = append(out, &Mount{Path: p, Driver: m.Driver, VolumeHandle: m.VolumeHandle,
			Target: kubelet.Target{Kind: kubelet.KindStaging, Plugin: kubelet.CSIPluginDir,
				Driver: m.Driver, HandleHash: kubelet.HandleHash(m.VolumeHandle)}})
	}
	return out
}

func readDirBeneath(root, rel string) ([]string, error) {
	f, err := OpenBeneath(root, rel, unix.O_RDONLY|unix.O_DIRECTORY)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return f.Readdirnames(-1)
}
