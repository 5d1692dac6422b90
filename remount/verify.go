package remount

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/mountmedic/mountmedic/probe"
	"k8s.io/klog/v2"
)

// Verification.
//
// A tier reports Healed only after probing every place it can reach: the
// staging path and publish targets on the host, and each container's own
// view of the volume, <mountPath> opened inside /proc/<pid>/root (the
// container's mount namespace and root) with openat2(RESOLVE_IN_ROOT|
// RESOLVE_NO_SYMLINKS) and probed through the descriptor
// (probe.Prober.CheckIn): a symlink the container planted on the way fails
// the verification instead of leading it to a healthy place outside the
// container (an absolute symlink under /proc/<pid>/root resolves against
// our root). A host path is probed with probe.Prober.CheckPath. Either is
// statfs followed by statx(AT_STATX_FORCE_SYNC), never a plain stat, which a
// dead FUSE mount answers from its attribute cache, on its own goroutine
// under the probe deadline (the open included: an open on a hung FUSE mount
// blocks too), at most one per path in flight, so a path that hangs costs
// one parked thread, never a pile of them.

// place is somewhere a tier verifies.
type place struct {
	// root is, for a container's view, /proc/<pid>/root, inside which path
	// is resolved; empty for a host path.
	root string
	// path is the path to probe: a host path, or a path inside root.
	path string
	// label names it in actions and errors: the host path, or
	// "pid <n>:<path>".
	label string
}

func hostPlace(path string) place { return place{path: path, label: path} }

func containerPlace(procDir string, pid int, path string) place {
	return place{
		root:  procDir + "/" + strconv.Itoa(pid) + "/root",
		path:  cleanAbs(path),
		label: fmt.Sprintf("pid %d:%s", pid, cleanAbs(path)),
	}
}

// cleanAbs makes p an absolute clean path.
func cleanAbs(p string) string {
	if p == "" || p[0] != '/' {
		p = "/" + p
	}
	for len(p) > 1 && p[len(p)-1] == '/' {
		p = p[:len(p)-1]
	}
	return p
}

// check probes path (probe.Prober.CheckPath): nil when the filesystem
// answered, else an error naming the state (probe.ErrHung past the
// deadline, or while an earlier probe of the path has not returned).
func (r *Repairer) check(ctx context.Context, path string) (probe.State, error) {
	st, err := r.prober.CheckPath(ctx, path)
	switch {
	case st == probe.Healthy:
		return st, nil
	case err == nil:
		err = fmt.Errorf("probe of %s: %s", path, st)
	}
	return st, err
}

// checkIn probes path inside root (probe.Prober.CheckIn), as check does.
func (r *Repairer) checkIn(ctx context.Context, root, path string) (probe.State, error) {
	st, err := r.prober.CheckIn(ctx, root, path)
	switch {
	case st == probe.Healthy:
		return st, nil
	case err == nil:
		err = fmt.Errorf("probe of %s in %s: %s", path, root, st)
	}
	return st, err
}

// verify probes the places at once and returns one action per place and
// the errors of the broken ones.
func (r *Repairer) verify(ctx context.Context, places []place) ([]Action, error) {
	// One probe per path, in a stable order.
	slices.SortFunc(places, func(a, b place) int {
		switch {
		case a.label < b.label:
			return -1
		case a.label > b.label:
			return 1
		}
		return 0
	})
	places = slices.CompactFunc(places, func(a, b place) bool { return a.root == b.root && a.path == b.path })
	actions := make([]Action, len(places))
	var wg sync.WaitGroup
	for i, pl := range places {
		wg.Go(func() {
			start := time.Now()
			var st probe.State
			var err error
			if pl.root != "" {
				st, err = r.checkIn(ctx, pl.root, pl.path)
			} else {
				st, err = r.check(ctx, pl.path)
			}
			a := Action{Op: opVerify, Path: pl.label, Took: time.Since(start), Detail: st.String()}
			if err != nil {
				a.Err = fmt.Errorf("verify %s: %s: %w", pl.label, st, err)
			}
			actions[i] = a
		})
	}
	wg.Wait()
	logger := klog.FromContext(ctx)
	for _, a := range actions {
		logger.V(4).Info("Verified", "place", a.Path, "state", a.Detail, "took", a.Took, "err", a.Err)
	}
	return actions, actionsErr(actions)
}
