package agent

import (
	"context"
	"slices"
	"testing"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/remount"
)

// reattachingRepairer is a fakeRepairer with the re-attach tier.
type reattachingRepairer struct{ fakeRepairer }

func (r *reattachingRepairer) Reattach(context.Context, *remount.Volume) remount.Outcome {
	return r.do(remount.TierReattach)
}

// TestNBDRungs: an NBD volume of a driver that re-attaches (ceph-csi,
// Rook's name included) starts its ladder with the re-attach, and a
// ceph-csi volume goes on to eviction only (a re-stage cannot reach its
// staging mount); a loop-backed volume, a driver that does not re-attach,
// a repairer without the tier, or the tier switched off leave the ladder
// as it was.
func TestNBDRungs(t *testing.T) {
	nbd := &probe.Backend{Kind: probe.BackendBlock, Dev: probe.Dev{Major: 43, Minor: 3}, Device: "nbd3"}
	loop := &probe.Backend{Kind: probe.BackendBlock, Dev: probe.Dev{Major: 7, Minor: 0}, Device: "loop0"}
	all := []string{"restage", "liveswap", "restart", "evict"}
	for name, tc := range map[string]struct {
		driver   string
		backend  *probe.Backend
		plain    bool // a repairer without Reattach
		tiers    remount.TierSet
		want     []string
		reported bool
	}{
		"ceph-csi rbd-nbd":          {driver: "rbd.csi.ceph.com", backend: nbd, want: []string{"reattach", "evict"}},
		"rook's ceph-csi rbd-nbd":   {driver: "rook-ceph.rbd.csi.ceph.com", backend: nbd, want: []string{"reattach", "evict"}},
		"ceph-csi krbd":             {driver: "rbd.csi.ceph.com", backend: loop, want: all, reported: true},
		"a driver that re-stages":   {driver: "cephfs.csi.ceph.com", backend: nbd, want: all},
		"repairer without the tier": {driver: "rbd.csi.ceph.com", backend: nbd, plain: true, want: []string{"evict"}},
		"tier switched off": {driver: "rbd.csi.ceph.com", backend: nbd, want: []string{"evict"},
			tiers: DefaultTiers.With(remount.TierReattach, false)},
	} {
		t.Run(name, func(t *testing.T) {
			cfg := DefaultConfig()
			if tc.tiers != 0 {
				cfg.Tiers = tc.tiers
			}
			a := &Agent{cfg: cfg, repairer: &reattachingRepairer{}}
			if tc.plain {
				a.repairer = &fakeRepairer{}
			}
			v := &brokenVolume{csi: true, driver: tc.driver, backend: tc.backend}
			var got []string
			for _, r := range a.rungs(v, true, 0) {
				got = append(got, r.String())
			}
			if !slices.Equal(got, tc.want) {
				t.Errorf("rungs = %v, want %v", got, tc.want)
			}
			if why := notUnderstood(v, false); (why != "") != tc.reported {
				t.Errorf("notUnderstood = %q, want reported %v", why, tc.reported)
			}
		})
	}
}

// TestReattachFirst: a queued NBD volume of ceph-csi whose floor is still
// the re-attach takes a re-attach slot (maxReattachRuns), not one of
// MaxConcurrentRepairs; once a run raised its floor, or for any other
// volume, or with the tier off, it takes a repair slot.
func TestReattachFirst(t *testing.T) {
	nbd := &probe.Backend{Kind: probe.BackendBlock, Dev: probe.Dev{Major: 43, Minor: 3}, Device: "nbd3"}
	fuse := &probe.Backend{Kind: probe.BackendFUSE, Dev: probe.Dev{Major: 0, Minor: 55}}
	for name, tc := range map[string]struct {
		driver  string
		backend *probe.Backend
		floor   remount.Tier
		tiers   remount.TierSet
		want    bool
	}{
		"ceph-csi rbd-nbd":            {driver: "rbd.csi.ceph.com", backend: nbd, want: true},
		"past its re-attach":          {driver: "rbd.csi.ceph.com", backend: nbd, floor: remount.TierEvict},
		"a FUSE volume":               {driver: "cephfs.csi.ceph.com", backend: fuse},
		"re-attach tier switched off": {driver: "rbd.csi.ceph.com", backend: nbd, tiers: DefaultTiers.With(remount.TierReattach, false)},
	} {
		t.Run(name, func(t *testing.T) {
			cfg := DefaultConfig()
			if tc.tiers != 0 {
				cfg.Tiers = tc.tiers
			}
			a := &Agent{cfg: cfg, repairer: &reattachingRepairer{}, decider: newDecider(&cfg),
				broken: map[string]*brokenVolume{"v": {key: "v", csi: true, driver: tc.driver, backend: tc.backend}}}
			a.decider.vols["v"] = &volState{floor: tc.floor}
			if got := a.reattachFirst("v"); got != tc.want {
				t.Errorf("reattachFirst = %v, want %v", got, tc.want)
			}
			if got := a.reattachFirst("gone"); got {
				t.Error("reattachFirst of a volume no longer broken = true, want false")
			}
		})
	}
}
