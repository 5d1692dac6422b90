package agent

import (
	"context"
)

// claimsAhead is how many queued volumes past the runs under way have
// their claims read ahead: at kubelet's 50 requests a second, a claim read
// ahead is about a second old when its run takes it, well within the
// cache's --cache-ttl that a run's own read is served from.
const claimsAhead = 50

// readAhead reads the claims of the volumes next in the queue, the same
// reads (podVolume, through the object cache) their runs would make on
// starting, with at most MaxConcurrentRepairs of them in flight. A run is
// otherwise held by its own steps (the node's pods, the re-stage) between
// two claim reads: with a thousand volumes queued, the client's token
// bucket, kubelet's, then sits unused while a handful of runs work; read
// ahead, the claims go through it back to back and a run finds its claim
// in the cache. Nothing else is read: Secrets, the driver and the
// re-stage stay in the run. The loop calls it (it owns the queue); each
// read ends on a.aheadDone.
func (a *Agent) readAhead(ctx context.Context) {
	if len(a.queue) == 0 {
		a.ahead = nil
		return
	}
	window := a.queue[:min(len(a.queue), claimsAhead)]
	if len(a.ahead) > 2*claimsAhead {
		in := make(map[string]bool, len(window))
		for _, k := range window {
			in[k] = true
		}
		for k := range a.ahead {
			if !in[k] {
				delete(a.ahead, k)
			}
		}
	}
	for _, key := range window {
		if a.reading >= a.cfg.MaxConcurrentRepairs {
			return
		}
		if a.ahead[key] {
			continue
		}
		bv := a.broken[key]
		if st := a.decider.vols[key]; bv == nil || st == nil || st.inflight {
			continue
		}
		j := a.prepare(bv)
		if j == nil || j.skip != "" || len(j.active) == 0 {
			continue
		}
		if a.ahead == nil {
			a.ahead = make(map[string]bool)
		}
		a.ahead[key] = true
		a.reading++
		a.workers.Add(1)
		go func() {
			defer a.workers.Done()
			for _, pod := range j.active {
				// Errors are the run's to report: it reads again.
				_, _, _ = a.podVolume(ctx, pod, bv.pods[string(pod.UID)])
			}
			select {
			case a.aheadDone <- struct{}{}:
			case <-ctx.Done():
			}
		}()
	}
}
