package agent

import (
	"context"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/mountmedic/mountmedic/remount"
)

// TestOutOfReachFollowsTheCatalogue: a reported volume whose daemon is out
// of the node plugin's reach goes to the eviction rung only when the user
// opted in, eviction (or delete) is enabled and the catalogue's grace for
// the driver's own recovery has passed; its report says which, and no other
// reported volume ever escalates.
func TestOutOfReachFollowsTheCatalogue(t *testing.T) {
	evictOnly := remount.NewTierSet(remount.TierEvict)
	tests := map[string]struct {
		driver   string
		optIn    bool
		tiers    remount.TierSet
		age      time.Duration // since the volume was found dead
		active   int
		escalate bool
		outcome  outcome
		says     []string
	}{
		"sidecar, default":          {driver: "gcsfuse.csi.storage.gke.io", tiers: DefaultTiers, active: 1, outcome: outcomeIgnored, says: []string{"reports it only", "--escalate-out-of-reach", "restarted sidecar"}},
		"sidecar, opted in":         {driver: "gcsfuse.csi.storage.gke.io", optIn: true, tiers: DefaultTiers, active: 1, escalate: true, outcome: outcomeWaiting, says: []string{"will evict", "never a pod no controller owns"}},
		"sidecar, delete tier only": {driver: "gcsfuse.csi.storage.gke.io", optIn: true, tiers: remount.NewTierSet(remount.TierDelete), active: 1, escalate: true, outcome: outcomeWaiting, says: []string{"will delete (UID precondition)"}},
		"sidecar, eviction off":     {driver: "gcsfuse.csi.storage.gke.io", optIn: true, tiers: remount.NewTierSet(remount.TierRestage), active: 1, outcome: outcomeIgnored, says: []string{"neither evict nor delete"}},
		"sidecar, no active pod":    {driver: "gcsfuse.csi.storage.gke.io", optIn: true, tiers: evictOnly, outcome: outcomeIgnored, says: []string{"will evict"}},
		"mount pod, within grace":   {driver: "csi.juicefs.com", optIn: true, tiers: evictOnly, age: time.Minute, active: 1, outcome: outcomeWaiting, says: []string{"--enable-manager", "still dead 2m0s after"}},
		"mount pod, grace passed":   {driver: "csi.juicefs.com", optIn: true, tiers: evictOnly, age: 3 * time.Minute, active: 1, escalate: true, outcome: outcomeWaiting, says: []string{"will evict"}},
		"engine pod, grace passed":  {driver: "driver.longhorn.io", optIn: true, tiers: evictOnly, age: 3 * time.Minute, active: 1, escalate: true, outcome: outcomeWaiting, says: []string{"auto-delete-pod-when-volume-detached-unexpectedly"}},
		"ceph-csi rbd (no daemon)":  {driver: "rbd.csi.ceph.com", optIn: true, tiers: evictOnly, age: time.Hour, active: 1, outcome: outcomeIgnored},
		"uncatalogued driver":       {driver: "fs.example.com", optIn: true, tiers: evictOnly, age: time.Hour, active: 1, outcome: outcomeIgnored},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			cfg := DefaultConfig()
			cfg.EscalateOutOfReach, cfg.Tiers = tc.optIn, tc.tiers
			a := &Agent{cfg: cfg}
			why := notUnderstood(&brokenVolume{csi: true, driver: tc.driver}, false)
			rec, skip := a.recoveryPlan(tc.driver, why)
			if !strings.HasPrefix(skip, why) {
				t.Errorf("recoveryPlan(%s) = %q, want it to start with the report %q", tc.driver, skip, why)
			}
			if n := len(dryRunPrefix + skip); n > 1000 {
				t.Errorf("recoveryPlan(%s) is %d bytes with the dry-run mark, want at most 1000: the event would cut off what mountmedic does", tc.driver, n)
			}
			for _, s := range tc.says {
				if !strings.Contains(skip, s) {
					t.Errorf("recoveryPlan(%s) = %q, want it to say %q", tc.driver, skip, s)
				}
			}
			j := &job{key: "k", skip: skip, reported: true, recovery: rec, since: time.Now().Add(-tc.age)}
			for range tc.active {
				j.active = append(j.active, &corev1.Pod{})
			}
			out, escalate := a.outOfReach(context.Background(), j)
			if escalate != tc.escalate || out != tc.outcome {
				t.Errorf("outOfReach = %v, escalate %v; want %v, escalate %v", out, escalate, tc.outcome, tc.escalate)
			}
			if escalate {
				if rungs := a.rungs(&brokenVolume{csi: true, driver: tc.driver}, false, 0); len(rungs) != 1 || rungs[0] != remount.TierEvict {
					t.Errorf("rungs of an out-of-reach volume = %s, want evict alone", rungList(rungs))
				}
			}
		})
	}
}
