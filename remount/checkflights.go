package remount

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/mountmedic/mountmedic/probe"
)

// checkFlights runs the re-attach tier's kernel checks (a device read, a
// write check) each on a goroutine of its own, at most one per key at a
// time. A check that outlives its deadline stays parked in the kernel
// until the device answers or fails it; a later check of the same key
// waits on that one rather than parking another goroutine, so a backend
// that stays down costs one goroutine per device, not one per repair
// attempt. The zero value is ready to use.
type checkFlights struct {
	mu      sync.Mutex
	flights map[string]*checkFlight
}

type checkFlight struct {
	done  chan struct{}
	err   error
	start time.Time
}

// run returns fn's result for key, or probe.ErrHung once timeout passes
// without one. When a check of key is already running, run waits on it.
func (c *checkFlights) run(ctx context.Context, key string, timeout time.Duration, fn func() error) error {
	c.mu.Lock()
	f := c.flights[key]
	if f == nil {
		if c.flights == nil {
			c.flights = make(map[string]*checkFlight)
		}
		f = &checkFlight{done: make(chan struct{}), start: time.Now()}
		c.flights[key] = f
		go func() {
			f.err = fn()
			c.mu.Lock()
			delete(c.flights, key)
			c.mu.Unlock()
			close(f.done)
		}()
	}
	c.mu.Unlock()
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case <-f.done:
		return f.err
	case <-timer.C:
		return fmt.Errorf("%w (%s; %s running for %s)", probe.ErrHung, timeout, key, time.Since(f.start).Round(time.Millisecond))
	case <-ctx.Done():
		return ctx.Err()
	}
}

// running is how many checks are in flight (parked ones included).
func (c *checkFlights) running() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.flights)
}
