package deploy_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mountmedic/mountmedic/scripts/kubetest"
)

// TestEventsPoliciesWithoutTheirServiceAccount: the events policies take
// a ServiceAccount as their parameter and match every event write in the
// cluster (only their match conditions narrow them to mountmedic's
// events). While that ServiceAccount does not exist (an install before it
// is created, an uninstall half done), the API server looks the parameter
// up before it evaluates the match conditions; the cluster's other event
// writes (kubelet's, controllers') must still be admitted.
func TestEventsPoliciesWithoutTheirServiceAccount(t *testing.T) {
	kc := kubectl(t)
	c := kubetest.Start(t, kubetest.Options{})
	ctx := context.Background()
	run(t, ".", kc, "--kubeconfig="+c.Kubeconfig, "apply", "-f", "agent-events-policy.yaml", "-f", "controller/failover-events-policy.yaml")
	// The policies admit writes only once the API server has loaded them;
	// a forged agent event refused says they are in force.
	if _, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "mountmedic"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "mountmedic", Namespace: "mountmedic"}}
	if _, err := c.Client.CoreV1().ServiceAccounts("mountmedic").Create(ctx, sa, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	ev := func(controller string, i int) *eventsv1.Event {
		return &eventsv1.Event{
			ObjectMeta:          metav1.ObjectMeta{Name: fmt.Sprintf("e-%d", i), Namespace: "default"},
			EventTime:           metav1.NewMicroTime(time.Now()),
			ReportingController: controller, ReportingInstance: "node-1", Action: "Test", Reason: "Test",
			Regarding: corev1.ObjectReference{Kind: "Node", Name: "node-1"}, Type: corev1.EventTypeNormal,
		}
	}
	events := c.Client.EventsV1().Events("default")
	i := 0
	deadline := time.Now().Add(time.Minute)
	for {
		i++
		_, err := events.Create(ctx, ev("mountmedic.io/agent", i), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		if err != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("a forged agent event by the admin is still admitted a minute after the policy was applied")
		}
		time.Sleep(200 * time.Millisecond)
	}
	if err := c.Client.CoreV1().ServiceAccounts("mountmedic").Delete(ctx, "mountmedic", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	// For 10 s after the ServiceAccount is gone (its deletion reaches the
	// policies' parameter cache within that), kubelet's kind of event is
	// admitted every time.
	refused := 0
	for end := time.Now().Add(10 * time.Second); time.Now().Before(end); time.Sleep(250 * time.Millisecond) {
		i++
		if _, err := events.Create(ctx, ev("kubelet", i), metav1.CreateOptions{}); err != nil {
			refused++
			if refused == 1 {
				t.Errorf("a kubelet event with the mountmedic ServiceAccount gone: %v", err)
			}
		}
	}
	if refused > 0 {
		t.Errorf("%d kubelet events refused while the events policies' ServiceAccount was missing, want 0", refused)
	}
}
