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
	c := &cycle{dirty: true, reports: make(chan probed, 1), timer: time.NewTimer(0), refresh: time.NewTimer(0)}
	c.refresh.Stop()
	defer c.timer.Stop()
	defer c.refresh.Stop()
	rel := newCodeRelease(a.cfg.ReleaseCode, a.release)
	defer rel.stop()
	resync := time.NewTicker(a.cfg.Resync)
	defer resync.Stop()
	summary := time.NewTicker(eventSummaryEvery)
	defer summary.Stop()
	defer a.limiter.flush(a.cfg.DryRun)
	for {
		select {
		case <-ctx.Done():
			return
		case <-tw.Changes():
			a.tableChanged(c)
		case <-c.refresh.C:
			a.refreshInventory(ctx, c, pw)
		case <-summary.C:
			a.limiter.flush(a.cfg.DryRun)
		case <-rel.C():
			rel.due(ctx, a.running)
		case <-resync.C:
			a.resync(ctx, c, pw)
		case driver := <-pw.Events():
			logger.V(2).Info("CSI driver registered; probing its volumes now", "driver", driver)
			a.driverBack(c, driver)
		case driver := <-a.driverUp:
			logger.V(2).Info("CSI driver answers again; probing its volumes now", "driver", driver)
			a.driverBack(c, driver)
		case <-a.stalled:
			logger.V(2).Info("A watch saw a backend fail (FUSE requests waiting past the probe deadline, or an nbd link dead); probing now")
			c.soon()
		case r := <-a.results:
			a.runEnded(ctx, r, rel)
		case <-a.aheadDone:
			a.reading--
			if a.synced() {
				a.startRuns(ctx)
			}
		case <-c.timer.C:
			a.startCycle(ctx, c, pw)
		case p := <-c.reports:
			a.endCycle(ctx, c, p)
		}
	}
}

// cycle is the loop's state of its probe cycles.
type cycle struct {
	// inv is the inventory of the last table read; dirty: read the
	// table again before the next cycle.
	inv   *probe.Inventory
	dirty bool
	// probing: a cycle's probes are under way (reports brings them);
	// again: something asked for a cycle meanwhile.
	probing, again bool
	// tracked is the inventory the PV store was last given, with the
	// informer synced.
	tracked *probe.Inventory
	reports chan probed
	// timer starts the next cycle.
	timer *time.Timer
	// refresh reads a changed table for the stall watch between cycles
	// (stallinventory.go); refreshing: it is set; readAt: the last read.
	refresh    *time.Timer
	refreshing bool
	readAt     time.Time
}

// soon starts a cycle now, or right after the one under way.
func (c *cycle) soon() {
	if c.probing {
		c.again = true
	} else {
		c.timer.Reset(0)
	}
}

// later starts the next cycle after the probe interval.
func (a *Agent) later(c *cycle) { c.timer.Reset(wait.Jitter(a.cfg.ProbeInterval, 0.1)) }

// nextCycle is the wait from a cycle's end to the next cycle, which starts
// a (jittered) probe interval after the cycle started: a cycle held by a
// slow backend does not push the next one back by its own length, nor the
// finding of a volume that broke meanwhile. The loop rests a quarter
// interval between two cycles at least.
func nextCycle(interval, took time.Duration) time.Duration {
	return max(wait.Jitter(interval, 0.1)-took, interval/4)
}

// startCycle reads the mount table when it changed and starts the cycle's
// probes; their report comes back on c.reports.
func (a *Agent) startCycle(ctx context.Context, c *cycle, pw *pluginWatcher) {
	if c.probing {
		c.again = true // a kick during a cycle: another one right after
		return
	}
	start := time.Now()
	prev := c.inv
	if c.inv = a.readTable(ctx, c.inv, &c.dirty, pw); c.inv == nil {
		a.later(c)
		return
	}
	if c.inv != prev {
		c.readAt = start
	}
	// The PVs of the node's volumes, read ahead of a repair: at each new
	// table once the informer has the node's pods.
	if c.inv != c.tracked && a.synced() {
		a.kube.pvs.track(publishedPVs(c.inv, a.pods))
		c.tracked = c.inv
	}
	c.probing = true
	a.current.Store(c.inv)
	a.probeAsync(ctx, c.inv, start, c.reports)
}

// endCycle acts on a cycle's report and schedules the next cycle.
func (a *Agent) endCycle(ctx context.Context, c *cycle, p probed) {
	c.probing = false
	a.afterProbe(ctx, p)
	if c.again {
		c.again = false
		c.timer.Reset(0)
	} else {
		c.timer.Reset(nextCycle(a.cfg.ProbeInterval, time.Since(p.start)))
	}
}

// resync reads the table again at the next cycle, forgets what the decider
// and the capabilities cache hold back, and re-checks the node's drivers.
func (a *Agent) resync(ctx context.Context, c *cycle, pw *pluginWatcher) {
	c.dirty = true
	a.decider.resync()
	a.caps.forget("")
	if c.inv != nil {
		// Pods the informer lacked at the table's read have come since.
		a.kube.pvs.track(publishedPVs(c.inv, a.pods))
		drivers := volumeDrivers(c.inv)
		pw.Watch(ctx, drivers)
		a.checkDrivers(ctx, drivers)
	}
}

// driverBack probes the volumes of a driver that registered or answers
// again now, without the wait the decider kept them in.
func (a *Agent) driverBack(c *cycle, driver string) {
	a.caps.forget(driver)
	for _, key := range a.decider.kick(driver, time.Now()) {
		a.notes.clear(key, noteDriverDown)
	}
	c.dirty = true
	c.timer.Reset(0)
}

// runEnded records how a repair run ended and starts the next ones.
func (a *Agent) runEnded(ctx context.Context, r jobResult, rel *codeRelease) {
	a.running--
	if r.reattach {
		a.reattaching--
	}
	if a.running == 0 {
		rel.runsEnded()
	}
	a.decider.finish(r.key, r.outcome, r.reachedEvict, time.Now())
	a.decider.setResidual(r.key, r.residual)
	if a.synced() {
		a.startRuns(ctx)
	}
}

// startRuns starts the repair runs of the queued due volumes, as many as
// MaxConcurrentRepairs allows (runs that begin with the re-attach rung as
// many as maxReattachRuns allows: reattachFirst). The loop calls it after
// each probe cycle and each time a run ends, so that a thousand volumes
// broken at once are repaired back to back, not a handful per probe
// cycle. A volume whose run has no slot stays queued, in order.
func (a *Agent) startRuns(ctx context.Context) {
	var held []string
	for i, key := range a.queue {
		if a.running-a.reattaching >= a.cfg.MaxConcurrentRepairs && a.reattaching >= maxReattachRuns {
			held = append(held, a.queue[i:]...)
			break
		}
		if st := a.decider.vols[key]; st == nil || st.inflight {
			continue // healed, or already under way since it was queued
		}
		reattach := a.reattachFirst(key)
		if reattach && a.reattaching >= maxReattachRuns || !reattach && a.running-a.reattaching >= a.cfg.MaxConcurrentRepairs {
			held = append(held, key)
			continue
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
		delete(a.ahead, key)
		a.running++
		if reattach {
			a.reattaching++
		}
		a.workers.Add(1)
		go func() {
			defer a.workers.Done()
			res := a.run(ctx, j)
			res.reattach = reattach
			select {
			case a.results <- res:
			case <-ctx.Done(): // the loop has ended
			}
		}()
	}
	a.queue = held
	a.readAhead(ctx)
	// Volumes left waiting for a slot: the API budget goes to their
	// repairs first (eventGate).
	a.gate.set(len(a.queue) > 0)
}
