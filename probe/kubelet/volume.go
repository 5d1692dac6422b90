package kubelet

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
)

// Kinds of BuildVolumeRequest errors; each error also names the object or
// field and what to do.
var (
	// ErrMissingObject: an object the request needs was not passed in.
	ErrMissingObject = errors.New("missing object")
	// ErrObjectMismatch: the objects passed in do not belong together (a
	// stale cache, or the wrong object fetched).
	ErrObjectMismatch = errors.New("objects do not match")
	// ErrUnsupportedVolume: the volume is not one remount can re-stage
	// (in-tree or CSI-migrated PV, inline volume, lifecycle mode).
	ErrUnsupportedVolume = errors.New("volume cannot be re-staged")
	// ErrNotAttached: the VolumeAttachment is not attached or is being
	// detached; kubelet would not mount the volume either.
	ErrNotAttached = errors.New("volume not attached")
)

// VolumeObjects are the plain API objects BuildVolumeRequest reads; the
// caller gets them (from informers or GETs) and resolves the secrets.
type VolumeObjects struct {
	Pod *corev1.Pod
	// VolumeName is the pod's spec.volumes[].name.
	VolumeName string
	// PVC is the claim the pod volume names (for a generic ephemeral volume,
	// the claim <pod>-<volume> the pod owns).
	PVC *corev1.PersistentVolumeClaim
	PV  *corev1.PersistentVolume
	// CSIDriver is the driver's CSIDriver object; nil when the cluster has
	// none (kubelet then requires attachment and adds no pod information).
	CSIDriver *storagev1.CSIDriver
	// VolumeAttachment is the object named AttachmentName(handle, driver,
	// node); it may be nil when the CSIDriver says attachRequired: false.
	VolumeAttachment *storagev1.VolumeAttachment
	// StageSecret and PublishSecret are the secrets SecretRefs(PV) names.
	StageSecret   *corev1.Secret
	PublishSecret *corev1.Secret
	// ServiceAccountTokens are the minted tokens by audience, needed when
	// the CSIDriver has spec.tokenRequests (see TokenRequests).
	ServiceAccountTokens map[string]authenticationv1.TokenRequestStatus
	// Capabilities are the driver's (CSIClient.NodeGetCapabilities).
	Capabilities NodeCapabilities
	// KubeletRoot is kubelet's --root-dir, e.g. /var/lib/kubelet.
	KubeletRoot string
}

// SecretRefs returns the PV's node stage and node publish secret references
// (nil when unset or when the PV is not a CSI volume). The stage secret is
// needed only when the driver stages the volume or the volume is a block
// volume.
func SecretRefs(pv *corev1.PersistentVolume) (stage, publish *corev1.SecretReference) {
	if pv == nil || pv.Spec.CSI == nil {
		return nil, nil
	}
	return pv.Spec.CSI.NodeStageSecretRef, pv.Spec.CSI.NodePublishSecretRef
}

// BuildVolumeRequest builds the request kubelet would send to stage and
// publish the pod's volume, checking the objects against each other as
// kubelet does (claim bound to this PV, volume mode against the containers'
// volumeMounts/volumeDevices, VolumeAttachment attached to the pod's node).
// Errors match ErrMissingObject, ErrObjectMismatch, ErrUnsupportedVolume or
// ErrNotAttached.
func BuildVolumeRequest(in VolumeObjects) (VolumeRequest, error) {
	if in.Pod == nil {
		return VolumeRequest{}, fmt.Errorf("volume %q: no pod given: pass the pod that mounts it: %w", in.VolumeName, ErrMissingObject)
	}
	vr, err := buildVolumeRequest(in)
	if err != nil {
		return VolumeRequest{}, fmt.Errorf("volume %q of pod %s: %w", in.VolumeName, klog.KObj(in.Pod), err)
	}
	return vr, nil
}

func buildVolumeRequest(in VolumeObjects) (VolumeRequest, error) {
	pod := in.Pod
	if !filepath.IsAbs(in.KubeletRoot) {
		return VolumeRequest{}, fmt.Errorf("kubelet root %q is not an absolute path: set it to kubelet's --root-dir", in.KubeletRoot)
	}
	if err := CheckPathName("pod uid", string(pod.UID)); err != nil {
		return VolumeRequest{}, fmt.Errorf("%w: %w", err, ErrObjectMismatch)
	}

	claimName, readOnly, err := podClaim(pod, in.VolumeName)
	if err != nil {
		return VolumeRequest{}, err
	}
	pvc, err := checkClaim(pod, in.VolumeName, claimName, in.PVC)
	if err != nil {
		return VolumeRequest{}, err
	}
	pv, err := checkPV(pvc, in.PV)
	if err != nil {
		return VolumeRequest{}, err
	}
	src := pv.Spec.CSI
	block := pv.Spec.VolumeMode != nil && *pv.Spec.VolumeMode == corev1.PersistentVolumeBlock
	if err := checkVolumeMode(pod, in.VolumeName, block); err != nil {
		return VolumeRequest{}, err
	}
	if err := checkDriver(in.CSIDriver, src.Driver); err != nil {
		return VolumeRequest{}, err
	}
	publishCtx, err := attachmentMetadata(in, pv)
	if err != nil {
		return VolumeRequest{}, err
	}

	caps := in.Capabilities
	accessMode := corev1.ReadWriteOnce
	if len(pv.Spec.AccessModes) > 0 {
		accessMode = pv.Spec.AccessModes[0]
	}
	vr := VolumeRequest{
		Driver:           src.Driver,
		VolumeHandle:     src.VolumeHandle,
		PVName:           pv.Name,
		Pod:              types.NamespacedName{Namespace: pod.Namespace, Name: pod.Name},
		PodUID:           pod.UID,
		VolumeAttributes: maps.Clone(src.VolumeAttributes),
		AccessMode:       AccessMode(accessMode, caps.SingleNodeMultiWriter),
		Block:            block,
		ReadOnly:         readOnly,
		StageUnstage:     caps.StageUnstage,
		PublishContext:   publishCtx,
	}
	if block {
		vr.StagingPath = BlockStagingPath(in.KubeletRoot, pv.Name)
		vr.TargetPath = BlockTargetPath(in.KubeletRoot, pv.Name, pod.UID)
	} else {
		vr.FSType = src.FSType
		vr.MountOptions = slices.Clone(pv.Spec.MountOptions)
		vr.StagingPath = StagingPath(in.KubeletRoot, src.Driver, src.VolumeHandle)
		vr.TargetPath = TargetPath(in.KubeletRoot, pod.UID, pv.Name)
		if caps.VolumeMountGroup && pod.Spec.SecurityContext != nil && pod.Spec.SecurityContext.FSGroup != nil {
			vr.VolumeMountGroup = strconv.FormatInt(*pod.Spec.SecurityContext.FSGroup, 10)
		}
	}

	stageRef, publishRef := SecretRefs(pv)
	// kubelet reads the stage secret for a filesystem volume only when the
	// driver stages, for a block volume always.
	if stageRef != nil && (caps.StageUnstage || block) {
		if vr.StageSecrets, err = secretData(pv, "nodeStageSecretRef", "StageSecret", stageRef, in.StageSecret); err != nil {
			return VolumeRequest{}, err
		}
	}
	if publishRef != nil {
		if vr.PublishSecrets, err = secretData(pv, "nodePublishSecretRef", "PublishSecret", publishRef, in.PublishSecret); err != nil {
			return VolumeRequest{}, err
		}
	}

	if d := in.CSIDriver; d != nil && d.Spec.PodInfoOnMount != nil && *d.Spec.PodInfoOnMount {
		vr.PodAttributes = map[string]string{
			PodNameKey:            pod.Name,
			PodNamespaceKey:       pod.Namespace,
			PodUIDKey:             string(pod.UID),
			ServiceAccountNameKey: pod.Spec.ServiceAccountName,
			// A PVC-backed volume, generic ephemeral included, has the
			// Persistent lifecycle.
			EphemeralKey: "false",
		}
	}
	// kubelet adds tokens on the filesystem path only (csi_mounter.go), not
	// in publishVolumeForBlock.
	if !block {
		if err := addTokens(&vr, in.CSIDriver, in.ServiceAccountTokens, pod); err != nil {
			return VolumeRequest{}, err
		}
	}
	return vr, nil
}

// ClaimName is the name of the PersistentVolumeClaim behind a volume of
// pod: its persistentVolumeClaim.claimName, or <pod name>-<volume name> for
// a generic ephemeral volume (the claim the ephemeral volume controller
// makes for it). ok is false for a volume of any other kind.
func ClaimName(pod *corev1.Pod, vol *corev1.Volume) (claim string, ok bool) {
	switch {
	case vol.PersistentVolumeClaim != nil:
		return vol.PersistentVolumeClaim.ClaimName, true
	case vol.Ephemeral != nil:
		// ephemeral.VolumeClaimName: <pod name>-<volume name>.
		return pod.Name + "-" + vol.Name, true
	}
	return "", false
}

// podClaim finds the claim behind the pod volume and kubelet's readOnly for
// it (persistentVolumeClaim.readOnly; false for a generic ephemeral volume).
func podClaim(pod *corev1.Pod, volumeName string) (claim string, readOnly bool, err error) {
	i := slices.IndexFunc(pod.Spec.Volumes, func(v corev1.Volume) bool { return v.Name == volumeName })
	if i < 0 {
		return "", false, fmt.Errorf("pod has no spec.volumes entry %q: pass a volume name from the pod spec: %w", volumeName, ErrObjectMismatch)
	}
	v := &pod.Spec.Volumes[i]
	if claim, ok := ClaimName(pod, v); ok {
		return claim, v.PersistentVolumeClaim != nil && v.PersistentVolumeClaim.ReadOnly, nil
	}
	switch {
	case v.CSI != nil:
		return "", false, fmt.Errorf("inline CSI volume (spec.volumes[].csi) has no PV, staging or secrets to rebuild; restart or evict the pod instead: %w", ErrUnsupportedVolume)
	default:
		return "", false, fmt.Errorf("not a persistentVolumeClaim or ephemeral volume, so not a CSI PV: %w", ErrUnsupportedVolume)
	}
}

func checkClaim(pod *corev1.Pod, volumeName, claimName string, pvc *corev1.PersistentVolumeClaim) (*corev1.PersistentVolumeClaim, error) {
	ref := pod.Namespace + "/" + claimName
	if pvc == nil {
		return nil, fmt.Errorf("PersistentVolumeClaim %s not given: get it and pass it as PVC: %w", ref, ErrMissingObject)
	}
	if pvc.Namespace != pod.Namespace || pvc.Name != claimName {
		return nil, fmt.Errorf("PVC %s given, but the pod volume names claim %s: pass that claim: %w", klog.KObj(pvc), ref, ErrObjectMismatch)
	}
	vol := slices.IndexFunc(pod.Spec.Volumes, func(v corev1.Volume) bool { return v.Name == volumeName })
	if pod.Spec.Volumes[vol].Ephemeral != nil && !metav1.IsControlledBy(pvc, pod) {
		return nil, fmt.Errorf("PVC %s was not created for this pod (the pod is not its controller): %w", ref, ErrObjectMismatch)
	}
	if pvc.Status.Phase != corev1.ClaimBound || pvc.Spec.VolumeName == "" {
		return nil, fmt.Errorf("PVC %s is not bound (phase %q, spec.volumeName %q): kubelet would not mount it: %w",
			ref, pvc.Status.Phase, pvc.Spec.VolumeName, ErrObjectMismatch)
	}
	return pvc, nil
}

func checkPV(pvc *corev1.PersistentVolumeClaim, pv *corev1.PersistentVolume) (*corev1.PersistentVolume, error) {
	name := pvc.Spec.VolumeName
	if pv == nil {
		return nil, fmt.Errorf("PersistentVolume %s (bound to PVC %s) not given: get it and pass it as PV: %w", name, klog.KObj(pvc), ErrMissingObject)
	}
	if pv.Name != name {
		return nil, fmt.Errorf("PersistentVolume %s given, but PVC %s is bound to %s: pass that PV: %w", pv.Name, klog.KObj(pvc), name, ErrObjectMismatch)
	}
	if pv.Spec.ClaimRef == nil || pv.Spec.ClaimRef.UID != pvc.UID {
		return nil, fmt.Errorf("PersistentVolume %s spec.claimRef does not point to PVC %s (uid %s): %w", pv.Name, klog.KObj(pvc), pvc.UID, ErrObjectMismatch)
	}
	src := pv.Spec.CSI
	if src == nil {
		return nil, fmt.Errorf("PersistentVolume %s has no spec.csi (an in-tree volume, or one kubelet migrates to CSI at mount time): not re-staged; restart or evict the pod instead: %w", pv.Name, ErrUnsupportedVolume)
	}
	if src.Driver == "" || src.VolumeHandle == "" {
		return nil, fmt.Errorf("PersistentVolume %s spec.csi has an empty driver or volumeHandle: %w", pv.Name, ErrUnsupportedVolume)
	}
	if err := CheckPathName("csi driver name", src.Driver); err != nil {
		return nil, fmt.Errorf("PersistentVolume %s: %w: %w", pv.Name, err, ErrUnsupportedVolume)
	}
	if err := CheckPathName("persistent volume name", pv.Name); err != nil {
		return nil, fmt.Errorf("%w: %w", err, ErrUnsupportedVolume)
	}
	return pv, nil
}

// checkVolumeMode refuses a filesystem volume in volumeDevices or a block
// volume in volumeMounts, as kubelet's desired state populator does.
func checkVolumeMode(pod *corev1.Pod, volumeName string, block bool) error {
	var mounted, device bool
	check := func(mounts []corev1.VolumeMount, devices []corev1.VolumeDevice) {
		mounted = mounted || slices.ContainsFunc(mounts, func(m corev1.VolumeMount) bool { return m.Name == volumeName })
		device = device || slices.ContainsFunc(devices, func(d corev1.VolumeDevice) bool { return d.Name == volumeName })
	}
	for _, c := range pod.Spec.InitContainers {
		check(c.VolumeMounts, c.VolumeDevices)
	}
	for _, c := range pod.Spec.Containers {
		check(c.VolumeMounts, c.VolumeDevices)
	}
	for _, c := range pod.Spec.EphemeralContainers {
		check(c.VolumeMounts, c.VolumeDevices)
	}
	switch {
	case block && mounted:
		return fmt.Errorf("PV has volumeMode Block, but a container lists the volume in volumeMounts: %w", ErrObjectMismatch)
	case !block && device:
		return fmt.Errorf("PV has volumeMode Filesystem, but a container lists the volume in volumeDevices: %w", ErrObjectMismatch)
	}
	return nil
}

// checkDriver checks that the CSIDriver object, if any, is the PV's driver
// and supports persistent volumes.
func checkDriver(d *storagev1.CSIDriver, driver string) error {
	if d == nil {
		return nil
	}
	if d.Name != driver {
		return fmt.Errorf("CSIDriver %s given for a volume of driver %s: pass CSIDriver %s or nil: %w", d.Name, driver, driver, ErrObjectMismatch)
	}
	// The API server defaults an empty list to Persistent.
	if modes := d.Spec.VolumeLifecycleModes; len(modes) > 0 && !slices.Contains(modes, storagev1.VolumeLifecyclePersistent) {
		return fmt.Errorf("CSIDriver %s does not list the Persistent lifecycle mode (has %q): %w", d.Name, modes, ErrUnsupportedVolume)
	}
	return nil
}

// attachmentMetadata returns the publish context: nil when the CSIDriver says
// attachRequired: false, else the status.attachmentMetadata of the volume's
// VolumeAttachment, which must be attached to the pod's node.
func attachmentMetadata(in VolumeObjects, pv *corev1.PersistentVolume) (map[string]string, error) {
	d := in.CSIDriver
	if d != nil && d.Spec.AttachRequired != nil && !*d.Spec.AttachRequired {
		return nil, nil
	}
	src, node := pv.Spec.CSI, in.Pod.Spec.NodeName
	if node == "" {
		return nil, fmt.Errorf("pod has no spec.nodeName: it is not scheduled: %w", ErrObjectMismatch)
	}
	name := AttachmentName(src.VolumeHandle, src.Driver, node)
	va := in.VolumeAttachment
	if va == nil {
		why := "no CSIDriver object, so attachment is required"
		if d != nil {
			why = "CSIDriver " + d.Name + " requires attachment"
		}
		return nil, fmt.Errorf("VolumeAttachment %s not given (%s): get it by that name and pass it as VolumeAttachment: %w", name, why, ErrMissingObject)
	}
	switch {
	case va.Name != name:
		return nil, fmt.Errorf("VolumeAttachment %s given, but this volume on node %s has %s: %w", va.Name, node, name, ErrObjectMismatch)
	case va.Spec.Attacher != src.Driver || va.Spec.NodeName != node:
		return nil, fmt.Errorf("VolumeAttachment %s is for driver %q on node %q, not %q on %q: %w", va.Name, va.Spec.Attacher, va.Spec.NodeName, src.Driver, node, ErrObjectMismatch)
	case va.Spec.Source.PersistentVolumeName != nil && *va.Spec.Source.PersistentVolumeName != pv.Name:
		return nil, fmt.Errorf("VolumeAttachment %s is for PersistentVolume %s, not %s: %w", va.Name, *va.Spec.Source.PersistentVolumeName, pv.Name, ErrObjectMismatch)
	case va.DeletionTimestamp != nil:
		return nil, fmt.Errorf("VolumeAttachment %s is being deleted (the volume is being detached): %w", va.Name, ErrNotAttached)
	case !va.Status.Attached:
		return nil, fmt.Errorf("VolumeAttachment %s has status.attached false: wait for the attacher: %w", va.Name, ErrNotAttached)
	}
	return maps.Clone(va.Status.AttachmentMetadata), nil
}

// secretData checks the secret against the PV's reference and returns its
// data as kubelet does (secret.data only, values as strings).
func secretData(pv *corev1.PersistentVolume, field, param string, ref *corev1.SecretReference, s *corev1.Secret) (map[string]string, error) {
	if s == nil {
		return nil, fmt.Errorf("PersistentVolume %s spec.csi.%s names Secret %s/%s, not given: get it and pass it as %s: %w",
			pv.Name, field, ref.Namespace, ref.Name, param, ErrMissingObject)
	}
	if s.Namespace != ref.Namespace || s.Name != ref.Name {
		return nil, fmt.Errorf("%s is Secret %s, but PersistentVolume %s spec.csi.%s names %s/%s: %w",
			param, klog.KObj(s), pv.Name, field, ref.Namespace, ref.Name, ErrObjectMismatch)
	}
	out := make(map[string]string, len(s.Data))
	for k, v := range s.Data {
		out[k] = string(v)
	}
	return out, nil
}

// TokenRequests returns the TokenRequests kubelet makes for a pod when its
// CSIDriver has spec.tokenRequests, keyed by audience. Create each for the
// pod's service account (pod.spec.serviceAccountName) and pass the statuses
// as VolumeObjects.ServiceAccountTokens.
func TokenRequests(d *storagev1.CSIDriver, pod *corev1.Pod) map[string]*authenticationv1.TokenRequest {
	if d == nil || pod == nil || len(d.Spec.TokenRequests) == 0 {
		return nil
	}
	out := make(map[string]*authenticationv1.TokenRequest, len(d.Spec.TokenRequests))
	for _, tr := range d.Spec.TokenRequests {
		audiences := []string{}
		if tr.Audience != "" {
			audiences = []string{tr.Audience}
		}
		out[tr.Audience] = &authenticationv1.TokenRequest{Spec: authenticationv1.TokenRequestSpec{
			Audiences:         audiences,
			ExpirationSeconds: tr.ExpirationSeconds,
			BoundObjectRef:    &authenticationv1.BoundObjectReference{APIVersion: "v1", Kind: "Pod", Name: pod.Name, UID: pod.UID},
		}}
	}
	return out
}

// addTokens puts the service account tokens the CSIDriver asks for into the
// publish volume context, or into the publish secrets when the CSIDriver
// sets serviceAccountTokenInSecrets.
func addTokens(vr *VolumeRequest, d *storagev1.CSIDriver, tokens map[string]authenticationv1.TokenRequestStatus, pod *corev1.Pod) error {
	if d == nil || len(d.Spec.TokenRequests) == 0 {
		return nil
	}
	out := make(map[string]authenticationv1.TokenRequestStatus, len(d.Spec.TokenRequests))
	for _, tr := range d.Spec.TokenRequests {
		t, ok := tokens[tr.Audience]
		if !ok || t.Token == "" {
			return fmt.Errorf("CSIDriver %s has spec.tokenRequests and no token for audience %q was given: create the requests from TokenRequests for service account %s/%s and pass them as ServiceAccountTokens: %w",
				d.Name, tr.Audience, pod.Namespace, pod.Spec.ServiceAccountName, ErrMissingObject)
		}
		out[tr.Audience] = t
	}
	data, err := json.Marshal(out)
	if err != nil {
		return fmt.Errorf("encode service account tokens: %w", err)
	}
	if d.Spec.ServiceAccountTokenInSecrets != nil && *d.Spec.ServiceAccountTokenInSecrets {
		if vr.PublishSecrets == nil {
			vr.PublishSecrets = map[string]string{}
		}
		vr.PublishSecrets[ServiceAccountTokensKey] = string(data)
		return nil
	}
	if vr.PodAttributes == nil {
		vr.PodAttributes = map[string]string{}
	}
	vr.PodAttributes[ServiceAccountTokensKey] = string(data)
	return nil
}

// NodeCapabilities is what a driver's NodeGetCapabilities advertised, as far
// as the requests kubelet builds depend on it.
type NodeCapabilities struct {
	StageUnstage          bool // STAGE_UNSTAGE_VOLUME
	SingleNodeMultiWriter bool // SINGLE_NODE_MULTI_WRITER
	VolumeMountGroup      bool // VOLUME_MOUNT_GROUP
}

// CheckPathName refuses names that would leave their directory in a path.
func CheckPathName(what, name string) error {
	if name == "" || name == "." || name == ".." || strings.ContainsAny(name, "/\x00") {
		return fmt.Errorf("%s %q cannot be used in a path: it is empty, a dot name or holds a slash", what, name)
	}
	return nil
}
