package agent

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mountmedic/mountmedic/remount"
)

func TestDefaultTiers(t *testing.T) {
	want := []string{"reattach", "restage", "liveswap", "restart", "evict", "unmount"}
	if got := DefaultTiers.Names(); !slices.Equal(got, want) {
		t.Errorf("DefaultTiers.Names() = %v, want %v", got, want)
	}
	if DefaultTiers.Has(remount.TierDelete) || DefaultTiers.Has(remount.TierForceDelete) {
		t.Error("the default tiers enable a deletion")
	}
}

func TestConfigValidate(t *testing.T) {
	valid := func() Config {
		c := DefaultConfig()
		c.NodeName = "node-1"
		return c
	}
	if err := valid().Validate(); err != nil {
		t.Fatalf("default config with a node name: %v", err)
	}
	link := filepath.Join(t.TempDir(), "kubelet")
	if err := os.Symlink(t.TempDir(), link); err != nil {
		t.Fatal(err)
	}
	tests := map[string]struct {
		edit func(*Config)
		want string // the flag the error must name
	}{
		"symlinked root":      {func(c *Config) { c.KubeletRoot = link }, "--kubelet-root"},
		"no node":             {func(c *Config) { c.NodeName = "" }, "--node-name"},
		"bad node":            {func(c *Config) { c.NodeName = "Node_1" }, "--node-name"},
		"relative root":       {func(c *Config) { c.KubeletRoot = "var/lib/kubelet" }, "--kubelet-root"},
		"root is slash":       {func(c *Config) { c.KubeletRoot = "/" }, "--kubelet-root"},
		"relative table":      {func(c *Config) { c.HostTable = "mountinfo" }, "--host-table"},
		"zero interval":       {func(c *Config) { c.ProbeInterval = 0 }, "--probe-interval"},
		"no strikes":          {func(c *Config) { c.Strikes = 0 }, "--strikes"},
		"backoff inverted":    {func(c *Config) { c.BackoffMax = time.Millisecond }, "--backoff-max"},
		"negative evictions":  {func(c *Config) { c.MaxEvictions = -1 }, "--max-evictions"},
		"no api rate":         {func(c *Config) { c.APIQPS = 0 }, "--kube-api-qps"},
		"no api burst":        {func(c *Config) { c.APIBurst = 0 }, "--kube-api-burst"},
		"negative release":    {func(c *Config) { c.ReleaseCode = -time.Second }, "--release-code-interval"},
		"daemonset evictable": {func(c *Config) { c.EvictOwnerKinds = []string{"DaemonSet"} }, "DaemonSet"},
		"bad driver":          {func(c *Config) { c.Drivers = []string{"a/b"} }, "--drivers"},
		"bad namespace":       {func(c *Config) { c.IncludeNamespaces = []string{"Kube_System"} }, "Kube_System"},
		"namespace both ways": {func(c *Config) { c.IncludeNamespaces, c.ExcludeNamespaces = []string{"a"}, []string{"a"} }, "both"},
		"force delete, no budget": {func(c *Config) {
			c.Tiers = c.Tiers.With(remount.TierForceDelete, true)
			c.MaxEvictions = 0
		}, "force-delete"},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			c := valid()
			tc.edit(&c)
			err := c.Validate()
			if err == nil {
				t.Fatalf("Validate() = nil, want an error naming %q", tc.want)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Validate() = %q, want it to name %q", err, tc.want)
			}
		})
	}
}

func TestNamespaceAndDriverFilters(t *testing.T) {
	c := DefaultConfig()
	c.IncludeNamespaces = []string{"apps", "data"}
	c.ExcludeNamespaces = []string{"kube-system"}
	c.Drivers = []string{"ru.yandex.s3.csi"}
	for ns, want := range map[string]bool{"apps": true, "data": true, "other": false, "kube-system": false} {
		if got := c.namespaceAllowed(ns); got != want {
			t.Errorf("namespaceAllowed(%q) = %v, want %v", ns, got, want)
		}
	}
	if !c.driverAllowed("ru.yandex.s3.csi") || c.driverAllowed("rbd.csi.ceph.com") {
		t.Error("driverAllowed does not follow --drivers")
	}
	c.Drivers = nil
	if !c.driverAllowed("anything") {
		t.Error("no --drivers must allow every driver")
	}
}

// TestReleasePlan: the executable's unused pages go back once start-up is
// over, at the interval, a minute after the last repair run of a burst,
// and never while a run is in flight.
func TestReleasePlan(t *testing.T) {
	if (releasePlan{}).on() {
		t.Error("--release-code-interval=0 releases, want never")
	}
	p := releasePlan{every: 5 * time.Minute}
	if !p.on() || p.first() != 30*time.Second {
		t.Errorf("default plan: on %v, first after %s; want on, 30s after start", p.on(), p.first())
	}
	if now, next := p.due(0); !now || next != 5*time.Minute {
		t.Errorf("due with no run in flight = %v, %s; want a release now, the next in 5m", now, next)
	}
	if now, next := p.due(3); now || next != 30*time.Second {
		t.Errorf("due with 3 runs in flight = %v, %s; want none now, a retry in 30s", now, next)
	}
	if got := p.afterRuns(); got != time.Minute {
		t.Errorf("after the last run of a burst: release in %s, want 1m", got)
	}
	short := releasePlan{every: 10 * time.Second}
	if short.first() != 10*time.Second || short.afterRuns() != 10*time.Second {
		t.Errorf("10s plan: first %s, after runs %s; want both within the interval", short.first(), short.afterRuns())
	}
}
