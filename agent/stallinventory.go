package agent

import (
	"context"
	"time"
)

// inventoryGap is the least time between two reads of the mount table that
// changes ask for between probe cycles (tableChanged): under a burst of
// mounts (pods starting, a thousand re-stages) the table is read at most
// once a second on top of the cycles' own reads.
const inventoryGap = time.Second

// tableChanged marks the table for the next cycle to read and, while the
// stall watch runs, has it read before then: now, or inventoryGap after
// the last read. The stall watch reads the waiting requests of the FUSE
// backends of the inventory it is given, so a volume mounted after the
// last cycle's read is unknown to it until the next one: a daemon that
// hangs under a pod started in between would be found by that cycle and
// its probe's deadline, not one deadline after the pod's first blocked
// read. Reading the table there probes nothing.
func (a *Agent) tableChanged(c *cycle) {
	c.dirty = true
	if a.cfg.StallPoll <= 0 || c.inv == nil || c.refreshing {
		return
	}
	c.refreshing = true
	c.refresh.Reset(time.Until(c.readAt.Add(inventoryGap)))
}

// refreshInventory reads the changed table (unless a cycle read it since
// the change) and gives the stall watch its inventory. The next cycle
// probes it, without reading it again when it has not changed since.
func (a *Agent) refreshInventory(ctx context.Context, c *cycle, pw *pluginWatcher) {
	c.refreshing = false
	if !c.dirty || c.inv == nil {
		return
	}
	c.readAt = time.Now()
	c.inv = a.readTable(ctx, c.inv, &c.dirty, pw)
	a.current.Store(c.inv)
}
