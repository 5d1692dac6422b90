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
	corev1 "k8s.io/api/core/v1"
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
// each becomes, the condition that turns it on (none: always) and the
// --set that makes it true.
var chartParts = []struct{ dir, file, cond, set string }{
	{".", "agent.yaml", "", ""},
	// Kustomize Components: what the base plus each renders beyond the base.
	{"controller", "controller.yaml", ".Values.controller.enabled", "controller.enabled=true"},
	{"prometheus", "prometheus.yaml", ".Values.prometheus.enabled", "prometheus.enabled=true"},
	{"grafana", "grafana.yaml", ".Values.grafana.enabled", "grafana.enabled=true"},
	{"profiles/openshift", "openshift.yaml", `eq .Values.profile "openshift"`, "profile=openshift"},
	{"identity/serviceaccount", "identity.yaml", `eq (include "mountmedic.identity" .) "serviceaccount"`, "identity=serviceaccount"},
}

// isComponent tells a kustomize Component, which renders only on a base.
func isComponent(dir string) bool {
	return dir == "controller" || strings.HasPrefix(dir, "profiles/") || strings.HasPrefix(dir, "identity/")
}

// componentOverlay is an overlay (in overlays/<name>/) of the base with
// the Component in dir.
func componentOverlay(dir string) string {
	return "resources: [../../deploy]\ncomponents: [../../deploy/" + dir + "]\n"
}

// renderPart renders one chart part: a kustomization, or for a Component,
// the objects the base with it adds to the base.
func renderPart(t *testing.T, dir string) []object {
	t.Helper()
	if !isComponent(dir) {
		return kustomize(t, dir)
	}
	base := map[string]bool{}
	for _, o := range kustomize(t, ".") {
		base[objKey(o)] = true
	}
	var out []object
	for _, o := range renderOverlay(t, strings.ReplaceAll(dir, "/", "-"), componentOverlay(dir)) {
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
	// markFullname is the install's name (fullnameOverride), which every
	// object's name starts with.
	markFullname = "@@FN@@"
	// markName is the app.kubernetes.io/name label's value (nameOverride).
	markName = "@@NAME@@"
)

func markBlock(valuesPath string) string { return "@@B:" + valuesPath + "@@" }
func markQuote(expr string) string       { return "@@Q:" + expr + "@@" }
func markAppend(include string) string   { return "@@A:" + include + "@@" }
func markRaw(expr string) string         { return "@@R:" + expr + "@@" }

// markInline is a map key whose line becomes the YAML an include gives
// (nothing, or more keys of that map).
func markInline(include string) string { return "@@I:" + include + "@@" }

var (
	reBlock  = regexp.MustCompile(`(?m)^( *)([A-Za-z]+): '@@B:([A-Za-z.]+)@@'$`)
	reQuote  = regexp.MustCompile(`'@@Q:([^@]+)@@'`)
	reAppend = regexp.MustCompile(`(?m)^( *)- '@@A:([A-Za-z.]+)@@'$`)
	reRaw    = regexp.MustCompile(`'@@R:([^@]+)@@'`)
	reInline = regexp.MustCompile(`(?m)^( *)'@@I:([A-Za-z.]+)@@': ""$`)
)

// chartTemplate turns one kustomization's objects into template text.
func chartTemplate(t *testing.T, objs []object, cond string) []byte {
	t.Helper()
	var b bytes.Buffer
	b.WriteString("# Generated from deploy/ by `go test ./deploy -run TestChart -update`. Do not edit.\n")
	if cond != "" {
		fmt.Fprintf(&b, "{{- if %s }}\n", cond)
	}
	for _, o := range objs {
		var m map[string]any
		if err := yaml.Unmarshal(o.raw, &m); err != nil {
			t.Fatalf("decode %s %s: %v", o.Kind, o.Metadata.Name, err)
		}
		m = markNamespace(m).(map[string]any)
		m = markNames(m, "").(map[string]any)
		meta := dig(t, m, "metadata")
		labels, _ := meta["labels"].(map[string]any)
		if labels == nil {
			labels = map[string]any{}
			meta["labels"] = labels
		}
		labels[markInline("mountmedic.labels")] = ""
		switch {
		case o.Kind == "Namespace":
			// Opt-in: helm install --create-namespace makes one without
			// the Pod Security labels the agent needs.
			meta["name"] = markRaw(".Release.Namespace")
		case o.Kind == "DaemonSet" && o.Metadata.Name == "mountmedic":
			markAgent(t, m)
		case o.Kind == "Deployment" && o.Metadata.Name == "mountmedic-controller":
			markController(t, m)
		case o.Kind == "PodMonitor":
			labels[markInline("mountmedic.monitorLabels")] = ""
			for _, e := range dig(t, m, "spec")["podMetricsEndpoints"].([]any) {
				e.(map[string]any)["interval"] = markQuote(".Values.prometheus.interval")
			}
		case o.Kind == "PrometheusRule":
			labels[markInline("mountmedic.monitorLabels")] = ""
		}
		out, err := yaml.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		if o.Kind == "Namespace" {
			b.WriteString("{{- if .Values.namespace.create }}\n")
		}
		b.WriteString("---\n")
		b.WriteString(escapeTemplate(string(out)))
		if o.Kind == "Namespace" {
			b.WriteString("{{- end }}\n")
		}
	}
	if cond != "" {
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
	s = reInline.ReplaceAllStringFunc(s, func(line string) string {
		g := reInline.FindStringSubmatch(line)
		return fmt.Sprintf("%s{{- include %q . | nindent %d }}", g[1], g[2], len(g[1]))
	})
	s = reQuote.ReplaceAllString(s, "{{ $1 | quote }}")
	s = reRaw.ReplaceAllString(s, "{{ $1 }}")
	s = strings.ReplaceAll(s, markNS, "{{ .Release.Namespace }}")
	s = strings.ReplaceAll(s, markFullname, `{{ include "mountmedic.fullname" . }}`)
	s = strings.ReplaceAll(s, markName, `{{ include "mountmedic.name" . }}`)
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
// metadata or subject namespace, a PodMonitor's namespaceSelector, an
// admission policy's namespaceSelector (kubernetes.io/metadata.name), a
// FlowSchema rule's namespaces, and a
// ServiceAccount user name (system:serviceaccount:NS:NAME) in a string.
func markNamespace(v any) any {
	switch x := v.(type) {
	case map[string]any:
		for k, e := range x {
			switch {
			case (k == "namespace" || k == "kubernetes.io/metadata.name") && e == baseNamespace:
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

// baseName is the name every object of the kustomizations starts with:
// in the chart, the install's (fullnameOverride).
const baseName = "mountmedic"

// nameFields are the fields whose value is an object's name or a
// reference to one: metadata, RBAC subjects and roleRefs, a pod's
// ServiceAccount and Secret, an admission binding's policy and parameter,
// a FlowSchema's priority level and subject, a Role's resourceNames.
var nameFields = map[string]bool{"name": true, "serviceAccountName": true, "secretName": true, "policyName": true, "resourceNames": true}

// nameInCode are the places strings name an object by its name: the
// admission policies' CEL (a ServiceAccount's user name) and the alerts'
// PromQL (the scrape job is app.kubernetes.io/name, the DaemonSet's name).
var nameInCode = strings.NewReplacer(
	"':"+baseName+"'", "':"+markFullname+"'",
	"':"+baseName+"-controller'", "':"+markFullname+"-controller'",
	":"+baseName+"$'", ":"+markFullname+"$'",
	`job="`+baseName+`"`, `job="`+markName+`"`,
	`daemonset="`+baseName+`"`, `daemonset="`+markFullname+`"`,
)

// markNames replaces the base's name where a field names an object (the
// object's own name, or a reference to it: nameFields), the
// app.kubernetes.io/name label's value, and a name inside a policy's CEL
// or a rule's PromQL (nameInCode). key is the field v is the value of.
func markNames(v any, key string) any {
	switch x := v.(type) {
	case map[string]any:
		for k, e := range x {
			if k == "app.kubernetes.io/name" && e == baseName {
				x[k] = markName
				continue
			}
			x[k] = markNames(e, k)
		}
		return x
	case []any:
		for i := range x {
			x[i] = markNames(x[i], key)
		}
		return x
	case string:
		if nameFields[key] && (x == baseName || strings.HasPrefix(x, baseName+"-")) {
			return markFullname + strings.TrimPrefix(x, baseName)
		}
		return nameInCode.Replace(x)
	}
	return v
}

// markAgent puts the agent's knobs into the DaemonSet: the kubelet
// layout (the profile's, or the values'), image, resources, scheduling,
// and the user's extra args, env, volumes, labels and annotations.
func markAgent(t *testing.T, ds map[string]any) {
	t.Helper()
	tmeta := dig(t, ds, "spec", "template", "metadata")
	tmeta[markInline("mountmedic.podAnnotations")] = ""
	dig(t, ds, "spec", "template", "metadata", "labels")[markInline("mountmedic.podLabels")] = ""
	spec := dig(t, ds, "spec", "template", "spec")
	spec["nodeSelector"] = markBlock("agent.nodeSelector")
	spec["tolerations"] = markBlock("agent.tolerations")
	spec["priorityClassName"] = markQuote(".Values.agent.priorityClassName")
	spec[markInline("mountmedic.agentPodSpec")] = ""
	// The kubeconfig volume is last (daemonset.yaml): the include puts it
	// back when it is needed, then the credentials directories.
	spec["volumes"] = markLayoutList(t, spec["volumes"], "hostPath", "path", "mountmedic.agentVolumes")
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
		for i, a := range args {
			for flag, inc := range layoutArgs {
				if strings.HasPrefix(a.(string), "--"+flag+"=") {
					args[i] = markQuote(`include "` + inc + `" .`)
				}
			}
		}
		c["args"] = append(args, markAppend("mountmedic.agentArgs"))
		c["env"] = append(c["env"].([]any), markAppend("mountmedic.agentEnv"))
		c["volumeMounts"] = markLayoutList(t, c["volumeMounts"], "", "mountPath", "mountmedic.agentVolumeMounts")
		return
	}
	t.Fatal("the DaemonSet has no container named agent")
}

// layoutArgs are the agent flags the kubelet layout sets, each rendered
// by a helper of _helpers.tpl.
var layoutArgs = map[string]string{
	"node-kubeconfig": "mountmedic.argNodeKubeconfig",
	"kubelet-root":    "mountmedic.argKubeletRoot",
	"cri-socket":      "mountmedic.argCRISocket",
}

// layoutPaths are the volumes whose host path (and mount path) the
// kubelet layout sets.
var layoutPaths = map[string]string{
	"kubelet-root":   "mountmedic.kubeletRoot",
	"cri-socket-dir": "mountmedic.criSocketDir",
}

// markLayoutList marks the layout's paths in the volumes (field
// hostPath.path) or the volume mounts (field mountPath) and replaces the
// last entry, the kubeconfig's, by the include that renders it when
// needed, with the credentials directories and the user's extra entries.
func markLayoutList(t *testing.T, list any, sub, field, include string) []any {
	t.Helper()
	l, _ := list.([]any)
	if len(l) == 0 || l[len(l)-1].(map[string]any)["name"] != "kubelet-kubeconfig" {
		t.Fatalf("the DaemonSet's last volume and mount must be kubelet-kubeconfig (the profiles patch it by index): %v", l)
	}
	for _, e := range l {
		e := e.(map[string]any)
		inc, ok := layoutPaths[e["name"].(string)]
		if !ok {
			continue
		}
		m := e
		if sub != "" {
			m = e[sub].(map[string]any)
		}
		m[field] = markQuote(`include "` + inc + `" .`)
	}
	return append(l[:len(l)-1], markAppend(include))
}

// markController puts the controller's knobs into its Deployment.
func markController(t *testing.T, d map[string]any) {
	t.Helper()
	dig(t, d, "spec")["replicas"] = markRaw(".Values.controller.replicas")
	spec := dig(t, d, "spec", "template", "spec")
	spec[markInline("mountmedic.controllerPodSpec")] = ""
	containers, _ := spec["containers"].([]any)
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

// chartTemplates renders every part and returns file name -> content,
// with the profiles' table.
func chartTemplates(t *testing.T) map[string][]byte {
	t.Helper()
	files := map[string][]byte{}
	for _, p := range chartParts {
		files[p.file] = chartTemplate(t, renderPart(t, p.dir), p.cond)
	}
	files["_profiles.tpl"] = profilesTemplate(t)
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
		if _, ok := files[e.Name()]; !ok && !handWritten[e.Name()] {
			t.Errorf("%s/%s is generated from no kustomization: remove it", dir, e.Name())
		}
	}
}

// handWritten are the chart's templates no kustomization generates.
var handWritten = map[string]bool{"_helpers.tpl": true, "NOTES.txt": true, "servicemonitor.yaml": true}

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

// chartOnlyLabels are the labels the chart puts on every object beyond
// the kustomizations' (the release's: helm.sh/chart, managed-by...).
var chartOnlyLabels = []string{"helm.sh/chart", "app.kubernetes.io/managed-by", "app.kubernetes.io/instance", "app.kubernetes.io/version"}

// compareRenders compares two renders object by object, the chart's
// release labels aside; want's Namespace is compared only if the chart
// renders one.
func compareRenders(t *testing.T, want, got []object) {
	t.Helper()
	norm := func(o object) any {
		n := normalize(t, o).(map[string]any)
		if l, ok := n["metadata"].(map[string]any)["labels"].(map[string]any); ok {
			for _, k := range chartOnlyLabels {
				delete(l, k)
			}
		}
		return n
	}
	w, g := map[string]any{}, map[string]any{}
	for _, o := range got {
		g[objKey(o)] = norm(o)
	}
	for _, o := range want {
		if _, ok := g[objKey(o)]; ok || o.Kind != "Namespace" {
			w[objKey(o)] = norm(o)
		}
	}
	for k, wv := range w {
		gv, ok := g[k]
		switch {
		case !ok:
			t.Errorf("the chart does not render %s", k)
		case !reflect.DeepEqual(gv, wv):
			gj, _ := json.MarshalIndent(gv, "", " ")
			wj, _ := json.MarshalIndent(wv, "", " ")
			t.Errorf("the chart renders %s differently from the kustomization:\nchart: %s\nkustomize: %s", k, gj, wj)
		}
	}
	for k := range g {
		if _, ok := w[k]; !ok {
			t.Errorf("the chart renders %s, which no kustomization has", k)
		}
	}
}

// TestChartRendersTheBase compares the chart's render, without and with
// every optional part, with the kustomizations' renders, object by
// object. The controller needs the agents' failover duty, whose one flag
// (--failover=true) the want side adds as an overlay would.
func TestChartRendersTheBase(t *testing.T) {
	for _, all := range []bool{false, true} {
		t.Run(fmt.Sprintf("optional parts %v", all), func(t *testing.T) {
			var want []object
			set := []string{"namespace.create=true"}
			for _, p := range chartParts {
				if strings.HasPrefix(p.dir, "profiles/") || strings.HasPrefix(p.dir, "identity/") || (p.cond != "" && !all) {
					continue
				}
				if p.set != "" {
					set = append(set, p.set)
				}
				want = append(want, renderPart(t, p.dir)...)
			}
			if all {
				set = append(set, "failover.enabled=true")
				want = withFailoverArg(t, want)
			}
			compareRenders(t, want, helmTemplate(t, baseNamespace, set...))
		})
	}
}

// TestChartIdentity compares the chart's identity=serviceaccount with the
// base plus deploy/identity/serviceaccount.
func TestChartIdentity(t *testing.T) {
	want := renderOverlay(t, "identity-serviceaccount", componentOverlay("identity/serviceaccount"))
	compareRenders(t, want, helmTemplate(t, baseNamespace, "identity=serviceaccount"))
}

// withFailoverArg returns objs with --failover=true added to the agent's
// args.
func withFailoverArg(t *testing.T, objs []object) []object {
	t.Helper()
	out := slices.Clone(objs)
	for i, o := range out {
		if o.Kind != "DaemonSet" {
			continue
		}
		var m map[string]any
		if err := yaml.Unmarshal(o.raw, &m); err != nil {
			t.Fatal(err)
		}
		c := dig(t, m, "spec", "template", "spec")["containers"].([]any)[0].(map[string]any)
		c["args"] = append(c["args"].([]any), "--failover=true")
		raw, err := yaml.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		out[i].raw = raw
	}
	return out
}

// TestChartValues renders the knobs and lets the agent judge the flags
// they give, in another namespace than the base's.
func TestChartValues(t *testing.T) {
	objs := helmTemplate(t, "storage-ops",
		"image.repository=registry.example.com/mountmedic", "image.tag=v1.2.3", "image.pullSecrets={regcred}",
		"agent.tiers={restage,liveswap}", "agent.drivers={ru.yandex.s3.csi}",
		"agent.excludeNamespaces={kube-system}", "agent.dryRun=true", "failover.enabled=true",
		"agent.extraArgs={--probe-interval=5s}",
		"agent.resources.limits.memory=256Mi",
		"agent.nodeSelector.pool=storage",
		"agent.podAnnotations.team=storage", "agent.podLabels.tier=node",
		"agent.priorityClassName=storage-critical",
		"agent.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].key=pool",
		"agent.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].operator=Exists",
		"agent.extraEnv[0].name=HTTPS_PROXY", "agent.extraEnv[0].value=http://proxy:3128",
		"agent.extraVolumes[0].name=extra", "agent.extraVolumes[0].emptyDir.medium=Memory",
		"agent.extraVolumeMounts[0].name=extra", "agent.extraVolumeMounts[0].mountPath=/extra",
		"profile=k3s", "kubelet.root=/data/kubelet", "criSocket=unix:///run/containerd/containerd.sock",
		"namespace.create=true",
		"prometheus.enabled=true", "prometheus.additionalLabels.release=kps", "prometheus.interval=15s", "prometheus.serviceMonitor.enabled=true",
		"grafana.enabled=true",
		"controller.enabled=true", "controller.replicas=3", "controller.extraArgs={--failover-max-nodes=2}")
	var ds appsv1.DaemonSet
	if err := yaml.Unmarshal(find(t, objs, "DaemonSet", "mountmedic").raw, &ds); err != nil {
		t.Fatal(err)
	}
	pod := ds.Spec.Template.Spec
	c := pod.Containers[0]
	if c.Image != "registry.example.com/mountmedic:v1.2.3" {
		t.Errorf("image = %q, want the values' repository:tag", c.Image)
	}
	for _, want := range []string{"--tiers=restage,liveswap", "--drivers=ru.yandex.s3.csi", "--exclude-namespaces=kube-system",
		"--dry-run=true", "--failover=true", "--probe-interval=5s",
		// The values' root and socket over the k3s profile's, its kubeconfig kept.
		"--kubelet-root=/data/kubelet", "--cri-socket=unix:///run/containerd/containerd.sock",
		"--node-kubeconfig=/var/lib/rancher/k3s/agent/kubelet.kubeconfig"} {
		if !slices.Contains(c.Args, want) {
			t.Errorf("agent args %q lack %s", c.Args, want)
		}
	}
	checkLayout(t, &ds)
	if !pod.HostNetwork || len(pod.ImagePullSecrets) != 1 || pod.ImagePullSecrets[0].Name != "regcred" ||
		pod.PriorityClassName != "storage-critical" || pod.Affinity == nil || pod.Affinity.NodeAffinity == nil ||
		ds.Spec.Template.Annotations["team"] != "storage" || ds.Spec.Template.Labels["tier"] != "node" ||
		ds.Spec.Template.Labels["app.kubernetes.io/name"] != "mountmedic" {
		t.Errorf("pod: hostNetwork %v, pull secrets %v, priority class %q, affinity %v, annotations %v, labels %v; want the k3s profile's host network and the values'",
			pod.HostNetwork, pod.ImagePullSecrets, pod.PriorityClassName, pod.Affinity, ds.Spec.Template.Annotations, ds.Spec.Template.Labels)
	}
	if !slices.ContainsFunc(c.Env, func(e corev1.EnvVar) bool { return e.Name == "HTTPS_PROXY" }) ||
		!slices.ContainsFunc(pod.Volumes, func(v corev1.Volume) bool { return v.Name == "extra" && v.EmptyDir != nil }) ||
		!slices.ContainsFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool { return m.Name == "extra" && m.MountPath == "/extra" }) {
		t.Errorf("extraEnv/extraVolumes/extraVolumeMounts missing: env %v volumes %v mounts %v", c.Env, pod.Volumes, c.VolumeMounts)
	}
	if got := c.Resources.Limits.Memory().String(); got != "256Mi" {
		t.Errorf("memory limit = %s, want 256Mi", got)
	}
	if pod.NodeSelector["pool"] != "storage" || pod.NodeSelector["kubernetes.io/os"] != "linux" {
		t.Errorf("nodeSelector = %v, want pool=storage added to kubernetes.io/os=linux", pod.NodeSelector)
	}
	ns := find(t, objs, "Namespace", "storage-ops")
	if ns.Metadata.Labels["pod-security.kubernetes.io/enforce"] != "privileged" {
		t.Errorf("Namespace labels %v, want pod-security.kubernetes.io/enforce=privileged", ns.Metadata.Labels)
	}
	for _, kind := range []string{"PodMonitor", "PrometheusRule", "ServiceMonitor"} {
		o := find(t, objs, kind, "mountmedic")
		if o.Metadata.Labels["release"] != "kps" {
			t.Errorf("%s labels %v, want prometheus.additionalLabels (release=kps)", kind, o.Metadata.Labels)
		}
		if kind != "PrometheusRule" && !regexp.MustCompile(`interval: "?15s"?\n`).Match(o.raw) {
			t.Errorf("%s has not the values' interval 15s:\n%s", kind, o.raw)
		}
	}
	// Every object carries the release's labels.
	for _, o := range objs {
		for _, l := range chartOnlyLabels {
			if o.Metadata.Labels[l] == "" {
				t.Errorf("%s has no label %s", objKey(o), l)
			}
		}
	}
	if ctl := decodeController(t, objs); len(ctl.Spec.Template.Spec.ImagePullSecrets) != 1 {
		t.Errorf("controller pull secrets %v, want regcred", ctl.Spec.Template.Spec.ImagePullSecrets)
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
		if bytes.Contains(o.raw, []byte("system:serviceaccount:"+baseNamespace+":")) || bytes.Contains(o.raw, []byte("namespace: "+baseNamespace+"\n")) ||
			bytes.Contains(o.raw, []byte("kubernetes.io/metadata.name: "+baseNamespace+"\n")) {
			t.Errorf("%s still names the namespace %s:\n%s", objKey(o), baseNamespace, o.raw)
		}
	}
}

// helmTemplateErr renders the chart and returns helm's error output, or
// "" when it rendered.
func helmTemplateErr(t *testing.T, set ...string) string {
	t.Helper()
	args := []string{"template", "mountmedic", chartDir, "--namespace", baseNamespace, "--kube-version", kubeVersion}
	for _, s := range set {
		args = append(args, "--set", s)
	}
	out, err := exec.Command(lab.RequireTool(t, "helm"), args...).CombinedOutput()
	if err == nil {
		return ""
	}
	return string(out)
}

// TestChartGuards renders values that are wrong or contradict each other:
// each must fail, naming the value and the fix.
func TestChartGuards(t *testing.T) {
	tests := map[string]struct {
		set  []string
		want []string
	}{
		"unknown tier":            {[]string{"agent.tiers={restage,bogus}"}, []string{"/agent/tiers", "force-delete"}},
		"unknown profile":         {[]string{"profile=gke"}, []string{"profile", "gke-cos"}},
		"relative kubelet root":   {[]string{"kubelet.root=var/lib/kubelet"}, []string{"/kubelet/root", "var/lib/kubelet"}},
		"socket without scheme":   {[]string{"criSocket=/run/crio/crio.sock"}, []string{"criSocket"}},
		"misspelt value":          {[]string{"agent.tier={restage}"}, []string{"tier"}},
		"controller, no failover": {[]string{"controller.enabled=true"}, []string{"controller.enabled=true needs failover.enabled=true"}},
		"second kubelet root":     {[]string{"agent.extraArgs={--kubelet-root=/data/kubelet}"}, []string{"--kubelet-root", "kubelet.root", "instead of a second flag"}},
		"second cri socket":       {[]string{"agent.extraArgs={--cri-socket=unix:///x.sock}"}, []string{"--cri-socket", "criSocket"}},
		"own metrics address":     {[]string{"agent.extraArgs={--metrics-addr=:9999}"}, []string{"--metrics-addr", "sets --metrics-addr itself"}},
		"own service account":     {[]string{"agent.extraArgs={--service-account-name=x}"}, []string{"--service-account-name", "fullnameOverride"}},
		"name not a DNS label":    {[]string{"fullnameOverride=Storage_Medic"}, []string{"fullnameOverride"}},
		"service monitor alone":   {[]string{"prometheus.serviceMonitor.enabled=true"}, []string{"prometheus.enabled=true"}},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			out := helmTemplateErr(t, tc.set...)
			if out == "" {
				t.Fatalf("helm template --set %v rendered; want it refused", tc.set)
			}
			for _, w := range tc.want {
				if !strings.Contains(out, w) {
					t.Errorf("helm template --set %v: %s\nwant it to name %q", tc.set, out, w)
				}
			}
		})
	}
	// The guards do not refuse what is consistent.
	if out := helmTemplateErr(t, "controller.enabled=true", "failover.enabled=true", "agent.extraArgs={--probe-interval=5s}"); out != "" {
		t.Errorf("consistent values refused: %s", out)
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
	// As the chart's NOTES and values say: the namespace, labelled for
	// the privileged agent, before the install (the helm CLI stores its
	// release there first).
	ctx := context.Background()
	if _, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "storage-ops",
		Labels: map[string]string{"pod-security.kubernetes.io/enforce": "privileged"}}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	notes := string(h("install", "mountmedic", chartDir, "--namespace", "storage-ops",
		"--set", "prometheus.enabled=true,grafana.enabled=true", "--wait=false"))
	for _, want := range []string{"in namespace storage-ops, profile kubeadm", "kubelet root  /var/lib/kubelet", "kubeconfig    /etc/kubernetes/kubelet.conf", "rollout status daemonset/mountmedic"} {
		if !strings.Contains(notes, want) {
			t.Errorf("helm install's NOTES lack %q:\n%s", want, notes)
		}
	}
	ds, err := c.Client.AppsV1().DaemonSets("storage-ops").Get(ctx, "mountmedic", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("DaemonSet after helm install: %v", err)
	}
	if slices.Contains(ds.Spec.Template.Spec.Containers[0].Args, "--failover=true") {
		t.Errorf("failover on by default: %q", ds.Spec.Template.Spec.Containers[0].Args)
	}
	h("upgrade", "mountmedic", chartDir, "--namespace", "storage-ops", "--reuse-values", "--set", "failover.enabled=true,controller.enabled=true", "--wait=false")
	ds, err = c.Client.AppsV1().DaemonSets("storage-ops").Get(ctx, "mountmedic", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("DaemonSet after helm upgrade: %v", err)
	}
	if !slices.Contains(ds.Spec.Template.Spec.Containers[0].Args, "--failover=true") {
		t.Errorf("helm upgrade --set failover.enabled=true: args %q", ds.Spec.Template.Spec.Containers[0].Args)
	}
	if _, err := c.Client.AppsV1().Deployments("storage-ops").Get(ctx, "mountmedic-controller", metav1.GetOptions{}); err != nil {
		t.Errorf("controller Deployment after helm upgrade --set controller.enabled=true: %v", err)
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
	// Renamed: every object under the new name, the NOTES' commands too.
	notes = string(h("install", "medic", chartDir, "--namespace", "storage-ops", "--wait=false",
		"--set", "fullnameOverride=storage-medic,failover.enabled=true,controller.enabled=true,identity=serviceaccount"))
	for _, want := range []string{"identity      ServiceAccount storage-medic, with the token", "daemonset/storage-medic", "secret generic storage-medic-peer-key", "kubectl mountmedic --name storage-medic"} {
		if !strings.Contains(notes, want) {
			t.Errorf("helm install --set fullnameOverride=storage-medic: NOTES lack %q:\n%s", want, notes)
		}
	}
	ds, err = c.Client.AppsV1().DaemonSets("storage-ops").Get(ctx, "storage-medic", metav1.GetOptions{})
	if err != nil || ds.Spec.Template.Spec.ServiceAccountName != "storage-medic" {
		t.Fatalf("DaemonSet storage-medic after helm install --set fullnameOverride=storage-medic: %v", err)
	}
	for _, get := range []func() error{
		func() error {
			_, err := c.Client.AppsV1().Deployments("storage-ops").Get(ctx, "storage-medic-controller", metav1.GetOptions{})
			return err
		},
		func() error {
			_, err := c.Client.AdmissionregistrationV1().ValidatingAdmissionPolicies().Get(ctx, "storage-medic-agent-events", metav1.GetOptions{})
			return err
		},
		func() error {
			_, err := c.Client.RbacV1().ClusterRoles().Get(ctx, "storage-medic-viewer", metav1.GetOptions{})
			return err
		},
	} {
		if err := get(); err != nil {
			t.Errorf("renamed install: %v", err)
		}
	}
	h("uninstall", "medic", "--namespace", "storage-ops", "--wait=false")
}

// TestChartPackage packages the chart as scripts/image.sh does for a
// release: the chart's version is the image's without the v, its
// appVersion the image's tag, so the packaged chart's default image is the
// one `mountmedic version` names.
func TestChartPackage(t *testing.T) {
	helm := lab.RequireTool(t, "helm")
	for version, chartVersion := range map[string]string{"v1.2.3": "1.2.3", "v0.4.0-3-gabc1234-dirty": "0.4.0-3-gabc1234-dirty", "dev": "0.0.0-dev"} {
		dir := t.TempDir()
		cmd := exec.Command("scripts/image.sh", "--chart-only", "--chart", dir, "--version", version)
		cmd.Dir = ".."
		cmd.Env = append(os.Environ(), "PATH="+filepath.Dir(helm)+":"+os.Getenv("PATH"))
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("scripts/image.sh --chart-only --version %s: %v\n%s", version, err, out)
		}
		tgz := filepath.Join(dir, "mountmedic-"+chartVersion+".tgz")
		meta := string(run(t, ".", helm, "show", "chart", tgz))
		if !strings.Contains(meta, "\nversion: "+chartVersion+"\n") || !strings.Contains(meta, "appVersion: "+version+"\n") {
			t.Errorf("%s: Chart.yaml\n%s\nwant version %s, appVersion %s", tgz, meta, chartVersion, version)
		}
		objs := decodeAll(t, run(t, ".", helm, "template", "mountmedic", tgz, "--namespace", baseNamespace, "--kube-version", kubeVersion))
		if img := decodeDaemonSet(t, objs).Spec.Template.Spec.Containers[0].Image; img != "mountmedic:"+version {
			t.Errorf("%s renders image %q, want mountmedic:%s", tgz, img, version)
		}
	}
}

// TestChartNames renders every part under fullnameOverride and
// nameOverride: every object's name starts with the install's name, no
// reference (RBAC subject and roleRef, ServiceAccount, Secret, policy
// binding and parameter, FlowSchema subject, resourceNames) nor a
// policy's CEL or an alert's PromQL names the base's objects, the
// selectors and the scrape job follow nameOverride, and the agent and the
// controller are told the names they need.
func TestChartNames(t *testing.T) {
	const full, name = "storage-medic", "smedic"
	objs := helmTemplate(t, "ops", "fullnameOverride="+full, "nameOverride="+name, "namespace.create=true",
		"identity=serviceaccount", "profile=openshift", "failover.enabled=true", "controller.enabled=true",
		"prometheus.enabled=true", "prometheus.serviceMonitor.enabled=true", "grafana.enabled=true")
	var check func(path string, v any, key string)
	check = func(path string, v any, key string) {
		switch x := v.(type) {
		case map[string]any:
			for k, e := range x {
				if k == "app.kubernetes.io/name" && e != name {
					t.Errorf("%s: app.kubernetes.io/name %v, want %s", path, e, name)
				}
				check(path+"."+k, e, k)
			}
		case []any:
			for i, e := range x {
				check(fmt.Sprintf("%s[%d]", path, i), e, key)
			}
		case string:
			if nameFields[key] && (x == baseName || strings.HasPrefix(x, baseName+"-")) {
				t.Errorf("%s = %q names the base's object, want %s...", path, x, full)
			}
			if nameInCode.Replace(x) != x {
				t.Errorf("%s names the base's ServiceAccount, DaemonSet or job in code:\n%s", path, x)
			}
		}
	}
	for _, o := range objs {
		if o.Kind != "Namespace" && o.Metadata.Name != full && !strings.HasPrefix(o.Metadata.Name, full+"-") {
			t.Errorf("%s: want a name starting with %s", objKey(o), full)
		}
		check(objKey(o), normalize(t, o), "")
	}
	var ds appsv1.DaemonSet
	if err := yaml.Unmarshal(find(t, objs, "DaemonSet", full).raw, &ds); err != nil {
		t.Fatal(err)
	}
	args := ds.Spec.Template.Spec.Containers[0].Args
	if !slices.Contains(args, "--service-account-name="+full) || ds.Spec.Template.Spec.ServiceAccountName != full {
		t.Errorf("agent: ServiceAccount %q, args %q; want %s and --service-account-name=%s", ds.Spec.Template.Spec.ServiceAccountName, args, full, full)
	}
	checkAgentArgs(t, buildMountmedic(t), args)
	var d appsv1.Deployment
	if err := yaml.Unmarshal(find(t, objs, "Deployment", full+"-controller").raw, &d); err != nil {
		t.Fatal(err)
	}
	ctl := d.Spec.Template.Spec.Containers[0].Args
	if !slices.Contains(ctl, "--failover-leader-lease="+full+"-failover-leader") || !slices.Contains(ctl, "--service-account-name="+full+"-controller") {
		t.Errorf("controller args %q, want --failover-leader-lease=%s-failover-leader (its Role's resourceNames) and --service-account-name=%s-controller", ctl, full, full)
	}
}
