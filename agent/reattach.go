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
