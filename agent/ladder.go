package agent

import (
	"context"
	"errors"
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

// job is one repair run for one broken volume, prepared by the loop.
type job struct {
	key  string
	vol  *brokenVolume
	skip string // non-empty: report the volume, do not repair it (why)
	// reported: skip comes from the driver catalogue (the agent cannot
	// heal this driver's volumes); its lost publish targets are guarded
	// all the same.
	reported bool
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

// jobResult is how a run ended, for the loop's decider.
type jobResult struct {
	key          string
	outcome      outcome
	reachedEvict bool
	// residual is set when the host was healed and running containers
	// were not.
	residual *residual
}

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

// rungs lists the ladder rungs a run may take, from floor: the node-side
// tiers when the volume can be re-staged here, then eviction (or, with
// eviction off, the delete that stands in for it).
func (a *Agent) rungs(restageable bool, floor remount.Tier) []remount.Tier {
	var out []remount.Tier
	t := a.cfg.Tiers
	if restageable && a.repairer != nil {
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
	if j.skip != "" {
		return res
	}
	if len(j.terminating) > 0 {
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
	rungs := a.rungs(j.vol.csi, floor)
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
			a.report.volume(j.active, r.pvc, corev1.EventTypeNormal, ReasonNotRepaired, actionRepair, a.report.message("%s", optOut.Error()))
		}
		res.outcome = outcomeIgnored
		return nil, true
	case err != nil && isDriverDown(err):
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
		rungs = a.rungs(false, j.floor)
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
	if errors.Is(out.Err, remount.ErrDriverUnavailable) {
		a.metrics.repair(tier, resultDriverUnavailable, out.Took)
		return a.driverDown(ctx, j, r, res, out.Err)
	}
	a.metrics.repair(tier, resultDryRun, 0)
	plan := planText(a.cfg.KubeletRoot, out.Actions)
	if out.Err != nil {
		plan += "; it would fail: " + out.Err.Error()
	}
	note := a.report.message("would %s (%s), then if that does not heal it: %s", tier, plan, orNothing(rungList(rungs[1:])))
	if a.notes.once(j.key, noteDryRun, note) {
		klog.FromContext(ctx).V(2).Info("Dry run", "tiers", rungList(rungs), "actions", len(out.Actions), "err", out.Err)
		a.report.volume(r.pods, r.pvc, corev1.EventTypeNormal, ReasonNotRepaired, actionRepair, note)
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
		if errors.Is(out.Err, remount.ErrDriverUnavailable) {
			a.metrics.repair(tier, resultDriverUnavailable, out.Took)
			return a.driverDown(ctx, j, r, res, out.Err)
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

// stuck is remount.Volume.Stuck for a broken volume: whether the agent's
// probe that found its backend Hung is still blocked in the daemon (nil for
// a volume not found Hung).
func (a *Agent) stuck(bv *brokenVolume) func() bool {
	if !bv.hung || bv.backend == nil {
		return nil
	}
	dev := bv.backend.Dev
	return func() bool { return a.prober.Stuck(dev) }
}

// tier runs one node-side rung on the repairer.
func (a *Agent) tier(ctx context.Context, rung remount.Tier, v *remount.Volume) remount.Outcome {
	switch rung {
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

// freshResult is the answer of freshPods.
type freshResult struct {
	pods []*corev1.Pod
	gone []string
	err  error
}

// awaitFresh waits for the fresh pods and returns r for them alone (their
// current objects), or nil when none is left or the API server could not
// say: then nothing is repaired.
func (a *Agent) awaitFresh(ctx context.Context, j *job, r *resolved, freshc <-chan freshResult) *resolved {
	logger := klog.FromContext(ctx)
	f := <-freshc
	if f.err != nil {
		logger.V(2).Info("Repair waits for the API server", "err", f.err)
		if a.notes.once(j.key, noteAPIWait, "") {
			a.report.volume(j.active, r.pvc, corev1.EventTypeWarning, ReasonNotRepaired, actionRepair, a.report.message("repair waits: %v", f.err))
		}
		return nil
	}
	if len(f.gone) > 0 {
		logger.V(2).Info("Pods gone or replaced since the cache saw them: not repaired", "pods", f.gone)
	}
	if len(f.pods) == 0 {
		return nil
	}
	keep := make(map[types.UID]*corev1.Pod, len(f.pods))
	for _, p := range f.pods {
		keep[p.UID] = p
	}
	var pods []*corev1.Pod
	for _, p := range r.pods {
		if cur := keep[p.UID]; cur != nil {
			pods = append(pods, cur)
		}
	}
	if len(pods) == 0 {
		return nil
	}
	fresh := (&residual{r: r}).forPods(pods)
	fresh.refreshContainers()
	return fresh
}

// freshPods reads the pods from the API server (a LIST of the node's pods
// shared by the runs of a burst, nodePods, not the informer's cache) and
// keeps those still there with the same UID, bound to this node and not
// being deleted, in their current state; gone names the others. An API
// server out of reach is errAPIWait: nothing is repaired on the cache's
// word.
func (a *Agent) freshPods(ctx context.Context, pods []*corev1.Pod) (fresh []*corev1.Pod, gone []string, err error) {
	l, err := a.nodePods.read(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %w", errAPIWait, err)
	}
	for _, pod := range pods {
		cur := l.pod(pod.Namespace, pod.Name)
		switch {
		case cur == nil:
			gone = append(gone, klog.KObj(pod).String()+" (deleted, or no longer bound to this node)")
			continue
		case cur.UID != pod.UID:
			gone = append(gone, fmt.Sprintf("%s (replaced: uid %s, was %s)", klog.KObj(pod), cur.UID, pod.UID))
			continue
		case cur.DeletionTimestamp != nil:
			gone = append(gone, klog.KObj(pod).String()+" (being deleted)")
			continue
		case cur.Spec.NodeName != pod.Spec.NodeName:
			gone = append(gone, klog.KObj(pod).String()+" (on node "+cur.Spec.NodeName+")")
			continue
		}
		fresh = append(fresh, cur)
	}
	return fresh, gone, nil
}

// isDriverDown reports a driver that is unavailable or not registered
// (remount's not-registered error matches ErrDriverUnavailable too).
func isDriverDown(err error) bool {
	return errors.Is(err, remount.ErrDriverUnavailable)
}

// driverDown records a driver that is down: one DriverDown event per
// episode, no escalation; the run is retried when the driver registers.
func (a *Agent) driverDown(ctx context.Context, j *job, r *resolved, res jobResult, err error) jobResult {
	a.setDriver(j.vol.driver, false)
	a.caps.forget(j.vol.driver)
	var pvc *corev1.PersistentVolumeClaim
	pods := j.active
	if r != nil {
		pvc = r.pvc
		if len(r.pods) > 0 {
			pods = r.pods
		}
	}
	if a.notes.once(j.key, noteDriverDown, "") {
		klog.FromContext(ctx).V(2).Info("CSI driver is down; waiting for it to register again", "err", err)
		a.report.volume(pods, pvc, corev1.EventTypeWarning, ReasonDriverDown, actionRepair,
			a.report.message("CSI driver %s is not available (%v): re-staging as soon as it registers again", j.vol.driver, err))
	}
	res.outcome = outcomeDriverDown
	return res
}

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
			v := &remount.Volume{Driver: j.vol.driver, VolumeHandle: j.vol.volumeHandle, Backend: j.vol.backend, Hung: j.vol.hung, Stuck: a.stuck(j.vol),
				Pods: []remount.PodVolume{{Dead: use.dead}}}
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

// guardMissing mounts the guard (remount.Repairer.Guard) over each publish
// target of the job's running pods that kubelet set up but that is no
// longer a mount point (the probe's Missing, past kubelet's publish
// window); guardNow calls it for volumes with no run under way. A Pending
// pod's target is kubelet's to publish and is left alone.
func (a *Agent) guardMissing(ctx context.Context, j *job) {
	logger := klog.FromContext(ctx)
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
			result := resultSuccess
			switch {
			case act.Err != nil:
				result = resultFailure
			case act.DryRun:
				result = resultDryRun
			}
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
