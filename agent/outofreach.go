package agent

import (
	"context"
	"fmt"
	"time"

	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/probe/kubelet"
	"github.com/mountmedic/mountmedic/remount"
)

// A catalogued driver whose daemon lives out of the node plugin's reach (a
// JuiceFS mount pod, a GCS FUSE sidecar, a Longhorn engine) is never
// re-staged: the catalogue's Recovery says who brings its daemon back and
// how long that takes, and, with --escalate-out-of-reach, the agent then
// takes the escalation it names through the ladder's own eviction rung.

// recoveryPlan returns the catalogue's Recovery of a reported volume's
// driver, nil when it has none, and why it is reported with what the agent
// will do about it.
func (a *Agent) recoveryPlan(driver, why string) (*kubelet.Recovery, string) {
	d, ok := kubelet.LookupDriver(driver)
	if !ok || d.Recovery == nil {
		return nil, why
	}
	r := d.Recovery
	var then string
	switch {
	case r.Then == kubelet.EscalateNone:
		then = "mountmedic reports it only"
	case !a.cfg.EscalateOutOfReach:
		then = "mountmedic reports it only; with --escalate-out-of-reach it would " + a.escalationText(r)
	case !a.evictionOn():
		then = "--escalate-out-of-reach would have mountmedic " + a.escalationText(r) + ", but neither evict nor delete is among --tiers: reported only"
	default:
		then = "mountmedic will " + a.escalationText(r)
	}
	return r, fmt.Sprintf("%s; recovery: %s; %s", why, r.By, then)
}

// escalationText says what the escalation of r does, and when.
func (a *Agent) escalationText(r *kubelet.Recovery) string {
	verb, budgets := "evict", "PodDisruptionBudgets respected"
	if !a.cfg.Tiers.Has(remount.TierEvict) && a.cfg.Tiers.Has(remount.TierDelete) {
		// A deletion does not ask the PodDisruptionBudgets.
		verb, budgets = "delete (UID precondition)", "PodDisruptionBudgets not asked"
	}
	what := verb + " the volume's pods that a controller owns (" + budgets + "; never a pod no controller owns)"
	if r.Grace > 0 {
		what += fmt.Sprintf(" when the volume is still dead %s after it was found dead", r.Grace)
	}
	return what
}

// evictionOn reports whether the ladder's eviction rung is enabled (evict,
// or the delete that stands in for it).
func (a *Agent) evictionOn() bool {
	return a.cfg.Tiers.Has(remount.TierEvict) || a.cfg.Tiers.Has(remount.TierDelete)
}

// outOfReach decides a reported volume's run: escalate, the run goes on to
// the eviction rung alone (never a re-stage, nor an unmount); otherwise it
// ends with the returned outcome: waiting while the driver's own recovery
// has time left, ignored when no escalation is opted in.
func (a *Agent) outOfReach(ctx context.Context, j *job) (_ outcome, escalate bool) {
	r := j.recovery
	if r == nil || r.Then != kubelet.EscalateEvict || !a.cfg.EscalateOutOfReach || !a.evictionOn() || len(j.active) == 0 {
		return outcomeIgnored, false
	}
	if left := r.Grace - time.Since(j.since); left > 0 {
		klog.FromContext(ctx).V(2).Info("Waiting for the driver's own recovery before evicting", "recovery", r.By, "left", left.Round(time.Second))
		return outcomeWaiting, false
	}
	return outcomeWaiting, true
}
