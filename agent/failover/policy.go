package failover

import (
	"context"
	"fmt"
	"slices"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// Annotation on a pod: "false" keeps it from being failed over (and
// fenced); "true" admits it even when the include lists leave its
// namespace or StorageClass out. Exclude lists and "false" always win.
const Annotation = "mountmedic.io/failover"

// mirrorPodAnnotation marks a static pod's mirror: kubelet owns it, the API
// cannot move it.
const mirrorPodAnnotation = "kubernetes.io/config.mirror"

// claimInfo is what the policy needs of a PersistentVolumeClaim and its
// PersistentVolume.
type claimInfo struct {
	// PV is the bound PersistentVolume's name ("" while unbound).
	PV string
	// AccessModes are the PV's when it is known, else the claim's.
	AccessModes  []corev1.PersistentVolumeAccessMode
	StorageClass string
	// NodeLocal: a local or hostPath PV lives on the node; moving the pod
	// cannot help.
	NodeLocal bool
	// Driver and VolumeHandle are the PV's CSI source ("" for other
	// volumes): they name its VolumeAttachment on a node.
	Driver, VolumeHandle string
	// Err is why the claim or its PV could not be read.
	Err error
}

// claimNames lists the claims a pod uses: its persistentVolumeClaim volumes
// and the claims of its generic ephemeral volumes (kubelet.ClaimName).
func claimNames(pod *corev1.Pod) []string {
	var out []string
	for i := range pod.Spec.Volumes {
		if claim, ok := kubelet.ClaimName(pod, &pod.Spec.Volumes[i]); ok {
			out = append(out, claim)
		}
	}
	return out
}

// decision is the policy's answer for one pod.
type decision struct {
	Eligible bool
	// Reason says why not (or "eligible").
	Reason string
	// PVs are the PersistentVolumes that make the pod eligible.
	PVs []string
	// Uncertain: a claim could not be read, so the answer may be wrong.
	// The fencer treats an uncertain pod as eligible; the controller tries
	// again later.
	Uncertain bool
}

// Reasons a pod is not eligible.
const (
	reasonEligible        = "eligible"
	reasonTerminated      = "pod has terminated"
	reasonNoController    = "no controller owns the pod"
	reasonDaemonSet       = "a DaemonSet pod belongs on its node"
	reasonMirror          = "static pod"
	reasonOptedOut        = "opted out by annotation " + Annotation + "=false"
	reasonBadAnnotation   = "annotation " + Annotation + " is neither true nor false"
	reasonNamespace       = "namespace not selected"
	reasonNoRWO           = "no ReadWriteOnce or ReadWriteOncePod volume"
	reasonStorageClass    = "its ReadWriteOnce volumes' StorageClasses are not selected"
	reasonNodeLocal       = "its ReadWriteOnce volumes are node-local"
	reasonLookupFailed    = "a claim could not be read"
	reasonNoVolumesClaims = "no PersistentVolumeClaim"
)

// decide applies the eligibility rules to a pod whose claims were read into
// claims (by claim name; a missing entry counts as unreadable).
func (c *Policy) decide(pod *corev1.Pod, claims map[string]claimInfo) decision {
	if pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed {
		return decision{Reason: reasonTerminated}
	}
	if _, ok := pod.Annotations[mirrorPodAnnotation]; ok {
		return decision{Reason: reasonMirror}
	}
	owner := metav1.GetControllerOfNoCopy(pod)
	switch {
	case owner == nil:
		return decision{Reason: reasonNoController}
	case owner.Kind == "DaemonSet":
		return decision{Reason: reasonDaemonSet}
	}
	optIn := false
	switch v, ok := pod.Annotations[Annotation]; {
	case !ok:
	case v == "false":
		return decision{Reason: reasonOptedOut}
	case v == "true":
		optIn = true
	default:
		return decision{Reason: fmt.Sprintf("%s (%q): fix the annotation", reasonBadAnnotation, v)}
	}
	if slices.Contains(c.ExcludeNamespaces, pod.Namespace) ||
		(!optIn && len(c.IncludeNamespaces) > 0 && !slices.Contains(c.IncludeNamespaces, pod.Namespace)) {
		return decision{Reason: reasonNamespace}
	}
	names := claimNames(pod)
	if len(names) == 0 {
		return decision{Reason: reasonNoVolumesClaims}
	}
	var d decision
	sawRWO, sawLocal := false, false
	for _, name := range names {
		info, ok := claims[name]
		if !ok || info.Err != nil {
			d.Uncertain = true
			continue
		}
		if !readWriteOnce(info.AccessModes) {
			continue
		}
		sawRWO = true
		if info.NodeLocal {
			sawLocal = true
			continue
		}
		if slices.Contains(c.ExcludeStorageClasses, info.StorageClass) ||
			(!optIn && len(c.IncludeStorageClasses) > 0 && !slices.Contains(c.IncludeStorageClasses, info.StorageClass)) {
			continue
		}
		if info.PV != "" && !slices.Contains(d.PVs, info.PV) {
			d.PVs = append(d.PVs, info.PV)
		} else if info.PV == "" {
			// An unbound claim of a running pod: nothing is attached.
			continue
		}
	}
	switch {
	case len(d.PVs) > 0:
		d.Eligible, d.Reason = true, reasonEligible
	case d.Uncertain:
		d.Reason = reasonLookupFailed
	case sawLocal:
		d.Reason = reasonNodeLocal
	case sawRWO:
		d.Reason = reasonStorageClass
	default:
		d.Reason = reasonNoRWO
	}
	return d
}

func readWriteOnce(modes []corev1.PersistentVolumeAccessMode) bool {
	return slices.Contains(modes, corev1.ReadWriteOnce) || slices.Contains(modes, corev1.ReadWriteOncePod)
}

// claimReader reads claims and PVs with a deadline per call.
type claimReader struct {
	client  kubernetes.Interface
	timeout time.Duration
}

// claim reads claim ns/name and its PV. A claim that does not exist is an
// error too (the pod cannot run without it, so an answer would be a guess).
func (r claimReader) claim(ctx context.Context, ns, name string) claimInfo {
	cctx, cancel := context.WithTimeout(ctx, r.timeout)
	pvc, err := r.client.CoreV1().PersistentVolumeClaims(ns).Get(cctx, name, metav1.GetOptions{})
	cancel()
	if err != nil {
		return claimInfo{Err: fmt.Errorf("get claim %s/%s: %w", ns, name, err)}
	}
	info := claimInfo{PV: pvc.Spec.VolumeName, AccessModes: pvc.Spec.AccessModes}
	if pvc.Spec.StorageClassName != nil {
		info.StorageClass = *pvc.Spec.StorageClassName
	}
	if info.PV == "" {
		return info
	}
	cctx, cancel = context.WithTimeout(ctx, r.timeout)
	pv, err := r.client.CoreV1().PersistentVolumes().Get(cctx, info.PV, metav1.GetOptions{})
	cancel()
	switch {
	case apierrors.IsNotFound(err):
		// The claim names a PV that is gone: nothing to attach or detach.
		info.PV = ""
		return info
	case err != nil:
		return claimInfo{Err: fmt.Errorf("get persistent volume %s of claim %s/%s: %w", info.PV, ns, name, err)}
	}
	if len(pv.Spec.AccessModes) > 0 {
		info.AccessModes = pv.Spec.AccessModes
	}
	if pv.Spec.StorageClassName != "" {
		info.StorageClass = pv.Spec.StorageClassName
	}
	info.NodeLocal = pv.Spec.Local != nil || pv.Spec.HostPath != nil
	if csi := pv.Spec.CSI; csi != nil {
		info.Driver, info.VolumeHandle = csi.Driver, csi.VolumeHandle
	}
	return info
}

// attachmentName is the name of the VolumeAttachment of a CSI volume on a
// node (kubelet.AttachmentName). The controller reads and deletes
// attachments by this name instead of listing them all.
func attachmentName(volumeHandle, driver, node string) string {
	return kubelet.AttachmentName(volumeHandle, driver, node)
}
