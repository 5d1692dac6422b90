package deploy_test

import (
	"context"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"sigs.k8s.io/yaml"

	"github.com/mountmedic/mountmedic/scripts/kubetest"
)

// TestKustomizeRenameFailsLoudly: a kustomize overlay's namePrefix or
// nameSuffix renames the agent's and the controller's ServiceAccounts
// (and kustomize rewrites every reference to them it knows) but not the
// names the admission policies' CEL matches, so a stolen token of a
// renamed account would not be held by them. The agent started as the
// DaemonSet of that overlay runs it, with its pod's token from a real API
// server, and the controller as its Deployment runs it, must each refuse
// to start and name the fix.
func TestKustomizeRenameFailsLoudly(t *testing.T) {
	for _, overlay := range []string{"namePrefix: team-\n", "nameSuffix: -b\n"} {
		objs := renderOverlay(t, "rename", overlay+"resources: [../../deploy]\n")
		var sa string
		for _, o := range objs {
			if o.Kind == "ServiceAccount" {
				sa = o.Metadata.Name
			}
		}
		if sa == "" || sa == baseName {
			t.Fatalf("%s: ServiceAccount %q, want it renamed", strings.TrimSpace(overlay), sa)
		}
		// The policies still match the base's name: what the agent guards.
		if !strings.Contains(string(find(t, objs, "ValidatingAdmissionPolicy", strings.Replace(sa, baseName, baseName+"-heartbeat-lease", 1)).raw), "':"+baseName+"'") {
			t.Fatalf("%s: the heartbeat Lease policy no longer matches %s by name: this test guards nothing", strings.TrimSpace(overlay), baseName)
		}
		args := decodeDaemonSetNamed(t, objs, sa).Spec.Template.Spec.Containers[0].Args

		c := kubetest.Start(t, kubetest.Options{})
		ctx := context.Background()
		c.CreateNamespace(t, baseNamespace)
		if _, err := c.Client.CoreV1().ServiceAccounts(baseNamespace).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a"}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		pod, err := c.Client.CoreV1().Pods(baseNamespace).Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: sa + "-x"},
			Spec: corev1.PodSpec{NodeName: "node-a", ServiceAccountName: sa, Containers: []corev1.Container{{Name: "agent", Image: "mountmedic"}}}},
			metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		kubeconfig := tokenKubeconfig(t, c.PodTokenConfig(t, pod))
		bin := buildMountmedic(t)
		cmdArgs := append(append([]string{}, args...), "--node-name=node-a", "--kubeconfig="+kubeconfig)
		out, err := exec.Command(bin, cmdArgs...).CombinedOutput()
		for _, want := range []string{"ServiceAccount " + baseNamespace + "/" + sa, "namePrefix or nameSuffix", "fullnameOverride"} {
			if err == nil || !strings.Contains(string(out), want) {
				t.Errorf("%s: mountmedic %s: %v\n%s\nwant a refusal naming %q", strings.TrimSpace(overlay), strings.Join(cmdArgs, " "), err, out, want)
			}
		}
		// Told the renamed name (as the chart's fullnameOverride does), the
		// check passes and the start goes on to the node credentials.
		cmdArgs = append(cmdArgs, "--service-account-name="+sa)
		out, _ = exec.Command(bin, cmdArgs...).CombinedOutput()
		if strings.Contains(string(out), "namePrefix") {
			t.Errorf("%s: with --service-account-name=%s the agent still refuses:\n%s", strings.TrimSpace(overlay), sa, out)
		}

		// The failover controller of the same overlay, as its Deployment
		// runs it with its own ServiceAccount's token.
		ctl := renderOverlay(t, "rename-controller", overlay+"resources: [../../deploy]\ncomponents: [../../deploy/controller]\n")
		ctlSA := sa + "-controller"
		if strings.HasSuffix(overlay, "-b\n") {
			ctlSA = baseName + "-controller-b"
		}
		var d appsv1.Deployment
		if err := yaml.Unmarshal(find(t, ctl, "Deployment", ctlSA).raw, &d); err != nil {
			t.Fatal(err)
		}
		if d.Spec.Template.Spec.ServiceAccountName != ctlSA {
			t.Fatalf("%s: controller ServiceAccount %q, want %s", strings.TrimSpace(overlay), d.Spec.Template.Spec.ServiceAccountName, ctlSA)
		}
		if _, err := c.Client.CoreV1().ServiceAccounts(baseNamespace).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: ctlSA}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		ctlArgs := append(append([]string{}, d.Spec.Template.Spec.Containers[0].Args...), "--kubeconfig="+tokenKubeconfig(t, c.ServiceAccountConfig(t, baseNamespace, ctlSA)))
		out, err = exec.Command(bin, ctlArgs...).CombinedOutput()
		for _, want := range []string{"ServiceAccount " + baseNamespace + "/" + ctlSA, "namePrefix or nameSuffix"} {
			if err == nil || !strings.Contains(string(out), want) {
				t.Errorf("%s: mountmedic %s: %v\n%s\nwant a refusal naming %q", strings.TrimSpace(overlay), strings.Join(ctlArgs, " "), err, out, want)
			}
		}
	}
}

// tokenKubeconfig writes rc (a bearer token) as a kubeconfig file.
func tokenKubeconfig(t *testing.T, rc *rest.Config) string {
	t.Helper()
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["c"] = &clientcmdapi.Cluster{Server: rc.Host, CertificateAuthorityData: rc.CAData}
	cfg.AuthInfos["a"] = &clientcmdapi.AuthInfo{Token: rc.BearerToken}
	cfg.Contexts["c"] = &clientcmdapi.Context{Cluster: "c", AuthInfo: "a"}
	cfg.CurrentContext = "c"
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
	return path
}

func decodeDaemonSetNamed(t *testing.T, objs []object, name string) *appsv1.DaemonSet {
	t.Helper()
	var ds appsv1.DaemonSet
	if err := yaml.Unmarshal(find(t, objs, "DaemonSet", name).raw, &ds); err != nil {
		t.Fatal(err)
	}
	return &ds
}
