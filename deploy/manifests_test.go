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
	"strconv"
	"strings"
	"testing"
	"time"

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
	{".", []string{"Namespace", "ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding", "DaemonSet", "Service",
		"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding", "FlowSchema", "PriorityLevelConfiguration", "NetworkPolicy"}},
	{"prometheus", []string{"PodMonitor", "PrometheusRule"}},
	{"grafana", []string{"ConfigMap"}},
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
	return decodeDaemonSet(t, objs), objs
}

// decodeDaemonSet decodes the mountmedic DaemonSet among rendered objects.
func decodeDaemonSet(t *testing.T, objs []object) *appsv1.DaemonSet {
	t.Helper()
	var ds appsv1.DaemonSet
	if err := yaml.Unmarshal(find(t, objs, "DaemonSet", "mountmedic").raw, &ds); err != nil {
		t.Fatalf("decode DaemonSet: %v", err)
	}
	return &ds
}

// checkAgentArgs runs `mountmedic` with a DaemonSet's args, a node name and
// a node kubeconfig that does not exist. The agent validates its configuration
// before it connects, so the only complaint must be about that kubeconfig:
// the agent's own validation judges the args' values.
func checkAgentArgs(t *testing.T, bin string, args []string) {
	t.Helper()
	missing := filepath.Join(t.TempDir(), "no-such-kubeconfig")
	// The identity's credentials: the kubelet's kubeconfig, or the
	// ServiceAccount's (outside a pod, a kubeconfig).
	credentials := "--node-kubeconfig="
	if id, _ := flagValue(args, "identity"); id == "serviceaccount" {
		credentials = "--kubeconfig="
	}
	cmdArgs := append(slices.Clone(args), "--node-name=node-1", credentials+missing)
	out, err := exec.Command(bin, cmdArgs...).CombinedOutput()
	if err == nil || !strings.Contains(string(out), missing) || strings.Count(strings.TrimSpace(string(out)), "\n") > 0 {
		t.Errorf("mountmedic %s: want one error naming the missing kubeconfig, got %v:\n%s", strings.Join(cmdArgs, " "), err, out)
	}
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
	checkAgentArgs(t, bin, args)
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
		want := len(kustomize(t, kz.dir))
		out := k("apply", "-k", kz.dir, "--dry-run=server")
		for _, line := range strings.Split(strings.TrimSpace(out), "\n") {
			if !strings.HasSuffix(line, "(server dry run)") {
				t.Errorf("kubectl apply -k %s --dry-run=server: %q", kz.dir, line)
			}
		}
		if n := strings.Count(out, "(server dry run)"); n != want {
			t.Errorf("kubectl apply -k %s --dry-run=server applied %d objects, want %d:\n%s", kz.dir, n, want, out)
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
	applyController(t, c, k)
}

// checkAccess asks the API server what the agent's ServiceAccount may do:
// the heartbeat Lease in its namespace and events list, nothing else. The agent's other API
// calls go with its node's identity, which TestNodeBlastRadius judges with
// real requests. The in-agent failover leader's binding is deleted first:
// that cluster-wide duty moves to its own ServiceAccount (mountmedic
// controller).
func checkAccess(t *testing.T, c *kubetest.Cluster) {
	t.Helper()
	const user = "system:serviceaccount:mountmedic:mountmedic"
	type ra = authorizationv1.ResourceAttributes
	lease := func(verb, ns string) ra {
		return ra{Verb: verb, Group: "coordination.k8s.io", Resource: "leases", Namespace: ns}
	}
	for _, tc := range []struct {
		name  string
		attrs ra
		allow bool
	}{
		{"get leases", lease("get", "mountmedic"), true},
		{"list leases", lease("list", "mountmedic"), true},
		{"create a lease (its node's: the policy)", lease("create", "mountmedic"), true},
		{"update a lease (its node's: the policy)", lease("update", "mountmedic"), true},
		// The failover controller's grants are its own ServiceAccount's
		// (deploy/controller/): none reaches other nodes from an agent.
		{"patch node (failover taint)", ra{Verb: "patch", Resource: "nodes"}, false},
		{"read kubelet leases", ra{Verb: "list", Group: "coordination.k8s.io", Resource: "leases", Namespace: "kube-node-lease"}, false},

		{"delete leases", lease("delete", "mountmedic"), false},
		{"patch leases", lease("patch", "mountmedic"), false},
		{"watch leases", lease("watch", "mountmedic"), false},
		{"leases elsewhere", lease("update", "kube-node-lease"), false},
		// The eviction budget's rebuild (agent/budgetevents.go).
		{"list events", ra{Verb: "list", Resource: "events"}, true},
		{"create events", ra{Verb: "create", Resource: "events", Namespace: "default"}, false},
		{"watch pods", ra{Verb: "watch", Resource: "pods"}, false},
		{"list pods", ra{Verb: "list", Resource: "pods"}, false},
		{"get pod", ra{Verb: "get", Resource: "pods", Namespace: "apps"}, false},
		{"evict pod", ra{Verb: "create", Resource: "pods", Subresource: "eviction", Namespace: "apps"}, false},
		{"delete pod", ra{Verb: "delete", Resource: "pods", Namespace: "apps"}, false},
		{"create events", ra{Verb: "create", Group: "events.k8s.io", Resource: "events", Namespace: "apps"}, false},
		{"get pv", ra{Verb: "get", Resource: "persistentvolumes"}, false},
		{"get pvc", ra{Verb: "get", Resource: "persistentvolumeclaims", Namespace: "apps"}, false},
		{"get csidriver", ra{Verb: "get", Group: "storage.k8s.io", Resource: "csidrivers"}, false},
		{"list volumeattachments", ra{Verb: "list", Group: "storage.k8s.io", Resource: "volumeattachments"}, false},
		{"delete volumeattachments", ra{Verb: "delete", Group: "storage.k8s.io", Resource: "volumeattachments"}, false},
		{"get secret", ra{Verb: "get", Resource: "secrets", Namespace: "apps"}, false},
		{"get secret in its namespace", ra{Verb: "get", Resource: "secrets", Namespace: "mountmedic"}, false},
		{"list secrets", ra{Verb: "list", Resource: "secrets", Namespace: "apps"}, false},
		{"mint token", ra{Verb: "create", Resource: "serviceaccounts", Subresource: "token", Namespace: "apps"}, false},
		{"patch node", ra{Verb: "patch", Resource: "nodes"}, false},
		{"delete nodes", ra{Verb: "delete", Resource: "nodes"}, false},
		{"create pods", ra{Verb: "create", Resource: "pods", Namespace: "mountmedic"}, false},
		{"exec into pods", ra{Verb: "create", Resource: "pods", Subresource: "exec", Namespace: "mountmedic"}, false},
		{"escalate", ra{Verb: "create", Group: "rbac.authorization.k8s.io", Resource: "clusterrolebindings"}, false},
		{"change the lease policy", ra{Verb: "update", Group: "admissionregistration.k8s.io", Resource: "validatingadmissionpolicies"}, false},
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

// configurationDoc is the page that holds the flag and metrics tables, the
// only place they are written.
const configurationDoc = "../docs/configuration.md"

// installDoc is the page that holds the failover overlays.
const installDoc = "../docs/install.md"

// TestConfigurationDocCoversFlagsAndMetrics: docs/configuration.md's agent
// flag tables name every flag of `mountmedic agent` and no other, each
// default written as a literal value is the one the command prints, and the
// metrics table names every mountmedic metric of the real agent's and
// controller's captures.
func TestConfigurationDocCoversFlagsAndMetrics(t *testing.T) {
	checkDocFlags(t, "agent", 30)
	_, doc := controllerFlagTable(t, string(readFile(t, configurationDoc)))
	for _, capture := range []string{metricsCapture, controllerCapture} {
		for name := range shape(t, readFile(t, capture)) {
			if strings.HasPrefix(name, "mountmedic_") && !strings.Contains(doc, "| `"+name+"` |") {
				t.Errorf("%s: the metrics table has no row for %s (%s)", configurationDoc, name, capture)
			}
		}
	}
}

// checkDocFlags checks docs/configuration.md's flag rows for command (the
// controller's table, or the agent's tables: the rest of the page) against
// `mountmedic <command> --help` (at least min flags): a row for every flag
// and for no other, and each default written as a literal value the one it
// prints. With -update it rewrites the page to agree: a missing flag gets a
// row (its --help usage as the description, to be reworded), a stale row
// goes, a wrong default takes --help's.
func checkDocFlags(t *testing.T, command string, min int) {
	t.Helper()
	help := string(run(t, ".", buildMountmedic(t), command, "--help"))
	flags, _, _ := strings.Cut(help, "Global Flags:")
	defaults := helpDefaults(flags)
	if len(defaults) < min {
		t.Fatalf("found only %d flags in mountmedic %s --help:\n%s", len(defaults), command, flags)
	}
	doc := string(readFile(t, configurationDoc))
	table, rest := controllerFlagTable(t, doc)
	if command != "controller" {
		table = rest
	}
	rows := docFlagRows(table)
	report := t.Errorf
	if *update {
		report = t.Logf
	}
	var fixes []flagFix
	for name := range rows {
		if _, ok := defaults[name]; !ok {
			fixes = append(fixes, flagFix{name: name, stale: true})
			report("%s has a row for --%s, which mountmedic %s --help does not list: remove the row or fix its name", configurationDoc, name, command)
		}
	}
	for name, def := range defaults {
		if name == "help" {
			continue
		}
		cell, ok := rows[name]
		if !ok {
			fixes = append(fixes, flagFix{name: name, def: def})
			report("%s's flag tables have no row for the %s's --%s", configurationDoc, command, name)
			continue
		}
		lit, ok := strings.CutPrefix(cell, "`")
		lit, ok2 := strings.CutSuffix(lit, "`")
		if !ok || !ok2 || strings.ContainsAny(lit, "`$") {
			continue // a description such as (all) or `$NODE_NAME`, else ...
		}
		if !sameDefault(lit, def) {
			fixes = append(fixes, flagFix{name: name, def: def, present: true})
			report("%s says --%s defaults to %q; mountmedic %s --help says %q", configurationDoc, name, lit, command, def.value)
		}
	}
	if *update && len(fixes) > 0 {
		if err := os.WriteFile(configurationDoc, []byte(fixDocFlags(doc, command == "controller", fixes)), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("rewrote %s: %d flag rows; check the wording of new rows", configurationDoc, len(fixes))
	}
}

// flagFix is one change -update makes to a flag table: a stale row to
// remove, a row to add, or (present) a default cell to replace.
type flagFix struct {
	name           string
	def            flagDefault
	stale, present bool
}

// cell is the default cell --help's default is written as.
func (d flagDefault) cell() string {
	switch {
	case d.value == "" && d.typ == "":
		return "`false`"
	case d.value == "":
		return "(none)"
	}
	v := d.value
	if u, err := strconv.Unquote(v); err == nil {
		v = u
	}
	return "`" + v + "`"
}

// fixDocFlags applies fixes to the rows of the controller's table
// (controller) or of the agent's tables. A new row goes at the end of its
// table: the controller's, the agent's failover table for --failover-*,
// else the agent's first table.
func fixDocFlags(doc string, controller bool, fixes []flagFix) string {
	lines := strings.Split(doc, "\n")
	byName := make(map[string]flagFix)
	for _, f := range fixes {
		byName[f.name] = f
	}
	row := regexp.MustCompile("^\\| `--([a-z0-9-]+)` \\| ([^|]*) \\|")
	var out []string
	inController, heading := false, ""
	lastRow := make(map[string]int) // table -> index in out of its last row
	for _, l := range lines {
		switch {
		case strings.HasPrefix(l, controllerTableStart):
			inController = true
		case strings.HasPrefix(l, controllerTableEnd):
			inController = false
		case strings.HasPrefix(l, "## "):
			heading = l
		}
		if m := row.FindStringSubmatch(l); m != nil && inController == controller {
			table := "agent"
			switch {
			case controller:
				table = "controller"
			case strings.Contains(heading, "Failover"):
				table = "failover"
			}
			if f, ok := byName[m[1]]; ok {
				if f.stale {
					continue
				}
				l = strings.Replace(l, "| "+m[2]+" |", "| "+f.def.cell()+" |", 1)
			}
			out = append(out, l)
			lastRow[table] = len(out) - 1
			continue
		}
		out = append(out, l)
	}
	// Insert new rows from the bottom up, so indexes stay valid.
	add := make(map[int][]string)
	for _, f := range fixes {
		if f.stale || f.present {
			continue
		}
		table := "agent"
		switch {
		case controller:
			table = "controller"
		case strings.HasPrefix(f.name, "failover"):
			table = "failover"
		}
		i := lastRow[table]
		add[i] = append(add[i], "| `--"+f.name+"` | "+f.def.cell()+" | "+f.def.usage+" |")
	}
	for i := len(out) - 1; i >= 0; i-- {
		if rows, ok := add[i]; ok {
			slices.Sort(rows)
			out = slices.Insert(out, i+1, rows...)
		}
	}
	return strings.Join(out, "\n")
}

// flagDefault is a flag's type, the default --help prints ("" when it
// prints none: the zero value) and its usage text.
type flagDefault struct{ typ, value, usage string }

// helpDefaults parses the flag lines of a cobra --help.
func helpDefaults(flags string) map[string]flagDefault {
	line := regexp.MustCompile(`^\s+(?:-\w, )?--([a-z0-9-]+)(?: ([a-zA-Z]+))?\s+(.*)$`)
	out := make(map[string]flagDefault)
	for _, l := range strings.Split(flags, "\n") {
		m := line.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		d := flagDefault{typ: m[2], usage: strings.TrimSpace(m[3])}
		if i := strings.LastIndex(m[3], "(default "); i >= 0 && strings.HasSuffix(m[3], ")") {
			d.value = strings.TrimSuffix(m[3][i+len("(default "):], ")")
			d.usage = strings.TrimSpace(m[3][:i])
		}
		out[m[1]] = d
	}
	return out
}

// docFlagRows maps each flag of a doc's flag tables to its default cell.
func docFlagRows(doc string) map[string]string {
	out := make(map[string]string)
	for _, m := range regexp.MustCompile("(?m)^\\| `--([a-z0-9-]+)` \\| ([^|]*) \\|").FindAllStringSubmatch(doc, -1) {
		out[m[1]] = strings.TrimSpace(m[2])
	}
	return out
}

// sameDefault compares a doc's literal with what --help printed.
func sameDefault(lit string, d flagDefault) bool {
	v := d.value
	if u, err := strconv.Unquote(v); err == nil {
		v = u
	}
	v = strings.TrimSuffix(strings.TrimPrefix(v, "["), "]")
	switch {
	case d.value == "" && d.typ == "":
		return lit == "false" // a bool that is false
	case d.value == "":
		return lit == "0" || lit == ""
	case d.typ == "duration":
		a, err1 := time.ParseDuration(lit)
		b, err2 := time.ParseDuration(v)
		return err1 == nil && err2 == nil && a == b
	}
	return lit == v
}

// docBlock returns the fenced code block of docs/install.md whose first
// line is first.
func docBlock(t *testing.T, first string) string {
	t.Helper()
	doc := string(readFile(t, installDoc))
	_, after, ok := strings.Cut(doc, "```yaml\n"+first+"\n")
	if !ok {
		t.Fatalf("%s has no yaml block starting with %q", installDoc, first)
	}
	block, _, ok := strings.Cut(after, "```")
	if !ok {
		t.Fatalf("%s: the block starting with %q does not end", installDoc, first)
	}
	return first + "\n" + block
}

// renderOverlay writes a documented overlay as overlays/<name>/kustomization.yaml
// beside a link to deploy/ (its resources: [../../deploy]) and renders it.
func renderOverlay(t *testing.T, name, kustomization string) []object {
	t.Helper()
	return decodeAll(t, run(t, ".", kubectl(t), "kustomize", overlayDir(t, name, kustomization)))
}

// overlayDir writes an overlay as overlays/<name>/kustomization.yaml beside
// a link to deploy/ and returns its directory.
func overlayDir(t *testing.T, name, kustomization string) string {
	t.Helper()
	root := t.TempDir()
	abs, err := filepath.Abs(".")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(abs, filepath.Join(root, "deploy")); err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(root, "overlays", name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "kustomization.yaml"), []byte(kustomization), 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestInstallDocFailoverOverlays renders the overlays docs/install.md gives for the
// failover duty: the one that turns it on with the controller Component
// (then the agent's own validation judges the DaemonSet's arguments, as
// TestDaemonSetFlagsExist does for the base), and the one that removes the
// agents' heartbeat RBAC.
func TestInstallDocFailoverOverlays(t *testing.T) {
	base := kustomize(t, ".")
	on := renderOverlay(t, "failover", docBlock(t, "# overlays/failover/kustomization.yaml"))
	args := decodeDaemonSet(t, on).Spec.Template.Spec.Containers[0].Args
	baseDS := decodeDaemonSet(t, base)
	if want := append(slices.Clone(baseDS.Spec.Template.Spec.Containers[0].Args), "--failover", "--failover-dry-run"); !slices.Equal(args, want) {
		t.Errorf("failover overlay DaemonSet args = %q, want %q", args, want)
	}
	ctl := decodeController(t, on).Spec.Template.Spec.Containers[0].Args
	plain := decodeController(t, renderOverlay(t, "controller", controllerOverlay)).Spec.Template.Spec.Containers[0].Args
	if want := append(slices.Clone(plain), "--failover-dry-run"); !slices.Equal(ctl, want) {
		t.Errorf("failover overlay controller args = %q, want %q", ctl, want)
	}
	if want := len(renderOverlay(t, "controller", controllerOverlay)); len(on) != want {
		t.Errorf("failover overlay renders %d objects, the base with the controller %d", len(on), want)
	}
	checkAgentArgs(t, buildMountmedic(t), args)

	off := renderOverlay(t, "no-failover-rbac", docBlock(t, "# overlays/no-failover-rbac/kustomization.yaml"))
	gone := map[string]bool{"RoleBinding/mountmedic": true}
	kept := make(map[string]bool)
	for _, o := range off {
		kept[o.Kind+"/"+o.Metadata.Name] = true
	}
	for _, o := range base {
		key := o.Kind + "/" + o.Metadata.Name
		if kept[key] == gone[key] {
			t.Errorf("no-failover-rbac overlay: %s present = %v, want %v", key, kept[key], !gone[key])
		}
	}
}
