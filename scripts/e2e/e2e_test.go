package e2e_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"

	"github.com/mountmedic/mountmedic/remount"
	"github.com/mountmedic/mountmedic/scripts/e2e"
	"github.com/mountmedic/mountmedic/scripts/kubetest"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

func TestMain(m *testing.M) { e2e.Main(m) }

// runsEnv sets how many times each scenario runs (default 1); the bench
// script (scripts/e2e/bench.sh) asks for more and reads the figures.
const runsEnv = "MOUNTMEDIC_E2E_RUNS"

// env is what every scenario shares: one cluster, one node, one agent.
type env struct {
	c     *kubetest.Cluster
	n     *e2e.Node
	agent *e2e.Agent
	figs  *e2e.Figures
	runs  int
	// scenario is the scenario running (its figures' row), mounter its
	// workload's FUSE daemon ("" for s3fs).
	scenario string
	mounter  string
}

// mounterName is the FUSE daemon of the running scenario's workload.
func (e *env) mounterName() string {
	if e.mounter == "" {
		return "s3fs"
	}
	return e.mounter
}

// TestE2E brings up the node once, proves it (the harness), deploys the
// agent as the DaemonSet of deploy/ and runs every scenario against it.
func TestE2E(t *testing.T) {
	lab.RequireRoot(t)
	runs := 1
	if v := os.Getenv(runsEnv); v != "" {
		var err error
		if runs, err = strconv.Atoi(v); err != nil || runs < 1 {
			t.Fatalf("%s=%q: want a positive number of runs", runsEnv, v)
		}
	}
	archive, err := e2e.AgentImage()
	if err != nil {
		t.Fatal(err)
	}
	c := kubetest.Start(t, kubetest.Options{Controllers: e2e.Controllers, Scheduler: true})
	n := e2e.StartNode(t, c, e2e.NodeOptions{Archives: []string{archive}})
	e := &env{c: c, n: n, figs: e2e.NewFigures(), runs: runs}
	t.Cleanup(func() { e.figs.Print(os.Stdout) })

	if !t.Run("harness", e.harness) {
		t.FailNow()
	}
	e.agent, err = n.NewAgent()
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range scenarios {
		t.Run(s.name, func(t *testing.T) {
			e.scenario, e.mounter = s.name, s.mounter
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
			defer cancel()
			if err := e.agent.Deploy(ctx, s.args...); err != nil {
				t.Fatal(err)
			}
			for i := range e.runs {
				ns := fmt.Sprintf("%s-%d", s.name, i)
				if !t.Run(ns, func(t *testing.T) { s.run(t, e, ns) }) {
					return
				}
			}
		})
	}
}

// harness proves the node: a pod mounts a real CSI volume whole and through
// a subPath; killing the node plugin leaves the container with ENOTCONN.
func (e *env) harness(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	w := e.workload(t, ctx, "harness")
	pod := w.pod(t, ctx)
	// The live-swap tier finds a pod's processes by their pod cgroup.
	if pids, err := remount.PodPIDs("/proc", string(pod.UID)); err != nil || len(pids) < 2 {
		t.Errorf("remount.PodPIDs(%s) = %v, %v; want the sandbox and the app container", pod.UID, pids, err)
	}
	killed := time.Now()
	e.n.Driver.Kill()
	defer e.restartDriver(t)
	for _, f := range []string{e2e.WholeFile, e2e.SubFile} {
		if _, err := w.Exec(ctx, pod, 10*time.Second, "cat", f); err == nil || !strings.Contains(err.Error(), "Transport endpoint is not connected") {
			t.Fatalf("read %s after the plugin died: %v, want ENOTCONN", f, err)
		}
	}
	if err := w.WaitLog(ctx, pod, "bad", killed); err != nil {
		t.Fatal(err)
	}
}

// workload deploys the scenario's workload and deletes it when the test
// ends (with the driver running, so that kubelet can unstage).
func (e *env) workload(t *testing.T, ctx context.Context, ns string) *wl {
	t.Helper()
	start := time.Now()
	w, err := e.n.DeployWorkloadWith(ctx, ns, e2e.WorkloadOptions{Mounter: e.mounter})
	if err != nil {
		t.Fatalf("%v\n%s", err, e.diagnostics(ns))
	}
	t.Logf("workload %s running and written in %s", ns, time.Since(start).Round(time.Millisecond))
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("workload %s:\n%s\n%s", ns, w.Describe(context.Background()), e.diagnostics(ns))
		}
		e.restartDriver(t)
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if err := w.Delete(ctx); err != nil {
			t.Errorf("delete workload %s: %v\n%s\n%s", ns, err, w.Describe(context.Background()), e.diagnostics(ns))
		}
	})
	return &wl{Workload: w}
}

// diagnostics is what a failure of a scenario in namespace ns prints: the
// agent's events there, its log, the node's kubelet mounts and kubelet's
// log. The DaemonSet logs at the default verbosity, so the events are the
// record of what the agent did.
func (e *env) diagnostics(ns string) string {
	var b strings.Builder
	if e.agent != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		evs, err := e.agent.Events(ctx, ns)
		fmt.Fprintf(&b, "agent events in %s (%v):\n", ns, err)
		for _, ev := range evs {
			fmt.Fprintf(&b, "  %s %s %s: %s\n", e2e.EventTime(&ev).Format("15:04:05.000"), ev.Regarding.Kind, ev.Reason, ev.Note)
		}
		fmt.Fprintf(&b, "agent log:\n%s\n", e.agent.LogTail(60))
	}
	fmt.Fprintf(&b, "node mounts:\n%s\nkubelet log:\n%s", e.nodeMounts(), lab.Tail(filepath.Join(e.n.Dir, "logs", "kubelet.log"), 40))
	return b.String()
}

// nodeMounts is the kubelet root's part of the node's mount table, for
// failure messages.
func (e *env) nodeMounts() string {
	data, err := os.ReadFile(e.n.MountTable())
	if err != nil {
		return err.Error()
	}
	var b strings.Builder
	for _, l := range strings.Split(string(data), "\n") {
		if strings.Contains(l, e2e.KubeletRoot) {
			b.WriteString(l + "\n")
		}
	}
	return b.String()
}

// restartDriver starts the node plugin again if it is down.
func (e *env) restartDriver(t *testing.T) {
	if e.n.Driver.Running() {
		return
	}
	if err := e.n.Driver.Restart(); err != nil {
		t.Error(err)
	}
}

type wl struct{ *e2e.Workload }

// pod returns the workload's one pod, with its files readable.
func (w *wl) pod(t *testing.T, ctx context.Context) *corev1.Pod {
	t.Helper()
	p := w.current(t, ctx)
	if err := w.ReadFiles(ctx, p); err != nil {
		t.Fatal(err)
	}
	return p
}

// current returns the workload's one pod as it is (its volume may be dead).
func (w *wl) current(t *testing.T, ctx context.Context) *corev1.Pod {
	t.Helper()
	pods, err := w.Pods(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(pods) != 1 {
		t.Fatalf("workload %s has %d pods, want 1: %s", w.Namespace, len(pods), w.Describe(ctx))
	}
	return &pods[0]
}

// restarts is the restart count of the pod's app container.
func restarts(p *corev1.Pod) int32 {
	for _, cs := range p.Status.ContainerStatuses {
		if cs.Name == "app" {
			return cs.RestartCount
		}
	}
	return -1
}
