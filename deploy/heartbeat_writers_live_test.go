package deploy_test

import (
	"context"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/mountmedic/mountmedic/agent/failover"
	"github.com/mountmedic/mountmedic/scripts/kubetest"
)

// TestHeartbeatWriters: with deploy/ applied to a real API server, a
// principal other than the agents that may write Leases in the agents'
// namespace (a ServiceAccount with a leader-election Role there) cannot
// forge a fence plan: it can neither create a heartbeat Lease, nor put a
// plan on a Lease of its own, nor change or unlabel a node's heartbeat.
// A node's own identity cannot write there either (NodeRestriction holds
// nodes to kube-node-lease): heartbeats are written with the agent's
// ServiceAccount.
func TestHeartbeatWriters(t *testing.T) {
	kc := kubectl(t)
	c := kubetest.Start(t, kubetest.Options{})
	run(t, ".", kc, "--kubeconfig="+c.Kubeconfig, "apply", "-k", ".")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	admin := c.Client
	const ns = "mountmedic"
	if _, err := admin.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "stranger"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	role := &rbacv1.Role{ObjectMeta: metav1.ObjectMeta{Name: "lease-writer", Namespace: ns},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{"coordination.k8s.io"}, Resources: []string{"leases"}, Verbs: []string{"get", "create", "update", "patch"}}}}
	if _, err := admin.RbacV1().Roles(ns).Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	binding := &rbacv1.RoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "lease-writer", Namespace: ns},
		RoleRef: rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: role.Name},
		Subjects: []rbacv1.Subject{
			{Kind: rbacv1.ServiceAccountKind, Name: "stranger", Namespace: ns},
			{Kind: rbacv1.GroupKind, APIGroup: rbacv1.GroupName, Name: "system:nodes"},
		}}
	if _, err := admin.RbacV1().RoleBindings(ns).Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	stranger := clientFor(t, c.ServiceAccountConfig(t, ns, "stranger"))
	nodeA := clientFor(t, c.NodeConfig(t, "writer-a"))
	nodeB := clientFor(t, c.NodeConfig(t, "writer-b"))
	for _, n := range []string{"writer-a", "writer-b"} {
		if _, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	plan := failover.EncodeFencePlan(30*time.Second, []string{"0b2a5f8e-0000-4000-8000-000000000001"})
	lease := func(name string, labels, ann map[string]string) *coordinationv1.Lease {
		return &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: labels, Annotations: ann},
			Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To("x"), LeaseDurationSeconds: ptr.To[int32](30)}}
	}
	hbLabel := map[string]string{failover.HeartbeatLabel: failover.HeartbeatLabelValue}
	planAnn := map[string]string{failover.FencePlanAnnotation: plan}
	dry := metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}}

	refusal := waitRefused(ctx, t, "a stranger creates a heartbeat Lease", func() error {
		_, err := stranger.CoordinationV1().Leases(ns).Create(ctx, lease("writer-a", hbLabel, planAnn), dry)
		return err
	})
	t.Logf("a stranger creating a heartbeat Lease: %v", refusal)
	if _, err := stranger.CoordinationV1().Leases(ns).Create(ctx, lease("other-lock", nil, nil), metav1.CreateOptions{}); err != nil {
		t.Fatalf("a stranger creates its own plain Lease: %v, want allowed (only heartbeats are held)", err)
	}
	if _, err := admin.CoordinationV1().Leases(ns).Create(ctx, lease("writer-a", hbLabel, planAnn), metav1.CreateOptions{}); err != nil {
		t.Fatalf("system:masters creates a heartbeat Lease: %v, want allowed", err)
	}
	edit := func(name string, f func(*coordinationv1.Lease)) func(as string) error {
		return func(as string) error {
			cl := map[string]interface {
				Get(context.Context, string, metav1.GetOptions) (*coordinationv1.Lease, error)
				Update(context.Context, *coordinationv1.Lease, metav1.UpdateOptions) (*coordinationv1.Lease, error)
			}{"stranger": stranger.CoordinationV1().Leases(ns), "node A": nodeA.CoordinationV1().Leases(ns), "node B": nodeB.CoordinationV1().Leases(ns)}[as]
			l, err := admin.CoordinationV1().Leases(ns).Get(ctx, name, metav1.GetOptions{})
			if err != nil {
				return err
			}
			f(l)
			_, err = cl.Update(ctx, l, metav1.UpdateOptions{DryRun: []string{metav1.DryRunAll}})
			return err
		}
	}
	otherPlan := func(l *coordinationv1.Lease) {
		l.Annotations[failover.FencePlanAnnotation] = failover.EncodeFencePlan(30*time.Second, []string{"0b2a5f8e-0000-4000-8000-000000000002"})
	}
	for _, tc := range []struct {
		what, as string
		do       func(as string) error
		allow    bool
	}{
		{"change a node's fence plan", "stranger", edit("writer-a", otherPlan), false},
		{"unlabel a node's heartbeat", "stranger", edit("writer-a", func(l *coordinationv1.Lease) { delete(l.Labels, failover.HeartbeatLabel) }), false},
		{"renew a node's heartbeat", "stranger", edit("writer-a", func(l *coordinationv1.Lease) { l.Spec.RenewTime = &metav1.MicroTime{Time: time.Now()} }), false},
		{"put a fence plan on its own Lease", "stranger", edit("other-lock", func(l *coordinationv1.Lease) { l.Annotations = planAnn }), false},
		{"label its own Lease a heartbeat", "stranger", edit("other-lock", func(l *coordinationv1.Lease) { l.Labels = hbLabel }), false},
		{"change its own plain Lease", "stranger", edit("other-lock", func(l *coordinationv1.Lease) { l.Spec.HolderIdentity = ptr.To("y") }), true},
		{"write its own heartbeat", "node A", edit("writer-a", otherPlan), false},
		{"write another node's heartbeat", "node B", edit("writer-a", otherPlan), false},
	} {
		err := tc.do(tc.as)
		switch {
		case tc.allow && err != nil:
			t.Errorf("%s: %s: %v, want allowed", tc.as, tc.what, err)
		case !tc.allow && !apierrors.IsForbidden(err):
			t.Errorf("%s: %s: %v, want forbidden", tc.as, tc.what, err)
		}
	}
}
