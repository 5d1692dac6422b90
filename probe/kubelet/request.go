package kubelet

import (
	"fmt"
	"maps"
	"slices"

	"github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
)

// Keys kubelet adds to a NodePublishVolume volume_context.
const (
	PodNameKey            = "csi.storage.k8s.io/pod.name"
	PodNamespaceKey       = "csi.storage.k8s.io/pod.namespace"
	PodUIDKey             = "csi.storage.k8s.io/pod.uid"
	ServiceAccountNameKey = "csi.storage.k8s.io/serviceAccount.name"
	EphemeralKey          = "csi.storage.k8s.io/ephemeral"
	// ServiceAccountTokensKey carries tokens: its value is a secret.
	ServiceAccountTokensKey = "csi.storage.k8s.io/serviceAccount.tokens"
)

const redacted = "<redacted>"

// VolumeRequest is everything kubelet puts into NodeStageVolume and
// NodePublishVolume for one volume of one pod. BuildVolumeRequest fills it
// from the API objects; StageRequest and PublishRequest turn it into gRPC
// requests.
//
// Its String, GoString and MarshalLog print secret values as "<redacted>".
type VolumeRequest struct {
	Driver       string
	VolumeHandle string
	// PVName is the PersistentVolume (kubelet's volume spec name).
	PVName string
	// Pod and PodUID name the pod whose target path this is.
	Pod    types.NamespacedName
	PodUID types.UID

	// VolumeAttributes is the PV's spec.csi.volumeAttributes: the
	// volume_context of NodeStageVolume.
	VolumeAttributes map[string]string
	// PodAttributes are added to VolumeAttributes in NodePublishVolume's
	// volume_context: pod information when the CSIDriver asks for it, and
	// service account tokens (ServiceAccountTokensKey, a secret).
	PodAttributes map[string]string

	FSType       string
	MountOptions []string
	AccessMode   csi.VolumeCapability_AccessMode_Mode
	// Block: the PV has volumeMode Block.
	Block bool
	// ReadOnly is the pod volume's persistentVolumeClaim.readOnly, which
	// kubelet sends as NodePublishVolume readonly. A container's
	// volumeMounts[].readOnly is applied to the container's own bind and is
	// not sent to the driver.
	ReadOnly bool
	// VolumeMountGroup is the pod's fsGroup, set only when the driver
	// advertises VOLUME_MOUNT_GROUP.
	VolumeMountGroup string
	// StageUnstage: the driver advertises STAGE_UNSTAGE_VOLUME, so the
	// volume is staged and NodePublishVolume names the staging path.
	StageUnstage bool

	StageSecrets   map[string]string
	PublishSecrets map[string]string
	// PublishContext is the VolumeAttachment's status.attachmentMetadata.
	PublishContext map[string]string

	StagingPath string
	TargetPath  string
}

// capability builds the VolumeCapability kubelet sends: block for a block
// volume, otherwise mount with the fsType, the PV's mountOptions as mount
// flags and the fsGroup when the driver applies it.
func (vr VolumeRequest) capability() *csi.VolumeCapability {
	c := &csi.VolumeCapability{AccessMode: &csi.VolumeCapability_AccessMode{Mode: vr.AccessMode}}
	if vr.Block {
		c.AccessType = &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}}
		return c
	}
	c.AccessType = &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{
		FsType:           vr.FSType,
		MountFlags:       slices.Clone(vr.MountOptions),
		VolumeMountGroup: vr.VolumeMountGroup,
	}}
	return c
}

// StageRequest is the NodeStageVolumeRequest kubelet sends for vr
// (csi_attacher.go MountDevice; csi_block.go stageVolumeForBlock): the PV's
// volume attributes only, no pod information. Call it only when
// vr.StageUnstage is set. The request holds the stage secrets: never log it.
func StageRequest(vr VolumeRequest) *csi.NodeStageVolumeRequest {
	return &csi.NodeStageVolumeRequest{
		VolumeId:          vr.VolumeHandle,
		PublishContext:    maps.Clone(vr.PublishContext),
		StagingTargetPath: vr.StagingPath,
		VolumeCapability:  vr.capability(),
		Secrets:           maps.Clone(vr.StageSecrets),
		VolumeContext:     maps.Clone(vr.VolumeAttributes),
	}
}

// PublishRequest is the NodePublishVolumeRequest kubelet sends for vr
// (csi_mounter.go SetUpAt; csi_block.go publishVolumeForBlock). The staging
// path is sent when the driver stages; for a block volume kubelet always
// sends it. The request holds the publish secrets: never log it.
func PublishRequest(vr VolumeRequest) *csi.NodePublishVolumeRequest {
	req := &csi.NodePublishVolumeRequest{
		VolumeId:         vr.VolumeHandle,
		PublishContext:   maps.Clone(vr.PublishContext),
		TargetPath:       vr.TargetPath,
		VolumeCapability: vr.capability(),
		Readonly:         vr.ReadOnly,
		Secrets:          maps.Clone(vr.PublishSecrets),
		VolumeContext:    publishVolumeContext(vr.VolumeAttributes, vr.PodAttributes),
	}
	if vr.StageUnstage || vr.Block {
		req.StagingTargetPath = vr.StagingPath
	}
	return req
}

// publishVolumeContext merges pod attributes over volume attributes, as
// kubelet's mergeMap does, without touching either.
func publishVolumeContext(volume, pod map[string]string) map[string]string {
	if len(volume) == 0 && len(pod) == 0 {
		return nil
	}
	out := make(map[string]string, len(volume)+len(pod))
	maps.Copy(out, volume)
	maps.Copy(out, pod)
	return out
}

// Redacted returns a copy of vr whose secret values read "<redacted>" (the
// keys stay, so a missing key can still be diagnosed).
func (vr VolumeRequest) Redacted() VolumeRequest {
	out := vr
	out.StageSecrets = redactValues(vr.StageSecrets)
	out.PublishSecrets = redactValues(vr.PublishSecrets)
	if _, ok := vr.PodAttributes[ServiceAccountTokensKey]; ok {
		out.PodAttributes = maps.Clone(vr.PodAttributes)
		out.PodAttributes[ServiceAccountTokensKey] = redacted
	}
	return out
}

func redactValues(m map[string]string) map[string]string {
	if m == nil {
		return nil
	}
	out := make(map[string]string, len(m))
	for k := range m {
		out[k] = redacted
	}
	return out
}

// plainRequest has VolumeRequest's fields and none of its methods.
type plainRequest VolumeRequest

// String prints vr with secret values redacted.
func (vr VolumeRequest) String() string {
	return fmt.Sprintf("%+v", plainRequest(vr.Redacted()))
}

// GoString keeps %#v from printing secrets.
func (vr VolumeRequest) GoString() string { return "kubelet.VolumeRequest" + vr.String() }

// MarshalLog keeps structured loggers from printing secrets.
func (vr VolumeRequest) MarshalLog() any { return plainRequest(vr.Redacted()) }

// AccessMode maps a PV access mode to a CSI access mode exactly as kubelet
// does (csi_client.go): SINGLE_NODE_MULTI_WRITER and SINGLE_NODE_SINGLE_WRITER
// only for a driver that advertises SINGLE_NODE_MULTI_WRITER; otherwise
// ReadWriteOnce and ReadWriteOncePod both become SINGLE_NODE_WRITER.
func AccessMode(mode corev1.PersistentVolumeAccessMode, singleNodeMultiWriter bool) csi.VolumeCapability_AccessMode_Mode {
	switch mode {
	case corev1.ReadWriteOnce:
		if singleNodeMultiWriter {
			return csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER
		}
		return csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER
	case corev1.ReadOnlyMany:
		return csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY
	case corev1.ReadWriteMany:
		return csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER
	case corev1.ReadWriteOncePod:
		if singleNodeMultiWriter {
			return csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER
		}
		return csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER
	}
	return csi.VolumeCapability_AccessMode_UNKNOWN
}
