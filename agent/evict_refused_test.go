package agent_test

import (
	"context"
	"strings"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/mountmedic/mountmedic/agent"
	"github.com/mountmedic/mountmedic/remount"
)

// TestAgentRefusedEvictionNeverDeletes runs the agent with the opt-in
// delete tier against a real API server whose admission policy refuses
// the eviction of the broken volume's pod (403 Forbidden), as the
// agent-evictions policy does for a pod of another node: the agent
// reports the refusal and never deletes the pod instead.
func TestAgentRefusedEvictionNeverDeletes(t *testing.T) {
	e := newEnv(t, nil)
	ctx := context.Background()
	labels := map[string]string{"app": "held"}
	v := e.createVolume("held", nil)
	pod := e.createPod("held-0", v, podOptions{owner: e.replicaSet("held", labels), labels: labels})

	// A policy refusing every eviction of this pod, by anyone.
	const name = "test-refuse-eviction"
	if _, err := e.admin.AdmissionregistrationV1().ValidatingAdmissionPolicies().Create(ctx, &admissionregistrationv1.ValidatingAdmissionPolicy{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: admissionregistrationv1.ValidatingAdmissionPolicySpec{
			FailurePolicy: ptr.To(admissionregistrationv1.Fail),
			MatchConstraints: &admissionregistrationv1.MatchResources{ResourceRules: []admissionregistrationv1.NamedRuleWithOperations{{
				RuleWithOperations: admissionregistrationv1.RuleWithOperations{
					Operations: []admissionregistrationv1.OperationType{admissionregistrationv1.Create},
					Rule: admissionregistrationv1.Rule{APIGroups: []string{""}, APIVersions: []string{"v1"},
						Resources: []string{"pods/eviction"}},
				},
			}}},
			Validations: []admissionregistrationv1.Validation{{
				Expression: "request.name != '" + pod.Name + "'",
				Message:    "evictions of this pod are refused by the test",
				// 403, as the shipped policies answer.
				Reason: ptr.To(metav1.StatusReasonForbidden),
			}},
		},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create policy: %v", err)
	}
	if _, err := e.admin.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Create(ctx, &admissionregistrationv1.ValidatingAdmissionPolicyBinding{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec: admissionregistrationv1.ValidatingAdmissionPolicyBindingSpec{PolicyName: name,
			ValidationActions: []admissionregistrationv1.ValidationAction{admissionregistrationv1.Deny}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create binding: %v", err)
	}
	e.waitFor("the API server to refuse the pod's eviction", func() (bool, error) {
		err := e.admin.PolicyV1().Evictions(pod.Namespace).Evict(ctx, &policyv1.Eviction{
			ObjectMeta:    metav1.ObjectMeta{Namespace: pod.Namespace, Name: pod.Name},
			DeleteOptions: &metav1.DeleteOptions{DryRun: []string{metav1.DryRunAll}},
		})
		return apierrors.IsForbidden(err), nil
	})
	e.deadVolume(v, pod)

	cfg := e.config()
	cfg.Tiers = remount.NewTierSet(remount.TierEvict, remount.TierDelete)
	a := e.startAgent(cfg, agent.Deps{})

	e.waitEvent(pod.UID, string(agent.ReasonNotRepaired), "eviction refused", "refused by the test")
	if n, _ := a.metric(`mountmedic_evictions_total{result="failed"}`); n < 1 {
		t.Errorf("mountmedic_evictions_total{failed} = %v, want at least 1", n)
	}
	// More attempts (the ladder retries with backoff): never a deletion.
	time.Sleep(2 * time.Second)
	p, err := e.admin.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
	if err != nil || p.DeletionTimestamp != nil {
		t.Fatalf("the pod whose eviction was refused was deleted (err %v, deletion %v)", err, p.GetDeletionTimestamp())
	}
	for _, r := range e.reasons(pod.UID) {
		if strings.HasPrefix(r, string(agent.ReasonEvicting)+":") {
			t.Errorf("an %s event after a refused eviction: the agent claims it removed the pod", r)
		}
	}
}
