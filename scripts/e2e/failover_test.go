package e2e_test

import (
	"context"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/mountmedic/mountmedic/agent/failover"
	"github.com/mountmedic/mountmedic/scripts/e2e"
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
