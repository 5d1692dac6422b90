package deploy_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mountmedic/mountmedic/scripts/kubetest"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// The pages whose kubectl and helm commands users copy (paths from the
// repository's root).
var docPages = []string{"README.md", "deploy/README.md", "deploy/profiles/README.md",
	"docs/agent.md", "docs/alerts.md", "docs/configuration.md", "docs/drivers.md", "docs/failover.md",
	"docs/install.md", "docs/kernel-facts.md", "docs/nbd.md", "docs/operations.md", "docs/remount.md", "docs/security.md"}

// docCommand is one kubectl or helm command of a page: a line of a code
// block (continuation lines joined), or an inline code span.
type docCommand struct {
	page string
	line int
	text string
	// helm: the command is in a code block that installs with helm; those
	// run on a cluster of their own, the others on one where deploy/ is
	// applied with kubectl.
	helm bool
}

func (c docCommand) String() string { return fmt.Sprintf("%s:%d: %s", c.page, c.line, c.text) }

var (
	reDocFence   = regexp.MustCompile("^\\s*```")
	reDocCommand = regexp.MustCompile(`^(kubectl|helm)\s`)
	reDocInline  = regexp.MustCompile("`((?:kubectl|helm) [^`]*)`")
)

// docCommands extracts every kubectl and helm command of the pages, in page
// order.
func docCommands(t *testing.T) []docCommand {
	t.Helper()
	var out []docCommand
	for _, page := range docPages {
		data, err := os.ReadFile(filepath.Join("..", page))
		if err != nil {
			t.Fatal(err)
		}
		lines := strings.Split(string(data), "\n")
		var block []docCommand
		inBlock, helm := false, false
		var cont *docCommand
		for i, l := range lines {
			if reDocFence.MatchString(l) {
				if inBlock {
					for j := range block {
						block[j].helm = helm
					}
					out = append(out, block...)
					block, helm, cont = nil, false, nil
				}
				inBlock = !inBlock
				continue
			}
			if !inBlock {
				continue
			}
			s := strings.TrimSpace(l)
			if cont != nil {
				cont.text += " " + s
			} else if reDocCommand.MatchString(s) {
				block = append(block, docCommand{page: page, line: i + 1, text: s})
				cont = &block[len(block)-1]
				helm = helm || strings.HasPrefix(s, "helm ")
			} else {
				continue
			}
			if strings.HasSuffix(cont.text, "\\") {
				cont.text = strings.TrimSpace(strings.TrimSuffix(cont.text, "\\"))
				continue
			}
			cont = nil
		}
		// Inline code spans outside the code blocks (a span may wrap a line).
		prose := removeBlocks(string(data))
		for _, m := range reDocInline.FindAllStringSubmatchIndex(prose, -1) {
			text := strings.Join(strings.Fields(prose[m[2]:m[3]]), " ")
			out = append(out, docCommand{page: page, line: strings.Count(prose[:m[0]], "\n") + 1, text: text})
		}
	}
	return out
}

// removeBlocks blanks the code blocks of a page, keeping its line count.
func removeBlocks(page string) string {
	lines := strings.Split(page, "\n")
	in := false
	for i, l := range lines {
		fence := reDocFence.MatchString(l)
		if in || fence {
			lines[i] = ""
		}
		if fence {
			in = !in
		}
	}
	return strings.Join(lines, "\n")
}

// notRunHere are the commands of the pages this test cannot run, each with
// the reason (and where it is tested otherwise). A page's command missing
// from this list runs; an entry no page has any more fails the test.
var notRunHere = map[string]string{
	"helm push out/mountmedic-1.2.3.tgz oci://registry.example.com/charts":                                                           "a remote registry; TestChartFromOCIRegistry runs it against a local one",
	"helm install mountmedic oci://registry.example.com/charts/mountmedic --version 1.2.3 -n mountmedic":                             "a remote registry; TestChartFromOCIRegistry runs it against a local one",
	"kubectl -n mountmedic port-forward ds/mountmedic 9809 &":                                                                        "goes through the kubelet of a running agent pod; the e2e node's agent serves these endpoints",
	"kubectl -n mountmedic logs POD | grep -i heartbeat":                                                                             "reads a container's log through its kubelet",
	"kubectl -n mountmedic logs POD | grep -i repair":                                                                                "reads a container's log through its kubelet",
	"kubectl krew install --manifest=/tmp/plugin/mountmedic.yaml --archive=/tmp/plugin/kubectl-mountmedic_v0.1.0_linux_amd64.tar.gz": "needs krew; cmd/kubectl-mountmedic's krew test checks the manifest and archive, and this test runs the plugin from PATH",
	"kubectl delete -k overlays/failover/ --ignore-not-found   # your overlay with deploy/controller/, if any":                       "the user's overlay; TestInstallDocFailoverOverlays renders it from install.md",
	// Names of a command in prose, not commands.
	"helm lint --strict":                    "a command's name in prose; TestChartLint runs it",
	"helm install":                          "a command's name in prose",
	"helm install --create-namespace":       "a command's name in prose (the page explains why not to)",
	"helm template | kubectl apply":         "a pipeline's shape in prose; TestProfilesApply applies the chart's render",
	"helm template | kubectl apply -f -":    "a pipeline's shape in prose; TestProfilesApply applies the chart's render",
	"kubectl apply -k ... --dry-run=server": "a command's shape in prose; TestApplyServerDryRun runs it on every kustomization",
	"kubectl describe":                      "a command's name in prose",
}

// placeholders are what the pages write for a name the user fills in, and
// the lab's object that takes its place.
var placeholders = strings.NewReplacer("NODE", "node-a", "worker-3", "node-a", "<node>", "node-a")

// TestDocCommands runs the kubectl and helm commands of the README and the
// docs, extracted from the pages (so an edit of a page is tested), against
// a real kube-apiserver: those of kubectl's install on a cluster where
// they are applied in page order with deploy/ installed, those of code
// blocks that install with helm on a second cluster. A command fails the
// test when it exits non-zero, as kubectl does on an API error (a field
// selector the API server rejects, an unknown resource, a missing
// object). The plugin runs as `kubectl mountmedic`, built onto PATH.
// Commands that delete run last.
func TestDocCommands(t *testing.T) {
	cmds := docCommands(t)
	seen := map[string]bool{}
	var kube, helm, destructive []docCommand
	for _, c := range cmds {
		seen[c.text] = true
		switch _, skip := notRunHere[c.text]; {
		case skip:
			t.Logf("not run: %s (%s)", c, notRunHere[c.text])
		case c.helm:
			helm = append(helm, c)
		case strings.Contains(c.text, " delete ") || strings.HasSuffix(c.text, "out-of-service-"):
			destructive = append(destructive, c)
		default:
			kube = append(kube, c)
		}
	}
	for text := range notRunHere {
		if !seen[text] {
			t.Errorf("notRunHere lists %q, which no page has any more: remove it", text)
		}
	}
	if len(kube) < 10 || len(helm) < 3 {
		t.Fatalf("found %d kubectl and %d helm commands in the pages: the extraction is broken", len(kube), len(helm))
	}
	env := docEnv(t)

	t.Run("kubectl", func(t *testing.T) {
		c := kubetest.Start(t, kubetest.Options{Controllers: kubetest.DefaultControllers})
		ctx := context.Background()
		crds := operatorCRDs(t)
		for _, crd := range []string{"podmonitors", "prometheusrules"} {
			runDoc(t, env, c, "kubectl apply --server-side -f "+filepath.Join(crds, "monitoring.coreos.com_"+crd+".yaml"))
		}
		if _, err := c.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a"}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		setup := func(cmd string) {
			switch {
			case strings.Contains(cmd, "rollout status ds/mountmedic"):
				// No DaemonSet controller here: report the rollout done, as
				// it would on a cluster without nodes.
				rolledOut(ctx, t, c)
			case strings.Contains(cmd, "lease mountmedic-failover-leader"):
				// The controller's leader Lease (deploy/controller).
				_, err := c.Client.CoordinationV1().Leases(baseNamespace).Create(ctx, &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: "mountmedic-failover-leader"}}, metav1.CreateOptions{})
				if err != nil && !strings.Contains(err.Error(), "already exists") {
					t.Fatal(err)
				}
			case strings.HasSuffix(cmd, "out-of-service-"):
				// The failover duty's taint, which the page removes.
				n, err := c.Client.CoreV1().Nodes().Get(ctx, "node-a", metav1.GetOptions{})
				if err != nil {
					t.Fatal(err)
				}
				n.Spec.Taints = append(n.Spec.Taints, corev1.Taint{Key: "node.kubernetes.io/out-of-service", Value: "mountmedic", Effect: corev1.TaintEffectNoExecute})
				if _, err := c.Client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{}); err != nil {
					t.Fatal(err)
				}
			}
		}
		// kubectl apply -k deploy/ comes first in the README; later pages
		// assume it.
		// What a command must have done beyond exiting 0.
		after := func(cmd string) {
			if strings.HasPrefix(cmd, "kubectl delete -k deploy/grafana/") {
				if _, err := c.Client.CoreV1().ConfigMaps(baseNamespace).Get(ctx, "mountmedic-dashboard", metav1.GetOptions{}); err == nil {
					t.Errorf("%q left the dashboard's ConfigMap (deploy/grafana/) in place", cmd)
				}
			}
		}
		for _, cmd := range append(kube, destructive...) {
			setup(cmd.text)
			runDocCommand(t, env, c, cmd)
			after(cmd.text)
		}
	})

	t.Run("helm", func(t *testing.T) {
		c := kubetest.Start(t, kubetest.Options{})
		installed := map[string]string{}
		for _, cmd := range helm {
			// One release of a name at a time: a page's second install of
			// a release name is another way to install, not an upgrade.
			f := strings.Fields(cmd.text)
			if len(f) > 2 && f[0] == "helm" && f[1] == "install" {
				if ns, ok := installed[f[2]]; ok {
					runDoc(t, env, c, "helm uninstall "+f[2]+" -n "+ns+" --wait")
				}
				installed[f[2]] = flagOf(f, "-n")
			}
			runDocCommand(t, env, c, cmd)
		}
	})
}

// flagOf returns the value after flag in fields.
func flagOf(fields []string, flag string) string {
	if i := slices.Index(fields, flag); i >= 0 && i+1 < len(fields) {
		return fields[i+1]
	}
	return ""
}

// docEnv is the environment the commands run in: kubectl, helm and the
// plugin (built as kubectl-mountmedic) on PATH, helm's homes in the test's
// directories.
func docEnv(t *testing.T) []string {
	t.Helper()
	plugins := t.TempDir()
	build := exec.Command("go", "build", "-o", filepath.Join(plugins, "kubectl-mountmedic"), "./cmd/kubectl-mountmedic")
	build.Dir = ".."
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build kubectl-mountmedic: %v\n%s", err, out)
	}
	path := strings.Join([]string{filepath.Dir(kubectl(t)), filepath.Dir(lab.RequireTool(t, "helm")), plugins, os.Getenv("PATH")}, ":")
	env := slices.DeleteFunc(os.Environ(), func(e string) bool { return strings.HasPrefix(e, "PATH=") || strings.HasPrefix(e, "KUBECONFIG=") })
	return append(env, "PATH="+path, "HELM_CACHE_HOME="+t.TempDir(), "HELM_CONFIG_HOME="+t.TempDir(), "HELM_DATA_HOME="+t.TempDir())
}

// runDocCommand runs a page's command, its placeholders filled in.
func runDocCommand(t *testing.T, env []string, c *kubetest.Cluster, cmd docCommand) {
	t.Helper()
	text := placeholders.Replace(cmd.text)
	out, err := shell(env, c, text)
	if err != nil {
		t.Errorf("%s\n$ %s\n%v\n%s", cmd, text, err, out)
		return
	}
	t.Logf("ran %s", cmd)
}

// runDoc runs a setup command of the test itself.
func runDoc(t *testing.T, env []string, c *kubetest.Cluster, text string) {
	t.Helper()
	if out, err := shell(env, c, text); err != nil {
		t.Fatalf("$ %s\n%v\n%s", text, err, out)
	}
}

// shell runs text with bash from the repository's root against c, within
// a minute (a command that waits for what never comes fails).
func shell(env []string, c *kubetest.Cluster, text string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "-o", "pipefail", "-c", text)
	cmd.Dir = ".."
	cmd.Env = append(slices.Clone(env), "KUBECONFIG="+c.Kubeconfig)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	return cmd.CombinedOutput()
}

// rolledOut writes the DaemonSet's status as its controller would with no
// node to run on.
func rolledOut(ctx context.Context, t *testing.T, c *kubetest.Cluster) {
	t.Helper()
	ds, err := c.Client.AppsV1().DaemonSets(baseNamespace).Get(ctx, "mountmedic", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	ds.Status = appsv1.DaemonSetStatus{ObservedGeneration: ds.Generation}
	if _, err := c.Client.AppsV1().DaemonSets(baseNamespace).UpdateStatus(ctx, ds, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}
