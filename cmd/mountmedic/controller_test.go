package main

import (
	"bytes"
	"context"
	"path/filepath"
	"strings"
	"testing"
)

func TestControllerBadInput(t *testing.T) {
	t.Setenv("POD_NAME", "mountmedic-controller-0")
	kubeconfig := filepath.Join(t.TempDir(), "missing-kubeconfig")
	tests := map[string]struct {
		args []string
		want []string // substrings of stderr
	}{
		"bad mode":         {[]string{"controller", "--failover-mode", "bogus"}, []string{"--failover-mode", "bogus"}},
		"bad share":        {[]string{"controller", "--failover-stand-down-share", "1.5"}, []string{"--failover-stand-down-share"}},
		"bad selector":     {[]string{"controller", "--failover-node-selector", "a in ("}, []string{"--failover-node-selector"}},
		"no identity":      {[]string{"controller", "--failover-identity", ""}, []string{"--failover-identity is empty"}},
		"bad qps":          {[]string{"controller", "--kube-api-qps", "0", "--kubeconfig", kubeconfig}, []string{"--kube-api-qps"}},
		"missing config":   {[]string{"controller", "--kubeconfig", kubeconfig}, []string{"--kubeconfig", "missing-kubeconfig"}},
		"no node flags":    {[]string{"controller", "--node-name", "n1"}, []string{"unknown flag", "--node-name"}},
		"no heartbeat":     {[]string{"controller", "--failover-heartbeat-interval", "5s"}, []string{"unknown flag"}},
		"two errors named": {[]string{"controller", "--failover-max-nodes", "0", "--failover-kubelet-grace", "0s"}, []string{"--failover-max-nodes 0", "--failover-kubelet-grace 0s"}},
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
