package agent

import (
	"context"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/probe"
)

// loop is the agent's single decision goroutine: it owns the inventory and
// the decider; repair runs report back on a.results.
func (a *Agent) loop(ctx context.Context, tw *tableWatcher, pw *pluginWatcher) {
	logger := klog.FromContext(ctx)
	var inv *probe.Inventory
	dirty := true
	// probing: a cycle's probes are under way (reports brings them);
	// again: something asked for a cycle meanwhile.
	probing, again := false, false
	// pvsTracked: the PV store has been given a table read with the
	// informer synced.
	pvsTracked := false
	reports := make(chan probed, 1)
	probeTimer := time.NewTimer(0)
	defer probeTimer.Stop()
	resync := time.NewTicker(a.cfg.Resync)
	defer resync.Stop()
	summary := time.NewTicker(eventSummaryEvery)
	defer summary.Stop()
	defer a.limiter.flush(a.cfg.DryRun)
	// The executable's pages that only start-up used go back to the
	// kernel once it is done, a minute after the last repair run of a
	// burst, and every ReleaseCode while no repair runs.
	plan := releasePlan{every: a.cfg.ReleaseCode}
	var release <-chan time.Time
	releaseTimer := time.NewTimer(plan.first())
	defer releaseTimer.Stop()
	if plan.on() {
		release = releaseTimer.C
	}
	released := 0
	kick := func(driver string) {
		a.caps.forget(driver)
		for _, key := range a.decider.kick(driver, time.Now()) {
			a.notes.clear(key, noteDriverDown)
		}
		dirty = true
		probeTimer.Reset(0)
	}
	for {
		select {
		case <-ctx.Done():
			return
		case <-tw.Changes():
			dirty = true
		case <-summary.C:
			a.limiter.flush(a.cfg.DryRun)
		case <-release:
			now, next := plan.due(a.running)
			if now {
				a.releaseCode(ctx, released)
				released++
			}
			releaseTimer.Reset(next)
		case <-resync.C:
			dirty = true
			a.decider.resync()
			a.caps.forget("")
			if inv != nil {
				// Pods the informer lacked at the table's read have come since.
				a.kube.pvs.track(publishedPVs(inv, a.pods))
				drivers := volumeDrivers(inv)
				pw.Watch(ctx, drivers)
				a.checkDrivers(ctx, drivers)
			}
		case driver := <-pw.Events():
			logger.V(2).Info("CSI driver registered; probing its volumes now", "driver", driver)
			kick(driver)
		case driver := <-a.driverUp:
			logger.V(2).Info("CSI driver answers again; probing its volumes now", "driver", driver)
			kick(driver)
		case <-a.stalled:
			logger.V(2).Info("A FUSE backend's probe passed its deadline while requests wait on it; probing now")
			if probing {
				again = true
			} else {
				probeTimer.Reset(0)
			}
		case r := <-a.results:
			a.running--
			if a.running == 0 && plan.on() {
				releaseTimer.Reset(plan.afterRuns())
			}
			a.decider.finish(r.key, r.outcome, r.reachedEvict, time.Now())
			a.decider.setResidual(r.key, r.residual)
			if a.synced() {
				a.startRuns(ctx)
			}
		case <-probeTimer.C:
			if probing {
				again = true // a kick during a cycle: another one right after
				continue
			}
			start := time.Now()
			prev := inv
			if inv = a.readTable(ctx, inv, &dirty, pw); inv == nil {
				probeTimer.Reset(wait.Jitter(a.cfg.ProbeInterval, 0.1))
				continue
			}
			// The PVs of the node's volumes, read ahead of a repair: at
			// each new table once the informer has the node's pods.
			if (inv != prev || !pvsTracked) && a.synced() {
				a.kube.pvs.track(publishedPVs(inv, a.pods))
				pvsTracked = true
			}
			probing = true
			a.current.Store(inv)
			a.probeAsync(ctx, inv, start, reports)
		case p := <-reports:
			probing = false
			a.afterProbe(ctx, p)
			if again {
				again = false
				probeTimer.Reset(0)
			} else {
				probeTimer.Reset(wait.Jitter(a.cfg.ProbeInterval, 0.1))
			}
		}
	}
}

// startRuns starts the repair runs of the queued due volumes, as many as
// MaxConcurrentRepairs allows. The loop calls it after each probe cycle and
// each time a run ends, so that a thousand volumes broken at once are
// repaired back to back, not a handful per probe cycle.
func (a *Agent) startRuns(ctx context.Context) {
	for len(a.queue) > 0 && a.running < a.cfg.MaxConcurrentRepairs {
		key := a.queue[0]
		a.queue = a.queue[1:]
		if st := a.decider.vols[key]; st == nil || st.inflight {
			continue // healed, or already under way since it was queued
		}
		var j *job
		if bv := a.broken[key]; bv != nil {
			j = a.prepare(bv)
		} else if rs := a.decider.residualOf(key); rs != nil {
			j = a.prepareResidual(ctx, key, rs)
		}
		if j == nil {
			continue
		}
		st := a.decider.start(key)
		j.floor, j.since, j.attempt = st.floor, st.since, st.attempts
		a.running++
		a.workers.Add(1)
		go func() {
			defer a.workers.Done()
			a.results <- a.run(ctx, j)
		}()
	}
}
