package agent_test

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/transport"

	"github.com/mountmedic/mountmedic/agent"
	"github.com/mountmedic/mountmedic/scripts/kubetest"
)

// TestNodeClientFollowsCertificateRotation: kubelet rotates its client
// certificate by writing a new one where kubelet.conf points; the agent's
// client, made from that kubeconfig, must present the new one without a
// restart (client-go reloads certificate files and, on its refresh period,
// closes connections made with the old one). The rotated certificate here
// carries one more group, so the API server's SelfSubjectReview shows which
// one the client presented.
func TestNodeClientFollowsCertificateRotation(t *testing.T) {
	// client-go's rotation check runs every 5 minutes; the variable is
	// exported for tests like this one. Read when a transport is made.
	old := transport.CertCallbackRefreshDuration
	transport.CertCallbackRefreshDuration = 100 * time.Millisecond
	t.Cleanup(func() { transport.CertCallbackRefreshDuration = old })

	c := kubetest.Start(t, kubetest.Options{})
	const node = "rotating-node"
	dir := t.TempDir()
	kubeconfig := filepath.Join(dir, "kubelet.conf")
	kubeletRoot := filepath.Join(dir, "kubelet")
	c.WriteNodeKubeconfig(t, kubeconfig, kubeletRoot, node, "")
	client, err := agent.NewNodeClient(agent.Config{NodeKubeconfig: kubeconfig, NodeName: node, Version: "test"})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	whoami := func() (authenticationv1.UserInfo, error) {
		ssr, err := client.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
		if err != nil {
			return authenticationv1.UserInfo{}, err
		}
		return ssr.Status.UserInfo, nil
	}
	u, err := whoami()
	if err != nil {
		t.Fatal(err)
	}
	const marker = "rotated"
	if u.Username != agent.NodeUser(node) || slices.Contains(u.Groups, marker) {
		t.Fatalf("before rotation the client is %q in %q, want %q without group %q", u.Username, u.Groups, agent.NodeUser(node), marker)
	}

	// Rotate as kubelet does: a new certificate and key at the same path.
	cert, key := c.ClientCredentials(t, agent.NodeUser(node), agent.NodeGroup, marker)
	pemFile := filepath.Join(kubeletRoot, kubetest.KubeletClientFile)
	tmp := pemFile + ".new"
	if err := os.WriteFile(tmp, append(cert, key...), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, pemFile); err != nil {
		t.Fatal(err)
	}
	var last authenticationv1.UserInfo
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		u, err := whoami()
		if err != nil {
			return false, nil
		}
		last = u
		return slices.Contains(u.Groups, marker), nil
	})
	if err != nil {
		t.Fatalf("the client never presented the rotated certificate: still %q in %q", last.Username, last.Groups)
	}
}
