package agent_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/mountmedic/mountmedic/agent"
	"github.com/mountmedic/mountmedic/remount"
)

// TestAgentBudgetSurvivesRestart starts an agent (--max-evictions 2 per
// 10 minutes) on a node whose previous agent run evicted a pod 3 minutes
// ago, as its Evicting event on the real API server says. Two pods on
// dead volumes then need evicting: the rebuilt budget lets one go and
// holds the other. Events that must not count are there too: a dry-run
// eviction, one older than the window, and one of another node's agent
// (written with that node's identity, as the events policy demands).
func TestAgentBudgetSurvivesRestart(t *testing.T) {
	e := newEnv(t, nil)
	ctx := context.Background()
	labels := map[string]string{"app": "budget"}
	owner := e.replicaSet("budget", labels)
	var pods []*corev1.Pod
	for i := range 2 {
		v := e.createVolume(fmt.Sprintf("budget-%d", i), nil)
		pod := e.createPod(fmt.Sprintf("budget-%d", i), v, podOptions{owner: owner, labels: labels})
		e.deadVolume(v, pod)
		pods = append(pods, pod)
	}

	now := time.Now()
	record := func(rc *rest.Config, node, note string, at time.Time) {
		t.Helper()
		cs, err := kubernetes.NewForConfig(rc)
		if err != nil {
			t.Fatal(err)
		}
		ev := &eventsv1.Event{
			ObjectMeta:          metav1.ObjectMeta{GenerateName: "gone-", Namespace: testNamespace},
			EventTime:           metav1.NewMicroTime(at),
			ReportingController: agent.ReportingController, ReportingInstance: node,
			Action: "Evict", Reason: string(agent.ReasonEvicting), Type: corev1.EventTypeNormal, Note: note,
			Regarding: corev1.ObjectReference{Kind: "Pod", APIVersion: "v1", Namespace: testNamespace, Name: "gone-0", UID: types.UID("gone-0-uid")},
		}
		if _, err := cs.EventsV1().Events(testNamespace).Create(ctx, ev, metav1.CreateOptions{}); err != nil {
			t.Fatalf("record a past eviction of node %s (%q): %v", node, note, err)
		}
	}
	const evicted = "evicted the pod so that its ReplicaSet replaces it with fresh mounts"
	record(e.agentConfig, e.node, evicted, now.Add(-3*time.Minute))
	record(e.agentConfig, e.node, "[dry-run] would evict the pod so that its controller replaces it with fresh mounts", now.Add(-2*time.Minute))
	record(e.agentConfig, e.node, evicted, now.Add(-20*time.Minute))
	record(nodeConfig(t, e.cluster, "node-b"), "node-b", evicted, now.Add(-time.Minute))

	cfg := e.config()
	cfg.Tiers = remount.NewTierSet(remount.TierEvict)
	cfg.MaxEvictions = 2
	cfg.EvictionWindow = 10 * time.Minute
	// The node's identity may not list events: the ServiceAccount's
	// client does it, as the command gives it.
	sa, err := kubernetes.NewForConfig(e.cluster.ServiceAccountConfig(t, "mountmedic", "mountmedic"))
	if err != nil {
		t.Fatal(err)
	}
	a := e.startAgent(cfg, agent.Deps{EventReader: sa})

	has := func(uid types.UID, reason agent.Reason, part string) bool {
		for _, ev := range e.eventsOf(uid) {
			if ev.Reason == string(reason) && strings.Contains(ev.Note, part) {
				return true
			}
		}
		return false
	}
	e.waitFor("one pod evicted and the other held by the node's budget", func() (bool, error) {
		for i := range 2 {
			p, q := pods[i].UID, pods[1-i].UID
			if has(p, agent.ReasonEvicting, "evicted the pod") && has(q, agent.ReasonNotRepaired, "budget of 2 evictions") {
				return true, nil
			}
		}
		return false, nil
	})
	// More cycles: still one eviction.
	time.Sleep(time.Second)
	if n, _ := a.metric(`mountmedic_evictions_total{result="evicted"}`); n != 1 {
		t.Errorf("mountmedic_evictions_total{evicted} = %v, want 1 (a budget of 2, one taken by the previous run)", n)
	}
}
