package agent

import (
	"context"
	"time"

	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/probe"
)

// NewProber makes the prober of an agent of cfg, for its probe cycles and
// for the Repairer to verify with (Deps.Prober, remount.Config.Prober).
func NewProber(cfg Config) *probe.Prober {
	pc := probe.DefaultConfig()
	pc.Timeout, pc.Parallel, pc.WriteCheck = cfg.ProbeTimeout, cfg.ProbeParallel, cfg.WriteCheck
	return probe.NewProber(pc)
}

// readTable re-reads the mount table when it changed (or, while the node has
// block-backed filesystems, when their super options changed) and returns
// the inventory to probe; nil while no table could ever be read.
func (a *Agent) readTable(ctx context.Context, inv *probe.Inventory, dirty *bool, pw *pluginWatcher) *probe.Inventory {
	logger := klog.FromContext(ctx)
	if !*dirty && inv != nil {
		// A block-backed filesystem reports a shutdown (ext4, xfs) or an
		// aborted journal (emergency_ro) only in its super options, and no
		// mount-table notification says they changed: while the node has
		// one, compare them every cycle (a table read, about 2.5 µs per
		// mount in the kernel) and take the whole table again only when
		// they changed.
		if changed, err := probe.SuperOptionsChanged(a.cfg.HostTable, inv); err != nil || changed {
			*dirty = true
		}
	}
	if inv != nil && !inv.Publishing.IsZero() && !time.Now().Before(inv.Publishing) {
		// A publish target was in kubelet's publish window: read again
		// whether it got mounted, as no table change may say so.
		*dirty = true
	}
	if inv != nil && a.caps.knowsAny(inv.StagingUnknown) {
		// A driver that had not said whether it stages has answered:
		// read again whether its bare globalmount is a lost staging.
		*dirty = true
	}
	if *dirty || inv == nil {
		fresh, err := a.table.Read(ctx)
		if err != nil {
			logger.Error(err, "Reading the mount table failed")
			if inv == nil {
				return nil
			}
		} else {
			first := inv == nil
			inv, *dirty = fresh, false
			drivers := volumeDrivers(inv)
			pw.Watch(ctx, drivers)
			switch {
			case first:
				a.checkDrivers(ctx, drivers)
			case len(inv.StagingUnknown) > 0:
				a.checkDrivers(ctx, inv.StagingUnknown)
			}
		}
	}
	return inv
}

// probed is one probe cycle's report, from the goroutine that waited for
// it.
type probed struct {
	inv   *probe.Inventory
	rep   *probe.Report
	start time.Time
}

// probeAsync probes inv on its own goroutine and sends the report on out:
// the cycle's wait for its probes (up to a deadline and a quarter when a
// backend is slow or hangs) never holds up the loop, which goes on taking
// the ends of repair runs and starting the next ones.
func (a *Agent) probeAsync(ctx context.Context, inv *probe.Inventory, start time.Time, out chan<- probed) {
	a.workers.Add(1)
	go func() {
		defer a.workers.Done()
		out <- probed{inv: inv, rep: a.prober.Probe(ctx, inv), start: start}
	}()
}

// afterProbe updates the metrics and the decider from a probe cycle's
// report and starts the repair runs that are due.
func (a *Agent) afterProbe(ctx context.Context, p probed) {
	logger := klog.FromContext(ctx)
	inv, rep, start := p.inv, p.rep, p.start
	end := time.Now()
	a.metrics.observeScan(inv, rep, end.Sub(start), end)
	if a.condition != nil {
		a.condition.observe(rep)
	}
	a.lastScan.Store(end.UnixNano())
	a.scanned.Store(true)

	broken := groupBroken(rep)
	seen := make(map[string]sighting, len(broken))
	for k, v := range broken {
		seen[k] = sighting{driver: v.driver, certain: v.certain(), probed: start}
	}
	due := a.decider.observe(seen, end)
	a.notes.keep(func(key string) bool { _, ok := a.decider.vols[key]; return ok })
	if len(broken) > 0 {
		logger.V(4).Info("Probe cycle", "mounts", len(inv.Mounts), "broken", len(broken), "due", len(due), "running", a.running)
	}
	if !a.synced() {
		if len(due) > 0 {
			logger.V(2).Info("Pod informer not synced: repairs wait", "due", len(due))
		}
		return
	}
	a.broken, a.queue = broken, due
	a.guardNow(ctx, broken)
	a.startRuns(ctx)
}

// watchStalls starts the prober's stall watch (Config.StallPoll) over the
// inventory the loop probes. It reads the fuse control filesystem where
// the repairer finds it: mounted already, or a detached mount of it that
// no mount table shows (remount.Repairer.FusectlDir; the host is left as
// found). A dry-run agent mounts nothing: it watches only when fusectl is
// mounted already.
func (a *Agent) watchStalls(ctx context.Context) {
	if a.cfg.StallPoll <= 0 {
		return
	}
	var dir string
	if m, ok := a.repairer.(interface {
		FusectlDir(context.Context) (string, error)
	}); ok && !a.cfg.DryRun {
		d, err := m.FusectlDir(ctx)
		if err != nil {
			klog.FromContext(ctx).Error(err, "Cannot read the fuse control filesystem: hung FUSE daemons are found by the probe cycles only")
		}
		dir = d
	}
	a.workers.Add(1)
	go func() {
		defer a.workers.Done()
		a.prober.WatchStallsAt(ctx, dir, a.cfg.StallPoll, a.current.Load, func() {
			select {
			case a.stalled <- struct{}{}:
			default:
			}
		})
	}()
}

// NewTableReader is the reader of cfg's mount table that the loop, the
// Repairer (remount.Config.Table) and the stall watch share.
func NewTableReader(cfg Config) *probe.TableReader {
	return probe.NewTableReader(cfg.HostTable, probe.Options{Root: cfg.KubeletRoot, Live: true, MaxSize: cfg.MaxTableSize})
}
