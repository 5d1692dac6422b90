package agent

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/remount"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// errAPIWait marks a repair that waits for the API server (an object or a
// Secret it needs could not be read): retry with backoff, never escalate.
var errAPIWait = errors.New("waiting for the API server")

// podVolume finds the pod's spec.volumes entry behind a broken mount and its
// claim, if any: directly when a subPath bind or plugin path names it, else
// by the claim bound to the PV the publish target is named after.
func (a *Agent) podVolume(ctx context.Context, pod *corev1.Pod, use *podUse) (*corev1.Volume, *corev1.PersistentVolumeClaim, error) {
	byName := func(name string) *corev1.Volume {
		for i := range pod.Spec.Volumes {
			if pod.Spec.Volumes[i].Name == name {
				return &pod.Spec.Volumes[i]
			}
		}
		return nil
	}
	withClaim := func(v *corev1.Volume) (*corev1.Volume, *corev1.PersistentVolumeClaim, error) {
		claim, ok := kubelet.ClaimName(pod, v)
		if !ok {
			return v, nil, nil
		}
		pvc, err := a.kube.pvc(ctx, pod.Namespace, claim)
		if err != nil {
			return v, nil, fmt.Errorf("get PersistentVolumeClaim %s/%s: %w", pod.Namespace, claim, err)
		}
		return v, pvc, nil
	}
	if use.volumeName != "" {
		if v := byName(use.volumeName); v != nil {
			return withClaim(v)
		}
		return nil, nil, fmt.Errorf("pod has no volume %q that its mounts name", use.volumeName)
	}
	if v := byName(use.specName); v != nil {
		if _, ok := kubelet.ClaimName(pod, v); !ok {
			return v, nil, nil // an inline volume
		}
	}
	// The PV read ahead names its claim: read that one first. A pod with
	// many claims then costs one claim read, not one per claim before
	// it. The claim must still name the PV (a PV released and bound
	// again names another claim).
	if pv := a.kube.pvs.lookup(use.specName); pv != nil && pv.Spec.ClaimRef != nil && pv.Spec.ClaimRef.Namespace == pod.Namespace {
		for i := range pod.Spec.Volumes {
			v := &pod.Spec.Volumes[i]
			if claim, ok := kubelet.ClaimName(pod, v); ok && claim == pv.Spec.ClaimRef.Name {
				pvc, err := a.kube.pvc(ctx, pod.Namespace, claim)
				if err != nil {
					return v, nil, fmt.Errorf("get PersistentVolumeClaim %s/%s: %w", pod.Namespace, claim, err)
				}
				if pvc.Spec.VolumeName == use.specName {
					return v, pvc, nil
				}
				break
			}
		}
	}
	var errs []error
	for i := range pod.Spec.Volumes {
		v := &pod.Spec.Volumes[i]
		claim, ok := kubelet.ClaimName(pod, v)
		if !ok {
			continue
		}
		pvc, err := a.kube.pvc(ctx, pod.Namespace, claim)
		if err != nil {
			errs = append(errs, fmt.Errorf("get PersistentVolumeClaim %s/%s: %w", pod.Namespace, claim, err))
			continue
		}
		if pvc.Spec.VolumeName == use.specName {
			return v, pvc, nil
		}
	}
	if len(errs) > 0 {
		return nil, nil, errors.Join(errs...)
	}
	return nil, nil, fmt.Errorf("no volume of the pod is bound to PersistentVolume %q", use.specName)
}

// optedOut reports whether obj's annotations opt it out of repairs, and a
// complaint for a value that is neither "true" nor "false" (treated as an
// opt-out: when in doubt, do not touch).
func optedOut(annotations map[string]string) (bool, string) {
	v, ok := annotations[OptOutAnnotation]
	switch {
	case !ok || v == "true":
		return false, ""
	case v == "false":
		return true, ""
	}
	return true, fmt.Sprintf("annotation %s=%q is neither \"true\" nor \"false\": treated as \"false\"; set \"false\" to opt out or remove it", OptOutAnnotation, v)
}

// containerMounts lists where the pod's running containers see the volume,
// and the runtime IDs of those that need the fresh mount put into their own
// mount namespace (a subPath, or propagation other than HostToContainer and
// Bidirectional: a re-stage on the host never reaches those).
//
// unseen names the regular and ephemeral containers of a pod that is not
// being deleted that would see the volume through their own bind and have
// no status yet or a waiting one: kubelet reports a container some time
// after it starts, so one may run on the dead mount already (see
// resolved.unseen).
func containerMounts(pod *corev1.Pod, volume string) (_ []remount.ContainerMount, own, unseen []string) {
	running := runningContainers(pod)
	live := pod.DeletionTimestamp == nil && (pod.Status.Phase == corev1.PodPending || pod.Status.Phase == corev1.PodRunning)
	// Not reported yet: no status, or waiting (kubelet's "ContainerCreating"
	// until its next status sync). A terminated one holds no mount.
	reported := make(map[string]bool)
	for _, list := range [][]corev1.ContainerStatus{pod.Status.ContainerStatuses, pod.Status.EphemeralContainerStatuses} {
		for _, st := range list {
			if st.State.Waiting == nil {
				reported[st.Name] = true
			}
		}
	}
	type ctr struct {
		name   string
		env    []corev1.EnvVar
		mounts []corev1.VolumeMount
		init   bool
	}
	var ctrs []ctr
	for _, c := range pod.Spec.InitContainers {
		ctrs = append(ctrs, ctr{c.Name, c.Env, c.VolumeMounts, true})
	}
	for _, c := range pod.Spec.Containers {
		ctrs = append(ctrs, ctr{c.Name, c.Env, c.VolumeMounts, false})
	}
	for _, c := range pod.Spec.EphemeralContainers {
		ctrs = append(ctrs, ctr{c.Name, c.Env, c.VolumeMounts, false})
	}
	var out []remount.ContainerMount
	for _, c := range ctrs {
		id, ok := running[c.name]
		if !ok {
			if live && !c.init && !reported[c.name] && ownBind(c.mounts, volume) && !slices.Contains(unseen, c.name) {
				unseen = append(unseen, c.name)
			}
			continue
		}
		for _, vm := range c.mounts {
			if vm.Name != volume {
				continue
			}
			sub := vm.SubPath
			if vm.SubPathExpr != "" {
				var ok bool
				if sub, ok = expandSubPath(vm.SubPathExpr, pod, c.env); !ok {
					continue // needs a ConfigMap or Secret value: left to restart/evict
				}
			}
			out = append(out, remount.ContainerMount{PodUID: pod.UID, Container: c.name, ContainerID: id, MountPath: vm.MountPath})
			p := vm.MountPropagation
			if (sub != "" || p == nil || (*p != corev1.MountPropagationHostToContainer && *p != corev1.MountPropagationBidirectional)) &&
				!slices.Contains(own, id) {
				own = append(own, id)
			}
		}
	}
	return out, own, unseen
}

// ownBind reports whether one of mounts is of volume and reaches the
// container through the container's own bind (a subPath, or propagation
// other than HostToContainer and Bidirectional), which a re-stage on the
// host does not reach.
func ownBind(mounts []corev1.VolumeMount, volume string) bool {
	for _, vm := range mounts {
		if vm.Name != volume {
			continue
		}
		p := vm.MountPropagation
		if vm.SubPath != "" || vm.SubPathExpr != "" || p == nil ||
			(*p != corev1.MountPropagationHostToContainer && *p != corev1.MountPropagationBidirectional) {
			return true
		}
	}
	return false
}

// runningContainers maps the names of the pod's running containers (init,
// regular and ephemeral) to their runtime IDs.
func runningContainers(pod *corev1.Pod) map[string]string {
	running := make(map[string]string)
	for _, list := range [][]corev1.ContainerStatus{pod.Status.InitContainerStatuses, pod.Status.ContainerStatuses, pod.Status.EphemeralContainerStatuses} {
		for _, st := range list {
			if st.State.Running != nil {
				running[st.Name] = stripRuntime(st.ContainerID)
			}
		}
	}
	return running
}

// stripRuntime turns a status containerID ("containerd://abc") into the
// runtime's ID ("abc").
func stripRuntime(id string) string {
	if _, after, ok := strings.Cut(id, "://"); ok {
		return after
	}
	return id
}

// expandSubPath expands $(VAR) in a subPathExpr the way kubelet does, from
// the container's literal env values and the pod fields the downward API
// gives; unknown variables stay as written. It fails for a variable that
// comes from a ConfigMap, a Secret or a resource field.
func expandSubPath(expr string, pod *corev1.Pod, env []corev1.EnvVar) (string, bool) {
	vars := make(map[string]string)
	unresolved := make(map[string]bool)
	for _, e := range env {
		switch {
		case e.ValueFrom == nil:
			vars[e.Name] = expandVars(e.Value, vars)
		case e.ValueFrom.FieldRef != nil:
			if v, ok := podField(pod, e.ValueFrom.FieldRef.FieldPath); ok {
				vars[e.Name] = v
			} else {
				unresolved[e.Name] = true
			}
		default:
			unresolved[e.Name] = true
		}
	}
	for name := range unresolved {
		if strings.Contains(expr, "$("+name+")") {
			return "", false
		}
	}
	return expandVars(expr, vars), true
}

func podField(pod *corev1.Pod, path string) (string, bool) {
	switch path {
	case "metadata.name":
		return pod.Name, true
	case "metadata.namespace":
		return pod.Namespace, true
	case "metadata.uid":
		return string(pod.UID), true
	case "spec.nodeName":
		return pod.Spec.NodeName, true
	case "spec.serviceAccountName":
		return pod.Spec.ServiceAccountName, true
	case "status.podIP":
		return pod.Status.PodIP, true
	case "status.hostIP":
		return pod.Status.HostIP, true
	}
	return "", false
}

// expandVars replaces $(NAME) with vars[NAME] and $$ with $; a reference to
// an unknown name is left as written.
func expandVars(s string, vars map[string]string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] != '$' || i+1 >= len(s) {
			b.WriteByte(s[i])
			continue
		}
		switch s[i+1] {
		case '$':
			b.WriteByte('$')
			i++
		case '(':
			end := strings.IndexByte(s[i+2:], ')')
			if end < 0 {
				b.WriteString(s[i:])
				return b.String()
			}
			name := s[i+2 : i+2+end]
			if v, ok := vars[name]; ok {
				b.WriteString(v)
			} else {
				b.WriteString(s[i : i+3+end])
			}
			i += 2 + end
		default:
			b.WriteByte(s[i])
		}
	}
	return b.String()
}

// resolved is a broken volume with what the ladder needs from the API.
type resolved struct {
	vol *remount.Volume
	// pods are the pods the ladder acts on; pvc is the volume's claim (nil
	// for inline and plugin volumes).
	pods []*corev1.Pod
	pvc  *corev1.PersistentVolumeClaim
	// restageable: a CSI PV volume that BuildVolumeRequest could describe;
	// when false only eviction can help.
	restageable bool
	// needSwap: a container sees the volume through its own bind.
	needSwap bool
	// ownBinds are, by pod UID, the runtime IDs of the running containers
	// that see the volume through their own bind, which a re-stage on the
	// host does not reach.
	ownBinds map[string][]string
	// unseen are, by pod UID, the containers that see the volume through
	// their own bind and had no Running status when the volume was
	// resolved (containerMounts). One that started on the dead mount just
	// before the repair is invisible to the live swap until kubelet
	// reports it: a run that heals the host leaves a residual that looks
	// again until they run or unseenWait passes.
	unseen map[string][]string
	// volumes are, by pod UID, the pod's name of the volume, to read its
	// containers' mounts again from a fresh pod.
	volumes map[string]string
	// why is the reason restageable is false.
	why string
}

// setContainers records, for the pod with uid, its volume's name and
// which of its containers see the volume through their own bind: running
// (own, by runtime ID) and not reported running yet (unseen, by name).
// The maps are copied first: a residual's resolved shares them.
func (r *resolved) setContainers(uid, volume string, own, unseen []string) {
	r.volumes = maps.Clone(r.volumes)
	r.ownBinds = maps.Clone(r.ownBinds)
	r.unseen = maps.Clone(r.unseen)
	if r.volumes == nil {
		r.volumes = make(map[string]string)
	}
	r.volumes[uid] = volume
	delete(r.ownBinds, uid)
	delete(r.unseen, uid)
	if len(own) > 0 {
		if r.ownBinds == nil {
			r.ownBinds = make(map[string][]string)
		}
		r.ownBinds[uid] = own
	}
	if len(unseen) > 0 {
		if r.unseen == nil {
			r.unseen = make(map[string][]string)
		}
		r.unseen[uid] = unseen
	}
	r.needSwap = len(r.ownBinds) > 0
}

// refreshContainers reads the containers' mounts of the pods that had
// containers not yet reported running from the fresh pods (r.pods): a
// container kubelet reports running since is swapped like the others.
func (r *resolved) refreshContainers() {
	if len(r.unseen) == 0 {
		return
	}
	vol := *r.vol
	vol.Pods = slices.Clone(r.vol.Pods)
	for _, pod := range r.pods {
		uid := string(pod.UID)
		if _, ok := r.unseen[uid]; !ok {
			continue
		}
		cms, own, unseen := containerMounts(pod, r.volumes[uid])
		r.setContainers(uid, r.volumes[uid], own, unseen)
		for i := range vol.Pods {
			if vol.Pods[i].Publish.PodUID == pod.UID {
				vol.Pods[i].Containers = cms
			}
		}
	}
	r.vol = &vol
}

// wipe drops the secret values of a volume's requests after the repair.
func (r *resolved) wipe() {
	if r == nil || r.vol == nil {
		return
	}
	clear(r.vol.Stage.StageSecrets)
	clear(r.vol.Stage.PublishSecrets)
	for i := range r.vol.Pods {
		clear(r.vol.Pods[i].Publish.StageSecrets)
		clear(r.vol.Pods[i].Publish.PublishSecrets)
		delete(r.vol.Pods[i].Publish.PodAttributes, kubelet.ServiceAccountTokensKey)
	}
}

// resolve builds the remount.Volume of a broken volume for the pods of a
// job: the pod volume and claim behind each pod's mounts, the PV, CSIDriver,
// VolumeAttachment and Secrets, the driver's capabilities, and each running
// container's mounts. needRequests is false when only eviction remains (no
// driver call, no Secret).
func (a *Agent) resolve(ctx context.Context, j *job, needRequests bool) (*resolved, error) {
	logger := klog.FromContext(ctx)
	bv := j.vol
	r := &resolved{vol: &remount.Volume{Driver: bv.driver, VolumeHandle: bv.volumeHandle, Backend: bv.backend, Hung: bv.hung},
		restageable: bv.csi}
	if !bv.csi {
		r.why = "not a CSI volume: only eviction gets the pod fresh mounts"
	}
	// Claims and pod volumes first: the PVC carries the opt-out annotation.
	type podVol struct {
		pod *corev1.Pod
		use *podUse
		vol *corev1.Volume
		pvc *corev1.PersistentVolumeClaim // nil for a volume without a claim
	}
	var pvs []podVol
	for _, pod := range j.active {
		use := bv.pods[string(pod.UID)]
		v, pvc, err := a.podVolume(ctx, pod, use)
		if err != nil {
			if unreachable(err) {
				return r, fmt.Errorf("pod %s: %w: %w", klog.KObj(pod), errAPIWait, err)
			}
			return r, fmt.Errorf("pod %s: %w", klog.KObj(pod), err)
		}
		if pvc != nil && r.pvc == nil {
			r.pvc = pvc
		}
		pvs = append(pvs, podVol{pod, use, v, pvc})
		r.pods = append(r.pods, pod)
	}
	if r.pvc != nil {
		if out, complaint := optedOut(r.pvc.Annotations); out {
			return r, &optOutError{what: "PersistentVolumeClaim " + klog.KObj(r.pvc).String(), complaint: complaint}
		}
	}
	if !bv.csi || !needRequests {
		return r, nil
	}

	caps, err := a.caps.get(ctx, bv.driver)
	if err != nil {
		return r, err
	}
	secrets := make(map[types.NamespacedName]*corev1.Secret)
	getSecret := func(ref *corev1.SecretReference) (*corev1.Secret, error) {
		if ref == nil {
			return nil, nil
		}
		key := types.NamespacedName{Namespace: ref.Namespace, Name: ref.Name}
		if s, ok := secrets[key]; ok {
			return s, nil
		}
		s, err := a.kube.secret(ctx, ref.Namespace, ref.Name)
		if err != nil {
			if unreachable(err) {
				return nil, fmt.Errorf("get Secret %s: %w: %w", key, errAPIWait, err)
			}
			return nil, fmt.Errorf("get Secret %s: %w", key, err)
		}
		secrets[key] = s
		return s, nil
	}
	for _, pv := range pvs {
		in := kubelet.VolumeObjects{Pod: pv.pod, VolumeName: pv.vol.Name, PVC: pv.pvc, Capabilities: caps, KubeletRoot: a.cfg.KubeletRoot}
		if in.PVC != nil && in.PVC.Spec.VolumeName != "" {
			if in.PV, err = a.kube.pv(ctx, in.PVC.Spec.VolumeName); err != nil {
				return r, apiErr("PersistentVolume "+in.PVC.Spec.VolumeName, err)
			}
		}
		if in.CSIDriver, err = a.kube.csiDriver(ctx, bv.driver); err != nil {
			return r, apiErr("CSIDriver "+bv.driver, err)
		}
		if in.PV != nil && in.PV.Spec.CSI != nil && (in.CSIDriver == nil || in.CSIDriver.Spec.AttachRequired == nil || *in.CSIDriver.Spec.AttachRequired) {
			name := kubelet.AttachmentName(in.PV.Spec.CSI.VolumeHandle, in.PV.Spec.CSI.Driver, pv.pod.Spec.NodeName)
			va, err := a.kube.volumeAttachment(ctx, name)
			if err != nil && !apierrors.IsNotFound(err) {
				return r, apiErr("VolumeAttachment "+name, err)
			}
			in.VolumeAttachment = va
		}
		if d := in.CSIDriver; d != nil && len(d.Spec.TokenRequests) > 0 {
			r.restageable = false
			r.why = fmt.Sprintf("CSIDriver %s asks for service account tokens, which mountmedic does not mint", d.Name)
			return r, nil
		}
		stageRef, publishRef := kubelet.SecretRefs(in.PV)
		if stageRef != nil && (caps.StageUnstage || (in.PV.Spec.VolumeMode != nil && *in.PV.Spec.VolumeMode == corev1.PersistentVolumeBlock)) {
			if in.StageSecret, err = getSecret(stageRef); err != nil {
				return r, err
			}
		}
		if in.PublishSecret, err = getSecret(publishRef); err != nil {
			return r, err
		}
		vr, err := kubelet.BuildVolumeRequest(in)
		if err != nil {
			if errors.Is(err, kubelet.ErrUnsupportedVolume) {
				r.restageable = false
				r.why = err.Error()
				return r, nil
			}
			if errors.Is(err, kubelet.ErrObjectMismatch) {
				// Perhaps a stale cache: read them afresh next time.
				claim, _ := kubelet.ClaimName(pv.pod, pv.vol)
				a.kube.forget("pvc/"+pv.pod.Namespace+"/"+claim, "csidriver/"+bv.driver)
				if in.PV != nil {
					a.kube.forget("pv/" + in.PV.Name)
				}
			}
			return r, err
		}
		if r.vol.VolumeHandle == "" {
			r.vol.VolumeHandle = vr.VolumeHandle
		}
		if len(r.vol.Pods) == 0 {
			r.vol.Stage = vr
		}
		cms, own, unseen := containerMounts(pv.pod, pv.vol.Name)
		// A pod with no dead mount (its volume lost only its staging
		// mount) has containers that see a live volume: nothing to swap.
		if len(pv.use.dead) > 0 {
			r.setContainers(string(pv.pod.UID), pv.vol.Name, own, unseen)
		}
		r.vol.Pods = append(r.vol.Pods, remount.PodVolume{Publish: vr, Dead: pv.use.dead, Containers: cms})
	}
	clear(secrets)
	logger.V(4).Info("Resolved volume", "pods", len(r.vol.Pods), "stageUnstage", caps.StageUnstage)
	return r, nil
}

// apiErr wraps a GET failure, marking it errAPIWait when the API server
// could not be reached.
func apiErr(what string, err error) error {
	if unreachable(err) {
		return fmt.Errorf("get %s: %w: %w", what, errAPIWait, err)
	}
	return fmt.Errorf("get %s: %w", what, err)
}

// optOutError is a volume opted out of repairs by annotation.
type optOutError struct {
	what      string
	complaint string
}

func (e *optOutError) Error() string {
	if e.complaint != "" {
		return e.what + ": " + e.complaint
	}
	return e.what + " has annotation " + OptOutAnnotation + "=\"false\": not repaired"
}
