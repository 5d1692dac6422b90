package agent

import (
	"context"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/probe/kubelet"
	"github.com/mountmedic/mountmedic/remount"
)

// unmountTerminating lazily unmounts the dead mounts of pods being deleted,
// so that kubelet can finish tearing them down, and force-deletes those
// stuck past their deadline when that opt-in tier is on.
func (a *Agent) unmountTerminating(ctx context.Context, j *job) outcome {
	o := outcomeWaiting
	now := time.Now()
	for _, pod := range j.terminating {
		use := j.vol.pods[string(pod.UID)]
		if use == nil {
			continue
		}
		switch {
		case !a.cfg.Tiers.Has(remount.TierUnmount) || a.repairer == nil:
			if a.notes.once(j.key, noteTerminating, string(pod.UID)) {
				a.report.pod(pod, nil, corev1.EventTypeWarning, ReasonNotRepaired, actionUnmount,
					a.report.message("the pod is terminating with %d dead mounts; the unmount tier is off", len(use.dead)))
			}
		case a.cfg.DryRun:
			a.metrics.repair(remount.TierUnmount, resultDryRun, 0)
			if a.notes.once(j.key, noteTerminating, string(pod.UID)) {
				a.report.pod(pod, nil, corev1.EventTypeNormal, ReasonNotRepaired, actionUnmount,
					a.report.message("would lazily unmount %d dead mounts of the terminating pod so that kubelet can finish", len(use.dead)))
			}
		default:
			v := &remount.Volume{Driver: j.vol.driver, VolumeHandle: j.vol.volumeHandle, Backend: j.vol.backend, Hung: j.vol.hung,
				Pods: volumeUsers(j, pod.UID, use.dead)}
			out := a.repairer.Unmount(ctx, v)
			if out.Err != nil {
				a.metrics.repair(remount.TierUnmount, resultFailure, out.Took)
				klog.FromContext(ctx).Error(out.Err, "Unmounting the dead mounts of a terminating pod failed", "pod", klog.KObj(pod))
				a.report.pod(pod, nil, corev1.EventTypeWarning, ReasonNotRepaired, actionUnmount,
					a.report.message("lazily unmounting the dead mounts of the terminating pod failed: %v", out.Err))
				o = outcomeFailed
			} else {
				a.metrics.repair(remount.TierUnmount, resultSuccess, out.Took)
				if !a.notes.once(j.key, noteUnmounted, string(pod.UID)) {
					break
				}
				a.report.pod(pod, nil, corev1.EventTypeNormal, ReasonVolumeRepaired, actionUnmount,
					a.report.message("lazily unmounted %d dead mounts of the terminating pod so that kubelet can finish", len(use.dead)))
			}
		}
		if a.cfg.Tiers.Has(remount.TierForceDelete) && a.forceDeleteOverdue(pod, now) {
			a.forceDelete(ctx, j.key, pod, nil)
		}
	}
	return o
}

// volumeUsers are the pods of the unmount tier's volume: the terminating
// pod with its dead mounts, and every other pod on the node that uses the
// volume, so that a hung connection's abort never kills a process of a
// pod that uses the volume (remount.Unmounter.Users).
func volumeUsers(j *job, uid types.UID, dead []*probe.Mount) []remount.PodVolume {
	out := []remount.PodVolume{{Publish: kubelet.VolumeRequest{PodUID: uid}, Dead: dead}}
	for other := range j.vol.pods {
		if other != string(uid) {
			out = append(out, remount.PodVolume{Publish: kubelet.VolumeRequest{PodUID: types.UID(other)}})
		}
	}
	return out
}
