package kubetest_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/mountmedic/mountmedic/scripts/kubetest"
)

func TestControlPlane(t *testing.T) {
	c := kubetest.Start(t, kubetest.Options{Controllers: kubetest.DefaultControllers})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	const ns = "kubetest"
	c.CreateNamespace(t, ns)

	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "app", Labels: map[string]string{"app": "demo"}},
		Spec: corev1.PodSpec{
			NodeName:   "node-1",
			Containers: []corev1.Container{{Name: "main", Image: "busybox"}},
		},
	}
	pod, err := c.Client.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create pod: %v", err)
	}
	out, err := c.Kubectl("get", "pods", "-n", ns, "-o", "name")
	if err != nil {
		t.Fatalf("kubectl get pods: %v", err)
	}
	if got, want := strings.TrimSpace(out), "pod/app"; got != want {
		t.Errorf("kubectl get pods -o name = %q, want %q", got, want)
	}

	t.Run("rbac", func(t *testing.T) {
		sa, err := kubernetes.NewForConfig(c.ServiceAccountConfig(t, ns, "reader"))
		if err != nil {
			t.Fatalf("service-account client: %v", err)
		}
		_, err = sa.CoreV1().Pods(ns).Get(ctx, "app", metav1.GetOptions{})
		if !apierrors.IsForbidden(err) {
			t.Fatalf("get pod as unprivileged service account: err = %v, want forbidden", err)
		}
		grantPodReader(ctx, t, c.Client, ns, "reader")
		err = wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 10*time.Second, true, func(ctx context.Context) (bool, error) {
			_, err := sa.CoreV1().Pods(ns).Get(ctx, "app", metav1.GetOptions{})
			return err == nil, nil
		})
		if err != nil {
			t.Fatalf("get pod after binding a pod-reader role: %v", err)
		}
		imp, err := kubernetes.NewForConfig(c.ImpersonateConfig("someone", "some-group"))
		if err != nil {
			t.Fatalf("impersonating client: %v", err)
		}
		if _, err := imp.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{}); !apierrors.IsForbidden(err) {
			t.Fatalf("list pods as impersonated user: err = %v, want forbidden", err)
		}
	})

	t.Run("identities", func(t *testing.T) {
		whoami := func(rc *rest.Config) authenticationv1.UserInfo {
			t.Helper()
			cs, err := kubernetes.NewForConfig(rc)
			if err != nil {
				t.Fatal(err)
			}
			ssr, err := cs.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
			if err != nil {
				t.Fatalf("SelfSubjectReview: %v", err)
			}
			return ssr.Status.UserInfo
		}
		node := whoami(c.NodeConfig(t, "node-1"))
		if node.Username != kubetest.NodeUser("node-1") || !slices.Contains(node.Groups, kubetest.NodeGroup) {
			t.Errorf("NodeConfig(node-1) is %q in %q, want %q in %q", node.Username, node.Groups, kubetest.NodeUser("node-1"), kubetest.NodeGroup)
		}
		// The pod above is bound to node-1: a token bound to it names the node.
		tok := whoami(c.PodTokenConfig(t, pod))
		if got := tok.Extra["authentication.kubernetes.io/node-name"]; !slices.Equal(got, []string{"node-1"}) {
			t.Errorf("PodTokenConfig(pod on node-1) extra node-name = %q, want [node-1] (user %q, extra %v)", got, tok.Username, tok.Extra)
		}
	})

	t.Run("eviction", func(t *testing.T) {
		// A Pending pod ignores its budget on eviction: make it Running and Ready.
		pod.Status.Phase = corev1.PodRunning
		pod.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: metav1.Now()}}
		if _, err := c.Client.CoreV1().Pods(ns).UpdateStatus(ctx, pod, metav1.UpdateOptions{}); err != nil {
			t.Fatalf("set pod running and ready: %v", err)
		}
		minAvailable := intstr.FromInt32(1)
		pdb := &policyv1.PodDisruptionBudget{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "demo"},
			Spec: policyv1.PodDisruptionBudgetSpec{
				MinAvailable: &minAvailable,
				Selector:     &metav1.LabelSelector{MatchLabels: map[string]string{"app": "demo"}},
			},
		}
		if pdb, err = c.Client.PolicyV1().PodDisruptionBudgets(ns).Create(ctx, pdb, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create pdb: %v", err)
		}
		waitBudget(ctx, t, c.Client, ns, "demo", 0)

		eviction := &policyv1.Eviction{ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "app"}}
		if err := c.Client.PolicyV1().Evictions(ns).Evict(ctx, eviction); !apierrors.IsTooManyRequests(err) {
			t.Fatalf("evict while the budget forbids: err = %v, want 429 too many requests", err)
		}

		pdb, err = c.Client.PolicyV1().PodDisruptionBudgets(ns).Get(ctx, "demo", metav1.GetOptions{})
		if err != nil {
			t.Fatalf("get pdb: %v", err)
		}
		none := intstr.FromInt32(0)
		pdb.Spec.MinAvailable = &none
		if _, err := c.Client.PolicyV1().PodDisruptionBudgets(ns).Update(ctx, pdb, metav1.UpdateOptions{}); err != nil {
			t.Fatalf("relax pdb: %v", err)
		}
		waitBudget(ctx, t, c.Client, ns, "demo", 1)
		if err := c.Client.PolicyV1().Evictions(ns).Evict(ctx, eviction); err != nil {
			t.Fatalf("evict after relaxing the budget: %v", err)
		}
		got, err := c.Client.CoreV1().Pods(ns).Get(ctx, "app", metav1.GetOptions{})
		if err != nil {
			t.Fatalf("get evicted pod: %v", err)
		}
		if got.DeletionTimestamp == nil {
			t.Errorf("evicted pod has no deletion timestamp")
		}
		// Without a kubelet the pod stays Terminating; force-delete it.
		zero := int64(0)
		if err := c.Client.CoreV1().Pods(ns).Delete(ctx, "app", metav1.DeleteOptions{GracePeriodSeconds: &zero}); err != nil {
			t.Fatalf("force-delete evicted pod: %v", err)
		}
	})
}

func grantPodReader(ctx context.Context, t *testing.T, client kubernetes.Interface, ns, sa string) {
	t.Helper()
	role := &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "pod-reader"},
		Rules:      []rbacv1.PolicyRule{{APIGroups: []string{""}, Resources: []string{"pods"}, Verbs: []string{"get"}}},
	}
	if _, err := client.RbacV1().Roles(ns).Create(ctx, role, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create role: %v", err)
	}
	binding := &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: "pod-reader"},
		RoleRef:    rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "Role", Name: "pod-reader"},
		Subjects:   []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Namespace: ns, Name: sa}},
	}
	if _, err := client.RbacV1().RoleBindings(ns).Create(ctx, binding, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create role binding: %v", err)
	}
}

// waitBudget waits until the disruption controller has observed the budget's
// latest spec and allows the given number of disruptions.
func waitBudget(ctx context.Context, t *testing.T, client kubernetes.Interface, ns, name string, allowed int32) {
	t.Helper()
	var last policyv1.PodDisruptionBudgetStatus
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		pdb, err := client.PolicyV1().PodDisruptionBudgets(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		last = pdb.Status
		return pdb.Status.ObservedGeneration == pdb.Generation && pdb.Status.DisruptionsAllowed == allowed, nil
	})
	if err != nil {
		t.Fatalf("wait for pdb %s/%s to allow %d disruptions: %v (last status %+v)", ns, name, allowed, err, last)
	}
}

// TestBrokerAttach starts a cluster through a broker, as a test binary in
// the guest of scripts/guest does, and uses it as the admin and as a node.
func TestBrokerAttach(t *testing.T) {
	b := kubetest.Serve(t, t.TempDir())
	c := kubetest.Attach(t, b.Addr, kubetest.Options{})
	ctx := context.Background()
	c.CreateNamespace(t, "attached")
	if _, err := c.Kubectl("get", "namespace", "attached"); err != nil {
		t.Errorf("kubectl on the attached cluster: %v", err)
	}
	node, err := kubernetes.NewForConfig(c.NodeConfig(t, "node-1"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := node.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-1"}}, metav1.CreateOptions{}); err != nil {
		t.Errorf("the node's own identity creates its Node: %v", err)
	}
	t.Logf("cluster started by the broker in %v", b.Started)
}
