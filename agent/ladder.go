package agent

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/remount"
)

// repairer is what the agent needs of the mount side (remount.Repairer).
// Each call acts on one broken volume and reports what it did; an Outcome
// whose Err matches remount.ErrDriverUnavailable means "retry when the
// driver is back", not a failure to escalate.
type repairer interface {
	Restage(ctx context.Context, v *remount.Volume) remount.Outcome
	LiveSwap(ctx context.Context, v *remount.Volume) remount.Outcome
	Restart(ctx context.Context, v *remount.Volume) remount.Outcome
	Unmount(ctx context.Context, v *remount.Volume) remount.Outcome
	Guard(ctx context.Context, target string) remount.Action
}

// rungs lists the ladder rungs a run may take, from floor: the node-side
// tiers when the volume can be re-staged here (the re-attach first for an
// NBD volume, nbdRungs), then eviction (or, with eviction off, the delete
// that stands in for it).
func (a *Agent) rungs(v *brokenVolume, restageable bool, floor remount.Tier) []remount.Tier {
	var out []remount.Tier
	t := a.cfg.Tiers
	_, reattach, restage := a.nbdRungs(v)
	if restageable && a.repairer != nil && reattach {
		out = append(out, remount.TierReattach)
	}
	if restageable && a.repairer != nil && restage {
		for _, r := range []remount.Tier{remount.TierRestage, remount.TierLiveSwap, remount.TierRestart} {
			if t.Has(r) {
				out = append(out, r)
			}
		}
	}
	if t.Has(remount.TierEvict) || t.Has(remount.TierDelete) {
		out = append(out, remount.TierEvict)
	}
	for len(out) > 0 && out[0] < floor {
		out = out[1:]
	}
	return out
}

func rungList(rs []remount.Tier) string {
	names := make([]string, len(rs))
	for i, r := range rs {
		names[i] = r.String()
	}
	return strings.Join(names, ", ")
}

// describe is the VolumeBroken message of a volume.
func describe(v *brokenVolume) string {
	what := "volume"
	if v.driver != "" {
		what = fmt.Sprintf("volume of %s", v.driver)
	}
	msg := fmt.Sprintf("%s is %s (%d broken mounts)", what, v.state, len(v.mounts))
	if v.err != nil {
		msg += ": " + v.err.Error()
	}
	return msg
}

// run carries out one repair run. It never panics and always returns.
func (a *Agent) run(ctx context.Context, j *job) (res jobResult) {
	logger := klog.FromContext(ctx).WithValues("volume", j.key, "driver", j.vol.driver, "attempt", j.attempt)
	ctx = klog.NewContext(ctx, logger)
	res = jobResult{key: j.key, outcome: outcomeIgnored}
	if j.resume != nil {
		defer func() {
			// A resume that waits (API server, driver) or fails before
			// it reached the containers keeps its residual: they still
			// hold the dead mount.
			if res.residual == nil && (res.outcome == outcomeWaiting || res.outcome == outcomeFailed) {
				res.residual = j.resume
			}
		}()
	}

	a.announce(ctx, j)
	switch {
	case j.skip != "":
		// Reported, not repaired; the eviction rung alone, when the
		// driver's daemon is out of the plugin's reach and the
		// escalation is due.
		var escalate bool
		if res.outcome, escalate = a.outOfReach(ctx, j); !escalate {
			return res
		}
	case len(j.terminating) > 0:
		res.outcome = a.unmountTerminating(ctx, j)
	}
	if len(j.active) == 0 {
		return res
	}
	// Every rung from here re-mounts, restarts or evicts: act on the pods
	// as the API server has them now, never on the informer's copy, which
	// after a partition can still show a pod force-deleted or replaced
	// under its name. The read runs while the volume is resolved; its
	// answer is awaited before the first tier.
	freshc := make(chan freshResult, 1)
	go func() {
		var f freshResult
		f.pods, f.gone, f.err = a.freshPods(ctx, j.active)
		freshc <- f
	}()

	floor := j.floor
	if j.resume != nil {
		floor = max(floor, remount.TierLiveSwap) // the host is re-staged already
	}
	rungs := a.rungs(j.vol, j.vol.csi && j.skip == "", floor)
	var (
		r   *resolved
		err error
	)
	needRequests := len(rungs) > 0 && rungs[0] != remount.TierEvict
	r, err = a.resolve(ctx, j, needRequests)
	defer r.wipe()
	if j.resume != nil {
		// The residual's requests lost their secret values when its run
		// ended (wipe), and a resume re-stages again when the host broke
		// since: the requests are the fresh ones, what holds the dead
		// mount is what the residual knew. Resolved no longer, the
		// residual's own requests do for a live swap of a healthy host.
		rs := j.resume.forPods(j.active)
		if err == nil && r.restageable {
			rs = rs.withRequests(r)
		} else {
			logger.V(2).Info("Resuming with the residual's requests: the volume cannot be resolved afresh", "err", err, "why", r.why)
		}
		r, err = rs, nil
	}
	rungs, done := a.checkResolved(ctx, j, r, err, rungs, &res)
	if done {
		return res
	}
	if r = a.awaitFresh(ctx, j, r, freshc); r == nil {
		res.outcome = outcomeWaiting
		return res
	}
	if a.cfg.DryRun && rungs[0] != remount.TierEvict {
		return a.dryRun(ctx, j, r, rungs, res)
	}
	return a.climb(ctx, j, r, rungs, res)
}

// announce sends the events a broken volume gets once per episode: broken
// (to every pod that uses it), each pod left out and why, and why the
// volume is not repaired when the job skips it.
func (a *Agent) announce(ctx context.Context, j *job) {
	logger := klog.FromContext(ctx)
	allPods := append(append([]*corev1.Pod{}, j.active...), j.terminating...)
	for pod := range j.excluded {
		allPods = append(allPods, pod)
	}
	if a.notes.once(j.key, noteBroken, "") {
		logger.V(2).Info("Volume broken", "state", j.vol.state, "mounts", len(j.vol.mounts), "pods", len(j.vol.pods), "err", j.vol.err)
		a.report.volume(allPods, nil, corev1.EventTypeWarning, ReasonVolumeBroken, actionProbe, a.report.message("%s", describe(j.vol)))
	}
	for pod, why := range j.excluded {
		if a.notes.once(j.key, noteExcluded, string(pod.UID)) {
			a.report.pod(pod, nil, corev1.EventTypeWarning, ReasonNotRepaired, actionRepair, a.report.message("%s", why))
		}
	}
	if j.skip != "" && a.notes.once(j.key, noteSkip, "") {
		logger.V(2).Info("Volume not repaired", "reason", j.skip)
		a.report.volume(append(append([]*corev1.Pod{}, j.active...), j.terminating...), nil, corev1.EventTypeWarning, ReasonNotRepaired, actionRepair, a.report.message("%s", j.skip))
	}
}

// checkResolved reports how resolving the volume went and narrows the
// rungs to what the resolved volume allows. done: the run ends here, with
// res set.
func (a *Agent) checkResolved(ctx context.Context, j *job, r *resolved, err error, rungs []remount.Tier, res *jobResult) (_ []remount.Tier, done bool) {
	logger := klog.FromContext(ctx)
	if r != nil && r.pvc != nil && a.notes.once(j.key, noteBrokenClaim, "") {
		// The pods heard of it above; the claim is known only now.
		a.report.claim(r.pvc, r.pods, corev1.EventTypeWarning, ReasonVolumeBroken, actionProbe, a.report.message("%s", describe(j.vol)))
	}
	var optOut *optOutError
	switch {
	case errors.As(err, &optOut):
		if a.notes.once(j.key, noteOptOut, "") {
			a.report.volume(j.active, r.pvc, corev1.EventTypeNormal, ReasonRepairOptedOut, actionRepair, a.report.message("%s", optOut.Error()))
		}
		res.outcome = outcomeIgnored
		return nil, true
	case err != nil && isDriverDown(err):
		// The run found the driver down before its first rung, as the
		// rung would have: counted as that rung's attempt, so that
		// repairs_total{result="driver_unavailable"} (and the alert on
		// it) sees every DriverDown, whichever step noticed first.
		if len(rungs) > 0 {
			a.metrics.repairs.WithLabelValues(rungs[0].String(), resultDriverUnavailable).Inc()
		}
		*res = a.driverDown(ctx, j, r, *res, err)
		return nil, true
	case errors.Is(err, errAPIWait):
		logger.V(2).Info("Repair waits for the API server", "err", err)
		if a.notes.once(j.key, noteAPIWait, "") {
			a.report.volume(j.active, r.pvc, corev1.EventTypeWarning, ReasonNotRepaired, actionRepair, a.report.message("repair waits: %v", err))
		}
		res.outcome = outcomeWaiting
		return nil, true
	case err != nil:
		logger.Error(err, "Cannot describe the volume to its driver")
		a.metrics.repair(remount.TierRestage, resultFailure, 0)
		if a.notes.once(j.key, noteResolve, err.Error()) {
			a.report.volume(j.active, r.pvc, corev1.EventTypeWarning, ReasonNotRepaired, actionRepair, a.report.message("cannot re-stage: %v", err))
		}
		res.outcome = outcomeFailed
		return nil, true
	}
	if !r.restageable {
		rungs = a.rungs(j.vol, false, j.floor)
		if a.notes.once(j.key, noteWhy, "") && r.why != "" {
			logger.V(2).Info("Volume cannot be re-staged", "reason", r.why)
		}
	}
	if len(rungs) == 0 {
		why := "no enabled tier can repair this volume (enabled: " + strings.Join(a.cfg.Tiers.Names(), ", ") + ")"
		if a.repairer == nil && r.restageable {
			why = "this agent runs without a repairer and eviction is off: report only"
		}
		if r.why != "" {
			why = r.why + "; " + why
		}
		if a.notes.once(j.key, noteNoRung, "") {
			a.report.volume(r.pods, r.pvc, corev1.EventTypeWarning, ReasonNotRepaired, actionRepair, a.report.message("%s", why))
		}
		res.outcome = outcomeIgnored
		return nil, true
	}
	return rungs, false
}

// dryRun reports what the first node-side rung would do. The repairer is a
// dry-run one (New checks): it resolves every path, asks the driver whether
// it answers and reports its plan.
func (a *Agent) dryRun(ctx context.Context, j *job, r *resolved, rungs []remount.Tier, res jobResult) jobResult {
	tier := rungs[0]
	out := a.tier(ctx, tier, r.vol)
	if res, waits := a.waitsOn(ctx, j, r, res, tier, out); waits {
		return res
	}
	a.metrics.repair(tier, resultDryRun, 0)
	plan := planText(a.cfg.KubeletRoot, out.Actions)
	if out.Err != nil {
		plan += "; it would fail: " + out.Err.Error()
	}
	note := a.report.message("would %s (%s), then if that does not heal it: %s", tier, plan, orNothing(rungList(rungs[1:])))
	if a.notes.once(j.key, noteDryRun, note) {
		klog.FromContext(ctx).V(2).Info("Dry run", "tiers", rungList(rungs), "actions", len(out.Actions), "err", out.Err)
		a.report.volume(r.pods, r.pvc, corev1.EventTypeNormal, ReasonWouldRepair, actionRepair, note)
	}
	res.outcome = outcomeWaiting
	return res
}

// climb runs the rungs in order until one heals the volume, eviction ends
// the run, or none is left.
func (a *Agent) climb(ctx context.Context, j *job, r *resolved, rungs []remount.Tier, in jobResult) (res jobResult) {
	logger := klog.FromContext(ctx)
	res = in
	// hostHealed: this run (or the one it resumes) re-staged the host and
	// containers still hold the dead mount; unless a later tier heals
	// them, the run leaves a residual.
	hostHealed := j.resume != nil
	defer func() {
		if hostHealed && res.outcome != outcomeHealed && res.outcome != outcomeDriverDown {
			res.residual = &residual{vol: j.vol, r: r}
		}
	}()
	for i, tier := range rungs {
		next := ""
		if i+1 < len(rungs) {
			next = rungs[i+1].String()
		}
		if tier == remount.TierEvict {
			res.reachedEvict = true
			res.outcome = a.evictRung(ctx, j, r)
			return res
		}
		out := a.tier(ctx, tier, r.vol)
		logger.V(2).Info("Repair tier done", "tier", tier, "healed", out.Healed, "took", out.Took, "actions", len(out.Actions), "err", out.Err)
		if res, waits := a.waitsOn(ctx, j, r, res, tier, out); waits {
			return res
		}
		if j.vol.csi {
			a.setDriver(j.vol.driver, true)
		}
		if out.Healed {
			a.metrics.repair(tier, resultSuccess, out.Took)
		} else {
			a.metrics.repair(tier, resultFailure, out.Took)
		}
		switch {
		case out.Healed && tier == remount.TierRestage && r.needSwap && next != "":
			hostHealed = true
			a.report.volume(r.pods, r.pvc, corev1.EventTypeNormal, ReasonRepairEscalated, actionRepair,
				a.report.message("re-staged on the host in %.2fs; running containers hold their own bind of the dead mount: trying %s", out.Took.Seconds(), next))
			continue
		case out.Healed && tier == remount.TierRestage && r.needSwap:
			// Nothing after the re-stage can reach the containers' own
			// binds: say so, never "repaired".
			a.report.volume(r.pods, r.pvc, corev1.EventTypeWarning, ReasonNotRepaired, actionRepair,
				a.report.message("re-staged on the host in %.2fs, but running containers hold their own bind of the dead mount and no further tier (liveswap, restart, evict) is enabled: restart the pods", out.Took.Seconds()))
			res.outcome = outcomeIgnored
			return res
		case out.Healed:
			a.notes.clearAll(j.key)
			res.outcome = outcomeHealed
			// Containers not reported running yet may run on the dead
			// mount: look again once kubelet reports them.
			unseen := len(r.unseen) > 0 && a.cfg.Tiers.Has(remount.TierLiveSwap)
			switch {
			case remount.Changed(out.Actions) && j.vol.lostStaging() != nil:
				a.report.volume(r.pods, r.pvc, corev1.EventTypeNormal, ReasonVolumeRepaired, actionRepair,
					a.report.message("repaired by %s in %.2fs: staged again, the staging mount was gone under the running pods (broken for %.1fs; a stale FUSE daemon unmounting its mountpoint by path, or a repair cut short, leaves this)", tier, out.Took.Seconds(), time.Since(j.since).Seconds()))
			case remount.Changed(out.Actions):
				a.report.volume(r.pods, r.pvc, corev1.EventTypeNormal, ReasonVolumeRepaired, actionRepair,
					a.report.message("repaired by %s in %.2fs (broken for %.1fs)", tier, out.Took.Seconds(), time.Since(j.since).Seconds()))
			case j.resume != nil && unseen:
				// A resume that found no container to swap yet: the
				// host's repair was reported, the swap will be.
			default:
				// The mounts answer again: the report the run acted on
				// was older than them (someone else mounted the volume
				// again).
				a.report.volume(r.pods, r.pvc, corev1.EventTypeNormal, ReasonVolumeRepaired, actionRepair,
					a.report.message("answers again: %s changed nothing (broken for %.1fs)", tier, time.Since(j.since).Seconds()))
			}
			if unseen {
				until := time.Now().Add(unseenWait)
				if j.resume != nil {
					until = j.resume.unseenUntil
				}
				logger.V(2).Info("Containers not reported running yet may hold the dead mount: looking again when they are", "pods", len(r.unseen), "until", until)
				res.residual = &residual{vol: j.vol, r: r, unseenUntil: until}
			}
			return res
		case next != "":
			a.report.volume(r.pods, r.pvc, corev1.EventTypeWarning, ReasonRepairEscalated, actionRepair,
				a.report.message("%s did not heal the volume (%s): trying %s", tier, errText(out.Err), next))
		default:
			logger.Error(out.Err, "Repair failed, no further tier", "tier", tier)
			a.report.volume(r.pods, r.pvc, corev1.EventTypeWarning, ReasonNotRepaired, actionRepair,
				a.report.message("%s did not heal the volume (%s) and no further tier is enabled", tier, errText(out.Err)))
		}
	}
	res.outcome = outcomeFailed
	return res
}

// evictRung evicts the volume's pods, the last rung, and says how the run
// ends.
func (a *Agent) evictRung(ctx context.Context, j *job, r *resolved) outcome {
	start := time.Now()
	er := a.evictPods(ctx, j.key, r.pods, r.pvc)
	result := resultFailure
	switch {
	case a.cfg.DryRun:
		result = resultDryRun
	case er.evicted > 0:
		result = resultSuccess
	}
	a.metrics.repair(remount.TierEvict, result, time.Since(start))
	switch {
	case er.evicted > 0 || er.waiting:
		return outcomeWaiting
	case er.refused == len(r.pods):
		return outcomeIgnored
	}
	return outcomeFailed
}

// tier runs one node-side rung on the repairer.
func (a *Agent) tier(ctx context.Context, rung remount.Tier, v *remount.Volume) remount.Outcome {
	switch rung {
	case remount.TierReattach:
		if ra, ok := a.repairer.(reattacher); ok {
			return ra.Reattach(ctx, v)
		}
	case remount.TierRestage:
		return a.repairer.Restage(ctx, v)
	case remount.TierLiveSwap:
		return a.repairer.LiveSwap(ctx, v)
	case remount.TierRestart:
		return a.repairer.Restart(ctx, v)
	}
	return remount.Outcome{Err: fmt.Errorf("no node-side tier %s", rung)}
}

// planText is a dry run's actions for an event: each step with its path
// relative to the kubelet root.
func planText(root string, actions []remount.Action) string {
	if len(actions) == 0 {
		return "nothing to do"
	}
	steps := make([]string, 0, len(actions))
	for _, act := range actions {
		act.DryRun = false
		steps = append(steps, strings.ReplaceAll(act.String(), strings.TrimSuffix(root, "/")+"/", ""))
	}
	return strings.Join(steps, "; ")
}

func orNothing(s string) string {
	if s == "" {
		return "nothing more"
	}
	return s
}

func errText(err error) string {
	if err == nil {
		return "still broken after it"
	}
	return err.Error()
}

// waitsOn ends a run whose tier found something down that no later tier
// can bring back: the volume's backend (remount.ErrBackendUnavailable,
// checked first: it matches ErrDriverUnavailable too) or its driver. It
// counts the attempt and reports whether the run ends.
func (a *Agent) waitsOn(ctx context.Context, j *job, r *resolved, res jobResult, tier remount.Tier, out remount.Outcome) (jobResult, bool) {
	switch {
	case errors.Is(out.Err, remount.ErrBackendUnavailable):
		a.metrics.repair(tier, resultBackendUnavailable, out.Took)
		return a.backendDown(ctx, j, r, res, out.Err), true
	case errors.Is(out.Err, remount.ErrDriverUnavailable):
		a.metrics.repair(tier, resultDriverUnavailable, out.Took)
		return a.driverDown(ctx, j, r, res, out.Err), true
	}
	return res, false
}
