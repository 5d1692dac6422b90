package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"sigs.k8s.io/yaml"

	"github.com/mountmedic/mountmedic/agent"
	"github.com/mountmedic/mountmedic/agent/failover"
	"github.com/mountmedic/mountmedic/agent/status"
	"github.com/mountmedic/mountmedic/scripts/kubetest"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// TestPluginAsViewer installs deploy/ on a real kube-apiserver and runs the
// plugin as a user bound to nothing but the shipped ClusterRole
// mountmedic-viewer, with kubectl's flags (--kubeconfig, --context), in
// every output format, for the cluster and for one node. The hostile
// user: one who may create events and writes some that claim to come from
// node-a's agent. One written before the admission policy was installed
// is admitted by the API server and must not be shown; one written after
// is refused by the API server. The same for an event that claims to come
// from the failover controller, which only the controller's
// ServiceAccount writes once the policy is in force (node-a's own identity
// cannot either).
func TestPluginAsViewer(t *testing.T) {
	c := kubetest.Start(t, kubetest.Options{})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	admin := c.Client
	c.CreateNamespace(t, "app")
	for _, n := range []string{"node-a", "node-b"} {
		if _, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	pod, err := admin.CoreV1().Pods("app").Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "db-0"},
		Spec: corev1.PodSpec{NodeName: "node-a", Containers: []corev1.Container{{Name: "db", Image: "db"}},
			Volumes: []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: "data-db-0"}}}}}},
		metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	event := func(cs kubernetes.Interface, name, reason, note string, dry ...string) error {
		_, err := cs.EventsV1().Events("app").Create(ctx, &eventsv1.Event{
			ObjectMeta: metav1.ObjectMeta{Name: name}, EventTime: metav1.NowMicro(),
			ReportingController: agent.ReportingController, ReportingInstance: "node-a",
			Action: "Repair", Reason: reason, Note: note, Type: corev1.EventTypeNormal,
			Regarding: corev1.ObjectReference{Kind: "Pod", Namespace: "app", Name: pod.Name, UID: pod.UID},
		}, metav1.CreateOptions{DryRun: dry})
		return err
	}
	// failoverEvent is the failover controller's event about node-a.
	failoverEvent := func(cs kubernetes.Interface, name, note string, dry ...string) error {
		_, err := cs.EventsV1().Events("default").Create(ctx, &eventsv1.Event{
			ObjectMeta: metav1.ObjectMeta{Name: name}, EventTime: metav1.NowMicro(),
			ReportingController: failover.ReportingController, ReportingInstance: "mountmedic-controller-0",
			Action: "Taint", Reason: failover.ReasonFailedOver, Note: note, Type: corev1.EventTypeWarning,
			Regarding: corev1.ObjectReference{Kind: "Node", Name: "node-a"},
		}, metav1.CreateOptions{DryRun: dry})
		return err
	}
	// Before the policy exists, anyone who may create events forges one.
	if err := event(admin, "forged-early", string(agent.ReasonVolumeRepaired), "forged before the policy"); err != nil {
		t.Fatal(err)
	}
	if err := failoverEvent(admin, "forged-failover-early", "forged before the policy"); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(lab.RequireTool(t, "kubectl"), "--kubeconfig="+c.Kubeconfig, "apply", "-k", "../../deploy").CombinedOutput()
	if err != nil {
		t.Fatalf("kubectl apply -k deploy: %v\n%s", err, out)
	}
	// The controller Component's events policy, with its parameter, the
	// controller's ServiceAccount, as the Component has them.
	out, err = exec.Command(lab.RequireTool(t, "kubectl"), "--kubeconfig="+c.Kubeconfig, "apply", "-f", "../../deploy/controller/failover-events-policy.yaml").CombinedOutput()
	if err != nil {
		t.Fatalf("kubectl apply the failover events policy: %v\n%s", err, out)
	}
	// The controller's ServiceAccount, allowed to create events.
	if _, err := admin.CoreV1().ServiceAccounts("mountmedic").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "mountmedic-controller"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.RbacV1().ClusterRoles().Create(ctx, &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: "event-writer"},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{"events.k8s.io"}, Resources: []string{"events"}, Verbs: []string{"create"}}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: "event-writer"},
		RoleRef:  rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: "event-writer"},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Namespace: "mountmedic", Name: "mountmedic-controller"}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	controller, err := kubernetes.NewForConfig(c.ServiceAccountConfig(t, "mountmedic", "mountmedic-controller"))
	if err != nil {
		t.Fatal(err)
	}
	// Once the policy is enforced, a forged event is refused.
	var last error
	if err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
		last = event(admin, "forged-late", string(agent.ReasonVolumeRepaired), "forged after the policy", metav1.DryRunAll)
		return apierrors.IsForbidden(last), nil
	}); err != nil {
		t.Fatalf("a forged agent event is never refused: %v", last)
	}
	if err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
		last = failoverEvent(admin, "forged-failover-late", "forged after the policy", metav1.DryRunAll)
		return apierrors.IsForbidden(last), nil
	}); err != nil {
		t.Fatalf("a forged failover controller event is never refused: %v", last)
	}
	// Node-a's agent writes its events once the policy has settled.
	time.Sleep(11 * time.Second)
	asNode, err := kubernetes.NewForConfig(c.NodeConfig(t, "node-a"))
	if err != nil {
		t.Fatal(err)
	}
	if err := event(asNode, "real", string(agent.ReasonVolumeRepaired), "re-staged \x1b[31mdata"); err != nil {
		t.Fatalf("node-a's identity writes node-a's agent event: %v", err)
	}
	if err := failoverEvent(asNode, "node-claims-failover", "node-a poses as the controller"); !apierrors.IsForbidden(err) {
		t.Errorf("node-a's identity writes a failover controller event: %v, want 403 Forbidden", err)
	}
	if err := failoverEvent(controller, "real-failover", "node confirmed dead"); err != nil {
		t.Fatalf("the controller's ServiceAccount writes its event: %v", err)
	}

	// The viewer: a user bound only to mountmedic-viewer.
	if _, err := admin.RbacV1().ClusterRoleBindings().Create(ctx, &rbacv1.ClusterRoleBinding{
		ObjectMeta: metav1.ObjectMeta{Name: "viewer"},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "ClusterRole", Name: status.ViewerRole},
		Subjects:   []rbacv1.Subject{{Kind: "User", Name: "viewer"}},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	cert, key := c.ClientCredentials(t, "viewer")
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["lab"] = &clientcmdapi.Cluster{Server: c.Server, CertificateAuthorityData: c.Config.CAData}
	cfg.AuthInfos["viewer"] = &clientcmdapi.AuthInfo{ClientCertificateData: cert, ClientKeyData: key}
	cfg.Contexts["viewer"] = &clientcmdapi.Context{Cluster: "lab", AuthInfo: "viewer", Namespace: "app"}
	cfg.Contexts["nobody"] = &clientcmdapi.Context{Cluster: "lab", AuthInfo: "nobody"}
	cfg.AuthInfos["nobody"] = &clientcmdapi.AuthInfo{}
	cfg.CurrentContext = "nobody"
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, kubeconfig); err != nil {
		t.Fatal(err)
	}
	plugin := func(args ...string) string {
		t.Helper()
		var stdout, stderr bytes.Buffer
		args = append(args, "--kubeconfig", kubeconfig, "--context", "viewer")
		if code := execute(ctx, args, &stdout, &stderr); code != 0 {
			t.Fatalf("kubectl mountmedic %s: exit %d\n%s%s", strings.Join(args, " "), code, stdout.String(), stderr.String())
		}
		return stdout.String()
	}

	table := plugin()
	for _, want := range []string{"node-a", "node-b", "repaired", "pod/app/db-0", "before the admission policy"} {
		if !strings.Contains(table, want) {
			t.Errorf("kubectl mountmedic lacks %q:\n%s", want, table)
		}
	}
	if wide := plugin("-o", "wide"); !strings.Contains(wide, "REPAIR NOTE") || !strings.Contains(wide, `re-staged \x1b[31mdata`) {
		t.Errorf("kubectl mountmedic -o wide lacks the note column or shows a raw escape:\n%s", wide)
	}
	var v status.View
	if err := json.Unmarshal([]byte(plugin("-o", "json")), &v); err != nil {
		t.Fatal(err)
	}
	for _, n := range v.Nodes {
		if n.Name == "node-a" && (n.LastRepair == nil || n.LastRepair.Note == "forged before the policy") {
			t.Errorf("node-a's last repair = %+v, want node-a's agent's own event", n.LastRepair)
		}
	}

	detail := plugin("node", "node-a")
	for _, want := range []string{"Node:", "node-a", "db-0", "data-db-0", "VolumeRepaired", "verified: events with reportingController", "1 events claim",
		"What the failover controller reported (1 events", "node confirmed dead", "claim to come from the mountmedic failover controller"} {
		if !strings.Contains(detail, want) {
			t.Errorf("kubectl mountmedic node node-a lacks %q:\n%s", want, detail)
		}
	}
	if strings.Contains(detail, "forged") || strings.Contains(detail, "poses") || strings.Contains(detail, "\x1b") {
		t.Errorf("kubectl mountmedic node node-a shows a forged event or a raw escape:\n%s", detail)
	}
	var d status.NodeDetail
	if err := yaml.Unmarshal([]byte(plugin("node", "node-a", "-o", "yaml")), &d); err != nil {
		t.Fatal(err)
	}
	if len(d.Events) != 1 || d.Events[0].Note != "re-staged \x1b[31mdata" || len(d.Pods) != 1 || len(d.Warnings) != 2 {
		t.Errorf("node node-a -o yaml: events %+v, pods %+v, warnings %q; want node-a's agent's one event, db-0, two warnings (a forged agent and a forged controller event)", d.Events, d.Pods, d.Warnings)
	}
	if len(d.FailoverEvents) != 1 || d.FailoverEvents[0].Note != "node confirmed dead" {
		t.Errorf("node node-a -o yaml: failover events %+v, want the controller's one", d.FailoverEvents)
	}

	// Without the viewer role: an error that names it.
	var stdout, stderr bytes.Buffer
	if code := execute(ctx, []string{"--kubeconfig", kubeconfig, "--as", "nobody"}, &stdout, &stderr); code == 0 || !strings.Contains(stderr.String(), status.ViewerRole) {
		t.Errorf("kubectl mountmedic as a user without the role: exit %d, stderr %q; want an error naming %s", code, stderr.String(), status.ViewerRole)
	}
}
