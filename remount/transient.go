package remount

import (
	"context"
	"errors"
	"slices"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/klog/v2"
)

// Transient failures.
//
// A tier that fails for a reason that passes (a mount changed between the
// tier's read and its act, a busy mount, a driver that says an operation
// on the volume is already in flight) runs again, a few times with
// backoff, instead of handing the volume to the next, more disruptive
// tier. Any other failure says the tier cannot work and ends it at once.

const (
	// defaultTransientRetries is how many times a tier runs again after a
	// transient failure.
	defaultTransientRetries = 2
	// defaultTransientBackoff is the wait before the first run again; it
	// doubles for each one after.
	defaultTransientBackoff = 250 * time.Millisecond
)

// transientCodes are the gRPC codes of CSI and CRI calls that say "try
// again": Aborted (the CSI spec: an operation is pending for the volume)
// and ResourceExhausted. Unavailable and DeadlineExceeded of the CSI
// driver are ErrDriverUnavailable, which the agent waits out instead.
var transientCodes = map[codes.Code]bool{codes.Aborted: true, codes.ResourceExhausted: true}

// transientErrnos are the syscall errors that pass: a mount busy for a
// moment, an interrupted or would-block call, a short-lived lack of
// memory or descriptors.
var transientErrnos = []unix.Errno{unix.EBUSY, unix.EAGAIN, unix.EINTR, unix.ENOMEM, unix.EMFILE, unix.ENFILE}

// Transient reports whether err is a failure that the same tier may get
// past if it runs again soon. Errors joined (errors.Join) are transient
// only when each of them is: one that says the tier cannot work wins. A
// driver that is down is not transient here (the agent waits for it
// without running any tier), and neither is a cancelled context.
func Transient(err error) bool {
	if err == nil {
		return false
	}
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		errs := j.Unwrap()
		for _, e := range errs {
			if e != nil && !Transient(e) {
				return false
			}
		}
		return len(errs) > 0
	}
	switch {
	case errors.Is(err, ErrDriverUnavailable), errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return false
	case errors.Is(err, ErrMountChanged):
		// The mounts moved under the tier (a concurrent mount or unmount
		// at the volume's paths): the next run reads them again.
		return true
	}
	var gs interface{ GRPCStatus() *status.Status }
	if errors.As(err, &gs) {
		return transientCodes[gs.GRPCStatus().Code()]
	}
	for _, e := range transientErrnos {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

// retries is how many times a tier runs again after a transient failure.
func (r *Repairer) retries() int {
	if r.cfg.TransientRetries < 0 {
		return 0
	}
	if r.cfg.TransientRetries == 0 {
		return defaultTransientRetries
	}
	return r.cfg.TransientRetries
}

// backoff is the wait before run again number n (0 first).
func (r *Repairer) backoff(n int) time.Duration {
	d := r.cfg.TransientBackoff
	if d <= 0 {
		d = defaultTransientBackoff
	}
	return d << n
}

// again says whether the tier runs again after an attempt that ended with
// o (attempt n, 0 first; o.Actions are this attempt's), and waits the
// backoff; false when ctx ends first. A restart that stopped a container
// is not run again: it would stop the container kubelet started anew.
func (r *Repairer) again(ctx context.Context, o *Outcome, n int) bool {
	if o.Healed || r.cfg.DryRun || n >= r.retries() || !Transient(o.Err) {
		return false
	}
	if slices.ContainsFunc(o.Actions, func(a Action) bool { return a.Op == opStopContainer && a.Err == nil }) {
		return false
	}
	wait := r.backoff(n)
	klog.FromContext(ctx).V(2).Info("Transient failure: the tier runs again", "attempt", n+1, "wait", wait, "err", o.Err)
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
