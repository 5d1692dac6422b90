package agent

import (
	"context"

	"github.com/mountmedic/mountmedic/probe/kubelet"
	"github.com/mountmedic/mountmedic/remount"
)

// reattacher is the re-attach tier of the mount side
// (remount.Repairer.Reattach); a repairer without it has no such rung.
type reattacher interface {
	Reattach(ctx context.Context, v *remount.Volume) remount.Outcome
}

// nbdRungs says how an NBD volume of a driver that re-attaches
// (kubelet.Driver.Reattach: ceph-csi RBD's rbd-nbd mounter) enters the
// ladder: reattach first, the cheapest repair (the kernel device, the
// mounts and the containers' binds stay; a failed filesystem is mounted
// afresh on the kept device); restage reports whether the re-stage rungs
// follow, which they do only for a driver a re-stage can reach (not
// ceph-csi, whose staging mount sits below kubelet's staging path).
// nbd is false for any other volume, which enters the ladder as before.
func (a *Agent) nbdRungs(v *brokenVolume) (nbd, reattach, restage bool) {
	if v == nil || !v.csi || !remount.IsNBD(v.backend) {
		return false, false, true
	}
	d, ok := kubelet.LookupDriver(v.driver)
	if !ok || !d.Reattach {
		return false, false, true
	}
	_, can := a.repairer.(reattacher)
	return true, can && a.cfg.Tiers.Has(remount.TierReattach), d.Restage
}

// maxReattachRuns bounds the repair runs under way that began with the
// re-attach rung. They are not held to MaxConcurrentRepairs: a re-attach is
// one NodeStageVolume, the request ceph-csi's own healer sends for every
// attached volume at once when its node plugin starts
// (internal/rbd/rbd_healer.go, RunVolumeHealer: a goroutine per
// VolumeAttachment), and it changes nothing the pods hold. A node plugin
// restart kills every rbd-nbd daemon of the node: held to four at a time,
// twenty volumes waited five rounds of re-attaches. The rung after a
// failed re-attach of ceph-csi's volumes is eviction, which the eviction
// budget bounds (MaxEvictions).
const maxReattachRuns = 32

// RepairSlots is how many volumes the agent's repair runs act on at once
// at most: the mount side's bound (remount.Config.Parallel) must let
// every run the loop starts go, re-attaches (maxReattachRuns) included.
func (c Config) RepairSlots() int { return c.MaxConcurrentRepairs + maxReattachRuns }

// reattachFirst reports whether the run of the queued volume key begins
// with the re-attach rung: an NBD volume of a driver that re-attaches,
// whose earlier runs did not raise its floor past that rung.
func (a *Agent) reattachFirst(key string) bool {
	bv := a.broken[key]
	if bv == nil || !a.cfg.Tiers.Has(remount.TierReattach) {
		return false
	}
	st := a.decider.vols[key]
	if st == nil || st.floor > remount.TierReattach {
		return false
	}
	_, reattach, _ := a.nbdRungs(bv)
	return reattach
}
