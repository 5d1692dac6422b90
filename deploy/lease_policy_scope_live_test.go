package deploy_test

import (
	"context"
	"strings"
	"testing"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"

	"github.com/mountmedic/mountmedic/agent/failover"
	"github.com/mountmedic/mountmedic/scripts/kubetest"
)

// leasePolicies are the shipped ValidatingAdmissionPolicies that match
// Lease writes (deploy/heartbeat-lease-policy.yaml and the controller
// Component's admission-policy.yaml).
var leasePolicies = []string{"mountmedic-heartbeat-lease", "mountmedic-heartbeat-writers", "mountmedic-controller-leases"}

// TestLeasePoliciesScope applies the base with the controller Component to
// a real kube-apiserver and shows that the Lease policies, all
// failurePolicy Fail, reach only the heartbeat namespace:
//
//   - kubelet's node Lease in kube-node-lease (written with the node's own
//     identity), a leader-election Lease in kube-system and a Lease in an
//     application namespace are written, with the shipped policies and
//     with each policy made to fail on every evaluation (its match
//     constraints kept, its rules replaced by one that is a CEL runtime
//     error): outside the heartbeat namespace none is evaluated;
//   - the same broken policy refuses every Lease write in the heartbeat
//     namespace, which proves it was in force;
//   - a stolen agent or controller token cannot write a Lease outside the
//     heartbeat namespace at all (RBAC), so neither can plant a heartbeat
//     where the policies do not look; and nothing reads heartbeats there
//     (the controller, the peer lists and status read --failover-namespace).
//
// TestHeartbeatWriters and TestControllerBlastRadius show the protections
// in the heartbeat namespace, with the same scoped policies.
func TestLeasePoliciesScope(t *testing.T) {
	kc := kubectl(t)
	c := kubetest.Start(t, kubetest.Options{})
	dir := overlayDir(t, "controller", controllerOverlay)
	run(t, ".", kc, "--kubeconfig="+c.Kubeconfig, "apply", "-k", dir)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	admin := c.Client
	const ns = "mountmedic"
	c.CreateNamespace(t, appsNS)
	if _, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "scope-node"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	// A tenant's workload with its own leader election in its namespace.
	if _, err := admin.CoreV1().ServiceAccounts(appsNS).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "tenant"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	role := &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: "lease-writer", Namespace: appsNS},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{"coordination.k8s.io"}, Resources: []string{"leases"}, Verbs: []string{"get", "create", "update"}}}}
	if _, err := admin.RbacV1().Roles(appsNS).Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.RbacV1().RoleBindings(appsNS).Create(ctx, &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "lease-writer", Namespace: appsNS},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: role.Name},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: "tenant", Namespace: appsNS}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	node := clientFor(t, c.NodeConfig(t, "scope-node"))
	tenant := clientFor(t, c.ServiceAccountConfig(t, appsNS, "tenant"))
	agentToken := clientFor(t, c.ServiceAccountConfig(t, ns, "mountmedic"))
	controllerToken := clientFor(t, c.ServiceAccountConfig(t, ns, "mountmedic-controller"))

	hb := map[string]string{failover.HeartbeatLabel: failover.HeartbeatLabelValue}
	lease := func(ns, name string, labels map[string]string) *coordinationv1.Lease {
		return &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: labels},
			Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To("x"), LeaseDurationSeconds: ptr.To[int32](40)}}
	}
	// write creates the Lease or, once it exists, renews it, as kubelet
	// and leader election do.
	write := func(cs kubernetes.Interface, l *coordinationv1.Lease) error {
		leases := cs.CoordinationV1().Leases(l.Namespace)
		cur, err := leases.Get(ctx, l.Name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			_, err = leases.Create(ctx, l, metav1.CreateOptions{})
			return err
		}
		if err != nil {
			return err
		}
		cur.Spec.RenewTime = &metav1.MicroTime{Time: time.Now()}
		_, err = leases.Update(ctx, cur, metav1.UpdateOptions{})
		return err
	}
	outside := []struct {
		what string
		cs   kubernetes.Interface
		l    *coordinationv1.Lease
	}{
		{"the node renews its kubelet Lease in kube-node-lease", node, lease(failover.KubeletLeaseNamespace, "scope-node", nil)},
		{"a leader election in kube-system", admin, lease("kube-system", "kube-controller-manager", nil)},
		{"a tenant's leader election in its namespace", tenant, lease(appsNS, "tenant-leader", nil)},
		// Not evaluated, and harmless: no reader looks outside the
		// heartbeat namespace.
		{"a tenant's Lease labelled a heartbeat in its namespace", tenant, lease(appsNS, "scope-node", hb)},
	}
	checkOutside := func(when string) {
		t.Helper()
		for _, o := range outside {
			// Twice: a create, then an update.
			for range 2 {
				if err := write(o.cs, o.l); err != nil {
					t.Errorf("%s: %s: %v, want allowed (the Lease policies match only namespace %s)", when, o.what, err, ns)
				}
			}
		}
	}
	checkOutside("with the shipped policies")

	// Stolen tokens: no Lease outside the heartbeat namespace (RBAC), so
	// no heartbeat where the policies do not look.
	for who, cs := range map[string]kubernetes.Interface{"agent": agentToken, "controller": controllerToken} {
		for _, where := range []string{appsNS, failover.KubeletLeaseNamespace, "kube-system"} {
			_, err := cs.CoordinationV1().Leases(where).Create(ctx, lease(where, "scope-node", hb), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
			if !apierrors.IsForbidden(err) {
				t.Errorf("a stolen %s token creates a heartbeat-labelled Lease in %s: %v, want forbidden", who, where, err)
			}
		}
	}

	// Each policy, broken: every evaluation is a CEL runtime error, which
	// failurePolicy Fail turns into a refusal.
	for _, name := range leasePolicies {
		p, err := admin.AdmissionregistrationV1().ValidatingAdmissionPolicies().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if p.Spec.MatchConstraints == nil || p.Spec.MatchConstraints.NamespaceSelector == nil ||
			p.Spec.MatchConstraints.NamespaceSelector.MatchLabels["kubernetes.io/metadata.name"] != ns {
			t.Errorf("policy %s: namespaceSelector %v, want kubernetes.io/metadata.name=%s", name, p.Spec.MatchConstraints.NamespaceSelector, ns)
		}
		broken := &admissionregistrationv1.ValidatingAdmissionPolicy{
			ObjectMeta: metav1.ObjectMeta{Name: name + "-broken"},
			Spec: admissionregistrationv1.ValidatingAdmissionPolicySpec{
				FailurePolicy:    p.Spec.FailurePolicy,
				MatchConstraints: p.Spec.MatchConstraints,
				Validations:      []admissionregistrationv1.Validation{{Expression: "int(object.metadata.name) > 0"}},
			},
		}
		if _, err := admin.AdmissionregistrationV1().ValidatingAdmissionPolicies().Create(ctx, broken, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		binding := &admissionregistrationv1.ValidatingAdmissionPolicyBinding{ObjectMeta: metav1.ObjectMeta{Name: broken.Name},
			Spec: admissionregistrationv1.ValidatingAdmissionPolicyBindingSpec{PolicyName: broken.Name,
				ValidationActions: []admissionregistrationv1.ValidationAction{admissionregistrationv1.Deny}}}
		if _, err := admin.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		var last error
		if err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
			_, last = admin.CoordinationV1().Leases(ns).Create(ctx, lease(ns, "any-lease", nil), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
			return last != nil && strings.Contains(last.Error(), broken.Name), nil
		}); err != nil {
			t.Fatalf("policy %s, broken: a Lease write in %s never refused (last: %v)", name, ns, last)
		}
		t.Logf("policy %s, broken, in namespace %s: %v", name, ns, last)
		checkOutside("policy " + name + " broken")
		if err := admin.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Delete(ctx, binding.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		if err := admin.AdmissionregistrationV1().ValidatingAdmissionPolicies().Delete(ctx, broken.Name, metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
	}
}

// TestLeasePoliciesFollowTheNamespace: installed in another namespace (a
// kustomize overlay's namespace, a Helm release's), the Lease policies
// match that namespace's Leases, where the heartbeats are: a selector
// left on the base's namespace would leave them unguarded (fail open).
func TestLeasePoliciesFollowTheNamespace(t *testing.T) {
	for _, ns := range []string{baseNamespace, "ops"} {
		renders := map[string][]object{
			"kustomize": renderOverlay(t, "lease-ns-"+ns, "namespace: "+ns+"\nresources: [../../deploy]\n"),
			"helm":      helmTemplate(t, ns, "failover.enabled=true", "controller.enabled=true"),
		}
		for how, objs := range renders {
			names := leasePolicies
			if how == "kustomize" {
				names = names[:2] // the controller Component takes no namespace overlay
			}
			for _, name := range names {
				var p admissionregistrationv1.ValidatingAdmissionPolicy
				if err := yaml.Unmarshal(find(t, objs, "ValidatingAdmissionPolicy", name).raw, &p); err != nil {
					t.Fatal(err)
				}
				if sel := p.Spec.MatchConstraints.NamespaceSelector; sel == nil || sel.MatchLabels["kubernetes.io/metadata.name"] != ns {
					t.Errorf("%s (%s, namespace %s): namespaceSelector %v, want kubernetes.io/metadata.name=%s", name, how, ns, sel, ns)
				}
			}
		}
	}
}
