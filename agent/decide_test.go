package agent

import (
	"slices"
	"testing"
	"time"

	"github.com/mountmedic/mountmedic/remount"
)

func testDecider() *decider {
	cfg := DefaultConfig()
	cfg.Strikes = 2
	cfg.BackoffBase = time.Second
	cfg.BackoffMax = 8 * time.Second
	cfg.Resync = 30 * time.Second
	return newDecider(&cfg)
}

func TestDeciderStrikes(t *testing.T) {
	t0 := time.Unix(1000, 0)
	tests := map[string]struct {
		seen    sighting
		cycles  int
		wantDue []bool // due after each cycle
	}{
		"transient state waits for its strikes": {sighting{driver: "d"}, 3, []bool{false, true, true}},
		"a gone FUSE connection acts at once":   {sighting{driver: "d", certain: true}, 2, []bool{true, true}},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			d := testDecider()
			for i := 0; i < tc.cycles; i++ {
				due := d.observe(map[string]sighting{"v": tc.seen}, t0.Add(time.Duration(i)*time.Second))
				if got := slices.Contains(due, "v"); got != tc.wantDue[i] {
					t.Errorf("cycle %d: due = %v, want %v", i+1, got, tc.wantDue[i])
				}
			}
		})
	}
}

func TestDeciderBackoffDoubles(t *testing.T) {
	d := testDecider()
	t0 := time.Unix(1000, 0)
	broken := map[string]sighting{"v": {driver: "d", certain: true}}
	now := t0
	var waits []time.Duration
	for i := 0; i < 6; i++ {
		if due := d.observe(broken, now); !slices.Contains(due, "v") {
			t.Fatalf("attempt %d: not due at %v", i+1, now.Sub(t0))
		}
		d.start("v")
		// In flight: never due twice.
		if due := d.observe(broken, now); slices.Contains(due, "v") {
			t.Fatalf("attempt %d: due while a run is in flight", i+1)
		}
		d.finish("v", outcomeFailed, false, now)
		st := d.vols["v"]
		waits = append(waits, st.next.Sub(now))
		if due := d.observe(broken, st.next.Add(-time.Millisecond)); slices.Contains(due, "v") {
			t.Fatalf("attempt %d: due before its backoff of %v ended", i+1, waits[i])
		}
		now = st.next
	}
	want := []time.Duration{1, 2, 4, 8, 8, 8}
	for i := range want {
		want[i] *= time.Second
	}
	if !slices.Equal(waits, want) {
		t.Errorf("backoff waits = %v, want %v", waits, want)
	}
}

func TestDeciderDriverDownWaitsForKick(t *testing.T) {
	d := testDecider()
	t0 := time.Unix(1000, 0)
	broken := map[string]sighting{"a": {driver: "d1", certain: true}, "b": {driver: "d2", certain: true}}
	d.observe(broken, t0)
	for _, k := range []string{"a", "b"} {
		d.start(k)
		d.finish(k, outcomeDriverDown, false, t0)
	}
	// Far later, still not due: a driver that is down is waited for, never
	// retried on the clock alone (only the resync lets it try again).
	if due := d.observe(broken, t0.Add(time.Hour)); len(due) != 0 {
		t.Fatalf("due while the driver is down = %v, want none", due)
	}
	if got := d.kick("d1", t0.Add(time.Hour)); !slices.Equal(got, []string{"a"}) {
		t.Errorf("kick(d1) = %v, want [a]", got)
	}
	if due := d.observe(broken, t0.Add(time.Hour)); !slices.Equal(due, []string{"a"}) {
		t.Errorf("due after kick(d1) = %v, want [a]", due)
	}
	d.resync()
	if due := d.observe(broken, t0.Add(2*time.Hour)); !slices.Contains(due, "b") {
		t.Errorf("due after resync = %v, want b among them", due)
	}
}

func TestDeciderKickWindowCoversVolumesSeenAfter(t *testing.T) {
	d := testDecider()
	t0 := time.Unix(1000, 0)
	d.kick("d1", t0) // the driver registered before any probe saw the volume broken
	broken := map[string]sighting{"late": {driver: "d1"}, "other": {driver: "d2"}}
	due := d.observe(broken, t0.Add(time.Second))
	if !slices.Equal(due, []string{"late"}) {
		t.Errorf("due right after d1 returned = %v, want [late] (strikes skipped for d1 only)", due)
	}
	// Past the window a new volume waits for its strikes again.
	d2 := testDecider()
	d2.kick("d1", t0)
	if due := d2.observe(map[string]sighting{"late": {driver: "d1"}}, t0.Add(returnWindow+time.Second)); len(due) != 0 {
		t.Errorf("due %v after the return window, want none", due)
	}
}

func TestDeciderHealedStartsOver(t *testing.T) {
	d := testDecider()
	t0 := time.Unix(1000, 0)
	broken := map[string]sighting{"v": {driver: "d"}}
	d.observe(broken, t0)
	d.observe(broken, t0.Add(time.Second))
	d.start("v")
	d.finish("v", outcomeHealed, false, t0.Add(time.Second))
	if st := d.vols["v"]; st.strikes != 0 || st.floor != 0 {
		t.Errorf("after a heal: strikes %d floor %d, want 0 and 0", st.strikes, st.floor)
	}
	// Healthy in the next cycle: forgotten.
	d.observe(map[string]sighting{}, t0.Add(2*time.Second))
	if _, ok := d.vols["v"]; ok {
		t.Error("a volume that probes healthy is still remembered")
	}
}

// TestDeciderIgnoresCyclesOlderThanTheRun: a cycle that began before a
// run ended (a probe stuck in the hung daemon the run aborted answers
// "disconnected" after the repair) does not make the repaired volume due
// again, however certain its sighting; a cycle begun after the run does,
// and the state (backoff, attempts) is kept across the ignored one.
func TestDeciderIgnoresCyclesOlderThanTheRun(t *testing.T) {
	d := testDecider()
	t0 := time.Unix(1000, 0)
	hung := map[string]sighting{"v": {driver: "d", certain: true, probed: t0}}
	if due := d.observe(hung, t0.Add(time.Second)); !slices.Contains(due, "v") {
		t.Fatalf("certain sighting: due %v, want v", due)
	}
	d.start("v")
	ended := t0.Add(3 * time.Second)
	d.finish("v", outcomeHealed, false, ended)
	// The cycle that began at 2.5 s ends after the run, 1.5 s later: past
	// the backoff, but it began before the run ended.
	stale := map[string]sighting{"v": {driver: "d", certain: true, probed: ended.Add(-500 * time.Millisecond)}}
	if due := d.observe(stale, ended.Add(1500*time.Millisecond)); len(due) != 0 {
		t.Fatalf("a cycle begun before the run ended made %v due, want none", due)
	}
	st := d.vols["v"]
	if st == nil || st.attempts != 1 || st.strikes != 0 {
		t.Fatalf("state after the ignored cycle: %+v, want kept with 1 attempt and no strike", st)
	}
	fresh := map[string]sighting{"v": {driver: "d", certain: true, probed: ended.Add(time.Second)}}
	if due := d.observe(fresh, ended.Add(2*time.Second)); !slices.Contains(due, "v") {
		t.Fatalf("a cycle begun after the run ended: due %v, want v (still broken)", due)
	}
}

func TestDeciderEvictionFloor(t *testing.T) {
	d := testDecider()
	t0 := time.Unix(1000, 0)
	broken := map[string]sighting{"v": {driver: "d", certain: true}}
	d.observe(broken, t0)
	d.start("v")
	d.finish("v", outcomeWaiting, true, t0)
	if got := d.vols["v"].floor; got != remount.TierEvict {
		t.Errorf("floor after a run reached eviction = %d, want %d", got, remount.TierEvict)
	}
	d.kick("d", t0)
	if got := d.vols["v"].floor; got != 0 {
		t.Errorf("floor after the driver returned = %d, want 0 (try the tiers again)", got)
	}
}

func TestNoteBook(t *testing.T) {
	n := newNoteBook()
	if !n.once("v", noteDriverDown, "") || n.once("v", noteDriverDown, "") {
		t.Fatal("once: want true then false")
	}
	if !n.once("v", noteTerminating, "pod-a") || !n.once("v", noteTerminating, "pod-b") {
		t.Fatal("once: a note about another subject is another note")
	}
	n.once("v", noteSkip, "")
	n.clear("v", noteTerminating)
	if !n.once("v", noteTerminating, "pod-a") || !n.once("v", noteTerminating, "pod-b") {
		t.Error("clear(kind) did not forget every subject of the kind")
	}
	if n.once("v", noteDriverDown, "") || n.once("v", noteSkip, "") {
		t.Error("clear(kind) forgot a note of another kind")
	}
	if !n.once("w", noteSkip, "") {
		t.Error("a note of one volume silenced another's")
	}
	n.clearAll("v")
	if !n.once("v", noteSkip, "") {
		t.Error("clearAll did not forget the volume's notes")
	}
	n.keep(func(string) bool { return false })
	if !n.once("v", noteSkip, "") {
		t.Error("keep(none) did not forget the volume")
	}
}
