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
// view of the volume through /proc/<pid>/root/<mountPath> (the walk through
// the magic link resolves the path in the container's mount namespace and
// root). A probe is statfs followed by statx(AT_STATX_FORCE_SYNC), never a
// plain stat, which a dead FUSE mount answers from its attribute cache. Each
// probe runs on its own goroutine under the probe deadline; at most one
// probe per path is in flight, so a path that hangs costs one parked thread,
// never a pile of them (see package probe).

// place is somewhere a tier verifies.
type place struct {
	// path is the path to probe: a host path, or /proc/<pid>/root/<path>.
	path string
	// label names it in actions and errors: the host path, or
	// "pid <n>:<path>".
	label string
}

func hostPlace(path string) place { return place{path: path, label: path} }

func containerPlace(procDir string, pid int, path string) place {
	return place{
		path:  procDir + "/" + strconv.Itoa(pid) + "/root" + cleanAbs(path),
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

// prober runs verification probes.
type prober struct {
	sys     probe.Syscalls
	timeout time.Duration

	mu       sync.Mutex
	inflight map[string]*flight
}

type flight struct {
	done chan struct{}
	err  error
}

// check probes path: nil when the filesystem answered, else an error for
// which probe.StateOf gives the state (probe.ErrHung past the deadline).
func (p *prober) check(ctx context.Context, path string) error {
	p.mu.Lock()
	f := p.inflight[path]
	if f != nil {
		select {
		case <-f.done:
			delete(p.inflight, path)
			f = nil
		default:
		}
	}
	if f != nil {
		p.mu.Unlock()
		return fmt.Errorf("an earlier probe of %s has not returned: %w", path, probe.ErrHung)
	}
	f = &flight{done: make(chan struct{})}
	p.inflight[path] = f
	p.mu.Unlock()

	go func() {
		err := p.sys.Statfs(path)
		if err != nil {
			err = fmt.Errorf("statfs: %w", err)
		} else if err = p.sys.StatxSync(path); err != nil {
			err = fmt.Errorf("statx: %w", err)
		}
		f.err = err
		close(f.done)
	}()
	timer := time.NewTimer(p.timeout)
	defer timer.Stop()
	select {
	case <-f.done:
		p.mu.Lock()
		if p.inflight[path] == f {
			delete(p.inflight, path)
		}
		p.mu.Unlock()
		return f.err
	case <-timer.C:
		return fmt.Errorf("no answer within %s: %w", p.timeout, probe.ErrHung)
	case <-ctx.Done():
		return ctx.Err()
	}
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
	places = slices.CompactFunc(places, func(a, b place) bool { return a.path == b.path })
	actions := make([]Action, len(places))
	var wg sync.WaitGroup
	for i, pl := range places {
		wg.Go(func() {
			start := time.Now()
			err := r.prober.check(ctx, pl.path)
			a := Action{Op: OpVerify, Path: pl.label, Took: time.Since(start)}
			st := probe.StateOf(err)
			a.Detail = st.String()
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
