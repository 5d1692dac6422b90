package agent

// stages says whether a CSI driver stages its volumes, from the
// capabilities already cached (never dialing: the loop reads the table
// with it): known is false until the driver has answered.
func (c *capsCache) stages(driver string) (stages, known bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	caps, ok := c.m[driver]
	return caps.StageUnstage, ok
}

// knowsAny reports whether any of drivers has answered since a table read
// could not tell whether it stages.
func (c *capsCache) knowsAny(drivers []string) bool {
	for _, d := range drivers {
		if _, known := c.stages(d); known {
			return true
		}
	}
	return false
}
