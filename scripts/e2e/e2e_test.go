package e2e_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/mountmedic/mountmedic/remount"
	"github.com/mountmedic/mountmedic/scripts/e2e"
	"github.com/mountmedic/mountmedic/scripts/kubetest"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestMain(m *testing.M) { e2e.Main(m) }

// TestHarness proves the node: a pod mounts a real CSI volume whole and
// through a subPath; killing the node plugin leaves the container with
// ENOTCONN; deleting the pod (the naive fix) does not heal it.
func TestHarness(t *testing.T) {
	c := kubetest.Start(t, kubetest.Options{Controllers: e2e.Controllers, Scheduler: true})
	n := e2e.StartNode(t, c, e2e.NodeOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	start := time.Now()
	w, err := n.DeployWorkload(ctx, "harness")
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("workload running in %s", time.Since(start).Round(time.Millisecond))
	pods, err := w.Pods(ctx)
	if err != nil || len(pods) != 1 {
		t.Fatalf("pods = %d, %v; want 1", len(pods), err)
	}
	pod := &pods[0]
	if err := w.ReadFiles(ctx, pod); err != nil {
		t.Fatal(err)
	}
	// The live-swap tier finds a pod's processes by their pod cgroup.
	if pids, err := remount.PodPIDs("/proc", string(pod.UID)); err != nil || len(pids) < 2 {
		t.Errorf("remount.PodPIDs(%s) = %v, %v; want the sandbox and the app container", pod.UID, pids, err)
	}

	killed := time.Now()
	n.Driver.Kill()
	if _, err := w.Exec(ctx, pod, 10*time.Second, "cat", e2e.WholeFile); err == nil || !strings.Contains(err.Error(), "Transport endpoint is not connected") {
		t.Fatalf("read %s after the plugin died: %v, want ENOTCONN", e2e.WholeFile, err)
	}
	if _, err := w.Exec(ctx, pod, 10*time.Second, "cat", e2e.SubFile); err == nil || !strings.Contains(err.Error(), "Transport endpoint is not connected") {
		t.Fatalf("read %s after the plugin died: %v, want ENOTCONN", e2e.SubFile, err)
	}
	if err := w.WaitLog(ctx, pod, "bad", killed); err != nil {
		t.Fatal(err)
	}
	if err := n.Driver.Restart(); err != nil {
		t.Fatal(err)
	}

	// The naive fix: delete the pod. Its replacement binds the dead staging
	// mount again (the driver answers NodeStage with OK on it) and never runs.
	if err := c.Client.CoreV1().Pods(w.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	wctx, wcancel := context.WithTimeout(ctx, 30*time.Second)
	defer wcancel()
	if p, err := w.WaitRunning(wctx, string(pod.UID)); err == nil {
		if rerr := w.ReadFiles(ctx, p); rerr == nil {
			t.Fatalf("the replacement pod %s runs and reads its files: the naive fix healed", p.Name)
		}
		t.Logf("replacement pod %s runs but cannot read its files", p.Name)
	} else {
		t.Logf("no replacement pod ran within 30s: %s", w.Describe(ctx))
	}
}
