package failover

import (
	"strings"
	"testing"
	"time"

	"github.com/spf13/pflag"
)

func validConfig() Config {
	c := DefaultConfig()
	c.Enabled = true
	c.NodeName = "node-1"
	c.Namespace = "mountmedic"
	c.Identity = "mountmedic-abcde"
	return c
}

func validControllerConfig() ControllerConfig {
	c := DefaultControllerConfig()
	c.Namespace = "mountmedic"
	c.Identity = "mountmedic-controller-abcde"
	return c
}

func TestValidate(t *testing.T) {
	tests := map[string]struct {
		edit func(*Config)
		want string // substring of the error; "" for none
	}{
		"defaults":              {edit: func(*Config) {}},
		"disabled not checked":  {edit: func(c *Config) { c.Enabled = false; c.NodeName = ""; c.HeartbeatInterval = 0 }},
		"no node":               {edit: func(c *Config) { c.NodeName = "" }, want: "--node-name is empty"},
		"bad node":              {edit: func(c *Config) { c.NodeName = "Node_1" }, want: "--node-name"},
		"bad namespace":         {edit: func(c *Config) { c.Namespace = "a/b" }, want: "--failover-namespace"},
		"no identity":           {edit: func(c *Config) { c.Identity = "" }, want: "--failover-identity"},
		"zero interval":         {edit: func(c *Config) { c.HeartbeatInterval = 0 }, want: "--failover-heartbeat-interval"},
		"fence below two beats": {edit: func(c *Config) { c.FenceAfter = 8 * time.Second }, want: "below two --failover-heartbeat-interval"},
		"fence not whole":       {edit: func(c *Config) { c.FenceAfter = 30500 * time.Millisecond }, want: "whole seconds"},
		"ns both lists":         {edit: func(c *Config) { c.IncludeNamespaces = []string{"db"}; c.ExcludeNamespaces = []string{"db"} }, want: `"db" is in both`},
		"bad ns":                {edit: func(c *Config) { c.ExcludeNamespaces = []string{"Bad"} }, want: "namespace \"Bad\""},
		"sc both lists":         {edit: func(c *Config) { c.IncludeStorageClasses = []string{"ssd"}; c.ExcludeStorageClasses = []string{"ssd"} }, want: `"ssd" is in both`},
		"peer key, defaults":    {edit: func(c *Config) { c.PeerKeyFile = "/etc/mountmedic/peer/key" }},
		"no peers":              {edit: func(c *Config) { c.PeerKeyFile = "k"; c.Peers = 0 }, want: "--failover-peers"},
		"peer timeout above interval": {
			edit: func(c *Config) { c.PeerKeyFile = "k"; c.PeerTimeout = c.HeartbeatInterval }, want: "--failover-peer-timeout",
		},
		"bad peer listen": {edit: func(c *Config) { c.PeerKeyFile = "k"; c.PeerListen = "9810" }, want: "--failover-peer-listen"},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			c := validConfig()
			tc.edit(&c)
			err := c.Validate()
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("Validate() = %v, want nil", err)
			case tc.want != "" && err == nil:
				t.Fatalf("Validate() = nil, want an error naming %q", tc.want)
			case tc.want != "" && !strings.Contains(err.Error(), tc.want):
				t.Fatalf("Validate() = %v, want it to name %q", err, tc.want)
			}
		})
	}
}

func TestValidateController(t *testing.T) {
	tests := map[string]struct {
		edit func(*ControllerConfig)
		want string // substring of the error; "" for none
	}{
		"defaults":         {edit: func(*ControllerConfig) {}},
		"bad namespace":    {edit: func(c *ControllerConfig) { c.Namespace = "a/b" }, want: "--failover-namespace"},
		"no identity":      {edit: func(c *ControllerConfig) { c.Identity = "" }, want: "--failover-identity"},
		"bad lease name":   {edit: func(c *ControllerConfig) { c.LeaderLease = "A_B" }, want: "--failover-leader-lease"},
		"bad mode":         {edit: func(c *ControllerConfig) { c.Mode = "delete" }, want: "--failover-mode"},
		"margin too small": {edit: func(c *ControllerConfig) { c.FenceMargin = 5 * time.Second }, want: "--failover-fence-margin"},
		"renew above lease": {
			edit: func(c *ControllerConfig) { c.RenewDeadline = 20 * time.Second }, want: "--failover-leader-renew-deadline",
		},
		"retry above renew": {
			edit: func(c *ControllerConfig) { c.RetryPeriod = 10 * time.Second }, want: "--failover-leader-retry-period",
		},
		"no nodes":      {edit: func(c *ControllerConfig) { c.MaxNodes = 0 }, want: "--failover-max-nodes"},
		"share zero":    {edit: func(c *ControllerConfig) { c.StandDownShare = 0 }, want: "--failover-stand-down-share"},
		"share above 1": {edit: func(c *ControllerConfig) { c.StandDownShare = 1.2 }, want: "--failover-stand-down-share"},
		"bad selector":  {edit: func(c *ControllerConfig) { c.NodeSelector = "a in (" }, want: "--failover-node-selector"},
		"negative release": {
			edit: func(c *ControllerConfig) { c.ReleaseCode = -time.Second }, want: "--release-code-interval",
		},
		"sc both lists": {edit: func(c *ControllerConfig) {
			c.IncludeStorageClasses = []string{"ssd"}
			c.ExcludeStorageClasses = []string{"ssd"}
		}, want: `"ssd" is in both`},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			c := validControllerConfig()
			tc.edit(&c)
			err := c.Validate()
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("Validate() = %v, want nil", err)
			case tc.want != "" && err == nil:
				t.Fatalf("Validate() = nil, want an error naming %q", tc.want)
			case tc.want != "" && !strings.Contains(err.Error(), tc.want):
				t.Fatalf("Validate() = %v, want it to name %q", err, tc.want)
			}
		})
	}
}

func TestAddFlags(t *testing.T) {
	c := validConfig()
	fl := pflag.NewFlagSet("agent", pflag.ContinueOnError)
	c.AddFlags(fl)
	err := fl.Parse([]string{"--failover", "--failover-fence-after=40s",
		"--failover-exclude-namespaces=kube-system,monitoring", "--failover-dry-run"})
	if err != nil {
		t.Fatalf("parse flags: %v", err)
	}
	if !c.Enabled || c.FenceAfter != 40*time.Second || !c.DryRun {
		t.Errorf("flags bound into %+v", c)
	}
	if got := strings.Join(c.ExcludeNamespaces, ","); got != "kube-system,monitoring" {
		t.Errorf("ExcludeNamespaces = %q, want kube-system,monitoring", got)
	}
	if err := c.Validate(); err != nil {
		t.Errorf("Validate() after flags = %v", err)
	}
	// The agent does not judge other nodes: no controller flag.
	for _, name := range []string{"failover-mode", "failover-max-nodes", "failover-leader-candidate", "failover-leader-lease", "failover-kubelet-grace"} {
		if fl.Lookup(name) != nil {
			t.Errorf("the agent's flags have --%s, a flag of the controller", name)
		}
	}

	cc := validControllerConfig()
	cfl := pflag.NewFlagSet("controller", pflag.ContinueOnError)
	cc.AddFlags(cfl)
	err = cfl.Parse([]string{"--failover-mode=force-delete", "--failover-fence-after=40s", "--failover-max-nodes=3",
		"--failover-stand-down-share=0.3", "--failover-exclude-namespaces=kube-system,monitoring", "--failover-dry-run"})
	if err != nil {
		t.Fatalf("parse controller flags: %v", err)
	}
	if cc.Mode != ModeForceDelete || cc.FenceAfter != 40*time.Second || cc.MaxNodes != 3 || cc.StandDownShare != 0.3 || !cc.DryRun ||
		strings.Join(cc.ExcludeNamespaces, ",") != "kube-system,monitoring" {
		t.Errorf("controller flags bound into %+v", cc)
	}
	if err := cc.Validate(); err != nil {
		t.Errorf("Validate() after controller flags = %v", err)
	}
	if err := cfl.Parse([]string{"--failover-mode=evict"}); err == nil || !strings.Contains(err.Error(), "taint or force-delete") {
		t.Errorf("--failover-mode=evict: err = %v, want one naming the modes", err)
	}
}

func TestFenceWindow(t *testing.T) {
	c := validControllerConfig() // FenceAfter 30s, margin 15s
	tests := map[string]struct {
		lease int32
		want  time.Duration
	}{
		"not advertised":     {lease: 0, want: 45 * time.Second},
		"shorter advertised": {lease: 10, want: 45 * time.Second},
		"longer advertised":  {lease: 60, want: 75 * time.Second},
	}
	for name, tc := range tests {
		if got := c.FenceWindow(tc.lease); got != tc.want {
			t.Errorf("%s: FenceWindow(%d) = %s, want %s", name, tc.lease, got, tc.want)
		}
	}
}

// TestHeartbeatDefaults: no more heartbeat writes than kubelet's node lease,
// and a hibernated node's shutdown taint is not taken for a fence.
func TestHeartbeatDefaults(t *testing.T) {
	c := DefaultConfig()
	if c.HeartbeatInterval < 10*time.Second {
		t.Errorf("default heartbeat interval %s, want at least kubelet's node lease period (10s)", c.HeartbeatInterval)
	}
	if DefaultControllerConfig().TrustShutdownTaint {
		t.Errorf("TrustShutdownTaint on by default: a hibernated instance carries the shutdown taint and resumes unfenced")
	}
	if err := validConfig().Validate(); err != nil {
		t.Errorf("defaults: %v", err)
	}
}
