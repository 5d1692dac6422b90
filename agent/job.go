package agent

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/probe/kubelet"
	"github.com/mountmedic/mountmedic/remount"
)

// job is one repair run for one broken volume, prepared by the loop.
type job struct {
	key  string
	vol  *brokenVolume
	skip string // non-empty: report the volume, do not repair it (why)
	// reported: skip comes from the driver catalogue (the agent cannot
	// heal this driver's volumes); its lost publish targets are guarded
	// all the same.
	reported bool
	// recovery: the catalogue's Recovery of a reported volume whose daemon
	// is out of the node plugin's reach (outofreach.go).
	recovery *kubelet.Recovery
	// active are the pods to repair; terminating are pods being deleted
	// that still hold dead mounts; excluded are opted out or filtered
	// pods, with why.
	active      []*corev1.Pod
	terminating []*corev1.Pod
	excluded    map[*corev1.Pod]string
	floor       remount.Tier
	since       time.Time
	attempt     int
	// resume, when set, is a residual to finish: the host was re-staged
	// in an earlier run, running containers still see the dead mount.
	resume *residual
}

// jobResult is how a run ended, for the loop's decider.
type jobResult struct {
	key          string
	outcome      outcome
	reachedEvict bool
	// residual is set when the host was healed and running containers
	// were not.
	residual *residual
	// reattach: the run began with the re-attach rung (reattachFirst).
	reattach bool
}

// prepare sorts the pods of a broken volume into those to repair, those
// being deleted and those left alone, from the pod informer. It returns nil
// when no pod of the volume is known (mounts of a pod the API server no
// longer has, or a staging mount no pod uses).
func (a *Agent) prepare(bv *brokenVolume) *job {
	j := &job{key: bv.key, vol: bv, excluded: make(map[*corev1.Pod]string)}
	switch {
	case bv.block:
		j.skip = "raw block volumes are reported, not repaired"
	case bv.csi && !a.cfg.driverAllowed(bv.driver):
		j.skip = fmt.Sprintf("CSI driver %s is not in --drivers", bv.driver)
	case bv.csi:
		j.skip = notUnderstood(bv, a.cfg.RepairUnknownDrivers)
		j.reported = j.skip != ""
		if j.reported {
			j.recovery, j.skip = a.recoveryPlan(bv.driver, j.skip)
		}
	}
	n := 0
	for _, uid := range bv.podUIDs() {
		pod := a.pods.get(uid)
		if pod == nil {
			continue
		}
		if pod.Status.Phase == corev1.PodPending && onlyUnpublished(bv.pods[uid]) {
			// kubelet writes vol_data.json before NodePublishVolume: a
			// Pending pod's publish target that is not mounted yet is
			// kubelet at work, and no container of the pod runs to write
			// there: a repair would race kubelet's setup.
			continue
		}
		n++
		switch {
		case pod.DeletionTimestamp != nil || pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed:
			j.terminating = append(j.terminating, pod)
		case a.fenced != nil && a.fenced(string(pod.UID)):
			j.excluded[pod] = "the pod is fenced: this node lost its failover heartbeat, so its containers were stopped and its volumes unmounted; not repaired until the fence lifts"
		case !a.cfg.namespaceAllowed(pod.Namespace):
			j.excluded[pod] = fmt.Sprintf("namespace %s is excluded by --include-namespaces/--exclude-namespaces: not repaired", pod.Namespace)
		default:
			if out, complaint := optedOut(pod.Annotations); out {
				why := fmt.Sprintf("the pod has annotation %s=\"false\": not repaired", OptOutAnnotation)
				if complaint != "" {
					why = complaint
				}
				j.excluded[pod] = why
				continue
			}
			j.active = append(j.active, pod)
		}
	}
	if n == 0 {
		return nil
	}
	return j
}

// onlyUnpublished reports a pod whose only broken mounts of the volume are
// publish targets kubelet set up (vol_data.json) that are not mount points
// (no mount ID: the probe's Unmounted).
func onlyUnpublished(use *podUse) bool {
	if use == nil || len(use.dead) == 0 {
		return false
	}
	for _, m := range use.dead {
		if m == nil || m.ID != 0 || m.Target.Kind != kubelet.KindPublish {
			return false
		}
	}
	return true
}

// residual is what a run leaves when it re-staged the volume on the host
// but did not heal the running containers that see it through their own
// binds (a private mount or a subPath): the volume as resolved then (its
// secrets wiped; its ownBinds name those containers).
// The probe no longer sees the volume broken (the host's mounts are fresh),
// so the decider keeps it and the loop resumes the ladder after the
// re-stage until a tier heals the containers, or they are all gone
// (restarted, their pod deleted or evicted).
type residual struct {
	vol *brokenVolume
	r   *resolved
	// unseenUntil bounds the wait for r.unseen's containers to be
	// reported running (zero: no wait).
	unseenUntil time.Time
}

// unseenWait is how long a residual waits for containers that had no
// Running status when their volume was repaired on the host: a kubelet
// status sync is a second or two; a container still waiting after this
// was not running on the dead mount.
const unseenWait = 30 * time.Second

// forPods is the residual's resolved volume narrowed to pods, the fresh
// informer copies of the pods that still hold the dead mount. The stored
// residual is not changed.
func (rs *residual) forPods(pods []*corev1.Pod) *resolved {
	r := *rs.r
	vol := *rs.r.vol
	keep := make(map[types.UID]bool, len(pods))
	for _, p := range pods {
		keep[p.UID] = true
	}
	vol.Pods = nil
	for _, pv := range rs.r.vol.Pods {
		if keep[pv.Publish.PodUID] {
			vol.Pods = append(vol.Pods, pv)
		}
	}
	r.vol, r.pods = &vol, pods
	return &r
}

// holders returns the pods of the residual that still hold the dead mount:
// the pod (same UID) is not being deleted and one of the containers that
// saw the volume through its own bind still runs under the same runtime
// ID (a restarted container was bound afresh by kubelet), or, until
// unseenUntil, one of its containers that had no Running status at the
// repair runs now. waiting: a container of the latter kind is not
// reported running yet. get reads a pod by UID from the informer.
func (rs *residual) holders(get func(uid string) *corev1.Pod, now time.Time) (out []*corev1.Pod, waiting bool) {
	live := func(uid string) *corev1.Pod {
		pod := get(uid)
		if pod == nil || pod.DeletionTimestamp != nil || pod.Status.Phase == corev1.PodSucceeded || pod.Status.Phase == corev1.PodFailed {
			return nil
		}
		return pod
	}
	for uid, ids := range rs.r.ownBinds {
		pod := live(uid)
		if pod == nil {
			continue
		}
		for _, id := range runningContainers(pod) {
			if slices.Contains(ids, id) {
				out = append(out, pod)
				break
			}
		}
	}
	if now.Before(rs.unseenUntil) {
		for uid, names := range rs.r.unseen {
			pod := live(uid)
			if pod == nil || slices.ContainsFunc(out, func(p *corev1.Pod) bool { return p.UID == pod.UID }) {
				continue
			}
			running := runningContainers(pod)
			if slices.ContainsFunc(names, func(n string) bool { _, ok := running[n]; return ok }) {
				out = append(out, pod)
			} else {
				waiting = true
			}
		}
	}
	slices.SortFunc(out, func(a, b *corev1.Pod) int { return strings.Compare(string(a.UID), string(b.UID)) })
	return out, waiting
}

// withRequests is r with the CSI requests of fresh, the same volume
// resolved again for the same pods: the stage request, and each pod's
// publish request where fresh has the pod.
func (r *resolved) withRequests(fresh *resolved) *resolved {
	vol := *r.vol
	vol.Stage = fresh.vol.Stage
	vol.Pods = slices.Clone(r.vol.Pods)
	for i := range vol.Pods {
		for _, f := range fresh.vol.Pods {
			if f.Publish.PodUID == vol.Pods[i].Publish.PodUID {
				vol.Pods[i].Publish = f.Publish
				break
			}
		}
	}
	out := *r
	out.vol = &vol
	return &out
}

// prepareResidual makes the job that resumes a residual: the volume is
// re-staged on the host, some running containers still see the dead mount
// through their own binds. It returns nil, and forgets the residual, when
// none of them runs any more (restarted onto the fresh mount, or their pods
// deleted or evicted); it returns nil and keeps the residual while every
// holder is in a pod the failover heartbeat fenced.
func (a *Agent) prepareResidual(ctx context.Context, key string, rs *residual) *job {
	var pods []*corev1.Pod
	fenced := 0
	holders, waiting := rs.holders(a.pods.get, time.Now())
	for _, p := range holders {
		if a.fenced != nil && a.fenced(string(p.UID)) {
			fenced++
			continue
		}
		pods = append(pods, p)
	}
	if len(pods) == 0 && fenced > 0 {
		// The fence stopped them, it did not heal them: the residual waits
		// until the fence lifts (and deletes those pods) or they run again.
		klog.FromContext(ctx).V(2).Info("Every container that holds the dead mount is in a fenced pod: waiting for the fence to lift", "volume", key, "pods", fenced)
		return nil
	}
	if len(pods) == 0 && waiting {
		// A container that had no Running status at the repair is not
		// reported yet: the residual looks again at the next cycle.
		return nil
	}
	if len(pods) == 0 {
		a.decider.setResidual(key, nil)
		if len(rs.r.ownBinds) == 0 {
			return nil // only unseen containers, none of which ran on the dead mount
		}
		klog.FromContext(ctx).V(2).Info("No running container holds the dead mount any more", "volume", key)
		a.report.claim(rs.r.pvc, nil, corev1.EventTypeNormal, ReasonVolumeRepaired, actionRepair,
			a.report.message("no running container holds the dead mount any more (restarted onto the fresh mount, or its pod replaced)"))
		return nil
	}
	return &job{key: key, vol: rs.vol, active: pods, excluded: make(map[*corev1.Pod]string), resume: rs}
}
