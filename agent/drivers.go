package agent

import (
	"context"
	"errors"

	"github.com/mountmedic/mountmedic/remount"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/klog/v2"
)

// checkDrivers asks each driver for its capabilities in the background (at
// most one check at a time) to keep mountmedic_driver_up current and to
// notice a driver that came back without its socket being re-created.
func (a *Agent) checkDrivers(ctx context.Context, drivers []string) {
	if len(drivers) == 0 || !a.checking.CompareAndSwap(false, true) {
		return
	}
	a.workers.Add(1)
	go func() {
		defer a.workers.Done()
		defer a.checking.Store(false)
		for _, d := range drivers {
			cctx, cancel := context.WithTimeout(ctx, a.cfg.APITimeout)
			_, err := a.caps.get(cctx, d)
			cancel()
			if ctx.Err() != nil {
				return
			}
			up := err == nil
			if err != nil && !isDriverDown(err) {
				klog.FromContext(ctx).V(2).Info("CSI driver check failed", "driver", d, "err", err)
			}
			if a.setDriver(d, up) {
				select {
				case a.driverUp <- d:
				default:
				}
			}
		}
	}()
}

// setDriver records a driver's state and reports whether it just came back
// up after being seen down.
func (a *Agent) setDriver(driver string, up bool) bool {
	a.metrics.setDriverUp(driver, up)
	a.driverMu.Lock()
	defer a.driverMu.Unlock()
	was, seen := a.driverOK[driver]
	a.driverOK[driver] = up
	return seen && !was && up
}

// isDriverDown reports a driver that is unavailable or not registered
// (remount's not-registered error matches ErrDriverUnavailable too).
func isDriverDown(err error) bool {
	return errors.Is(err, remount.ErrDriverUnavailable)
}

// driverDown records a driver that is down: one DriverDown event per
// episode, no escalation; the run is retried when the driver registers.
func (a *Agent) driverDown(ctx context.Context, j *job, r *resolved, res jobResult, err error) jobResult {
	a.setDriver(j.vol.driver, false)
	a.caps.forget(j.vol.driver)
	pods, pvc := eventTargets(j, r)
	if a.notes.once(j.key, noteDriverDown, "") {
		klog.FromContext(ctx).V(2).Info("CSI driver is down; waiting for it to register again", "err", err)
		a.report.volume(pods, pvc, corev1.EventTypeWarning, ReasonDriverDown, actionRepair,
			a.report.message("CSI driver %s is not available (%v): re-staging as soon as it registers again", j.vol.driver, err))
	}
	res.outcome = outcomeDriverDown
	return res
}

// backendDown records a volume whose driver answered and whose device
// still does not: the storage behind it is down. The driver is not marked
// down (it answered, and mountmedic_driver_up says so); one BackendDown
// event per episode, no escalation; the run is retried with the volume's
// backoff, and a backend that comes back heals the volume by itself
// before that (its daemon lives).
func (a *Agent) backendDown(ctx context.Context, j *job, r *resolved, res jobResult, err error) jobResult {
	if j.vol.csi {
		a.setDriver(j.vol.driver, true)
	}
	pods, pvc := eventTargets(j, r)
	if a.notes.once(j.key, noteBackendDown, "") {
		klog.FromContext(ctx).V(2).Info("The volume's backend is down; waiting for it", "err", err)
		a.report.volume(pods, pvc, corev1.EventTypeWarning, ReasonBackendDown, actionRepair,
			a.report.message("CSI driver %s answered, but the volume's device still does not (%v): the storage behind it is down; waiting for it, nothing escalated", j.vol.driver, err))
	}
	res.outcome = outcomeWaiting
	return res
}

// eventTargets are the pods and the claim a volume's events go to: the
// resolved ones, else the job's active pods and no claim.
func eventTargets(j *job, r *resolved) ([]*corev1.Pod, *corev1.PersistentVolumeClaim) {
	if r == nil {
		return j.active, nil
	}
	if len(r.pods) > 0 {
		return r.pods, r.pvc
	}
	return j.active, r.pvc
}
