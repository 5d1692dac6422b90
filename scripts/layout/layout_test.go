package layout

import (
	"bufio"
	"bytes"
	"os/exec"
	"strings"
	"testing"
)

const module = "github.com/mountmedic/mountmedic"

// productionTrees hold the packages that ship in the binary: every package
// under them is production code. Test support lives under scripts/ only.
var productionTrees = []string{"./cmd/...", "./agent/...", "./probe/...", "./remount/..."}

// production lists the packages under productionTrees (go list), relative to
// the module, so that a package added there is checked without an edit here.
func production(t *testing.T) []string {
	t.Helper()
	cmd := exec.Command("go", append([]string{"list", "-f", "{{.ImportPath}}"}, productionTrees...)...)
	cmd.Dir = "../.."
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("go list %v: %v", productionTrees, err)
	}
	var pkgs []string
	for line := range strings.SplitSeq(strings.TrimSpace(string(out)), "\n") {
		pkgs = append(pkgs, strings.TrimPrefix(line, module+"/"))
	}
	if len(pkgs) < 6 {
		t.Fatalf("go list %v found only %v", productionTrees, pkgs)
	}
	return pkgs
}

// testSupport is what no production package may depend on, directly or
// through another package.
var testSupport = []string{
	"testing",
	module + "/scripts/",
	"github.com/hanwen/go-fuse/",
}

// forbidden is what each package's doc says it must not import, directly
// or through another package: a prefix of an import path. A prefix ending
// in "/" names a tree; one without names that package and its subtree.
var forbidden = map[string][]string{
	// probe: pure data in, results out; no Kubernetes client, nothing that
	// acts. API types reach it only as data, through probe/kubelet.
	"probe": {"k8s.io/client-go", module + "/remount", module + "/agent", module + "/cmd"},
	// probe/kubelet: kubelet's conventions (paths, CSI requests from API
	// objects), pure functions; below probe, so it imports no probe either.
	"probe/kubelet": {"k8s.io/client-go", module + "/probe", module + "/remount", module + "/agent", module + "/cmd"},
	// remount: acts on mounts and the CSI/CRI sockets; no informers, no
	// API client, no agent.
	"remount": {"k8s.io/client-go", module + "/agent", module + "/cmd"},
	// agent: the long-running process; the command wires it, not the
	// reverse.
	"agent":          {module + "/cmd"},
	"agent/failover": {module + "/cmd"},
	"agent/status":   {module + "/cmd"},
	// statuscmd and the agent's command: no k8s.io/cli-runtime (18 MB of
	// the binary); only the kubectl plugin's command carries it.
	"agent/status/statuscmd": {module + "/cmd", "k8s.io/cli-runtime"},
	"cmd/mountmedic":         {"k8s.io/cli-runtime"},
}

// deps is the transitive, non-test dependency list of pkg (go list -deps).
func deps(t *testing.T, pkg string) []string {
	t.Helper()
	out, err := exec.Command("go", "list", "-deps", "-f", "{{.ImportPath}}", module+"/"+pkg).Output()
	if err != nil {
		var stderr []byte
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = ee.Stderr
		}
		t.Fatalf("go list -deps %s: %v\n%s", pkg, err, stderr)
	}
	var list []string
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		if p := strings.TrimSpace(sc.Text()); p != "" && p != module+"/"+pkg {
			list = append(list, p)
		}
	}
	return list
}

// matches reports whether path is prefix, or under it.
func matches(path, prefix string) bool {
	if strings.HasSuffix(prefix, "/") {
		return strings.HasPrefix(path, prefix)
	}
	return path == prefix || strings.HasPrefix(path, prefix+"/")
}

// why is the import chain from pkg to dep (go list's ImportStack through
// `go mod why -m` is module-level, so walk the direct imports instead).
func why(t *testing.T, pkg, dep string) string {
	out, err := exec.Command("go", "list", "-deps", "-f", `{{.ImportPath}}{{range .Imports}} {{.}}{{end}}`, module+"/"+pkg).Output()
	if err != nil {
		return "(no chain: " + err.Error() + ")"
	}
	imports := map[string][]string{}
	for line := range strings.SplitSeq(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) > 0 {
			imports[f[0]] = f[1:]
		}
	}
	start := module + "/" + pkg
	prev := map[string]string{start: ""}
	queue := []string{start}
	for len(queue) > 0 {
		p := queue[0]
		queue = queue[1:]
		if p == dep {
			var chain []string
			for ; p != ""; p = prev[p] {
				chain = append([]string{strings.TrimPrefix(p, module+"/")}, chain...)
			}
			return strings.Join(chain, " -> ")
		}
		for _, q := range imports[p] {
			if _, seen := prev[q]; !seen {
				prev[q] = p
				queue = append(queue, q)
			}
		}
	}
	return "(no chain found)"
}

func TestImportRules(t *testing.T) {
	for _, pkg := range production(t) {
		t.Run(pkg, func(t *testing.T) {
			rules := append(append([]string(nil), testSupport...), forbidden[pkg]...)
			for _, d := range deps(t, pkg) {
				for _, rule := range rules {
					if matches(d, rule) {
						t.Errorf("%s depends on %s, which it must not (rule %q): %s", pkg, d, rule, why(t, pkg, d))
					}
				}
			}
		})
	}
}

// The rules above must be able to fail: the test support packages really
// depend on what the rules forbid production code to.
func TestImportRulesCanFail(t *testing.T) {
	found := false
	for _, d := range deps(t, "scripts/kubetest") {
		if matches(d, module+"/scripts/lab") {
			found = true
		}
	}
	if !found {
		t.Errorf("scripts/kubetest does not depend on scripts/lab: the test-support rule checks nothing")
	}
	for _, pkg := range production(t) {
		if strings.HasPrefix(pkg, "scripts/") || strings.Contains(pkg, "/lab") {
			t.Errorf("production package %s is test support", pkg)
		}
	}
	if !matches("k8s.io/client-go/kubernetes", "k8s.io/client-go") || matches("k8s.io/client-gox", "k8s.io/client-go") {
		t.Errorf("matches does not tell a subtree from a sibling")
	}
}
