package deploy_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"

	"github.com/mountmedic/mountmedic/scripts/kubetest"
)

// controllerOverlay installs the base and the failover controller
// Component, as docs/install.md says.
const controllerOverlay = "resources: [../../deploy]\ncomponents: [../../deploy/controller]\n"

// controllerKinds are what the Component adds to the base.
var controllerKinds = []string{"Deployment", "PodDisruptionBudget"}

// decodeController decodes the controller's Deployment among rendered
// objects.
func decodeController(t *testing.T, objs []object) *appsv1.Deployment {
	t.Helper()
	var d appsv1.Deployment
	if err := yaml.Unmarshal(find(t, objs, "Deployment", "mountmedic-controller").raw, &d); err != nil {
		t.Fatalf("decode Deployment: %v", err)
	}
	return &d
}

// TestControllerComponent renders the base with deploy/controller/ and
// checks what the controller relies on and the hardening the issue asks
// for, then runs `mountmedic controller` with the Deployment's arguments so
// that its own validation judges them.
func TestControllerComponent(t *testing.T) {
	base := kustomize(t, ".")
	objs := renderOverlay(t, "controller", controllerOverlay)
	var kinds []string
	for _, o := range objs {
		if !slices.Contains(kinds, o.Kind) {
			kinds = append(kinds, o.Kind)
		}
		if o.Metadata.Labels["app.kubernetes.io/part-of"] != "mountmedic" {
			t.Errorf("%s %s has no label app.kubernetes.io/part-of=mountmedic", o.Kind, o.Metadata.Name)
		}
	}
	for _, k := range controllerKinds {
		if !slices.Contains(kinds, k) {
			t.Errorf("the controller Component renders no %s", k)
		}
	}
	// 9, and the admission policies (five policies, five bindings).
	if want := len(base) + 19; len(objs) != want {
		t.Errorf("base + controller render %d objects, want %d (the base's and the Component's 19)", len(objs), want)
	}
	// The Role that reads kubelet's Leases stays in kube-node-lease; every
	// other namespaced object is in mountmedic.
	for _, o := range objs {
		key := o.Kind + "/" + o.Metadata.Name
		switch {
		case o.Metadata.Name == "mountmedic-controller" && (o.Kind == "Role" || o.Kind == "RoleBinding") && o.Metadata.Namespace == "kube-node-lease":
		case o.Metadata.Namespace != "" && o.Metadata.Namespace != "mountmedic":
			t.Errorf("%s is in namespace %s", key, o.Metadata.Namespace)
		}
	}
	for _, kind := range []string{"Role", "RoleBinding"} {
		n := 0
		for _, o := range objs {
			if o.Kind == kind && o.Metadata.Name == "mountmedic-controller" && o.Metadata.Namespace == "kube-node-lease" {
				n++
			}
		}
		if n != 1 {
			t.Errorf("%d %s mountmedic-controller in kube-node-lease, want 1 (kubelet's Leases are read there)", n, kind)
		}
	}

	d := decodeController(t, objs)
	pod := d.Spec.Template.Spec
	c := pod.Containers[0]
	if d.Spec.Replicas == nil || *d.Spec.Replicas != 2 {
		t.Errorf("replicas = %v, want 2 (a leader and a standby)", d.Spec.Replicas)
	}
	if pod.ServiceAccountName != "mountmedic-controller" {
		t.Errorf("serviceAccountName = %q, want mountmedic-controller (its own, not the agents')", pod.ServiceAccountName)
	}
	if pod.HostPID || pod.HostNetwork || pod.HostIPC || len(pod.Volumes) != 0 {
		t.Errorf("the controller needs no host access: hostPID %v hostNetwork %v hostIPC %v volumes %v", pod.HostPID, pod.HostNetwork, pod.HostIPC, pod.Volumes)
	}
	psc, sc := pod.SecurityContext, c.SecurityContext
	switch {
	case psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot || psc.RunAsUser == nil || *psc.RunAsUser == 0:
		t.Errorf("pod securityContext %+v: want runAsNonRoot and a non-zero runAsUser", psc)
	case psc.SeccompProfile == nil || psc.SeccompProfile.Type != corev1.SeccompProfileTypeRuntimeDefault:
		t.Errorf("pod seccompProfile %+v: want RuntimeDefault", psc.SeccompProfile)
	case sc == nil || sc.ReadOnlyRootFilesystem == nil || !*sc.ReadOnlyRootFilesystem:
		t.Errorf("container securityContext %+v: want readOnlyRootFilesystem", sc)
	case sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation || sc.Privileged == nil || *sc.Privileged:
		t.Errorf("container securityContext %+v: want no privilege and no escalation", sc)
	case sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) || len(sc.Capabilities.Add) > 0:
		t.Errorf("capabilities %+v: want drop [ALL], add none", sc.Capabilities)
	}
	budget := resource.MustParse("256Mi")
	if c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() || c.Resources.Limits.Memory().Cmp(budget) > 0 || c.Resources.Limits.Memory().IsZero() {
		t.Errorf("resources %+v: want CPU and memory requests and a memory limit of at most 256Mi", c.Resources)
	}
	env := map[string]string{}
	for _, e := range c.Env {
		if e.ValueFrom != nil && e.ValueFrom.FieldRef != nil {
			env[e.Name] = e.ValueFrom.FieldRef.FieldPath
		}
	}
	if env["POD_NAMESPACE"] != "metadata.namespace" || env["POD_NAME"] != "metadata.name" {
		t.Errorf("env %v: want POD_NAMESPACE and POD_NAME from the downward API (the Leases' namespace, the identity)", env)
	}
	addr, ok := flagValue(c.Args, "metrics-addr")
	var port int32
	for _, p := range c.Ports {
		if p.Name == "metrics" {
			port = p.ContainerPort
		}
	}
	if !ok || !strings.HasSuffix(addr, ":"+strconv.Itoa(int(port))) {
		t.Errorf("--metrics-addr %q and container port metrics %d: want the same port", addr, port)
	}
	for path, pr := range map[string]*corev1.Probe{"/healthz": c.LivenessProbe, "/readyz": c.ReadinessProbe} {
		if pr == nil || pr.HTTPGet == nil || pr.HTTPGet.Path != path || pr.HTTPGet.Port != intstr.FromString("metrics") {
			t.Errorf("probe for %s = %+v, want an httpGet of %s on port metrics", path, pr, path)
		}
	}
	var pm struct {
		Spec struct {
			Selector metav1.LabelSelector `json:"selector"`
		} `json:"spec"`
	}
	if err := yaml.Unmarshal(find(t, kustomize(t, "prometheus"), "PodMonitor", "mountmedic").raw, &pm); err != nil {
		t.Fatal(err)
	}
	sel, err := metav1.LabelSelectorAsSelector(&pm.Spec.Selector)
	if err != nil || !sel.Matches(labels.Set(d.Spec.Template.Labels)) {
		t.Errorf("PodMonitor selector %v does not select the controller's pods %v (err %v)", pm.Spec.Selector, d.Spec.Template.Labels, err)
	}

	bin := buildMountmedic(t)
	help := string(run(t, ".", bin, "controller", "--help"))
	known := map[string]bool{}
	for _, m := range regexp.MustCompile(`(?m)^\s+(?:-\w, )?--([a-z0-9-]+)`).FindAllStringSubmatch(help, -1) {
		known[m[1]] = true
	}
	if len(c.Args) == 0 || c.Args[0] != "controller" {
		t.Fatalf("Deployment args = %q, want the controller command first", c.Args)
	}
	for _, a := range c.Args[1:] {
		name, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if !known[name] {
			t.Errorf("the Deployment passes --%s, which mountmedic controller does not have", name)
		}
	}
	// POD_NAME comes from the downward API in the cluster.
	missing := filepath.Join(t.TempDir(), "no-such-kubeconfig")
	cmd := exec.Command(bin, append(slices.Clone(c.Args), "--kubeconfig="+missing)...)
	cmd.Env = append(os.Environ(), "POD_NAME=mountmedic-controller-0", "POD_NAMESPACE=mountmedic")
	out, err := cmd.CombinedOutput()
	if err == nil || !strings.Contains(string(out), missing) || strings.Count(strings.TrimSpace(string(out)), "\n") > 0 {
		t.Errorf("mountmedic %s: want one error naming the missing kubeconfig, got %v:\n%s", strings.Join(cmd.Args[1:], " "), err, out)
	}
}

// applyController applies the base with the controller Component on the
// real API server (server-side dry run, then for real) and asks it what the
// controller's ServiceAccount may do.
func applyController(t *testing.T, c *kubetest.Cluster, k func(args ...string) string) {
	t.Helper()
	dir := overlayDir(t, "controller", controllerOverlay)
	want := len(renderOverlay(t, "controller", controllerOverlay))
	out := k("apply", "-k", dir, "--dry-run=server")
	if n := strings.Count(out, "(server dry run)"); n != want {
		t.Errorf("kubectl apply -k <base + controller> --dry-run=server applied %d objects, want %d:\n%s", n, want, out)
	}
	k("apply", "-k", dir)
	d, err := c.Client.AppsV1().Deployments("mountmedic").Get(context.Background(), "mountmedic-controller", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("controller Deployment after apply: %v", err)
	}
	if got := d.Spec.Template.Spec.Containers[0].Image; got != "mountmedic:dev" {
		t.Errorf("controller image = %q, want mountmedic:dev", got)
	}
	checkControllerAccess(t, c)
}

// checkControllerAccess asks the API server what the controller's
// ServiceAccount may do: what the controller needs must be allowed, the
// rest denied.
func checkControllerAccess(t *testing.T, c *kubetest.Cluster) {
	t.Helper()
	const user = "system:serviceaccount:mountmedic:mountmedic-controller"
	type ra = authorizationv1.ResourceAttributes
	lease := func(verb, ns, name string) ra {
		return ra{Verb: verb, Group: "coordination.k8s.io", Resource: "leases", Namespace: ns, Name: name}
	}
	for _, tc := range []struct {
		name  string
		attrs ra
		allow bool
	}{
		{"watch nodes", ra{Verb: "watch", Resource: "nodes"}, true},
		{"get node (fresh read)", ra{Verb: "get", Resource: "nodes", Name: "n1"}, true},
		{"patch node (taint)", ra{Verb: "patch", Resource: "nodes", Name: "n1"}, true},
		{"watch kubelet leases", lease("watch", "kube-node-lease", ""), true},
		{"get kubelet lease", lease("get", "kube-node-lease", "n1"), true},
		{"watch heartbeat leases", lease("watch", "mountmedic", ""), true},
		{"create leader lease", lease("create", "mountmedic", ""), true},
		{"update leader lease", lease("update", "mountmedic", "mountmedic-failover-leader"), true},
		{"list pods of a node", ra{Verb: "list", Resource: "pods"}, true},
		{"force-delete pod", ra{Verb: "delete", Resource: "pods", Namespace: "apps", Name: "db-0"}, true},
		{"get pvc", ra{Verb: "get", Resource: "persistentvolumeclaims", Namespace: "apps"}, true},
		{"get pv", ra{Verb: "get", Resource: "persistentvolumes"}, true},
		{"get volumeattachment", ra{Verb: "get", Group: "storage.k8s.io", Resource: "volumeattachments", Name: "csi-x"}, true},
		{"delete volumeattachment", ra{Verb: "delete", Group: "storage.k8s.io", Resource: "volumeattachments", Name: "csi-x"}, true},
		{"create events", ra{Verb: "create", Group: "events.k8s.io", Resource: "events", Namespace: "default"}, true},

		{"update a heartbeat lease", lease("update", "mountmedic", "n1"), false},
		{"delete leases", lease("delete", "mountmedic", "mountmedic-failover-leader"), false},
		{"write kubelet leases", lease("update", "kube-node-lease", "n1"), false},
		{"leases elsewhere", lease("list", "default", ""), false},
		{"update nodes", ra{Verb: "update", Resource: "nodes"}, false},
		{"delete nodes", ra{Verb: "delete", Resource: "nodes"}, false},
		{"patch node status", ra{Verb: "patch", Resource: "nodes", Subresource: "status"}, false},
		{"watch pods", ra{Verb: "watch", Resource: "pods"}, false},
		{"evict pods", ra{Verb: "create", Resource: "pods", Subresource: "eviction", Namespace: "apps"}, false},
		{"list volumeattachments", ra{Verb: "list", Group: "storage.k8s.io", Resource: "volumeattachments"}, false},
		{"get secrets", ra{Verb: "get", Resource: "secrets", Namespace: "apps"}, false},
		{"escalate", ra{Verb: "create", Group: "rbac.authorization.k8s.io", Resource: "clusterrolebindings"}, false},
	} {
		attrs := tc.attrs
		sar, err := c.Client.AuthorizationV1().SubjectAccessReviews().Create(context.Background(), &authorizationv1.SubjectAccessReview{
			Spec: authorizationv1.SubjectAccessReviewSpec{User: user, Groups: []string{"system:serviceaccounts", "system:serviceaccounts:mountmedic", "system:authenticated"}, ResourceAttributes: &attrs},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("SubjectAccessReview %s: %v", tc.name, err)
		}
		if sar.Status.Allowed != tc.allow {
			t.Errorf("%s may %s: allowed = %v, want %v (%s)", user, tc.name, sar.Status.Allowed, tc.allow, sar.Status.Reason)
		}
	}
}

// TestConfigurationDocCoversControllerFlags: docs/configuration.md's
// controller flag table names every flag of `mountmedic controller` and no
// other, with the defaults it prints (-update rewrites it to agree).
func TestConfigurationDocCoversControllerFlags(t *testing.T) {
	checkDocFlags(t, "controller", 20)
}

// Markers around the controller's flag table in docs/configuration.md: the
// agent and the controller share some flag names (--kubeconfig,
// --metrics-addr) with other defaults.
const (
	controllerTableStart = "<!-- flags of mountmedic controller -->"
	controllerTableEnd   = "<!-- end of the flags of mountmedic controller -->"
)

// controllerFlagTable splits docs/configuration.md into the controller's
// flag table and the rest.
func controllerFlagTable(t *testing.T, doc string) (table, rest string) {
	t.Helper()
	before, after, ok := strings.Cut(doc, controllerTableStart)
	table, after2, ok2 := strings.Cut(after, controllerTableEnd)
	if !ok || !ok2 {
		t.Fatalf("%s has no controller flag table between %q and %q", configurationDoc, controllerTableStart, controllerTableEnd)
	}
	return table, before + after2
}
