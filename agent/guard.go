package agent

import (
	"context"
	"errors"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/probe/kubelet"
	"github.com/mountmedic/mountmedic/remount"
)

// guardNow guards, before any run starts, the publish targets that lost
// their mount of the broken volumes no run is under way for, in every
// probe cycle and whether or not a run can repair them: a volume whose
// driver is down waits for the driver (or the resync) before its next run,
// and a container kubelet starts meanwhile must not write to the node's
// disk. A queued volume is guarded here before its run starts. A volume
// with a run under way is left to it: the guard must never land between
// the run's unmount and its NodePublishVolume (the driver would take the
// guard for the published volume).
func (a *Agent) guardNow(ctx context.Context, broken map[string]*brokenVolume) {
	if !a.cfg.Guard || a.repairer == nil {
		return
	}
	for key, bv := range broken {
		if st := a.decider.vols[key]; st != nil && st.inflight || !bv.unguarded() {
			continue
		}
		if j := a.prepare(bv); j != nil && (j.skip == "" || j.reported) {
			a.guardMissing(ctx, j)
		}
	}
}

// guardMissing mounts the guard (remount.Repairer.Guard) over each publish
// target of the job's running pods that kubelet set up but that is no
// longer a mount point (the probe's Missing, past kubelet's publish
// window); guardNow calls it for volumes with no run under way. A Pending
// pod's target is kubelet's to publish and is left alone.
func (a *Agent) guardMissing(ctx context.Context, j *job) {
	logger := klog.FromContext(ctx)
	if m := j.vol.stagingGuardable(); m != nil && m.ID == 0 {
		a.guardStaging(ctx, j, m.Path)
	}
	for _, pod := range j.active {
		use := j.vol.pods[string(pod.UID)]
		if pod.Status.Phase != corev1.PodRunning || use == nil {
			continue
		}
		for _, m := range use.dead {
			if m == nil || m.ID != 0 || m.Target.Kind != kubelet.KindPublish {
				continue // mounted (dead, or guarded already), or not a publish target
			}
			act := a.repairer.Guard(ctx, m.Path)
			if errors.Is(act.Err, remount.ErrMountChanged) {
				continue // published again meanwhile
			}
			result := guardResult(act)
			// Every cycle tries an unguarded target again: a dry run's
			// plan and a failure count, log and report once an episode.
			first := a.notes.once(j.key, noteGuard, result+" "+m.Path)
			if result == resultSuccess || first {
				a.metrics.guards.WithLabelValues(result).Inc()
			}
			if act.Err != nil {
				if first {
					logger.Error(act.Err, "Guarding a publish target that lost its mount failed", "pod", klog.KObj(pod), "path", m.Path)
				}
				continue
			}
			if first {
				what := "mounted a read-only guard there"
				if act.DryRun {
					what = "would mount a read-only guard there"
				}
				a.report.pod(pod, nil, corev1.EventTypeWarning, ReasonVolumeGuarded, actionGuard, a.report.message(
					"the volume's publish target lost its mount: mountmedic %s, so that a container started on it now fails to write (read-only file system) instead of writing to the node's disk, until the volume is repaired", what))
			}
		}
	}
}

// guardResult is the metrics result of a guard's action.
func guardResult(act remount.Action) string {
	switch {
	case act.Err != nil:
		return resultFailure
	case act.DryRun:
		return resultDryRun
	}
	return resultSuccess
}
