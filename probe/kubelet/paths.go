package kubelet

import (
	"crypto/sha256"
	"encoding/hex"
	"path/filepath"
	"strconv"
	"strings"

	"k8s.io/apimachinery/pkg/types"
)

// csiPluginName is kubelet's name for its CSI volume plugin.
const csiPluginName = "kubernetes.io/csi"

// Names kubelet gives files and directories of a CSI volume.
const (
	// GlobalMountDir is the staging mount's directory, beside vol_data.json.
	GlobalMountDir = "globalmount"
	// VolDataFile is the JSON file kubelet writes beside a staging
	// directory and a publish target (driverName, volumeHandle, ...).
	VolDataFile = "vol_data.json"
)

// AttachmentName is the name of the VolumeAttachment for a volume on a node:
// "csi-" and the hex SHA-256 of handle, driver and node name run together
// (csi_attacher.go getAttachmentName).
func AttachmentName(volumeHandle, driver, nodeName string) string {
	sum := sha256.Sum256([]byte(volumeHandle + driver + nodeName))
	return "csi-" + hex.EncodeToString(sum[:])
}

// StagingPath is where kubelet stages a filesystem volume:
// <kubeletRoot>/plugins/kubernetes.io/csi/<driver>/<hex sha256(handle)>/globalmount
// (csi_attacher.go makeDeviceMountPath). Older kubelets used
// plugins/kubernetes.io/csi/pv/<pv>/globalmount, which this does not give.
func StagingPath(kubeletRoot, driver, volumeHandle string) string {
	return filepath.Join(kubeletRoot, "plugins", csiPluginName, driver, HandleHash(volumeHandle), GlobalMountDir)
}

// LegacyStagingPath is the staging path of kubelets before 1.25:
// <kubeletRoot>/plugins/kubernetes.io/csi/pv/<pv>/globalmount, which volumes
// staged by such a kubelet keep.
func LegacyStagingPath(kubeletRoot, pv string) string {
	return filepath.Join(kubeletRoot, "plugins", csiPluginName, "pv", pv, GlobalMountDir)
}

// HandleHash is the hex SHA-256 of a volume handle, the staging path's
// directory name.
func HandleHash(volumeHandle string) string {
	sum := sha256.Sum256([]byte(volumeHandle))
	return hex.EncodeToString(sum[:])
}

// TargetPath is where kubelet publishes a filesystem volume for a pod:
// <kubeletRoot>/pods/<uid>/volumes/kubernetes.io~csi/<spec name>/mount, the
// spec name (the PV name) with "/" escaped to "~" (csi_mounter.go
// getTargetPath, GetCSIMounterPath).
func TargetPath(kubeletRoot string, podUID types.UID, specName string) string {
	return filepath.Join(kubeletRoot, "pods", string(podUID), "volumes",
		escapeQualifiedName(csiPluginName), escapeQualifiedName(specName), "mount")
}

// SubPathTarget is where kubelet binds a volumeMount's subPath for a
// container: <kubeletRoot>/pods/<uid>/volume-subpaths/<volume>/<container>/<index>,
// index being the volumeMount's position in the container's list
// (subpath_linux.go getSubpathBindTarget).
func SubPathTarget(kubeletRoot string, podUID types.UID, volume, container string, index int) string {
	return filepath.Join(kubeletRoot, "pods", string(podUID), "volume-subpaths", volume, container, strconv.Itoa(index))
}

// PodVolumePath is a pod volume of a plugin other than CSI:
// <kubeletRoot>/pods/<uid>/volumes/<plugin, escaped>/<volume>, for example
// the plugin kubernetes.io/empty-dir.
func PodVolumePath(kubeletRoot string, podUID types.UID, plugin, volume string) string {
	return filepath.Join(kubeletRoot, "pods", string(podUID), "volumes", escapeQualifiedName(plugin), volume)
}

// PodDevicePath is the symlink kubelet makes for a pod's CSI block volume:
// <kubeletRoot>/pods/<uid>/volumeDevices/kubernetes.io~csi/<spec name>.
func PodDevicePath(kubeletRoot string, podUID types.UID, specName string) string {
	return filepath.Join(kubeletRoot, "pods", string(podUID), "volumeDevices", CSIPluginDir, specName)
}

// BlockMapPath is kubelet's global map of a CSI block volume for a pod:
// <kubeletRoot>/plugins/kubernetes.io/csi/volumeDevices/<spec name>/dev/<uid>
// (csi_block.go GetGlobalMapPath and the pod's file in it).
func BlockMapPath(kubeletRoot, specName string, podUID types.UID) string {
	return filepath.Join(kubeletRoot, "plugins", csiPluginName, "volumeDevices", specName, "dev", string(podUID))
}

// BlockStagingPath is where kubelet stages a block volume:
// <kubeletRoot>/plugins/kubernetes.io/csi/volumeDevices/staging/<spec name>
// (csi_block.go GetStagingPath).
func BlockStagingPath(kubeletRoot, specName string) string {
	return filepath.Join(kubeletRoot, "plugins", csiPluginName, "volumeDevices", "staging", specName)
}

// BlockTargetPath is where kubelet publishes a block volume for a pod:
// <kubeletRoot>/plugins/kubernetes.io/csi/volumeDevices/publish/<spec name>/<uid>
// (csi_block.go getPublishPath).
func BlockTargetPath(kubeletRoot, specName string, podUID types.UID) string {
	return filepath.Join(kubeletRoot, "plugins", csiPluginName, "volumeDevices", "publish", specName, string(podUID))
}

// escapeQualifiedName is kubelet's escaping of a plugin or volume name in a
// path segment: "/" becomes "~".
func escapeQualifiedName(s string) string { return strings.ReplaceAll(s, "/", "~") }
