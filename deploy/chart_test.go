package deploy_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/mountmedic/mountmedic/scripts/kubetest"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// The Helm chart (deploy/chart/mountmedic) is generated from the kustomize
// base and its optional parts, so the two cannot drift: each part's render
// becomes one template file, with the knobs of values.yaml put in place of
// the fields they set (image, the agent's extra flags, resources, node
// selection, the namespace). `go test ./deploy -run TestChart -update`
// rewrites the templates; without -update, TestChartInSync fails when they
// differ from what the kustomizations render now.

const chartDir = "chart/mountmedic"

// chartParts are the kustomizations the chart is made of, the template
// each becomes and the value that turns it on (none: always).
var chartParts = []struct{ dir, file, enable string }{
	{".", "agent.yaml", ""},
	// A kustomize Component: what the base plus it renders beyond the base.
	{"controller", "controller.yaml", "controller.enabled"},
	{"prometheus", "prometheus.yaml", "prometheus.enabled"},
	{"grafana", "grafana.yaml", "grafana.enabled"},
}

// renderPart renders one chart part: a kustomization, or for the controller
// Component, the objects the base with it adds to the base.
func renderPart(t *testing.T, dir string) []object {
	t.Helper()
	if dir != "controller" {
		return kustomize(t, dir)
	}
	base := map[string]bool{}
	for _, o := range kustomize(t, ".") {
		base[objKey(o)] = true
	}
	var out []object
	for _, o := range renderOverlay(t, "controller", controllerOverlay) {
		if !base[objKey(o)] {
			out = append(out, o)
		}
	}
	return out
}

// The namespace every kustomization installs into: in the chart, the
// release's.
const baseNamespace = "mountmedic"

// Markers put into the decoded objects and replaced by template text once
// they are YAML again.
const (
	markNS = "@@NS@@"
)

func markBlock(valuesPath string) string { return "@@B:" + valuesPath + "@@" }
func markQuote(expr string) string       { return "@@Q:" + expr + "@@" }
func markAppend(include string) string   { return "@@A:" + include + "@@" }
func markRaw(expr string) string         { return "@@R:" + expr + "@@" }

var (
	reBlock  = regexp.MustCompile(`(?m)^( *)([A-Za-z]+): '@@B:([A-Za-z.]+)@@'$`)
	reQuote  = regexp.MustCompile(`'@@Q:([^@]+)@@'`)
	reAppend = regexp.MustCompile(`(?m)^( *)- '@@A:([A-Za-z.]+)@@'$`)
	reRaw    = regexp.MustCompile(`'@@R:([^@]+)@@'`)
)

// chartTemplate turns one kustomization's objects into template text.
func chartTemplate(t *testing.T, objs []object, enable string) []byte {
	t.Helper()
	var b bytes.Buffer
	b.WriteString("# Generated from deploy/ by `go test ./deploy -run TestChart -update`. Do not edit.\n")
	if enable != "" {
		fmt.Fprintf(&b, "{{- if .Values.%s }}\n", enable)
	}
	for _, o := range objs {
		if o.Kind == "Namespace" {
			continue // helm install -n NS --create-namespace
		}
		var m map[string]any
		if err := yaml.Unmarshal(o.raw, &m); err != nil {
			t.Fatalf("decode %s %s: %v", o.Kind, o.Metadata.Name, err)
		}
		m = markNamespace(m).(map[string]any)
		if o.Kind == "DaemonSet" && o.Metadata.Name == "mountmedic" {
			markAgent(t, m)
		}
		if o.Kind == "Deployment" && o.Metadata.Name == "mountmedic-controller" {
			markController(t, m)
		}
		out, err := yaml.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		b.WriteString("---\n")
		b.WriteString(escapeTemplate(string(out)))
	}
	if enable != "" {
		b.WriteString("{{- end }}\n")
	}
	s := b.String()
	s = reBlock.ReplaceAllStringFunc(s, func(line string) string {
		g := reBlock.FindStringSubmatch(line)
		return fmt.Sprintf("%s%s:\n%s  {{- toYaml .Values.%s | nindent %d }}", g[1], g[2], g[1], g[3], len(g[1])+2)
	})
	s = reAppend.ReplaceAllStringFunc(s, func(line string) string {
		g := reAppend.FindStringSubmatch(line)
		return fmt.Sprintf("%s{{- include %q . | nindent %d }}", g[1], g[2], len(g[1]))
	})
	s = reQuote.ReplaceAllString(s, "{{ $1 | quote }}")
	s = reRaw.ReplaceAllString(s, "{{ $1 }}")
	s = strings.ReplaceAll(s, markNS, "{{ .Release.Namespace }}")
	if strings.Contains(s, "@@") {
		t.Fatalf("a marker was left in the template (a field shape the generator does not know):\n%s", s)
	}
	return []byte(s)
}

// escapeTemplate makes the braces the manifests carry for Prometheus and
// Grafana ({{ $labels.node }}) literal text for Helm's template engine.
func escapeTemplate(s string) string {
	s = strings.ReplaceAll(s, "{{", "\x00L")
	s = strings.ReplaceAll(s, "}}", "\x00R")
	s = strings.ReplaceAll(s, "\x00L", `{{ "{{" }}`)
	return strings.ReplaceAll(s, "\x00R", `{{ "}}" }}`)
}

// markNamespace replaces the base namespace where a field names it: a
// metadata or subject namespace, a PodMonitor's namespaceSelector, a
// FlowSchema rule's namespaces, and a
// ServiceAccount user name (system:serviceaccount:NS:NAME) in a string.
func markNamespace(v any) any {
	switch x := v.(type) {
	case map[string]any:
		for k, e := range x {
			switch {
			case k == "namespace" && e == baseNamespace:
				x[k] = markNS
			case k == "matchNames" || k == "namespaces":
				if l, ok := e.([]any); ok {
					for i := range l {
						if l[i] == baseNamespace {
							l[i] = markNS
						}
					}
				}
			default:
				x[k] = markNamespace(e)
			}
		}
		return x
	case []any:
		for i := range x {
			x[i] = markNamespace(x[i])
		}
		return x
	case string:
		return strings.ReplaceAll(x, "system:serviceaccount:"+baseNamespace+":", "system:serviceaccount:"+markNS+":")
	}
	return v
}

// markAgent puts the agent's knobs into the DaemonSet.
func markAgent(t *testing.T, ds map[string]any) {
	t.Helper()
	spec := dig(t, ds, "spec", "template", "spec")
	spec["nodeSelector"] = markBlock("agent.nodeSelector")
	spec["tolerations"] = markBlock("agent.tolerations")
	containers, _ := spec["containers"].([]any)
	for _, c := range containers {
		c := c.(map[string]any)
		if c["name"] != "agent" {
			continue
		}
		c["image"] = markQuote(`include "mountmedic.image" .`)
		c["imagePullPolicy"] = markQuote(".Values.image.pullPolicy")
		c["resources"] = markBlock("agent.resources")
		args, _ := c["args"].([]any)
		c["args"] = append(args, markAppend("mountmedic.agentArgs"))
		return
	}
	t.Fatal("the DaemonSet has no container named agent")
}

// markController puts the controller's knobs into its Deployment.
func markController(t *testing.T, d map[string]any) {
	t.Helper()
	dig(t, d, "spec")["replicas"] = markRaw(".Values.controller.replicas")
	containers, _ := dig(t, d, "spec", "template", "spec")["containers"].([]any)
	for _, c := range containers {
		c := c.(map[string]any)
		c["image"] = markQuote(`include "mountmedic.image" .`)
		c["imagePullPolicy"] = markQuote(".Values.image.pullPolicy")
		c["resources"] = markBlock("controller.resources")
		args, _ := c["args"].([]any)
		c["args"] = append(args, markAppend("mountmedic.controllerArgs"))
	}
}

func dig(t *testing.T, m map[string]any, path ...string) map[string]any {
	t.Helper()
	for _, p := range path {
		n, ok := m[p].(map[string]any)
		if !ok {
			t.Fatalf("no %s in the object (path %v)", p, path)
		}
		m = n
	}
	return m
}

// chartTemplates renders every part and returns file name -> content.
func chartTemplates(t *testing.T) map[string][]byte {
	t.Helper()
	files := map[string][]byte{}
	for _, p := range chartParts {
		files[p.file] = chartTemplate(t, renderPart(t, p.dir), p.enable)
	}
	return files
}

func TestChartInSync(t *testing.T) {
	files := chartTemplates(t)
	dir := filepath.Join(chartDir, "templates")
	if *update {
		for name, data := range files {
			if err := os.WriteFile(filepath.Join(dir, name), data, 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	for name, want := range files {
		got, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil || !bytes.Equal(got, want) {
			t.Errorf("%s/%s differs from what deploy/%s renders now (err %v): run `go test ./deploy -run TestChart -update` and commit it", dir, name, partOf(name), err)
		}
	}
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if _, ok := files[e.Name()]; !ok && e.Name() != "_helpers.tpl" && e.Name() != "NOTES.txt" {
			t.Errorf("%s/%s is generated from no kustomization: remove it", dir, e.Name())
		}
	}
}

func partOf(file string) string {
	for _, p := range chartParts {
		if p.file == file {
			return p.dir
		}
	}
	return "?"
}

// kubeVersion is the Kubernetes version offline renders assume: the one the
// tests' kube-apiserver runs (a helm built from source defaults to v1.20).
const kubeVersion = "v1.37.1"

// helmTemplate renders the chart with the pinned helm.
func helmTemplate(t *testing.T, namespace string, set ...string) []object {
	t.Helper()
	args := []string{"template", "mountmedic", chartDir, "--namespace", namespace, "--kube-version", kubeVersion}
	for _, s := range set {
		args = append(args, "--set", s)
	}
	return decodeAll(t, run(t, ".", lab.RequireTool(t, "helm"), args...))
}

// normalize decodes an object into plain JSON values for comparison.
func normalize(t *testing.T, o object) any {
	t.Helper()
	var v any
	if err := yaml.Unmarshal(o.raw, &v); err != nil {
		t.Fatal(err)
	}
	// Through JSON, so that numbers and empty values compare alike.
	data, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var n any
	if err := json.Unmarshal(data, &n); err != nil {
		t.Fatal(err)
	}
	return n
}

func objKey(o object) string {
	return o.Kind + " " + o.Metadata.Namespace + "/" + o.Metadata.Name
}

// TestChartRendersTheBase compares the chart's render with every part on
// and the kustomizations' renders, object by object.
func TestChartRendersTheBase(t *testing.T) {
	for _, all := range []bool{false, true} {
		t.Run(fmt.Sprintf("optional parts %v", all), func(t *testing.T) {
			want := map[string]any{}
			var set []string
			for _, p := range chartParts {
				if p.enable != "" && !all {
					continue
				}
				if p.enable != "" {
					set = append(set, p.enable+"=true")
				}
				for _, o := range renderPart(t, p.dir) {
					if o.Kind != "Namespace" {
						want[objKey(o)] = normalize(t, o)
					}
				}
			}
			got := map[string]any{}
			for _, o := range helmTemplate(t, baseNamespace, set...) {
				got[objKey(o)] = normalize(t, o)
			}
			for k, w := range want {
				g, ok := got[k]
				switch {
				case !ok:
					t.Errorf("the chart does not render %s", k)
				case !reflect.DeepEqual(g, w):
					gj, _ := json.MarshalIndent(g, "", " ")
					wj, _ := json.MarshalIndent(w, "", " ")
					t.Errorf("the chart renders %s differently from the kustomization:\nchart: %s\nkustomize: %s", k, gj, wj)
				}
			}
			for k := range got {
				if _, ok := want[k]; !ok {
					t.Errorf("the chart renders %s, which no kustomization has", k)
				}
			}
		})
	}
}

// TestChartValues renders the knobs and lets the agent judge the flags
// they give, in another namespace than the base's.
func TestChartValues(t *testing.T) {
	objs := helmTemplate(t, "storage-ops",
		"image.repository=registry.example.com/mountmedic", "image.tag=v1.2.3",
		"agent.tiers={restage,liveswap}", "agent.drivers={ru.yandex.s3.csi}",
		"agent.excludeNamespaces={kube-system}", "agent.dryRun=true", "failover.enabled=true",
		"agent.extraArgs={--probe-interval=5s}",
		"agent.resources.limits.memory=256Mi",
		"agent.nodeSelector.pool=storage",
		"prometheus.enabled=true", "grafana.enabled=true",
		"controller.enabled=true", "controller.replicas=3", "controller.extraArgs={--failover-max-nodes=2}")
	var ds appsv1.DaemonSet
	if err := yaml.Unmarshal(find(t, objs, "DaemonSet", "mountmedic").raw, &ds); err != nil {
		t.Fatal(err)
	}
	c := ds.Spec.Template.Spec.Containers[0]
	if c.Image != "registry.example.com/mountmedic:v1.2.3" {
		t.Errorf("image = %q, want the values' repository:tag", c.Image)
	}
	for _, want := range []string{"--tiers=restage,liveswap", "--drivers=ru.yandex.s3.csi", "--exclude-namespaces=kube-system",
		"--dry-run=true", "--failover=true", "--probe-interval=5s"} {
		if !slices.Contains(c.Args, want) {
			t.Errorf("agent args %q lack %s", c.Args, want)
		}
	}
	if got := c.Resources.Limits.Memory().String(); got != "256Mi" {
		t.Errorf("memory limit = %s, want 256Mi", got)
	}
	if ds.Spec.Template.Spec.NodeSelector["pool"] != "storage" || ds.Spec.Template.Spec.NodeSelector["kubernetes.io/os"] != "linux" {
		t.Errorf("nodeSelector = %v, want pool=storage added to kubernetes.io/os=linux", ds.Spec.Template.Spec.NodeSelector)
	}
	checkAgentArgs(t, buildMountmedic(t), c.Args)
	ctl := decodeController(t, objs)
	if *ctl.Spec.Replicas != 3 || !slices.Contains(ctl.Spec.Template.Spec.Containers[0].Args, "--failover-max-nodes=2") ||
		ctl.Spec.Template.Spec.Containers[0].Image != "registry.example.com/mountmedic:v1.2.3" {
		t.Errorf("controller: replicas %d, args %q, image %q; want 3, --failover-max-nodes=2 added, the values' image",
			*ctl.Spec.Replicas, ctl.Spec.Template.Spec.Containers[0].Args, ctl.Spec.Template.Spec.Containers[0].Image)
	}
	// Nothing of the release is left in the base's namespace.
	for _, o := range objs {
		// kubelet's Leases are in kube-node-lease wherever mountmedic is.
		if o.Metadata.Namespace != "" && o.Metadata.Namespace != "storage-ops" && o.Metadata.Namespace != "kube-node-lease" {
			t.Errorf("%s is in namespace %q, want the release's", objKey(o), o.Metadata.Namespace)
		}
		if bytes.Contains(o.raw, []byte("system:serviceaccount:"+baseNamespace+":")) || bytes.Contains(o.raw, []byte("namespace: "+baseNamespace+"\n")) {
			t.Errorf("%s still names the namespace %s:\n%s", objKey(o), baseNamespace, o.raw)
		}
	}
}

func TestChartLint(t *testing.T) {
	helm := lab.RequireTool(t, "helm")
	run(t, ".", helm, "lint", "--strict", "--kube-version", kubeVersion, chartDir)
	run(t, ".", helm, "lint", "--strict", "--kube-version", kubeVersion, chartDir, "--set", "failover.enabled=true,controller.enabled=true,prometheus.enabled=true,grafana.enabled=true")
}

// TestChartInstall installs the chart as a user would, with helm against the
// real kube-apiserver, then upgrades it with a knob.
func TestChartInstall(t *testing.T) {
	helm := lab.RequireTool(t, "helm")
	crds := operatorCRDs(t)
	c := kubetest.Start(t, kubetest.Options{})
	kc := kubectl(t)
	for _, crd := range []string{"podmonitors", "prometheusrules"} {
		run(t, ".", kc, "--kubeconfig="+c.Kubeconfig, "apply", "--server-side", "-f", filepath.Join(crds, "monitoring.coreos.com_"+crd+".yaml"))
		run(t, ".", kc, "--kubeconfig="+c.Kubeconfig, "wait", "--for=condition=Established", "--timeout=60s", "crd/"+crd+".monitoring.coreos.com")
	}
	h := func(args ...string) []byte {
		t.Helper()
		cmd := exec.Command(helm, append(args, "--kubeconfig="+c.Kubeconfig)...)
		cmd.Env = append(os.Environ(), "HELM_CACHE_HOME="+t.TempDir(), "HELM_CONFIG_HOME="+t.TempDir(), "HELM_DATA_HOME="+t.TempDir())
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("helm %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return out
	}
	h("install", "mountmedic", chartDir, "--namespace", "storage-ops", "--create-namespace",
		"--set", "prometheus.enabled=true,grafana.enabled=true,controller.enabled=true", "--wait=false")
	ctx := context.Background()
	ds, err := c.Client.AppsV1().DaemonSets("storage-ops").Get(ctx, "mountmedic", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("DaemonSet after helm install: %v", err)
	}
	if slices.Contains(ds.Spec.Template.Spec.Containers[0].Args, "--failover=true") {
		t.Errorf("failover on by default: %q", ds.Spec.Template.Spec.Containers[0].Args)
	}
	h("upgrade", "mountmedic", chartDir, "--namespace", "storage-ops", "--reuse-values", "--set", "failover.enabled=true", "--wait=false")
	ds, err = c.Client.AppsV1().DaemonSets("storage-ops").Get(ctx, "mountmedic", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("DaemonSet after helm upgrade: %v", err)
	}
	if !slices.Contains(ds.Spec.Template.Spec.Containers[0].Args, "--failover=true") {
		t.Errorf("helm upgrade --set failover.enabled=true: args %q", ds.Spec.Template.Spec.Containers[0].Args)
	}
	// The ServiceAccount the chart binds is the one the DaemonSet runs as,
	// in the release's namespace.
	if _, err := c.Client.CoreV1().ServiceAccounts("storage-ops").Get(ctx, ds.Spec.Template.Spec.ServiceAccountName, metav1.GetOptions{}); err != nil {
		t.Errorf("the DaemonSet's ServiceAccount in the release namespace: %v", err)
	}
	h("uninstall", "mountmedic", "--namespace", "storage-ops", "--wait=false")
	if _, err := c.Client.AppsV1().DaemonSets("storage-ops").Get(ctx, "mountmedic", metav1.GetOptions{}); err == nil {
		t.Errorf("DaemonSet still there after helm uninstall")
	}
}
