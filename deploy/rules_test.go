package deploy_test

import (
	"bytes"
	"encoding/json"
	"os"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"sigs.k8s.io/yaml"
)

const (
	rulesFile          = "prometheus/rules.yaml"
	rulesTestFile      = "prometheus/rules_test.yaml"
	prometheusRuleFile = "prometheus/prometheusrule.yaml"
	dashboardFile      = "grafana/mountmedic.json"
	metricsCapture     = "testdata/metrics.txt"
	controllerCapture  = "testdata/controller-metrics.txt"
)

// prometheusRuleHeader opens the generated PrometheusRule.
const prometheusRuleHeader = `# GENERATED from rules.yaml by
#   go test ./deploy/ -run TestPrometheusRuleMatchesRulesFile -update
# Do not edit: edit rules.yaml (the source, which promtool checks and tests)
# and regenerate. The Prometheus Operator loads this; a Prometheus without
# the operator loads rules.yaml directly.
apiVersion: monitoring.coreos.com/v1
kind: PrometheusRule
metadata:
  name: mountmedic
  namespace: mountmedic
  labels:
    app.kubernetes.io/name: mountmedic
spec:
`

// prometheusRule renders rules.yaml as the operator's CR: the header, then
// the rule file's groups (its leading comment dropped) indented under spec.
func prometheusRule(t *testing.T) []byte {
	t.Helper()
	src := string(readFile(t, rulesFile))
	i := strings.Index(src, "\ngroups:")
	if i < 0 {
		t.Fatalf("%s has no top-level groups:", rulesFile)
	}
	var b strings.Builder
	b.WriteString(prometheusRuleHeader)
	for _, line := range strings.SplitAfter(src[i+1:], "\n") {
		if strings.TrimSpace(line) == "" {
			b.WriteString(line)
			continue
		}
		b.WriteString("  " + line)
	}
	return []byte(b.String())
}

func TestPrometheusRuleMatchesRulesFile(t *testing.T) {
	want := prometheusRule(t)
	if *update {
		if err := os.WriteFile(prometheusRuleFile, want, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got := readFile(t, prometheusRuleFile)
	if !bytes.Equal(got, want) {
		t.Fatalf("%s differs from what %s generates: run go test ./deploy/ -run TestPrometheusRuleMatchesRulesFile -update", prometheusRuleFile, rulesFile)
	}
	// And it means the same: the CR's spec is the rule file.
	var rules, cr struct {
		Groups []any `json:"groups"`
		Spec   struct {
			Groups []any `json:"groups"`
		} `json:"spec"`
	}
	if err := yaml.Unmarshal(readFile(t, rulesFile), &rules); err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(got, &cr); err != nil {
		t.Fatal(err)
	}
	if len(rules.Groups) == 0 || !reflect.DeepEqual(rules.Groups, cr.Spec.Groups) {
		t.Errorf("%s spec.groups differ from %s groups", prometheusRuleFile, rulesFile)
	}
}

func TestPromtoolRules(t *testing.T) {
	pt := promtool(t)
	run(t, ".", pt, "check", "rules", rulesFile)
	run(t, "prometheus", pt, "test", "rules", "rules_test.yaml")
}

// alert is one alerting rule of rules.yaml.
type alert struct {
	Alert       string            `json:"alert"`
	Expr        string            `json:"expr"`
	Labels      map[string]string `json:"labels"`
	Annotations map[string]string `json:"annotations"`
}

func alerts(t *testing.T) []alert {
	t.Helper()
	var f struct {
		Groups []struct {
			Rules []alert `json:"rules"`
		} `json:"groups"`
	}
	if err := yaml.Unmarshal(readFile(t, rulesFile), &f); err != nil {
		t.Fatal(err)
	}
	var out []alert
	for _, g := range f.Groups {
		out = append(out, g.Rules...)
	}
	return out
}

// runbooks is the page each alert's runbook_url points into.
const runbooks = "docs/alerts.md"

// TestAlertsHaveRunbooksAndTests: each alert links its runbook section and
// has a promtool test in which it fires.
func TestAlertsHaveRunbooksAndTests(t *testing.T) {
	doc := string(readFile(t, "../"+runbooks))
	tests := string(readFile(t, rulesTestFile))
	for _, a := range alerts(t) {
		anchor := strings.ToLower(a.Alert)
		if want := runbooks + "#" + anchor; !strings.HasSuffix(a.Annotations["runbook_url"], want) {
			t.Errorf("%s runbook_url = %q, want it to end in %s", a.Alert, a.Annotations["runbook_url"], want)
		}
		if !strings.Contains(doc, "\n### "+a.Alert+"\n") {
			t.Errorf("%s has no runbook heading \"### %s\"", runbooks, a.Alert)
		}
		if !regexp.MustCompile(`alertname: ` + a.Alert + `\n\s+exp_alerts:\n\s+- `).MatchString(tests) {
			t.Errorf("%s has no promtool test in which it fires (%s)", a.Alert, rulesTestFile)
		}
		if a.Labels["severity"] == "" || a.Annotations["summary"] == "" || a.Annotations["description"] == "" {
			t.Errorf("%s lacks a severity label, summary or description", a.Alert)
		}
	}
}

// panelTarget is one query of the dashboard.
type panelTarget struct {
	panel, ref, expr string
	instant          bool
}

type dashboard struct {
	UID        string `json:"uid"`
	Title      string `json:"title"`
	Templating struct {
		List []struct {
			Name  string `json:"name"`
			Type  string `json:"type"`
			Query any    `json:"query"`
		} `json:"list"`
	} `json:"templating"`
	Panels []panel `json:"panels"`
}

type panel struct {
	ID         int            `json:"id"`
	Type       string         `json:"type"`
	Title      string         `json:"title"`
	Datasource map[string]any `json:"datasource"`
	GridPos    struct{ H, W, X, Y int }
	Panels     []panel `json:"panels"`
	Targets    []struct {
		Datasource   map[string]any `json:"datasource"`
		Expr         string         `json:"expr"`
		LegendFormat string         `json:"legendFormat"`
		RefID        string         `json:"refId"`
		Instant      bool           `json:"instant"`
	} `json:"targets"`
}

func loadDashboard(t *testing.T) (dashboard, []panel) {
	t.Helper()
	var d dashboard
	if err := json.Unmarshal(readFile(t, dashboardFile), &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	var flat []panel
	var walk func([]panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			flat = append(flat, p)
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	return d, flat
}

func dashboardTargets(t *testing.T) []panelTarget {
	t.Helper()
	_, panels := loadDashboard(t)
	var out []panelTarget
	for _, p := range panels {
		for _, tg := range p.Targets {
			out = append(out, panelTarget{panel: p.Title, ref: tg.RefID, expr: tg.Expr, instant: tg.Instant})
		}
	}
	return out
}

func TestDashboardShape(t *testing.T) {
	d, panels := loadDashboard(t)
	if d.UID != "mountmedic-overview" {
		t.Errorf("uid = %q: keep mountmedic-overview, links and provisioning depend on it", d.UID)
	}
	vars := make(map[string]string)
	for _, v := range d.Templating.List {
		q, _ := json.Marshal(v.Query)
		vars[v.Name] = v.Type + " " + string(q)
	}
	for name, want := range map[string]string{
		"datasource": `datasource "prometheus"`,
		"node":       `label_values(mountmedic_build_info, node)`,
		"driver":     `label_values(mountmedic_stale_mounts{node=~\"$node\"}, driver)`,
	} {
		if !strings.Contains(vars[name], want) {
			t.Errorf("variable %s = %s, want it to contain %s", name, vars[name], want)
		}
	}
	ids := make(map[int]string)
	for _, p := range panels {
		if prev, dup := ids[p.ID]; dup {
			t.Errorf("panels %q and %q share id %d", prev, p.Title, p.ID)
		}
		ids[p.ID] = p.Title
		if p.GridPos.X+p.GridPos.W > 24 || p.GridPos.W <= 0 || p.GridPos.H <= 0 {
			t.Errorf("panel %q gridPos %+v does not fit the 24-column grid", p.Title, p.GridPos)
		}
		if p.Type == "row" {
			continue
		}
		if p.Datasource["uid"] != "${datasource}" || len(p.Targets) == 0 {
			t.Errorf("panel %q: datasource %v, %d queries: want ${datasource} and at least one query", p.Title, p.Datasource, len(p.Targets))
		}
		for _, tg := range p.Targets {
			if tg.Datasource["uid"] != "${datasource}" || tg.Expr == "" {
				t.Errorf("panel %q query %s: datasource %v expr %q", p.Title, tg.RefID, tg.Datasource, tg.Expr)
			}
		}
	}
	// What the issue asks the dashboard to show.
	all := ""
	for _, tg := range dashboardTargets(t) {
		all += tg.expr + "\n"
	}
	for _, m := range []string{"mountmedic_stale_mounts", "mountmedic_probe_duration_seconds_bucket", "mountmedic_hung_probes",
		"mountmedic_repairs_total", "mountmedic_repair_duration_seconds_bucket", "mountmedic_evictions_total", "mountmedic_failover_failovers_total",
		"mountmedic_failover_node_fenced", "mountmedic_failover_heartbeat_renewals_total", "mountmedic_failover_leader"} {
		if !strings.Contains(all, m) {
			t.Errorf("no dashboard query uses %s", m)
		}
	}
}

// TestGrafanaConfigMap: the kustomization ships the dashboard file as is,
// labelled for Grafana's sidecar.
func TestGrafanaConfigMap(t *testing.T) {
	cm := find(t, kustomize(t, "grafana"), "ConfigMap", "mountmedic-dashboard")
	var data struct {
		Data map[string]string `json:"data"`
	}
	if err := yaml.Unmarshal(cm.raw, &data); err != nil {
		t.Fatal(err)
	}
	if cm.Metadata.Labels["grafana_dashboard"] != "1" {
		t.Errorf("ConfigMap labels %v: the sidecar loads ConfigMaps labelled grafana_dashboard=1", cm.Metadata.Labels)
	}
	if data.Data["mountmedic.json"] != string(readFile(t, dashboardFile)) {
		t.Errorf("ConfigMap data mountmedic.json differs from %s", dashboardFile)
	}
}

var metricName = regexp.MustCompile(`\b(mountmedic_[a-z_]+|process_[a-z_]+|go_[a-z_]+)\b`)

// TestQueriesUseExportedMetrics checks every metric name that a dashboard
// query or an alert names against the capture of a real agent's /metrics
// (testdata/metrics.txt, which the live test writes with -update and
// compares), so that a renamed metric fails here, without root.
func TestQueriesUseExportedMetrics(t *testing.T) {
	exported := make(map[string]bool)
	for _, capture := range []string{metricsCapture, controllerCapture} {
		parser := expfmt.NewTextParser(model.LegacyValidation)
		families, err := parser.TextToMetricFamilies(bytes.NewReader(readFile(t, capture)))
		if err != nil {
			t.Fatalf("%s: %v", capture, err)
		}
		for name, f := range families {
			exported[name] = true
			if f.GetType().String() == "HISTOGRAM" {
				for _, s := range []string{"_bucket", "_sum", "_count"} {
					exported[name+s] = true
				}
			}
		}
	}
	var exprs []string
	for _, tg := range dashboardTargets(t) {
		exprs = append(exprs, tg.expr)
	}
	for _, a := range alerts(t) {
		exprs = append(exprs, a.Expr)
	}
	var missing []string
	for _, e := range exprs {
		for _, m := range metricName.FindAllString(e, -1) {
			if !exported[m] && !slices.Contains(missing, m) {
				missing = append(missing, m)
			}
		}
	}
	if len(missing) > 0 {
		t.Errorf("queries use metrics neither the agent nor the controller exports (per %s and %s): %v", metricsCapture, controllerCapture, missing)
	}
}
