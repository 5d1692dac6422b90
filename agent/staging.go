package agent

import (
	"context"
	"errors"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/probe/kubelet"
	"github.com/mountmedic/mountmedic/remount"
)

// stagingGuardable is the volume's lost staging path (lostStaging) when
// the agent may guard it and stage it again without waiting for strikes:
// its driver is catalogued as staging at globalmount (a driver that does
// not stage leaves globalmount bare, and one not catalogued may be such a
// driver). The probe lists a staging path as lost only while a pod's
// publish target shows another filesystem than the bare directory's: a
// staging mount was there. nil otherwise.
func (v *brokenVolume) stagingGuardable() *probe.Mount {
	m := v.lostStaging()
	if m == nil {
		return nil
	}
	d, ok := kubelet.LookupDriver(v.driver)
	if !ok || d.Layout != kubelet.LayoutGlobalMount {
		return nil
	}
	return m
}

// guardStaging mounts the guard over the volume's staging path, which lost
// its mount under live publish targets: until the re-stage, a pod
// published from it gets the guard (its writes fail), not the node's disk.
// A guard there also reaches every bind of the bare directory (a pod
// published from it before the guard came): such a pod then reads the
// guard, and the re-stage's fresh mount, instead of the node's disk, and
// the failover fence unmounts that guard with the pod's volume
// (remount.Unmounter.UnmountFromTable).
func (a *Agent) guardStaging(ctx context.Context, j *job, path string) {
	act := a.repairer.Guard(ctx, path)
	if errors.Is(act.Err, remount.ErrMountChanged) {
		return // staged again meanwhile
	}
	result := guardResult(act)
	first := a.notes.once(j.key, noteGuard, result+" "+path)
	if result == resultSuccess || first {
		a.metrics.guards.WithLabelValues(result).Inc()
	}
	if !first {
		return
	}
	if act.Err != nil {
		klog.FromContext(ctx).Error(act.Err, "Guarding a staging path that lost its mount failed", "path", path)
		return
	}
	what := "mounted a read-only guard there"
	if act.DryRun {
		what = "would mount a read-only guard there"
	}
	for _, pod := range j.active {
		a.report.pod(pod, nil, corev1.EventTypeWarning, ReasonVolumeGuarded, actionGuard, a.report.message(
			"the volume's staging mount is gone while this pod uses it (a stale FUSE daemon unmounting its old mountpoint by path does this): mountmedic %s, so that a pod published from it fails to write instead of writing to the node's disk, and stages the volume again at once", what))
	}
}
