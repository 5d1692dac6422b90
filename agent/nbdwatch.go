package agent

import (
	"context"
	"errors"

	"github.com/mountmedic/mountmedic/probe"
)

// watchNBD starts the prober's watch of the kernel's nbd link-dead events
// (probe.Prober.WatchNBD): a daemon of an NBD volume that dies wakes a
// probe cycle at once, which finds the device's mounts broken without
// waiting on the device (probe.ErrNBDDaemonGone, certain: no strikes), so
// the re-attach tier runs within the kernel's dead-connection hold. The
// cycles' own check of each device's daemon (sysfs pid) finds the deaths
// the watch cannot hear. The wake shares the stall watch's channel: both
// ask for a cycle now. A dry run watches too: it only reads.
func (a *Agent) watchNBD(ctx context.Context) {
	a.workers.Add(1)
	go func() {
		defer a.workers.Done()
		a.prober.WatchNBD(ctx, func() {
			select {
			case a.stalled <- struct{}{}:
			default:
			}
		})
	}()
}

// nbdDaemonGone: the volume's nbd device is known dead without I/O, which
// no strikes are waited on for: nothing serves the device until a daemon
// is re-attached, and the kernel holds its I/O only for the dead-connection
// timeout.
func (v *brokenVolume) nbdDaemonGone() bool {
	return v.backend != nil && v.backend.Kind == probe.BackendBlock && errors.Is(v.err, probe.ErrNBDDaemonGone)
}
