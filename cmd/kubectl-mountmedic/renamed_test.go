package main

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"sigs.k8s.io/yaml"

	"github.com/mountmedic/mountmedic/agent"
	"github.com/mountmedic/mountmedic/agent/status"
	"github.com/mountmedic/mountmedic/scripts/kubetest"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// TestPluginRenamedInstall runs the node drill-down against the Helm chart
// installed under fullnameOverride and nameOverride in another namespace,
// on a real kube-apiserver, as a user bound only to the renamed viewer
// role: with --name it finds the agent's pod (by labels no rename
// changes) and vouches for its events through the renamed policy; without
// it, it says the policy is missing and names --name.
func TestPluginRenamedInstall(t *testing.T) {
	const full, ns = "storage-medic", "ops"
	c := kubetest.Start(t, kubetest.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	admin := c.Client
	out, err := exec.Command(lab.RequireTool(t, "helm"), "template", "mountmedic", "../../deploy/chart/mountmedic", "--namespace", ns,
		"--kube-version", "v1.37.1", "--set", "fullnameOverride="+full+",nameOverride=smedic,namespace.create=true").CombinedOutput()
	if err != nil {
		t.Fatalf("helm template: %v\n%s", err, out)
	}
	file := filepath.Join(t.TempDir(), "chart.yaml")
	if err := os.WriteFile(file, out, 0o644); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(lab.RequireTool(t, "kubectl"), "--kubeconfig="+c.Kubeconfig, "apply", "-f", file).CombinedOutput(); err != nil {
		t.Fatalf("kubectl apply the renamed chart: %v\n%s", err, out)
	}
	if _, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	ds, err := admin.AppsV1().DaemonSets(ns).Get(ctx, full, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// The DaemonSet's pod on node-a, as its controller would make it.
	if _, err := admin.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: full + "-x1", Labels: ds.Spec.Template.Labels},
		Spec: corev1.PodSpec{NodeName: "node-a", ServiceAccountName: full, Containers: []corev1.Container{{Name: "agent", Image: "mountmedic"}}}},
		metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// Node-a's agent writes its event once the policy has settled.
	time.Sleep(11 * time.Second)
	asNode, err := kubernetes.NewForConfig(c.NodeConfig(t, "node-a"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := asNode.EventsV1().Events("default").Create(ctx, &eventsv1.Event{
		ObjectMeta: metav1.ObjectMeta{Name: "real"}, EventTime: metav1.NowMicro(),
		ReportingController: agent.ReportingController, ReportingInstance: "node-a",
		Action: "Repair", Reason: string(agent.ReasonVolumeRepaired), Note: "re-staged", Type: corev1.EventTypeNormal,
		Regarding: corev1.ObjectReference{Kind: "Node", Name: "node-a"},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("node-a's identity writes its agent event: %v", err)
	}
	if _, err := admin.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "viewer"},
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: full + "-viewer"},
		Subjects: []rbacv1.Subject{{Kind: "User", Name: "viewer"}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	cert, key := c.ClientCredentials(t, "viewer")
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["lab"] = &clientcmdapi.Cluster{Server: c.Server, CertificateAuthorityData: c.Config.CAData}
	cfg.AuthInfos["viewer"] = &clientcmdapi.AuthInfo{ClientCertificateData: cert, ClientKeyData: key}
	cfg.Contexts["viewer"] = &clientcmdapi.Context{Cluster: "lab", AuthInfo: "viewer"}
	cfg.CurrentContext = "viewer"
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, kubeconfig); err != nil {
		t.Fatal(err)
	}
	node := func(args ...string) status.NodeDetail {
		t.Helper()
		var stdout, stderr bytes.Buffer
		args = append([]string{"node", "node-a", "-o", "yaml", "--kubeconfig", kubeconfig, "-n", ns}, args...)
		if code := execute(ctx, args, &stdout, &stderr); code != 0 {
			t.Fatalf("kubectl mountmedic %s: exit %d\n%s%s", strings.Join(args, " "), code, stdout.String(), stderr.String())
		}
		var d status.NodeDetail
		if err := yaml.Unmarshal(stdout.Bytes(), &d); err != nil {
			t.Fatal(err)
		}
		return d
	}
	d := node("--name", full)
	if d.Agent == nil || d.Agent.Name != full+"-x1" || len(d.Events) != 1 || !strings.Contains(d.Verified, full+"-agent-events") {
		t.Errorf("node node-a --name %s: agent %+v, events %+v, verified %q; want the agent pod, its one event, verified by %s-agent-events",
			full, d.Agent, d.Events, d.Verified, full)
	}
	if d := node(); len(d.Events) != 0 || !strings.Contains(d.Verified, "--name") {
		t.Errorf("node node-a without --name: events %+v, verified %q; want none shown and a hint naming --name", d.Events, d.Verified)
	}
}
