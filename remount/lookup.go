package remount

import (
	"context"
	"fmt"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/probe"
)

// lookupFlights opens names below a fresh volume's root within a deadline.
// The lookups go to the volume's filesystem (a FUSE daemon answers them),
// so a fresh daemon that hangs would park the repair worker for good. A
// lookup that outlives its deadline stays parked in the kernel on a
// goroutine of its own, which closes what it opens when it returns late;
// while it is parked, a lookup of the same name fails at once rather than
// parking another goroutine. The zero value is ready to use.
type lookupFlights struct {
	mu     sync.Mutex
	parked map[string]time.Time // key -> when its parked lookup began
}

// open opens name below dir with O_PATH and resolveSafe (no symlink, never
// above dir), as openat2 does, or fails with probe.ErrHung once timeout
// passes. key names the lookup for the parked set (the directory's path and
// name). The caller keeps dir open; open works on a duplicate of it.
func (l *lookupFlights) open(ctx context.Context, key string, dir int, name string, timeout time.Duration) (int, error) {
	l.mu.Lock()
	if since, ok := l.parked[key]; ok {
		l.mu.Unlock()
		return -1, fmt.Errorf("%w: an earlier lookup of %s has been parked for %s", probe.ErrHung, key, time.Since(since).Round(time.Millisecond))
	}
	l.mu.Unlock()
	// The goroutine may outlive the caller's descriptor: it owns a
	// duplicate, so a number the caller closes and the process reuses
	// is never resolved against.
	d, err := unix.FcntlInt(uintptr(dir), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("duplicate the descriptor of %s: %w", key, err)
	}
	type result struct {
		fd  int
		err error
	}
	res := make(chan result, 1)
	var (
		mu        sync.Mutex
		abandoned bool
	)
	start := time.Now()
	go func() {
		fd, err := openat2(d, name, unix.O_PATH, resolveSafe)
		unix.Close(d)
		mu.Lock()
		defer mu.Unlock()
		if !abandoned {
			res <- result{fd, err}
			return
		}
		if err == nil {
			unix.Close(fd)
		}
		l.mu.Lock()
		delete(l.parked, key)
		l.mu.Unlock()
	}()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	var stop error
	select {
	case r := <-res:
		return r.fd, r.err
	case <-timer.C:
		stop = fmt.Errorf("%w: lookup of %s not answered within %s", probe.ErrHung, key, timeout)
	case <-ctx.Done():
		stop = ctx.Err()
	}
	mu.Lock()
	defer mu.Unlock()
	select {
	case r := <-res: // it returned while the deadline fired
		return r.fd, r.err
	default:
	}
	abandoned = true
	l.mu.Lock()
	if l.parked == nil {
		l.parked = make(map[string]time.Time)
	}
	l.parked[key] = start
	l.mu.Unlock()
	return -1, stop
}

// parkedCount is how many lookups are parked.
func (l *lookupFlights) parkedCount() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.parked)
}
