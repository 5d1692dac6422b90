package e2e_test

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/mountmedic/mountmedic/agent/failover"
	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/scripts/e2e"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// nodeMonitorGrace is kube-controller-manager's --node-monitor-grace-period
// default: how long a kubelet may be silent before its node is Unknown.
const nodeMonitorGrace = 40 * time.Second

// failoverScenario: a pod with a ReadWriteOnce claim runs on a second node,
// which dies (its kubelet and its agent fall silent). The agents' failover
// duty (leader: the agent of the real node) confirms it dead, applies the
// out-of-service taint and force-deletes the pod; the replacement runs on
// the real node and reads the volume.
func failoverScenario(t *testing.T, e *env, ns string) {
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	// The cluster side: mountmedic controller under deploy/controller's
	// ServiceAccount and RBAC, with the Deployment's defaults.
	ctl, err := e2e.StartController(t, e.c)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("controller log:\n%s", ctl.LogTail(40))
		}
	})
	sim, err := e2e.StartSimNode(ctx, e.c.Client, "sim-"+ns)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := sim.Delete(context.Background()); err != nil {
			t.Error(err)
		}
	})
	w, err := e.n.DeployWorkloadWith(ctx, ns, e2e.WorkloadOptions{
		NoWait: true,
		// Prefer the simulated node, tolerate what the real node carries
		// (NotReady: no CNI plugin), but not the out-of-service taint.
		Affinity: &corev1.Affinity{NodeAffinity: &corev1.NodeAffinity{
			PreferredDuringSchedulingIgnoredDuringExecution: []corev1.PreferredSchedulingTerm{{
				Weight: 100,
				Preference: corev1.NodeSelectorTerm{MatchExpressions: []corev1.NodeSelectorRequirement{{
					Key: corev1.LabelHostname, Operator: corev1.NodeSelectorOpIn, Values: []string{sim.Name},
				}}},
			}},
		}},
		Tolerations: []corev1.Toleration{
			{Key: corev1.TaintNodeNotReady, Operator: corev1.TolerationOpExists},
			{Key: corev1.TaintNodeUnreachable, Operator: corev1.TolerationOpExists},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("agent log:\n%s", e.agent.LogTail(40))
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		if err := w.Delete(ctx); err != nil {
			t.Errorf("delete workload %s: %v", ns, err)
		}
	})
	var old *corev1.Pod
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		pods, err := w.Pods(ctx)
		if err != nil || len(pods) != 1 {
			return false, nil
		}
		old = &pods[0]
		return old.Spec.NodeName == sim.Name && old.Status.Phase == corev1.PodRunning, nil
	})
	if err != nil {
		t.Fatalf("the workload's pod never ran on %s: %s", sim.Name, w.Describe(ctx))
	}
	// The duty trusts a silence only after it saw the signal change.
	time.Sleep(10 * time.Second)

	died := sim.Die()
	time.Sleep(time.Until(died.Add(nodeMonitorGrace)))
	if err := sim.MarkUnknown(ctx); err != nil {
		t.Fatal(err)
	}
	var tainted time.Time
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		n, err := e.c.Client.CoreV1().Nodes().Get(ctx, sim.Name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		for _, taint := range n.Spec.Taints {
			if taint.Key == failover.TaintOutOfService && taint.Value == failover.TaintValue {
				tainted = time.Now()
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		e.figs.Miss("failover", "node death -> replacement reads", "s")
		t.Fatalf("node %s never got the out-of-service taint: %v", sim.Name, err)
	}
	e.figs.Duration("failover", "node death -> out-of-service taint", tainted.Sub(died))
	next, err := w.WaitRunning(ctx, string(old.UID))
	if err != nil {
		e.figs.Miss("failover", "node death -> replacement reads", "s")
		t.Fatal(err)
	}
	if next.Spec.NodeName != e.n.Name {
		t.Fatalf("replacement pod %s runs on %s, want %s", next.Name, next.Spec.NodeName, e.n.Name)
	}
	ok, err := w.WaitLogTime(ctx, next, "ok", died)
	if err != nil {
		e.figs.Miss("failover", "node death -> replacement reads", "s")
		t.Fatal(err)
	}
	e.figs.Duration("failover", "node death -> replacement reads", ok.Sub(died))
	t.Logf("failed over: taint %s, replacement reading %s after the node died",
		tainted.Sub(died).Round(time.Millisecond), ok.Sub(died).Round(time.Millisecond))
	if err := w.ReadFiles(ctx, next); err != nil {
		t.Fatal(err)
	}
}

// Figures of the fence scenario.
const (
	figFenceUnmounted = "agent cut off -> volume unmounted on the host"
	figFenceStopped   = "agent cut off -> app container stopped"
)

// planWait is how long the fence scenario waits, with its pod running,
// before it cuts the agent off: the heartbeat learns which pods to fence
// (its plan) after each renewal, and a renewal comes at least every 10 s
// plus jitter.
const planWait = 25 * time.Second

// fenceScenario: the real node's agent, the DaemonSet of deploy/ with its
// shipped flags (--host-table=/proc/1/mountinfo) and --failover, loses the
// API server alone: its in-cluster connections (KUBERNETES_SERVICE_HOST and
// _PORT, which its heartbeat uses) go through a proxy that the test cuts,
// kubelet keeps its own. Past --failover-fence-after its heartbeat fences
// the node: the workload's app container is stopped through containerd's
// CRI and the volume's publish target and subPath bind are lazily
// unmounted. Checked in the node's own mount namespace (the host's, where
// kubelet and containerd run), not the agent's: no mount of the pod is left
// there. kubelet then restarts the app container onto the node's bare
// directories: a file written there by the restarted container must land
// on the node's disk and never reach the S3 bucket or the staging mount.
func fenceScenario(t *testing.T, e *env, ns string) {
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	api, err := url.Parse(e.c.Server)
	if err != nil {
		t.Fatal(err)
	}
	proxy := lab.StartTCPProxy(t, api.Host)
	// Cleanups run last first: this one, before the proxy's own (which
	// cuts it for good), puts the agent back on the API server itself.
	t.Cleanup(func() {
		proxy.Restore()
		e.agent.APIServer = ""
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		if err := e.agent.Deploy(ctx, "--failover"); err != nil {
			t.Errorf("deploy the agent back on the API server itself: %v", err)
		}
	})
	e.agent.APIServer = proxy.Addr()
	if err := e.agent.Deploy(ctx, "--failover"); err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(e.agent.Pod.Spec.Containers[0].Args, "--host-table=/proc/1/mountinfo") {
		t.Fatalf("the agent runs with %v: want deploy/'s --host-table=/proc/1/mountinfo", e.agent.Pod.Spec.Containers[0].Args)
	}
	w := e.workload(t, ctx, ns)
	pod := w.pod(t, ctx)
	appID, err := appContainerID(pod)
	if err != nil {
		t.Fatal(err)
	}
	host := e.n.MountTable()
	podDir := filepath.Join(e2e.KubeletRoot, "pods", string(pod.UID))
	target := filepath.Join(podDir, "volumes", "kubernetes.io~csi", w.PV, "mount")
	staging := e2e.StagingPath(w.Handle)
	vol := mountAt(t, host, staging)
	if vol == nil {
		t.Fatalf("the node's mount table shows no staging mount at %s", staging)
	}
	before := volumeMountsIn(t, host, podDir, vol)
	if !slices.Contains(before, target) || len(before) < 2 {
		t.Fatalf("the node's mount table shows %v of the volume under %s: want the publish target %s and the subPath bind", before, podDir, target)
	}

	time.Sleep(planWait)
	cut := time.Now()
	proxy.Cut()
	var unmounted time.Time
	err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 2*time.Minute, true, func(context.Context) (bool, error) {
		if len(volumeMountsIn(t, host, podDir, vol)) > 0 {
			return false, nil
		}
		unmounted = time.Now()
		return true, nil
	})
	if err != nil {
		e.figs.Miss("fence", figFenceUnmounted, "s")
		t.Fatalf("the pod's mounts are still on the host 2 minutes after the agent was cut off: %v\nagent log:\n%s", volumeMountsIn(t, host, podDir, vol), e.agent.LogTail(30))
	}
	e.figs.Duration("fence", figFenceUnmounted, unmounted.Sub(cut))
	if mountAt(t, host, staging) == nil {
		t.Errorf("the staging mount %s is gone from the host: the fence leaves it (other pods may share it)", staging)
	}

	// Stopped through the CRI, by the agent: containerd reports the
	// container exited after the cut, and the agent says it stopped it.
	st, err := e.n.CRI.ContainerStatus(ctx, &runtimeapi.ContainerStatusRequest{ContainerId: appID})
	if err != nil {
		t.Fatalf("containerd's CRI on the app container %s: %v", appID, err)
	}
	if s := st.GetStatus(); s.GetState() != runtimeapi.ContainerState_CONTAINER_EXITED || time.Unix(0, s.GetFinishedAt()).Before(cut) {
		t.Errorf("containerd's CRI says the app container %s is %s, finished at %s: want exited after the cut (%s)",
			appID, s.GetState(), time.Unix(0, s.GetFinishedAt()).Format(time.RFC3339Nano), cut.Format(time.RFC3339Nano))
	} else {
		e.figs.Duration("fence", figFenceStopped, time.Unix(0, s.GetFinishedAt()).Sub(cut))
	}
	if log := e.agent.LogTail(200); !strings.Contains(log, "Fence: stopped containers") || !strings.Contains(log, string(pod.UID)) {
		t.Errorf("the agent's log does not say it stopped the containers of pod %s:\n%s", pod.UID, e.agent.LogTail(30))
	}
	t.Logf("fenced: app container stopped, the pod's mounts gone from the host %s after the cut", unmounted.Sub(cut).Round(time.Millisecond))

	// kubelet starts the app container again (the fence stops it again
	// every heartbeat period). The fence guarded the publish target: the
	// container's subPath cannot be prepared there, and nothing reaches the
	// node's disk or the volume.
	if m := mountAt(t, host, target); m == nil || m.Source != probe.GuardSource {
		t.Errorf("the node's top mount at the fenced publish target %s is %+v, want the guard", target, m)
	}
	e.wantGuardRefusal(t, ctx, w, pod.Name, 4*time.Minute)
	disk := filepath.Join(e.n.Dir, "root", target) // the node's own directory, below every mount
	if ents, err := os.ReadDir(disk); err != nil || len(ents) != 0 {
		t.Errorf("the node's directory under the fenced publish target: %d entries, %v; want none", len(ents), err)
	}
	if got := volumeMountsIn(t, host, podDir, vol); len(got) > 0 {
		t.Errorf("the restarted container brought mounts of the volume back on the host: %v", got)
	}

	// Back on the API server the agent lifts the fence and deletes the
	// pod for its Deployment to recreate. kubelet's teardown (the driver's
	// NodeUnpublishVolume) takes the guard away and removes the directory.
	proxy.Restore()
	if err := wait2(ctx, 2*time.Minute, func(ctx context.Context) bool {
		_, err := e.c.Client.CoreV1().Pods(ns).Get(ctx, pod.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(err)
	}); err != nil {
		t.Errorf("the fenced pod %s is still there 2 minutes after the agent got the API server back:\n%s\nnode mounts:\n%s", pod.Name, w.Describe(ctx), e.nodeMounts())
	}
}

// wait2 polls cond every 200 ms until it holds or timeout passes.
func wait2(ctx context.Context, timeout time.Duration, cond func(context.Context) bool) error {
	return wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		return cond(ctx), nil
	})
}

// appContainerID is the CRI ID of the pod's app container now.
func appContainerID(p *corev1.Pod) (string, error) {
	for _, cs := range p.Status.ContainerStatuses {
		if cs.Name == "app" && cs.ContainerID != "" {
			if _, id, ok := strings.Cut(cs.ContainerID, "://"); ok {
				return id, nil
			}
		}
	}
	return "", fmt.Errorf("pod %s has no app container ID yet", p.Name)
}

// volumeMountsIn lists the mount points under dir of the filesystem vol in
// the mount table at table.
func volumeMountsIn(t *testing.T, table, dir string, vol *mountinfo.Info) []string {
	t.Helper()
	f, err := os.Open(table)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	infos, err := mountinfo.GetMountsFromReader(f, mountinfo.PrefixFilter(dir))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, m := range infos {
		if m.Major == vol.Major && m.Minor == vol.Minor {
			out = append(out, m.Mountpoint)
		}
	}
	return out
}

// mountAt is the top mount at path in the mount table at table, nil when
// there is none.
func mountAt(t *testing.T, table, path string) *mountinfo.Info {
	t.Helper()
	f, err := os.Open(table)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	infos, err := mountinfo.GetMountsFromReader(f, mountinfo.SingleEntryFilter(path))
	if err != nil {
		t.Fatal(err)
	}
	if len(infos) == 0 {
		return nil
	}
	return infos[len(infos)-1]
}
