package deploy_test

import (
	"bufio"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mountmedic/mountmedic/scripts/kubetest"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// TestChartFromOCIRegistry ships the chart as a release does and installs
// it as a user would: scripts/image.sh packages version v1.2.3, helm
// pushes it to an OCI registry (go-containerregistry's, `crane registry
// serve`, on 127.0.0.1), and helm installs it from oci:// into a real
// kube-apiserver. The release runs the image the chart's appVersion names.
func TestChartFromOCIRegistry(t *testing.T) {
	helm := lab.RequireTool(t, "helm")
	registry := startRegistry(t, lab.RequireTool(t, "crane"))

	dir := t.TempDir()
	pkg := exec.Command("scripts/image.sh", "--chart-only", "--chart", dir, "--version", "v1.2.3")
	pkg.Dir = ".."
	pkg.Env = append(os.Environ(), "PATH="+filepath.Dir(helm)+":"+os.Getenv("PATH"))
	if out, err := pkg.CombinedOutput(); err != nil {
		t.Fatalf("scripts/image.sh --chart-only --version v1.2.3: %v\n%s", err, out)
	}
	helmEnv := append(os.Environ(), "HELM_CACHE_HOME="+t.TempDir(), "HELM_CONFIG_HOME="+t.TempDir(), "HELM_DATA_HOME="+t.TempDir())
	h := func(args ...string) string {
		t.Helper()
		cmd := exec.Command(helm, args...)
		cmd.Env = helmEnv
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("helm %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	repo := "oci://" + registry + "/charts"
	if out := h("push", filepath.Join(dir, "mountmedic-1.2.3.tgz"), repo, "--plain-http"); !strings.Contains(out, "Pushed: "+registry+"/charts/mountmedic:1.2.3") {
		t.Fatalf("helm push: %s, want the chart pushed as %s/charts/mountmedic:1.2.3", out, registry)
	}

	c := kubetest.Start(t, kubetest.Options{})
	ctx := context.Background()
	if _, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "storage-ops",
		Labels: map[string]string{"pod-security.kubernetes.io/enforce": "privileged"}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	h("install", "mountmedic", repo+"/mountmedic", "--version", "1.2.3", "--plain-http",
		"--namespace", "storage-ops", "--wait=false", "--kubeconfig="+c.Kubeconfig)
	ds, err := c.Client.AppsV1().DaemonSets("storage-ops").Get(ctx, "mountmedic", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("DaemonSet after helm install from %s: %v", repo, err)
	}
	if img := ds.Spec.Template.Spec.Containers[0].Image; img != "mountmedic:v1.2.3" {
		t.Errorf("the chart from %s runs image %q, want mountmedic:v1.2.3", repo, img)
	}
	var releases []struct {
		Chart      string `json:"chart"`
		AppVersion string `json:"app_version"`
	}
	if err := json.Unmarshal([]byte(h("list", "--namespace", "storage-ops", "-o", "json", "--kubeconfig="+c.Kubeconfig)), &releases); err != nil {
		t.Fatal(err)
	}
	if len(releases) != 1 || releases[0].Chart != "mountmedic-1.2.3" || releases[0].AppVersion != "v1.2.3" {
		t.Errorf("helm list: %+v, want one release of chart mountmedic-1.2.3, appVersion v1.2.3", releases)
	}
}

// startRegistry serves an in-memory OCI registry on a free port of
// 127.0.0.1 for the test and returns its host:port.
func startRegistry(t *testing.T, crane string) string {
	t.Helper()
	cmd := exec.Command(crane, "registry", "serve", "--address", "127.0.0.1:0")
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("crane registry serve: %v", err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	port := make(chan string, 1)
	go func() {
		re := regexp.MustCompile(`serving on port (\d+)`)
		sc := bufio.NewScanner(stderr)
		for sc.Scan() {
			if m := re.FindStringSubmatch(sc.Text()); m != nil {
				port <- m[1]
				break
			}
		}
		for sc.Scan() { // keep the pipe drained
		}
	}()
	select {
	case p := <-port:
		return "127.0.0.1:" + p
	case <-time.After(30 * time.Second):
		t.Fatal("crane registry serve did not say its port within 30s")
		return ""
	}
}
