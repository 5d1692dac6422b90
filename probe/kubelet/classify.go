package kubelet

import (
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
)

// Kind says which kubelet path a mount point is.
type Kind int

const (
	// KindNone is a mount point that is not a kubelet volume path.
	KindNone Kind = iota
	// KindPublish is a CSI publish target:
	// pods/<uid>/volumes/kubernetes.io~csi/<volume>/mount.
	KindPublish
	// KindStaging is a CSI staging mount:
	// plugins/kubernetes.io/csi/<driver>/<sha256(volumeHandle)>/globalmount,
	// or the older plugins/kubernetes.io/csi/pv/<pv>/globalmount, or one
	// directory below either, where drivers such as ceph-csi RBD stage
	// (<stagingTargetPath>/<volumeID>; Target.Sub names the directory); and
	// an in-tree plugin's device mount, plugins/kubernetes.io/<iscsi, rbd,
	// fc...>/... (Target.Plugin names the plugin, Volume the last segment).
	KindStaging
	// KindSubPath is a subPath bind:
	// pods/<uid>/volume-subpaths/<volume>/<container>/<index>.
	KindSubPath
	// KindBlock is a raw block volume path: pods/<uid>/volumeDevices/<plugin>/<volume>
	// or one of plugins/kubernetes.io/csi/volumeDevices/{staging,publish,<pv>/dev}.
	KindBlock
	// KindPluginVolume is a pod volume of another plugin:
	// pods/<uid>/volumes/<plugin>/<volume> (nfs, local-volume, empty-dir...).
	KindPluginVolume
)

var kindNames = [...]string{"none", "publish", "staging", "subpath", "block", "plugin"}

func (k Kind) String() string {
	if int(k) < len(kindNames) {
		return kindNames[k]
	}
	return "kind(" + strconv.Itoa(int(k)) + ")"
}

// MarshalText makes a Kind read as its name in JSON.
func (k Kind) MarshalText() ([]byte, error) { return []byte(k.String()), nil }

// CSIPluginDir is the escaped name kubelet gives the CSI plugin in pod paths.
const CSIPluginDir = "kubernetes.io~csi"

// Target is what a kubelet path names. Fields that the path does not carry
// are empty.
type Target struct {
	Kind Kind `json:"kind"`
	// PodUID is the pod's UID (publish, subpath, pod volumes, pod block paths,
	// block publish and map paths).
	PodUID string `json:"podUID,omitempty"`
	// Plugin is the escaped volume plugin name, for example kubernetes.io~csi
	// or kubernetes.io~nfs.
	Plugin string `json:"plugin,omitempty"`
	// Volume is the pod's volume directory name: the PV name for a PVC, the
	// volume name for inline volumes.
	Volume string `json:"volume,omitempty"`
	// Container and Index locate a subPath bind.
	Container string `json:"container,omitempty"`
	Index     int    `json:"index,omitempty"`
	// Driver is the CSI driver of a staging mount in the per-driver layout.
	Driver string `json:"driver,omitempty"`
	// HandleHash is the hex sha256 of the volume handle in the per-driver
	// staging layout.
	HandleHash string `json:"handleHash,omitempty"`
	// PV is the PersistentVolume named by a legacy staging path or a raw
	// block path.
	PV string `json:"pv,omitempty"`
	// Sub is the directory below globalmount a driver staged the volume in
	// (ceph-csi RBD: the volume ID); empty for a mount on globalmount.
	Sub string `json:"sub,omitempty"`
}

// StagingDir is the globalmount directory of a staging mount: its own
// path, or its parent when the driver stages one directory below.
func StagingDir(t Target, path string) string {
	if t.Kind == KindStaging && t.Sub != "" {
		return filepath.Dir(path)
	}
	return path
}

// Classify says which kubelet path mountpoint is, under the kubelet root
// root. Both must be clean absolute paths as the mount table shows them; no
// file system access is made. It splits path segments and never matches
// substrings, so a directory named like a kubelet path elsewhere is KindNone.
func Classify(root, mountpoint string) (Target, bool) {
	rel, ok := under(root, mountpoint)
	if !ok {
		return Target{}, false
	}
	seg := strings.Split(rel, "/")
	for _, s := range seg {
		if s == "" || s == "." || s == ".." {
			return Target{}, false
		}
	}
	switch seg[0] {
	case "pods":
		return classifyPod(seg[1:])
	case "plugins":
		return classifyPlugin(seg[1:])
	}
	return Target{}, false
}

// under returns p relative to root when p is strictly below root.
func under(root, p string) (string, bool) {
	root = strings.TrimSuffix(root, "/")
	if root == "" || len(p) <= len(root)+1 || p[len(root)] != '/' || p[:len(root)] != root {
		return "", false
	}
	return p[len(root)+1:], true
}

// Under reports whether p lies strictly below the kubelet root root, by
// path segments and without touching the file system.
func Under(root, p string) bool {
	_, ok := under(filepath.Clean(root), filepath.Clean(p))
	return ok
}

func classifyPod(seg []string) (Target, bool) {
	// <uid>/volumes/<plugin>/<volume>[/mount]
	// <uid>/volume-subpaths/<volume>/<container>/<index>
	// <uid>/volumeDevices/<plugin>/<volume>
	if len(seg) < 2 {
		return Target{}, false
	}
	t := Target{PodUID: seg[0]}
	switch seg[1] {
	case "volumes":
		switch {
		case len(seg) == 5 && seg[2] == CSIPluginDir && seg[4] == "mount":
			t.Kind, t.Plugin, t.Volume = KindPublish, seg[2], seg[3]
			return t, true
		case len(seg) == 4 && seg[2] != CSIPluginDir:
			t.Kind, t.Plugin, t.Volume = KindPluginVolume, seg[2], seg[3]
			return t, true
		}
	case "volume-subpaths":
		if len(seg) == 5 {
			i, err := strconv.Atoi(seg[4])
			if err != nil || i < 0 {
				return Target{}, false
			}
			t.Kind, t.Volume, t.Container, t.Index = KindSubPath, seg[2], seg[3], i
			return t, true
		}
	case "volumeDevices":
		if len(seg) == 4 {
			t.Kind, t.Plugin, t.Volume = KindBlock, seg[2], seg[3]
			return t, true
		}
	}
	return Target{}, false
}

func classifyPlugin(seg []string) (Target, bool) {
	// kubernetes.io/csi/<driver>/<sha256>/globalmount[/<sub>]
	// kubernetes.io/csi/pv/<pv>/globalmount[/<sub>]
	// kubernetes.io/csi/volumeDevices/staging/<pv>[/<volumeID>]
	// kubernetes.io/csi/volumeDevices/publish/<pv>/<uid>
	// kubernetes.io/csi/volumeDevices/<pv>/dev/<uid>
	if len(seg) >= 3 && seg[0] == "kubernetes.io" && inTreeDevicePlugins[seg[1]] && seg[2] != "volumeDevices" {
		// An in-tree plugin's device mount (its staging): iscsi/<iface>/<portal>-<iqn>-lun-<n>,
		// rbd/mounts/<pool>-image-<image>, fc/<wwn>-lun-<n>, <cloud disk>/mounts/<disk>.
		return Target{Kind: KindStaging, Plugin: "kubernetes.io~" + seg[1], Volume: seg[len(seg)-1]}, true
	}
	if len(seg) < 3 || seg[0] != "kubernetes.io" || seg[1] != "csi" {
		return Target{}, false
	}
	seg = seg[2:]
	if seg[0] == "volumeDevices" {
		t := Target{Kind: KindBlock, Plugin: CSIPluginDir}
		switch {
		case len(seg) == 3 && seg[1] == "staging":
			t.PV = seg[2]
			return t, true
		case len(seg) == 4 && seg[1] == "staging":
			// ceph-csi stages a block volume at <staging path>/<volume ID>.
			t.PV, t.Sub = seg[2], seg[3]
			return t, true
		case len(seg) == 4 && seg[1] == "publish":
			t.PV, t.PodUID = seg[2], seg[3]
			return t, true
		case len(seg) == 4 && seg[2] == "dev":
			t.PV, t.PodUID = seg[1], seg[3]
			return t, true
		}
		return Target{}, false
	}
	if len(seg) < 3 || len(seg) > 4 || seg[2] != GlobalMountDir {
		return Target{}, false
	}
	t := Target{Kind: KindStaging, Plugin: CSIPluginDir}
	if len(seg) == 4 {
		t.Sub = seg[3]
	}
	if seg[0] == "pv" {
		// The legacy path names no handle: a directory below it is
		// checked against vol_data.json by the caller (probe.Build).
		t.PV = seg[1]
		return t, true
	}
	if !isSHA256Hex(seg[1]) {
		return Target{}, false
	}
	t.Driver, t.HandleHash = seg[0], seg[1]
	if t.Sub != "" && StrayStaging(t.Driver, t.HandleHash, t.Sub) != "" {
		return Target{}, false
	}
	return t, true
}

// StrayStaging says why a mount point one directory below a per-driver
// globalmount (…/<driver>/<hash>/globalmount/<sub>) is not that volume's
// staging mount, "" when it is: the driver stages there (ceph-csi RBD and
// drivers not in the catalogue may; a catalogued driver of another layout
// never does) and sub is the volume ID, which for CSI is the volume handle
// whose hash names the directory above. A privileged pod with
// Bidirectional mount propagation can mount anything there; what fails
// this is no kubelet mount and is never acted on.
func StrayStaging(driver, handleHash, sub string) string {
	if d, ok := LookupDriver(driver); ok && d.Layout != LayoutVolumeIDDir {
		return fmt.Sprintf("%s (%s) stages on globalmount itself (layout %s), never below it", driver, d.Project, d.Layout)
	}
	if HandleHash(sub) != handleHash {
		return fmt.Sprintf("directory %q below globalmount is not the volume ID: its sha256 is not the staging directory's %.12s", sub, handleHash)
	}
	return ""
}

// StrayPath is StrayStaging of a mount point under the kubelet root root:
// "" when mountpoint is not one directory below a per-driver globalmount
// or is that volume's staging mount.
func StrayPath(root, mountpoint string) string {
	rel, ok := under(root, mountpoint)
	if !ok {
		return ""
	}
	seg := strings.Split(rel, "/")
	// plugins/kubernetes.io/csi/<driver>/<hash>/globalmount/<sub>
	if len(seg) != 7 || seg[0] != "plugins" || seg[1] != "kubernetes.io" || seg[2] != "csi" ||
		seg[3] == "pv" || seg[3] == "volumeDevices" || seg[5] != GlobalMountDir || !isSHA256Hex(seg[4]) {
		return ""
	}
	for _, s := range seg {
		if s == "" || s == "." || s == ".." {
			return ""
		}
	}
	return StrayStaging(seg[3], seg[4], seg[6])
}

// inTreeDevicePlugins are the in-tree volume plugins that mount a device
// once per node under plugins/kubernetes.io/<plugin>/ (their
// GetDeviceMountPath) and bind it into each pod.
var inTreeDevicePlugins = map[string]bool{
	"iscsi": true, "rbd": true, "fc": true, "aws-ebs": true, "gce-pd": true, "azure-disk": true, "cinder": true,
}

func isSHA256Hex(s string) bool {
	if len(s) != 64 {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// UnmarshalText reads a Kind from its name.
func (k *Kind) UnmarshalText(b []byte) error {
	for i, n := range kindNames {
		if n == string(b) {
			*k = Kind(i)
			return nil
		}
	}
	return fmt.Errorf("unknown mount kind %q: want one of %s", b, strings.Join(kindNames[:], ", "))
}
