package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/mountmedic/mountmedic/agent"
	"github.com/mountmedic/mountmedic/agent/failover"
	"github.com/mountmedic/mountmedic/agent/status"
	"github.com/mountmedic/mountmedic/scripts/kubetest"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// TestStatusOnRealAPIServer builds a small cluster's worth of the objects
// the agents and the failover duty leave (node conditions, events, heartbeat
// Leases, the out-of-service taint) on the real kube-apiserver and reads them
// back through the command, as a user would, in both output formats.
func TestStatusOnRealAPIServer(t *testing.T) {
	c := kubetest.Start(t, kubetest.Options{})
	ctx := context.Background()
	// The admission policy that vouches for the agents' events (below),
	// with its parameter, the agent's ServiceAccount.
	c.CreateNamespace(t, "mountmedic")
	if _, err := c.Client.CoreV1().ServiceAccounts("mountmedic").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "mountmedic"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(lab.RequireTool(t, "kubectl"), "--kubeconfig="+c.Kubeconfig, "apply", "-f", "../../deploy/agent-events-policy.yaml").CombinedOutput(); err != nil {
		t.Fatalf("apply the events policy: %v\n%s", err, out)
	}
	time.Sleep(11 * time.Second) // status trusts events created 10 s after the policy
	now := time.Now()
	cs := c.Client
	c.CreateNamespace(t, "app")
	mkNode := func(name string, cond *corev1.NodeCondition, taint bool) {
		t.Helper()
		n := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}}
		if taint {
			n.Spec.Taints = []corev1.Taint{{Key: failover.TaintOutOfService, Value: failover.TaintValue, Effect: corev1.TaintEffectNoExecute, TimeAdded: ptr.To(metav1.NewTime(now.Add(-3 * time.Minute)))}}
		}
		n, err := cs.CoreV1().Nodes().Create(ctx, n, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		n.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady",
			LastHeartbeatTime: metav1.NewTime(now), LastTransitionTime: metav1.NewTime(now)}}
		if cond != nil {
			n.Status.Conditions = append(n.Status.Conditions, *cond)
		}
		if _, err := cs.CoreV1().Nodes().UpdateStatus(ctx, n, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	cond := func(st corev1.ConditionStatus, msg string, heartbeat time.Time) *corev1.NodeCondition {
		return &corev1.NodeCondition{Type: agent.ConditionType, Status: st, Reason: string(agent.ReasonMountsBroken), Message: msg,
			LastHeartbeatTime: metav1.NewTime(heartbeat), LastTransitionTime: metav1.NewTime(now.Add(-time.Hour))}
	}
	mkNode("node-healthy", cond(corev1.ConditionFalse, "12 pod volume mounts healthy", now), false)
	mkNode("node-broken", cond(corev1.ConditionTrue, "3 of 7 pod volume mounts broken: ru.yandex.s3.csi Disconnected 2, ru.yandex.s3.csi Hung 1", now), false)
	mkNode("node-stale", cond(corev1.ConditionFalse, "4 pod volume mounts healthy", now.Add(-time.Hour)), false)
	mkNode("node-dead", nil, true)
	// A name a pod user cannot choose, but an event's note is theirs in part:
	// control characters must not reach the terminal.
	lease := func(node string, renewed time.Time, holder string) {
		t.Helper()
		l := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: node, Namespace: "mountmedic",
			Labels: map[string]string{failover.HeartbeatLabel: failover.HeartbeatLabelValue}},
			Spec: coordinationv1.LeaseSpec{HolderIdentity: &holder, LeaseDurationSeconds: ptr.To[int32](30),
				RenewTime: &metav1.MicroTime{Time: renewed}}}
		if _, err := cs.CoordinationV1().Leases("mountmedic").Create(ctx, l, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	lease("node-healthy", now.Add(-2*time.Second), "agent-a")
	lease("node-broken", now.Add(-2*time.Minute), "agent-b")
	lease("node-dead", now.Add(-10*time.Minute), "agent-d")
	// Node-broken's agent's repair events, written with node-broken's
	// identity under the admission policy that vouches for them: the
	// newer one wins.
	asNode, err := kubernetes.NewForConfig(c.NodeConfig(t, "node-broken"))
	if err != nil {
		t.Fatal(err)
	}
	event := func(name, reason, note string, at time.Time) {
		t.Helper()
		e := &corev1.Event{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "app"},
			InvolvedObject: corev1.ObjectReference{Kind: "Pod", Namespace: "app", Name: "db-0", APIVersion: "v1"},
			Reason:         reason, Message: note, Type: corev1.EventTypeNormal, Action: "Repair",
			EventTime:           metav1.NewMicroTime(at),
			ReportingController: agent.ReportingController, ReportingInstance: "node-broken"}
		if _, err := asNode.CoreV1().Events("app").Create(ctx, e, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	event("e1", string(agent.ReasonNotRepaired), "restage failed", now.Add(-10*time.Minute))
	event("e2", string(agent.ReasonVolumeRepaired), "re-staged\x1b[31m and swapped", now.Add(-time.Minute))

	var out, errOut bytes.Buffer
	if code := execute(ctx, []string{"status", "--kubeconfig", c.Kubeconfig}, &out, &errOut); code != 0 {
		t.Fatalf("mountmedic status: exit %d\n%s%s", code, out.String(), errOut.String())
	}
	table := out.String()
	for _, want := range []string{
		"NODE", "node-broken", "broken 3/7", "ru.yandex.s3.csi Disconnected 2, ru.yandex.s3.csi Hung 1", "repaired 60s ago (pod/app/db-0)",
		"fenced (heartbeat 2m0s ago)", "node-healthy", "healthy 0/12", "node-stale", "stale", "node-dead", "failed-over (3m ago)",
	} {
		if !strings.Contains(table, want) {
			t.Errorf("status table lacks %q:\n%s", want, table)
		}
	}
	if strings.Contains(table, "\x1b") {
		t.Errorf("status table writes a raw escape byte:\n%q", table)
	}

	out.Reset()
	if code := execute(ctx, []string{"status", "--kubeconfig", c.Kubeconfig, "-o", "json", "--broken"}, &out, &errOut); code != 0 {
		t.Fatalf("mountmedic status -o json: exit %d\n%s", code, errOut.String())
	}
	var v status.View
	if err := json.Unmarshal(out.Bytes(), &v); err != nil {
		t.Fatalf("status -o json: %v\n%s", err, out.String())
	}
	got := map[string]status.Node{}
	for _, n := range v.Nodes {
		got[n.Name] = n
	}
	if _, ok := got["node-healthy"]; ok || len(got) != 3 {
		t.Errorf("--broken nodes = %v, want node-broken, node-stale, node-dead", keys(got))
	}
	b := got["node-broken"]
	if b.Volumes.State != "broken" || b.Volumes.Broken != 3 || len(b.Volumes.Counts) != 2 || b.LastRepair == nil || b.LastRepair.Reason != string(agent.ReasonVolumeRepaired) || b.Failover.State != "fenced" {
		t.Errorf("node-broken = %+v", b)
	}
	if d := got["node-dead"]; d.Failover.State != "failed-over" || d.Volumes.State != "unknown" {
		t.Errorf("node-dead = %+v", d)
	}

	// As the kubectl plugin, with no subcommand: status.
	if args := commandArgs([]string{"/usr/local/bin/kubectl-mountmedic", "-o", "json"}); fmt.Sprint(args) != "[status -o json]" {
		t.Errorf("plugin args = %q, want status first", args)
	}
	if args := commandArgs([]string{"kubectl-mountmedic", "scan", "--mountinfo", "x"}); args[0] != "scan" {
		t.Errorf("plugin with a subcommand: args = %q", args)
	}
	if args := commandArgs([]string{"mountmedic", "-o", "json"}); args[0] != "-o" {
		t.Errorf("not as a plugin: args = %q, want them as given", args)
	}
}

func keys(m map[string]status.Node) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}
