package agent

import (
	"sort"
	"sync"
	"time"

	"github.com/mountmedic/mountmedic/remount"
)

// volState is what the loop remembers of one broken volume between probe
// cycles. It is dropped as soon as the volume probes healthy (or leaves the
// mount table): nothing of it survives a restart, and nothing needs to.
type volState struct {
	driver string
	// strikes counts consecutive probe cycles that found the volume broken.
	strikes int
	// since is when the current episode began (first broken probe).
	since time.Time
	// backoff is the next wait after a failed attempt; next is when the
	// next attempt may start.
	backoff time.Duration
	next    time.Time
	// attempts counts repair runs in this episode.
	attempts int
	// driverDown: the last attempt found the driver unavailable; wait for
	// its socket to appear again (or the resync).
	driverDown bool
	// kicked: the driver just registered; try now, skipping strikes and
	// backoff.
	kicked bool
	// floor is the first ladder rung of the next run: once a run reached
	// eviction, later runs go straight to it instead of re-running the
	// tiers that already failed.
	floor remount.Tier
	// inflight: a repair run is under way; ended: when the last one ended.
	inflight bool
	ended    time.Time
	// residual: the host is healed but running containers still see the
	// dead mount through their own binds. The volume is kept (the probe no
	// longer sees it broken) and comes due again until a tier heals the
	// containers or they are gone.
	residual *residual
}

// decider holds the per-volume decisions: strikes, backoff, driver down,
// in-flight runs. It is owned by the loop goroutine; it does no I/O.
type decider struct {
	strikes     int
	backoffBase time.Duration
	backoffMax  time.Duration
	// resyncEvery is how long a volume whose driver is down waits when no
	// registration wakes it.
	resyncEvery time.Duration
	vols        map[string]*volState
	// returned holds when each driver last registered again.
	returned map[string]time.Time
}

// returnWindow is how long after a driver registers again a volume of it
// that is first seen broken skips strikes and backoff.
const returnWindow = 10 * time.Second

func newDecider(cfg *Config) *decider {
	return &decider{strikes: cfg.Strikes, backoffBase: cfg.BackoffBase, backoffMax: cfg.BackoffMax,
		resyncEvery: cfg.Resync, vols: make(map[string]*volState), returned: make(map[string]time.Time)}
}

// sighting is what one probe cycle saw of a broken volume.
type sighting struct {
	driver string
	// certain: the state cannot heal by itself (a FUSE connection that is
	// gone never comes back), so strikes are not waited for.
	certain bool
	// probed is when the cycle began (its table read and probes); zero
	// for "now".
	probed time.Time
}

// observe records one probe cycle's broken volumes and returns, sorted, the
// keys due for a repair run now. Volumes no longer broken are forgotten,
// unless a run is still in flight for them. A volume first seen broken
// within returnWindow of its driver registering again is treated as kicked:
// the registration came before the probe that found the volume. A sighting
// from a cycle that began before the volume's last run ended says nothing
// of the volume since: it is not counted (the state is kept). Its probes
// may even be answers of the mount the run replaced: a probe stuck in a
// hung daemon returns when the run aborts the connection, and that answer
// must not send a healthy volume through a second re-stage.
func (d *decider) observe(broken map[string]sighting, now time.Time) []string {
	var due []string
	for key, st := range d.vols {
		if _, ok := broken[key]; ok || st.inflight {
			continue
		}
		if st.residual == nil {
			delete(d.vols, key)
			continue
		}
		if !now.Before(st.next) {
			due = append(due, key)
		}
	}
	for driver, at := range d.returned {
		if now.Sub(at) > returnWindow {
			delete(d.returned, driver)
		}
	}
	for key, s := range broken {
		st := d.vols[key]
		if st != nil && !s.probed.IsZero() && st.ended.After(s.probed) {
			continue
		}
		if st == nil {
			st = &volState{driver: s.driver, since: now, backoff: d.backoffBase}
			if _, ok := d.returned[s.driver]; ok && s.driver != "" {
				st.kicked = true
			}
			d.vols[key] = st
		}
		st.strikes++
		if s.certain && st.strikes < d.strikes {
			st.strikes = d.strikes
		}
		if d.due(st, now) {
			due = append(due, key)
		}
	}
	sort.Strings(due)
	return due
}

func (d *decider) due(st *volState, now time.Time) bool {
	switch {
	case st.inflight:
		return false
	case st.kicked:
		return true
	case st.driverDown:
		return false
	case st.strikes < d.strikes:
		return false
	}
	return !now.Before(st.next)
}

// start marks a run under way and returns its state.
func (d *decider) start(key string) *volState {
	st := d.vols[key]
	if st == nil {
		return nil
	}
	st.inflight, st.kicked = true, false
	st.attempts++
	return st
}

// outcome is how a repair run ended, as far as the decider cares.
type outcome int

const (
	// outcomeHealed: a tier healed the volume.
	outcomeHealed outcome = iota
	// outcomeFailed: no tier healed it; back off, then run again.
	outcomeFailed
	// outcomeDriverDown: the CSI driver is unavailable; wait for it.
	outcomeDriverDown
	// outcomeWaiting: nothing to do for now (API server unreachable, PDB
	// blocks, budget used up, dry run); back off without escalating.
	outcomeWaiting
	// outcomeIgnored: the volume is not to be repaired (opted out, filtered,
	// not repairable); look again after the longest backoff.
	outcomeIgnored
)

// finish records the end of a run. reachedEvict says the run got to the
// eviction rung (its floor for the next run).
func (d *decider) finish(key string, o outcome, reachedEvict bool, now time.Time) {
	st := d.vols[key]
	if st == nil {
		return
	}
	st.inflight, st.ended = false, now
	switch o {
	case outcomeHealed:
		// Probe again before anything else: strikes start over.
		st.strikes, st.floor, st.driverDown = 0, 0, false
		st.backoff = d.backoffBase
		st.next = now.Add(d.backoffBase)
		return
	case outcomeDriverDown:
		st.driverDown = true
		st.next = now.Add(d.resyncEvery)
		return
	case outcomeIgnored:
		st.next = now.Add(d.backoffMax)
		return
	}
	if reachedEvict {
		st.floor = remount.TierEvict
	}
	st.next = now.Add(st.backoff)
	st.backoff = min(2*st.backoff, d.backoffMax)
}

// setResidual records what a run left undone in the containers (nil when
// nothing).
func (d *decider) setResidual(key string, r *residual) {
	if st := d.vols[key]; st != nil {
		st.residual = r
	}
}

// residualOf returns the residual of a volume, nil when it has none.
func (d *decider) residualOf(key string) *residual {
	if st := d.vols[key]; st != nil {
		return st.residual
	}
	return nil
}

// kick marks the volumes of driver ("" for every driver) for an immediate
// run: the driver's socket just appeared. Volumes of the driver seen broken
// in the next returnWindow are kicked too (see observe).
func (d *decider) kick(driver string, now time.Time) []string {
	if driver != "" {
		d.returned[driver] = now
	}
	var keys []string
	for key, st := range d.vols {
		if driver != "" && st.driver != driver {
			continue
		}
		st.kicked, st.driverDown, st.floor = true, false, 0
		st.backoff = d.backoffBase
		keys = append(keys, key)
	}
	sort.Strings(keys)
	return keys
}

// resync lets volumes waiting for their driver try again.
func (d *decider) resync() {
	for _, st := range d.vols {
		st.driverDown = false
	}
}

// noteKind is what an event the agent sends once per volume and episode
// is about.
type noteKind uint8

const (
	noteBroken      noteKind = iota + 1 // VolumeBroken, to the pods
	noteBrokenClaim                     // VolumeBroken, to the claim
	noteExcluded                        // a pod left out (subject: its UID)
	noteSkip                            // the volume is reported, not repaired
	noteOptOut                          // opted out by annotation
	noteAPIWait                         // waiting for the API server
	noteResolve                         // the volume could not be resolved (subject: the error)
	noteWhy                             // why the ladder starts where it does
	noteNoRung                          // no enabled tier can repair it
	noteDryRun                          // a dry run's plan (subject: the plan)
	noteDriverDown                      // the CSI driver does not answer
	noteBackendDown                     // the driver answers, the volume's backend does not
	noteTerminating                     // a terminating pod holds the dead mount (subject: its UID)
	noteUnmounted                       // its dead mounts were unmounted (subject: the pod's UID)
	noteRefused                         // an eviction was refused (subject: the pod's UID)
	noteBudget                          // a PodDisruptionBudget blocks it (subject: the pod's UID)
	noteForce                           // a force delete (subject: the pod's UID)
	noteGuard                           // a publish target was guarded (subject: its path)
)

// note is one event sent once: its kind and what it is about (a pod's UID,
// an error's text, a plan; "" when the kind alone says it).
type note struct {
	kind    noteKind
	subject string
}

// noteBook remembers the events already sent for each volume in its
// current episode, so that a volume that stays broken does not repeat them
// at every run. Workers and the loop share it.
type noteBook struct {
	mu    sync.Mutex
	notes map[string]map[note]bool
}

func newNoteBook() *noteBook { return &noteBook{notes: make(map[string]map[note]bool)} }

// once reports whether the note of kind about subject was not yet sent for
// the volume key, and records it.
func (n *noteBook) once(key string, kind noteKind, subject string) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	m := n.notes[key]
	if m == nil {
		m = make(map[note]bool)
		n.notes[key] = m
	}
	k := note{kind, subject}
	if m[k] {
		return false
	}
	m[k] = true
	return true
}

// clear forgets the notes of key of the given kind, whatever their subject.
func (n *noteBook) clear(key string, kind noteKind) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for k := range n.notes[key] {
		if k.kind == kind {
			delete(n.notes[key], k)
		}
	}
}

// clearAll forgets every note of key: its episode is over.
func (n *noteBook) clearAll(key string) {
	n.mu.Lock()
	defer n.mu.Unlock()
	delete(n.notes, key)
}

// keep drops the notes of every volume not in live.
func (n *noteBook) keep(live func(key string) bool) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for key := range n.notes {
		if !live(key) {
			delete(n.notes, key)
		}
	}
}
