package failover

import (
	"time"

	"golang.org/x/sys/unix"
)

// bootClock reads CLOCK_BOOTTIME: the time since boot, suspend included.
// Go's monotonic clock (CLOCK_MONOTONIC) stops while the machine is
// suspended, so a node that was suspended for longer than FenceAfter and
// resumed would not count the suspend and would never fence, while the
// controller, whose clock ran, failed it over. The heartbeat measures its
// silence on this clock.
func bootClock() time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts); err != nil {
		// Linux has had CLOCK_BOOTTIME since 2.6.39; fall back to the
		// monotonic clock rather than stop the heartbeat.
		return time.Since(processStart)
	}
	return time.Duration(ts.Nano())
}

var processStart = time.Now()
