package main

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/mountmedic/mountmedic/agent"
	"github.com/mountmedic/mountmedic/scripts/kubetest"
)

// TestAgentServiceAccountIdentity starts the agent's credentials step as
// `mountmedic agent --identity=serviceaccount` does, against a real
// kube-apiserver: a token bound to the agent's pod on node-a is accepted
// for node-a, and refused for another node, and a token bound to no pod
// (it names no node) is refused; on an EKS node (an exec plugin in
// kubelet's kubeconfig) --identity=node names the way out.
func TestAgentServiceAccountIdentity(t *testing.T) {
	c := kubetest.Start(t, kubetest.Options{})
	ctx := context.Background()
	c.CreateNamespace(t, "mountmedic")
	if _, err := c.Client.CoreV1().ServiceAccounts("mountmedic").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "mountmedic"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	pod, err := c.Client.CoreV1().Pods("mountmedic").Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "mountmedic-x"},
		Spec: corev1.PodSpec{NodeName: "node-a", ServiceAccountName: "mountmedic",
			Containers: []corev1.Container{{Name: "agent", Image: "mountmedic"}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	bound := writeTokenKubeconfig(t, filepath.Join(dir, "bound"), c.PodTokenConfig(t, pod))
	unbound := writeTokenKubeconfig(t, filepath.Join(dir, "unbound"), c.ServiceAccountConfig(t, "mountmedic", "mountmedic"))

	cfg := agent.DefaultConfig()
	cfg.NodeName, cfg.Kubeconfig = "node-a", bound
	if _, err := agentClient(ctx, agent.IdentityServiceAccount, cfg); err != nil {
		t.Errorf("agentClient(serviceaccount, the token of node-a's agent pod) = %v, want nil", err)
	}
	cfg.NodeName = "node-b"
	if _, err := agentClient(ctx, agent.IdentityServiceAccount, cfg); !errors.Is(err, agent.ErrNotNodeBound) || !strings.Contains(err.Error(), `"node-b"`) {
		t.Errorf("agentClient(serviceaccount, node-a's token, --node-name=node-b) = %v, want ErrNotNodeBound naming node-b", err)
	}
	cfg.NodeName, cfg.Kubeconfig = "node-a", unbound
	if _, err := agentClient(ctx, agent.IdentityServiceAccount, cfg); !errors.Is(err, agent.ErrNotNodeBound) || !strings.Contains(err.Error(), "kubelet projects") {
		t.Errorf("agentClient(serviceaccount, a token bound to no pod) = %v, want ErrNotNodeBound naming the projected token", err)
	}
	cfg.NodeKubeconfig = execKubeconfig(t, dir)
	if _, err := agentClient(ctx, agent.IdentityNode, cfg); err == nil || !strings.Contains(err.Error(), "--identity=serviceaccount") {
		t.Errorf("agentClient(node, an exec plugin kubeconfig) = %v, want an error naming --identity=serviceaccount", err)
	}
	if _, err := agentClient(ctx, "pod", cfg); err == nil || !strings.Contains(err.Error(), "--identity") {
		t.Errorf("agentClient(pod) = %v, want an error naming --identity", err)
	}
}

// writeTokenKubeconfig writes rc (a bearer token) as a kubeconfig.
func writeTokenKubeconfig(t *testing.T, path string, rc *rest.Config) string {
	t.Helper()
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["c"] = &clientcmdapi.Cluster{Server: rc.Host, CertificateAuthorityData: rc.CAData}
	cfg.AuthInfos["a"] = &clientcmdapi.AuthInfo{Token: rc.BearerToken}
	cfg.Contexts["c"] = &clientcmdapi.Context{Cluster: "c", AuthInfo: "a"}
	cfg.CurrentContext = "c"
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
	return path
}
