package e2e_test

import (
	"context"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/mountmedic/mountmedic/scripts/e2e"
	"github.com/mountmedic/mountmedic/scripts/kubetest"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// TestK3s runs the agent on a node laid out as k3s lays one out
// (e2e.K3sLayout: kubelet's kubeconfig and credentials in
// /var/lib/rancher/k3s/agent, containerd on /run/k3s/containerd), deployed
// as a k3s user deploys it: deploy/ with the k3s profile's Component, and
// only what the lab needs on top (scripts/e2e/k3s). Its pod must start and
// become ready with the node's own identity read from k3s' files, read the
// node's kubelet mounts, heal a volume whose FUSE daemon died (the live
// scenario) and restart a container through k3s' CRI socket (the restart
// scenario), with its events.
//
// It needs a node of its own (both layouts use /var/lib/kubelet), hence
// its own test beside TestE2E; run it alone with
//
//	MOUNTMEDIC_REQUIRE_ROOT=1 go test -count=1 -v -run 'TestK3s$' ./scripts/e2e
func TestK3s(t *testing.T) {
	lab.RequireRoot(t)
	archive, err := e2e.AgentImage()
	if err != nil {
		t.Fatal(err)
	}
	c := kubetest.Start(t, kubetest.Options{Controllers: e2e.Controllers, Scheduler: true})
	n := e2e.StartNode(t, c, e2e.NodeOptions{Archives: []string{archive}, Layout: e2e.K3sLayout})
	e := &env{c: c, n: n, figs: e2e.NewFigures(), runs: 1}
	if e.agent, err = n.NewAgent(); err != nil {
		t.Fatal(err)
	}
	t.Run("base", func(t *testing.T) { k3sRefusesBase(t, e) })
	for _, s := range []scenario{
		{name: "live", run: k3sLiveScenario},
		{name: "restart", args: []string{"--tiers=restage,restart,evict,unmount"}, run: restartScenario},
	} {
		t.Run(s.name, func(t *testing.T) {
			e.scenario = "k3s-" + s.name
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			if err := e.agent.Deploy(ctx, s.args...); err != nil {
				t.Fatal(err)
			}
			checkK3sAgent(t, e)
			s.run(t, e, e.scenario)
		})
	}
}

// k3sRefusesBase applies deploy/ without the k3s profile (kubeadm's layout,
// through the lab's overlay) on the k3s node: kubelet must refuse its pod
// for want of /etc/kubernetes/kubelet.conf, as on a real k3s node, so that
// the scenarios after it show what the profile changes. The next Deploy
// replaces that DaemonSet.
func k3sRefusesBase(t *testing.T, e *env) {
	if out, err := e.c.Kubectl("apply", "-k", e2e.KubeadmLayout.Overlay); err != nil {
		t.Fatalf("apply %s: %v\n%s", e2e.KubeadmLayout.Overlay, err, out)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var seen []string
	err := wait.PollUntilContextCancel(ctx, 500*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		evs, err := e.c.Client.CoreV1().Events(e2e.AgentNamespace).List(ctx, metav1.ListOptions{FieldSelector: "reason=FailedMount"})
		if err != nil {
			return false, nil
		}
		seen = seen[:0]
		for _, ev := range evs.Items {
			seen = append(seen, ev.Message)
			if ev.InvolvedObject.Kind == "Pod" && strings.Contains(ev.Message, e2e.KubeletKubeconfig) {
				t.Logf("kubelet on the k3s node, for deploy/ as shipped: %s", ev.Message)
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		t.Fatalf("kubelet did not refuse deploy/'s pod for want of %s: %v (FailedMount events: %q)", e2e.KubeletKubeconfig, err, seen)
	}
}

// checkK3sAgent checks that the ready agent runs with the k3s profile's
// paths and that the API server took its credentials for the node's own.
func checkK3sAgent(t *testing.T, e *env) {
	t.Helper()
	p := e.agent.Pod
	args := p.Spec.Containers[0].Args
	for flag, want := range map[string]string{
		"--node-kubeconfig": e2e.K3sLayout.KubeletKubeconfig,
		"--cri-socket":      "unix://" + e2e.K3sLayout.ContainerdSocket(),
		"--kubelet-root":    e2e.KubeletRoot,
	} {
		var got []string
		for _, a := range args {
			if v, ok := strings.CutPrefix(a, flag+"="); ok {
				got = append(got, v)
			}
		}
		if len(got) != 1 || got[0] != want {
			t.Errorf("agent flag %s = %q, want only %q (args %q)", flag, got, want, args)
		}
	}
	if !p.Spec.HostNetwork {
		t.Errorf("agent pod hostNetwork = false, want true (the k3s profile)")
	}
	// The agent asks the API server who it is at start (SelfSubjectReview)
	// and only says this when it got no answer.
	if log := e.agent.LogTail(200); strings.Contains(log, "Cannot check the node credentials") {
		t.Errorf("the agent could not have its node credentials checked:\n%s", log)
	}
}

// k3sLiveScenario is the live scenario on the k3s node, and then what the
// agent saw of the node: the workload's kubelet mounts in its metrics, and
// its events on the pod, from this node's agent.
func k3sLiveScenario(t *testing.T, e *env, ns string) {
	start := time.Now()
	liveScenario(t, e, ns)
	if t.Failed() {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var kinds map[string]float64
	err := wait.PollUntilContextCancel(ctx, 500*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		m, err := e.agent.Metrics(ctx)
		if err != nil {
			return false, nil
		}
		kinds = map[string]float64{}
		for _, k := range []string{"staging", "publish", "subpath"} {
			kinds[k] = e2e.Sum(m, "mountmedic_kubelet_mounts", `kind="`+k+`"`)
		}
		return kinds["staging"] >= 1 && kinds["publish"] >= 1 && kinds["subpath"] >= 1, nil
	})
	if err != nil {
		t.Errorf("mountmedic_kubelet_mounts by kind = %v, want the workload's staging, publish and subPath mounts: %v", kinds, err)
	}
	evs, err := e.agent.Events(ctx, ns)
	if err != nil {
		t.Fatal(err)
	}
	// The agent reports on the pod and on its claim, as this node's agent.
	for _, reason := range []string{"VolumeBroken", "VolumeRepaired"} {
		kinds := map[string]bool{}
		for _, ev := range evs {
			if ev.Reason != reason || e2e.EventTime(&ev).Before(start.Truncate(time.Second)) {
				continue
			}
			if ev.ReportingInstance != e.n.Name {
				t.Errorf("%s event about %s %s from %q, want from %q", reason, ev.Regarding.Kind, ev.Regarding.Name, ev.ReportingInstance, e.n.Name)
			}
			kinds[ev.Regarding.Kind] = true
			if ev.Regarding.Kind == "Pod" {
				t.Logf("%s: %s", reason, ev.Note)
			}
		}
		if !kinds["Pod"] || !kinds["PersistentVolumeClaim"] {
			t.Errorf("%s events of the agent in %s are about %v, want the workload's pod and claim: %s", reason, ns, kinds, e.diagnostics(ns))
		}
	}
}
