package main

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"math/big"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

func TestAgentBadInput(t *testing.T) {
	t.Setenv("NODE_NAME", "")
	dir := t.TempDir()
	kubeconfig := filepath.Join(dir, "missing-kubeconfig")
	// Node kubeconfigs whose API server does not answer (port 1): only the
	// certificate can be judged, and the agent goes on to its next step.
	n1 := nodeKubeconfig(t, dir, "n1", "system:node:n1", "system:nodes")
	n2 := nodeKubeconfig(t, dir, "n2", "system:node:n2", "system:nodes")
	admin := nodeKubeconfig(t, dir, "admin", "kubernetes-admin", "system:masters")
	notNodes := nodeKubeconfig(t, dir, "no-group", "system:node:n1", "system:authenticated")
	eks := execKubeconfig(t, dir)
	tests := map[string]struct {
		args []string
		want []string // substrings of stderr
	}{
		"no node name":  {[]string{"agent"}, []string{"--node-name is empty", "NODE_NAME"}},
		"unknown tier":  {[]string{"agent", "--node-name", "n1", "--tiers", "restage,evcit"}, []string{"--tiers", `"evcit"`}},
		"relative root": {[]string{"agent", "--node-name", "n1", "--kubelet-root", "kubelet"}, []string{"--kubelet-root", "absolute"}},
		"zero interval": {[]string{"agent", "--node-name", "n1", "--probe-interval", "0s"}, []string{"--probe-interval 0s"}},
		"missing node config": {[]string{"agent", "--node-name", "n1", "--node-kubeconfig", kubeconfig},
			[]string{"--node-kubeconfig", "missing-kubeconfig", "kubelet's kubeconfig"}},
		"empty node config": {[]string{"agent", "--node-name", "n1", "--node-kubeconfig", ""}, []string{"--node-kubeconfig is empty"}},
		"admin, not a node": {[]string{"agent", "--node-name", "n1", "--node-kubeconfig", admin},
			[]string{"not this node's identity", `"kubernetes-admin"`, `"system:node:n1"`}},
		"another node": {[]string{"agent", "--node-name", "n1", "--node-kubeconfig", n2},
			[]string{"not this node's identity", `"system:node:n2"`}},
		"node name outside system:nodes": {[]string{"agent", "--node-name", "n1", "--node-kubeconfig", notNodes},
			[]string{"not this node's identity", `"system:nodes"`}},
		"missing service account config": {[]string{"agent", "--node-name", "n1", "--node-kubeconfig", n1, "--failover", "--kubeconfig", kubeconfig, "--api-timeout", "1s"},
			[]string{"--kubeconfig", "missing-kubeconfig"}},
		"exec plugin (EKS)": {[]string{"agent", "--node-name", "n1", "--node-kubeconfig", eks},
			[]string{"--node-kubeconfig", "exec plugin", `"aws-iam-authenticator"`, "--identity=serviceaccount"}},
		"unknown identity": {[]string{"agent", "--node-name", "n1", "--identity", "pod"}, []string{"--identity", `"pod"`, "serviceaccount"}},
		"stray argument":   {[]string{"agent", "--node-name", "n1", "extra"}, []string{"unknown command"}},
		"two errors named": {[]string{"agent", "--node-name", "n1", "--strikes", "0", "--probe-parallel", "0"}, []string{"--strikes 0", "--probe-parallel 0"}},
		"bad fence window": {[]string{"agent", "--node-name", "n1", "--failover", "--failover-fence-after", "30500ms"}, []string{"--failover-fence-after", "whole seconds"}},
		"no leader flags":  {[]string{"agent", "--node-name", "n1", "--failover", "--failover-leader-candidate=true"}, []string{"unknown flag", "--failover-leader-candidate"}},
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

// nodeKubeconfig writes a kubeconfig whose client certificate (a file, as
// kubeadm's kubelet.conf names kubelet's) is user's in groups, self-signed,
// for an API server that does not answer.
func nodeKubeconfig(t *testing.T, dir, name, user string, groups ...string) string {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: user, Organization: groups},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	pemFile := filepath.Join(dir, name+".pem")
	data := append(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER})...)
	if err := os.WriteFile(pemFile, data, 0o600); err != nil {
		t.Fatal(err)
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["c"] = &clientcmdapi.Cluster{Server: "https://127.0.0.1:1", InsecureSkipTLSVerify: true}
	cfg.AuthInfos["a"] = &clientcmdapi.AuthInfo{ClientCertificate: pemFile, ClientKey: pemFile}
	cfg.Contexts["c"] = &clientcmdapi.Context{Cluster: "c", AuthInfo: "a"}
	cfg.CurrentContext = "c"
	path := filepath.Join(dir, name+".conf")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
	return path
}

// execKubeconfig writes a kubeconfig whose user is an exec credential
// plugin, as EKS' nodeadm writes kubelet's.
func execKubeconfig(t *testing.T, dir string) string {
	t.Helper()
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["c"] = &clientcmdapi.Cluster{Server: "https://127.0.0.1:1", InsecureSkipTLSVerify: true}
	cfg.AuthInfos["a"] = &clientcmdapi.AuthInfo{Exec: &clientcmdapi.ExecConfig{
		APIVersion: "client.authentication.k8s.io/v1beta1", Command: "aws-iam-authenticator",
		Args: []string{"token", "-i", "cluster"}, InteractiveMode: clientcmdapi.NeverExecInteractiveMode}}
	cfg.Contexts["c"] = &clientcmdapi.Context{Cluster: "c", AuthInfo: "a"}
	cfg.CurrentContext = "c"
	path := filepath.Join(dir, "eks.conf")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
	return path
}

// TestFailoverIdentityDefault checks that --help names no machine: the
// identity defaults to $POD_NAME, else what the run finds (the node's
// name, the controller's host name), never the host name of whoever
// printed the help.
func TestFailoverIdentityDefault(t *testing.T) {
	t.Setenv("POD_NAME", "")
	host, err := os.Hostname()
	if err != nil {
		t.Fatal(err)
	}
	for _, cmd := range []string{"agent", "controller"} {
		var stdout, stderr bytes.Buffer
		execute(context.Background(), []string{cmd, "--help"}, &stdout, &stderr)
		for _, l := range strings.Split(stdout.String(), "\n") {
			if strings.Contains(l, "--failover-identity") && (strings.Contains(l, `(default "`) || !strings.Contains(l, "$POD_NAME")) {
				t.Errorf("mountmedic %s --help: %q, want no default value (the host name here is %q) and $POD_NAME named", cmd, strings.TrimSpace(l), host)
			}
		}
	}
	t.Setenv("POD_NAME", "mountmedic-x1")
	if got := newAgentCommand().Flags().Lookup("failover-identity").DefValue; got != "mountmedic-x1" {
		t.Errorf("agent --failover-identity default with POD_NAME set = %q, want mountmedic-x1", got)
	}
}

func TestAgentNodeNameFromEnvironment(t *testing.T) {
	t.Setenv("NODE_NAME", "node-from-env")
	cmd := newAgentCommand()
	if got := cmd.Flags().Lookup("node-name").DefValue; got != "node-from-env" {
		t.Errorf("--node-name default = %q, want $NODE_NAME (node-from-env)", got)
	}
}

// TestLegacyKlogFlagsGone checks that of klog's flags only -v and
// --vmodule are left on every command.
func TestLegacyKlogFlagsGone(t *testing.T) {
	for _, cmd := range []string{"agent", "controller", "scan", "status", "version"} {
		var stdout, stderr bytes.Buffer
		execute(context.Background(), []string{cmd, "--help"}, &stdout, &stderr)
		help := stdout.String()
		for _, legacy := range []string{"--log_dir", "--logtostderr", "--alsologtostderr", "--skip_headers", "--stderrthreshold", "--one_output", "--log_file", "--add_dir_header"} {
			if strings.Contains(help, legacy) {
				t.Errorf("mountmedic %s --help still offers %s", cmd, legacy)
			}
		}
		if !strings.Contains(help, "--vmodule") || !strings.Contains(help, "-v, --v") {
			t.Errorf("mountmedic %s --help lacks -v or --vmodule:\n%s", cmd, help)
		}
	}
	var stdout, stderr bytes.Buffer
	if code := execute(context.Background(), []string{"version", "--logtostderr"}, &stdout, &stderr); code != exitError || !strings.Contains(stderr.String(), "unknown flag: --logtostderr") {
		t.Errorf("version --logtostderr: exit %d, stderr %q; want unknown flag", code, stderr.String())
	}
	if code := execute(context.Background(), []string{"version", "-v=2"}, &stdout, &stderr); code != exitOK {
		t.Errorf("version -v=2: exit %d, stderr %q", code, stderr.String())
	}
}

// TestLogFormatJSON runs the agent up to its first log line (the API
// server of its node kubeconfig does not answer, so it logs that it goes
// on without checking the credentials, then stops at the missing
// ServiceAccount kubeconfig) with --log-format=json: the line is one JSON
// object with the message and its keys. It runs in a child process: klog's
// logger is global, and client-go goroutines of other tests still log.
func TestLogFormatJSON(t *testing.T) {
	if dir := os.Getenv("MOUNTMEDIC_TEST_JSON_DIR"); dir != "" {
		n1 := nodeKubeconfig(t, dir, "n1", "system:node:n1", "system:nodes")
		args := []string{"agent", "--log-format=json", "--node-name", "n1", "--node-kubeconfig", n1, "--failover",
			"--kubeconfig", filepath.Join(dir, "missing"), "--api-timeout", "1s"}
		os.Exit(execute(context.Background(), args, os.Stdout, os.Stderr))
	}
	cmd := exec.Command(os.Args[0], "-test.run=^TestLogFormatJSON$")
	cmd.Env = append(os.Environ(), "MOUNTMEDIC_TEST_JSON_DIR="+t.TempDir(), "NODE_NAME=")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err == nil {
		t.Fatalf("the agent exited 0; want the missing --kubeconfig refused. stderr %q", stderr.String())
	}
	var found bool
	for _, l := range strings.Split(stderr.String(), "\n") {
		if !strings.HasPrefix(l, "{") {
			continue
		}
		var line map[string]any
		if err := json.Unmarshal([]byte(l), &line); err != nil {
			t.Errorf("log line %q is not JSON: %v", l, err)
			continue
		}
		if strings.Contains(fmt.Sprint(line["msg"]), "Cannot check the node credentials") && line["ts"] != nil && line["err"] != nil {
			found = true
		}
	}
	if !found {
		t.Errorf("stderr %q: want the credentials line as a JSON object with ts, msg and err", stderr.String())
	}
	if strings.Contains(stderr.String(), "] Cannot check") {
		t.Errorf("stderr %q: a klog text line with --log-format=json", stderr.String())
	}
}
