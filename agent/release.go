package agent

import (
	"context"
	"time"

	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/agent/coldpages"
)

// releaseCodeFirst is when the agent first gives back the pages of its
// executable it no longer uses: start-up is done by then (the pod
// informer has synced on any API server that answers), and it is when the
// agent retries a release that a repair put off.
const releaseCodeFirst = 30 * time.Second

// releaseAfterRepairs is how long after the last repair run of a burst the
// agent gives back the pages of its executable it no longer uses.
const releaseAfterRepairs = time.Minute

// releasePlan is when the agent's loop gives back the pages of its
// executable it no longer uses (Config.ReleaseCode every, 0: never): once
// start-up is over, then every interval, a minute after the last repair
// run of a burst (what the runs touched, CSI and CRI clients and events,
// goes back; sooner when the interval is shorter), and never while a run
// is in flight: a release then is put off by releaseCodeFirst. Its times
// are for the loop's one timer.
type releasePlan struct{ every time.Duration }

// on: the agent releases at all.
func (p releasePlan) on() bool { return p.every > 0 }

// first is the timer's first wait.
func (p releasePlan) first() time.Duration { return min(releaseCodeFirst, p.every) }

// due is the timer's firing with running repair runs in flight: whether
// to release now, and the timer's next wait.
func (p releasePlan) due(running int) (now bool, next time.Duration) {
	if running > 0 {
		return false, releaseCodeFirst
	}
	return true, p.every
}

// afterRuns is the timer's wait once the last run in flight has ended.
func (p releasePlan) afterRuns() time.Duration { return min(releaseAfterRepairs, p.every) }

// codeRelease is the loop's timer of releasePlan: it gives the kernel back
// the pages of the agent's executable it no longer uses
// (coldpages.Release).
type codeRelease struct {
	plan    releasePlan
	timer   *time.Timer
	c       <-chan time.Time // nil: never fires
	release func() (coldpages.Result, error)
	// n counts the releases done.
	n int
}

func newCodeRelease(every time.Duration, release func() (coldpages.Result, error)) *codeRelease {
	r := &codeRelease{plan: releasePlan{every: every}, release: release}
	r.timer = time.NewTimer(r.plan.first())
	if r.plan.on() {
		r.c = r.timer.C
	}
	return r
}

// C fires when a release may be due.
func (r *codeRelease) C() <-chan time.Time { return r.c }

// due releases now unless repair runs are in flight, and sets the next
// wait.
func (r *codeRelease) due(ctx context.Context, running int) {
	now, next := r.plan.due(running)
	if now {
		res, err := r.release()
		coldpages.Log(klog.FromContext(ctx), r.n, res, err)
		r.n++
	}
	r.timer.Reset(next)
}

// runsEnded is told when the last repair run in flight has ended.
func (r *codeRelease) runsEnded() {
	if r.plan.on() {
		r.timer.Reset(r.plan.afterRuns())
	}
}

func (r *codeRelease) stop() { r.timer.Stop() }
