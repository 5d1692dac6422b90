package deploy_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"sigs.k8s.io/yaml"

	"github.com/mountmedic/mountmedic/scripts/kubetest"
)

// The kustomizations deploy/ ships, and what each must render.
var kustomizations = []struct {
	dir   string
	kinds []string
}{
	{".", []string{"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "DaemonSet", "Service"}},
	{"prometheus", []string{"PodMonitor", "PrometheusRule"}},
	{"grafana", []string{"ConfigMap"}},
	{"csi-token-requests", []string{"ClusterRole", "ClusterRoleBinding"}},
}

func TestKustomizationsRender(t *testing.T) {
	for _, k := range kustomizations {
		t.Run(k.dir, func(t *testing.T) {
			objs := kustomize(t, k.dir)
			var kinds []string
			for _, o := range objs {
				if !slices.Contains(kinds, o.Kind) {
					kinds = append(kinds, o.Kind)
				}
				if o.Metadata.Labels["app.kubernetes.io/part-of"] != "mountmedic" {
					t.Errorf("%s %s has no label app.kubernetes.io/part-of=mountmedic: kubectl delete -l cannot find it", o.Kind, o.Metadata.Name)
				}
			}
			slices.Sort(kinds)
			want := slices.Clone(k.kinds)
			slices.Sort(want)
			if !slices.Equal(kinds, want) {
				t.Errorf("kubectl kustomize %s renders kinds %v, want %v", k.dir, kinds, want)
			}
		})
	}
}

// daemonSet renders the base and decodes its DaemonSet.
func daemonSet(t *testing.T) (*appsv1.DaemonSet, []object) {
	t.Helper()
	objs := kustomize(t, ".")
	var ds appsv1.DaemonSet
	if err := yaml.Unmarshal(find(t, objs, "DaemonSet", "mountmedic").raw, &ds); err != nil {
		t.Fatalf("decode DaemonSet: %v", err)
	}
	return &ds, objs
}

// flagValue returns the value of --name=value in args.
func flagValue(args []string, name string) (string, bool) {
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, "--"+name+"="); ok {
			return v, true
		}
	}
	return "", false
}

// TestDaemonSetFlagsExist checks every flag the DaemonSet passes against
// `mountmedic agent --help`, then runs the command with exactly those
// arguments so that the agent's own validation judges their values.
func TestDaemonSetFlagsExist(t *testing.T) {
	ds, _ := daemonSet(t)
	bin := buildMountmedic(t)
	help := string(run(t, ".", bin, "agent", "--help"))
	known := make(map[string]bool)
	for _, m := range regexp.MustCompile(`(?m)^\s+(?:-\w, )?--([a-z0-9-]+)`).FindAllStringSubmatch(help, -1) {
		known[m[1]] = true
	}
	if len(known) < 10 {
		t.Fatalf("found only %d flags in mountmedic agent --help:\n%s", len(known), help)
	}
	args := ds.Spec.Template.Spec.Containers[0].Args
	if len(args) == 0 || args[0] != "agent" {
		t.Fatalf("DaemonSet args = %q, want the agent command first", args)
	}
	for _, a := range args[1:] {
		name, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		switch {
		case !strings.HasPrefix(a, "--") || !strings.Contains(a, "="):
			t.Errorf("DaemonSet arg %q: write flags as --name=value", a)
		case !known[name]:
			t.Errorf("DaemonSet passes --%s, which mountmedic agent does not have (see mountmedic agent --help)", name)
		}
	}

	// The agent validates its configuration before it connects: with the
	// manifest's arguments, a node name and a kubeconfig that does not
	// exist, the only complaint must be about that kubeconfig.
	missing := filepath.Join(t.TempDir(), "no-such-kubeconfig")
	cmdArgs := append(slices.Clone(args), "--node-name=node-1", "--kubeconfig="+missing)
	out, err := exec.Command(bin, cmdArgs...).CombinedOutput()
	if err == nil {
		t.Fatalf("mountmedic %s succeeded without a kubeconfig:\n%s", strings.Join(cmdArgs, " "), out)
	}
	if !strings.Contains(string(out), missing) || strings.Count(strings.TrimSpace(string(out)), "\n") > 0 {
		t.Errorf("mountmedic %s: want one error naming the missing kubeconfig, got:\n%s", strings.Join(cmdArgs, " "), out)
	}
}

// TestDaemonSetShape checks what the agent relies on, across files: the
// paths its flags name are the ones mounted, the metrics port is the one
// probed and scraped.
func TestDaemonSetShape(t *testing.T) {
	ds, objs := daemonSet(t)
	pod := ds.Spec.Template.Spec
	c := pod.Containers[0]
	args := c.Args
	mount := func(path string) (corev1.VolumeMount, corev1.Volume, bool) {
		for _, m := range c.VolumeMounts {
			if m.MountPath == path || strings.HasPrefix(path, m.MountPath+"/") {
				for _, v := range pod.Volumes {
					if v.Name == m.Name {
						return m, v, true
					}
				}
			}
		}
		return corev1.VolumeMount{}, corev1.Volume{}, false
	}

	root, ok := flagValue(args, "kubelet-root")
	if !ok {
		root = "/var/lib/kubelet"
	}
	if m, v, ok := mount(root); !ok || m.MountPath != root || v.HostPath == nil || v.HostPath.Path != root {
		t.Errorf("--kubelet-root %s: want a hostPath volume of %s mounted at the same path, got mount %+v volume %+v", root, root, m, v)
	} else if m.MountPropagation == nil || *m.MountPropagation != corev1.MountPropagationBidirectional {
		t.Errorf("kubelet root mount propagation = %v, want Bidirectional (unmounts must reach the host)", m.MountPropagation)
	}
	if table, _ := flagValue(args, "host-table"); table == "/proc/1/mountinfo" && !pod.HostPID {
		t.Errorf("--host-table /proc/1/mountinfo needs hostPID: true (else PID 1 is the agent itself)")
	}
	if sock, ok := flagValue(args, "cri-socket"); ok {
		path := strings.TrimPrefix(sock, "unix://")
		if m, v, ok := mount(path); !ok || v.HostPath == nil || m.MountPath != filepath.Dir(path) {
			t.Errorf("--cri-socket %s: want its directory mounted from the host, got mount %+v volume %+v", sock, m, v)
		}
	}
	if c.SecurityContext == nil || c.SecurityContext.Privileged == nil || !*c.SecurityContext.Privileged {
		t.Errorf("container is not privileged: Bidirectional propagation is admitted only for privileged containers")
	}
	if !pod.HostPID {
		t.Errorf("hostPID is off: live swap opens /proc/<pid>/ns/mnt of container processes")
	}
	if pod.PriorityClassName != "system-node-critical" {
		t.Errorf("priorityClassName = %q, want system-node-critical", pod.PriorityClassName)
	}
	if !slices.ContainsFunc(pod.Tolerations, func(tl corev1.Toleration) bool {
		return tl.Key == "" && tl.Operator == corev1.TolerationOpExists && tl.Effect == ""
	}) {
		t.Errorf("tolerations %+v: want {operator: Exists} to run on every node whatever its taints", pod.Tolerations)
	}
	var nodeName bool
	for _, e := range c.Env {
		if e.Name == "NODE_NAME" && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "spec.nodeName" {
			nodeName = true
		}
	}
	if !nodeName {
		t.Errorf("no NODE_NAME from the downward API (fieldRef spec.nodeName)")
	}
	ru := ds.Spec.UpdateStrategy.RollingUpdate
	if ds.Spec.UpdateStrategy.Type != appsv1.RollingUpdateDaemonSetStrategyType || ru == nil || ru.MaxSurge == nil || ru.MaxSurge.IntValue() != 0 {
		t.Errorf("updateStrategy %+v: want RollingUpdate with maxSurge 0 (never two agents on a node)", ds.Spec.UpdateStrategy)
	}
	if c.Resources.Requests.Cpu().IsZero() || c.Resources.Requests.Memory().IsZero() || c.Resources.Limits.Memory().IsZero() {
		t.Errorf("resources %+v: want CPU and memory requests and a memory limit", c.Resources)
	}

	// Metrics: the flag's port is the container port named metrics, which
	// the probes, the Service and the PodMonitor use.
	addr, ok := flagValue(args, "metrics-addr")
	if !ok {
		t.Fatalf("no --metrics-addr in the DaemonSet args")
	}
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatalf("--metrics-addr %q: %v", addr, err)
	}
	var metricsPort int32
	for _, p := range c.Ports {
		if p.Name == "metrics" {
			metricsPort = p.ContainerPort
		}
	}
	if fmt.Sprint(metricsPort) != port {
		t.Errorf("container port metrics = %d, --metrics-addr port = %s: want them equal", metricsPort, port)
	}
	for name, pr := range map[string]*corev1.Probe{"/healthz": c.LivenessProbe, "/readyz": c.ReadinessProbe} {
		if pr == nil || pr.HTTPGet == nil || pr.HTTPGet.Path != name || pr.HTTPGet.Port != intstr.FromString("metrics") {
			t.Errorf("probe for %s = %+v, want an httpGet of %s on port metrics", name, pr, name)
		}
	}
	var svc corev1.Service
	if err := yaml.Unmarshal(find(t, objs, "Service", "mountmedic").raw, &svc); err != nil {
		t.Fatal(err)
	}
	tmpl := labelsSet(ds.Spec.Template.Labels)
	if !tmpl.matches(svc.Spec.Selector) || svc.Spec.Ports[0].TargetPort != intstr.FromString("metrics") {
		t.Errorf("Service selector %v / targetPort %v do not select the agents' metrics port", svc.Spec.Selector, svc.Spec.Ports[0].TargetPort)
	}
	var pm struct {
		Spec struct {
			Selector            metav1.LabelSelector `json:"selector"`
			PodMetricsEndpoints []struct {
				Port string `json:"port"`
			} `json:"podMetricsEndpoints"`
		} `json:"spec"`
	}
	if err := yaml.Unmarshal(find(t, kustomize(t, "prometheus"), "PodMonitor", "mountmedic").raw, &pm); err != nil {
		t.Fatal(err)
	}
	if !tmpl.matches(pm.Spec.Selector.MatchLabels) || pm.Spec.PodMetricsEndpoints[0].Port != "metrics" {
		t.Errorf("PodMonitor selector %v / port %q do not select the agents' metrics port", pm.Spec.Selector.MatchLabels, pm.Spec.PodMetricsEndpoints[0].Port)
	}
}

type labelsSet map[string]string

func (l labelsSet) matches(sel map[string]string) bool {
	if len(sel) == 0 {
		return false
	}
	for k, v := range sel {
		if l[k] != v {
			return false
		}
	}
	return true
}

// prometheusOperator is the Prometheus Operator release whose CRDs
// (PodMonitor, PrometheusRule) the server-side dry run validates against;
// its Go module zip carries them in example/prometheus-operator-crd.
const prometheusOperator = "github.com/prometheus-operator/prometheus-operator@v0.80.1"

// operatorCRDs downloads the operator's module through the Go module proxy
// (cached in the module cache) and returns its CRD directory.
func operatorCRDs(t *testing.T) string {
	t.Helper()
	cmd := exec.Command("go", "mod", "download", "-json", prometheusOperator)
	cmd.Dir = t.TempDir() // outside the project's module: go.mod stays untouched
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go mod download %s: %v\n%s", prometheusOperator, err, out)
	}
	var mod struct{ Dir, Error string }
	if err := json.Unmarshal(out, &mod); err != nil || mod.Dir == "" {
		t.Fatalf("go mod download %s: %v %s\n%s", prometheusOperator, err, mod.Error, out)
	}
	return filepath.Join(mod.Dir, "example", "prometheus-operator-crd")
}

// TestApplyServerDryRun applies every kustomization to a real
// kube-apiserver with --dry-run=server (admission, schema validation of the
// Prometheus Operator CRs against the operator's CRDs), then for real, and
// checks the ServiceAccount's permissions with SubjectAccessReviews.
func TestApplyServerDryRun(t *testing.T) {
	kc := kubectl(t)
	crds := operatorCRDs(t)
	c := kubetest.Start(t, kubetest.Options{})
	k := func(args ...string) string {
		t.Helper()
		return string(run(t, ".", kc, append([]string{"--kubeconfig=" + c.Kubeconfig}, args...)...))
	}
	for _, crd := range []string{"podmonitors", "prometheusrules"} {
		k("apply", "--server-side", "-f", filepath.Join(crds, "monitoring.coreos.com_"+crd+".yaml"))
		k("wait", "--for=condition=Established", "--timeout=60s", "crd/"+crd+".monitoring.coreos.com")
	}
	// The Namespace must exist before a dry run of objects in it can pass:
	// a server-side dry run creates nothing.
	k("apply", "-f", "namespace.yaml")
	for _, kz := range kustomizations {
		out := k("apply", "-k", kz.dir, "--dry-run=server")
		for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
			if !strings.HasSuffix(line, "(server dry run)") {
				t.Errorf("kubectl apply -k %s --dry-run=server: %q", kz.dir, line)
			}
		}
		if n := strings.Count(out, "(server dry run)"); n != len(kustomize(t, kz.dir)) {
			t.Errorf("kubectl apply -k %s --dry-run=server applied %d objects, want %d:\n%s", kz.dir, n, len(kustomize(t, kz.dir)), out)
		}
	}
	for _, kz := range kustomizations {
		k("apply", "-k", kz.dir)
	}
	ds, err := c.Client.AppsV1().DaemonSets("mountmedic").Get(context.Background(), "mountmedic", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("DaemonSet after apply: %v", err)
	}
	if got := ds.Spec.Template.Spec.Containers[0].Image; got != "mountmedic:dev" {
		t.Errorf("DaemonSet image = %q, want mountmedic:dev (the kustomization's images entry)", got)
	}
	checkAccess(t, c)
}

// checkAccess asks the API server what the agent's ServiceAccount may do:
// what the agent needs must be allowed, the rest denied.
func checkAccess(t *testing.T, c *kubetest.Cluster) {
	t.Helper()
	const user = "system:serviceaccount:mountmedic:mountmedic"
	type ra = authorizationv1.ResourceAttributes
	for _, tc := range []struct {
		name  string
		attrs ra
		allow bool
	}{
		{"watch pods", ra{Verb: "watch", Resource: "pods"}, true},
		{"list pods", ra{Verb: "list", Resource: "pods"}, true},
		{"get pod", ra{Verb: "get", Resource: "pods", Namespace: "apps"}, true},
		{"evict pod", ra{Verb: "create", Resource: "pods", Subresource: "eviction", Namespace: "apps"}, true},
		{"delete pod (opt-in tiers)", ra{Verb: "delete", Resource: "pods", Namespace: "apps"}, true},
		{"create events", ra{Verb: "create", Group: "events.k8s.io", Resource: "events", Namespace: "apps"}, true},
		{"patch events", ra{Verb: "patch", Group: "events.k8s.io", Resource: "events", Namespace: "apps"}, true},
		{"get pv", ra{Verb: "get", Resource: "persistentvolumes"}, true},
		{"get pvc", ra{Verb: "get", Resource: "persistentvolumeclaims", Namespace: "apps"}, true},
		{"get csidriver", ra{Verb: "get", Group: "storage.k8s.io", Resource: "csidrivers"}, true},
		{"list volumeattachments", ra{Verb: "list", Group: "storage.k8s.io", Resource: "volumeattachments"}, true},
		{"get secret", ra{Verb: "get", Resource: "secrets", Namespace: "apps"}, true},
		{"mint token (csi-token-requests applied)", ra{Verb: "create", Resource: "serviceaccounts", Subresource: "token", Namespace: "apps"}, true},
		{"patch node (failover taint)", ra{Verb: "patch", Resource: "nodes"}, true},
		{"update own lease", ra{Verb: "update", Group: "coordination.k8s.io", Resource: "leases", Namespace: "mountmedic"}, true},

		{"list secrets", ra{Verb: "list", Resource: "secrets", Namespace: "apps"}, false},
		{"watch secrets", ra{Verb: "watch", Resource: "secrets"}, false},
		{"create pods", ra{Verb: "create", Resource: "pods", Namespace: "apps"}, false},
		{"update pods", ra{Verb: "update", Resource: "pods", Namespace: "apps"}, false},
		{"exec into pods", ra{Verb: "create", Resource: "pods", Subresource: "exec", Namespace: "apps"}, false},
		{"update pv", ra{Verb: "update", Resource: "persistentvolumes"}, false},
		{"list pv", ra{Verb: "list", Resource: "persistentvolumes"}, false},
		{"delete nodes", ra{Verb: "delete", Resource: "nodes"}, false},
		{"update nodes", ra{Verb: "update", Resource: "nodes"}, false},
		{"leases elsewhere", ra{Verb: "update", Group: "coordination.k8s.io", Resource: "leases", Namespace: "kube-node-lease"}, false},
		{"delete leases", ra{Verb: "delete", Group: "coordination.k8s.io", Resource: "leases", Namespace: "mountmedic"}, false},
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

// readFile reads a file of deploy/.
func readFile(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestReadmeCoversFlagsAndMetrics: README.md's configuration table names
// every flag of `mountmedic agent`, and its metrics table every mountmedic
// metric of the real agent's capture.
func TestReadmeCoversFlagsAndMetrics(t *testing.T) {
	readme := string(readFile(t, "README.md"))
	help := string(run(t, ".", buildMountmedic(t), "agent", "--help"))
	flags, _, _ := strings.Cut(help, "Global Flags:")
	for _, m := range regexp.MustCompile(`(?m)^\s+(?:-\w, )?--([a-z0-9-]+)`).FindAllStringSubmatch(flags, -1) {
		if m[1] != "help" && !strings.Contains(readme, "| `--"+m[1]+"` |") {
			t.Errorf("README.md's configuration table has no row for --%s", m[1])
		}
	}
	for name := range shape(t, readFile(t, metricsCapture)) {
		if strings.HasPrefix(name, "mountmedic_") && !strings.Contains(readme, "| `"+name+"` |") {
			t.Errorf("README.md's metrics table has no row for %s", name)
		}
	}
}
