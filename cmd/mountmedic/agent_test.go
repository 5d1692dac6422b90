package main

import (
	"bytes"
	"context"
	"path/filepath"
	"strings"
	"testing"
)

func TestAgentBadInput(t *testing.T) {
	t.Setenv("NODE_NAME", "")
	kubeconfig := filepath.Join(t.TempDir(), "missing-kubeconfig")
	tests := map[string]struct {
		args []string
		want []string // substrings of stderr
	}{
		"no node name":     {[]string{"agent"}, []string{"--node-name is empty", "NODE_NAME"}},
		"unknown tier":     {[]string{"agent", "--node-name", "n1", "--tiers", "restage,evcit"}, []string{"--tiers", `"evcit"`}},
		"relative root":    {[]string{"agent", "--node-name", "n1", "--kubelet-root", "kubelet"}, []string{"--kubelet-root", "absolute"}},
		"zero interval":    {[]string{"agent", "--node-name", "n1", "--probe-interval", "0s"}, []string{"--probe-interval 0s"}},
		"missing config":   {[]string{"agent", "--node-name", "n1", "--kubeconfig", kubeconfig}, []string{"--kubeconfig", "missing-kubeconfig"}},
		"stray argument":   {[]string{"agent", "--node-name", "n1", "extra"}, []string{"unknown command"}},
		"bad fence window": {[]string{"agent", "--node-name", "n1", "--failover", "--failover-fence-after", "30500ms"}, []string{"--failover-fence-after", "whole seconds"}},
		"no leader flags":  {[]string{"agent", "--node-name", "n1", "--failover", "--failover-leader-candidate=true"}, []string{"unknown flag", "--failover-leader-candidate"}},
		"two errors named": {[]string{"agent", "--node-name", "n1", "--strikes", "0", "--probe-parallel", "0"}, []string{"--strikes 0", "--probe-parallel 0"}},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			if code := execute(context.Background(), tc.args, &stdout, &stderr); code != exitError {
				t.Errorf("execute(%v) = %d, want %d", tc.args, code, exitError)
			}
			for _, w := range tc.want {
				if !strings.Contains(stderr.String(), w) {
					t.Errorf("execute(%v) stderr = %q, want it to name %q", tc.args, stderr.String(), w)
				}
			}
		})
	}
}

func TestAgentNodeNameFromEnvironment(t *testing.T) {
	t.Setenv("NODE_NAME", "node-from-env")
	cmd := newAgentCommand()
	if got := cmd.Flags().Lookup("node-name").DefValue; got != "node-from-env" {
		t.Errorf("--node-name default = %q, want $NODE_NAME (node-from-env)", got)
	}
}
