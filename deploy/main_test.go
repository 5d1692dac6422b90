// Package deploy_test checks what deploy/ ships against the real parts it is
// meant for: the kustomizations against a real kube-apiserver (server-side
// dry run, and a real apply whose RBAC the agent then runs under), the
// DaemonSet's flags against `mountmedic agent --help`, the alert rules with
// promtool, and every dashboard query and alert expression against a real
// Prometheus scraping a real agent in the fault lab (live_test.go).
//
// Tools: kubectl (and etcd, kube-apiserver) from scripts/tools.sh,
// prometheus and promtool from Debian (scripts/deps.sh). A missing tool
// skips a test, or fails it when MOUNTMEDIC_REQUIRE_ROOT=1 (CI): see
// lab.RequireTool and lab.RequireBinary.
package deploy_test

import (
	"bufio"
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"

	"github.com/mountmedic/mountmedic/scripts/lab"
)

var update = flag.Bool("update", false, "rewrite generated files (prometheus/prometheusrule.yaml, the Helm chart's templates, docs/configuration.md's flag rows) and the metrics capture (testdata/metrics.txt)")

func TestMain(m *testing.M) {
	code := lab.Run(m)
	if built.dir != "" {
		os.RemoveAll(built.dir)
	}
	os.Exit(code)
}

// promtool is Prometheus's rule and metrics checker (Debian's prometheus
// package, scripts/deps.sh).
func promtool(t *testing.T) string {
	t.Helper()
	return lab.RequireBinary(t, "promtool")
}

// kubectl is the pinned kubectl that scripts/tools.sh builds (its built-in
// kustomize renders the kustomizations), never whichever one is on PATH.
func kubectl(t *testing.T) string {
	t.Helper()
	return lab.RequireTool(t, "kubectl")
}

// run runs a program and returns its standard output; on failure it fails
// the test with the program's output.
func run(t *testing.T, dir string, name string, args ...string) []byte {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("%s %s: %v\n%s%s", filepath.Base(name), strings.Join(args, " "), err, stdout.String(), stderr.String())
	}
	return stdout.Bytes()
}

// built is the command, built once for all the tests that run it; TestMain
// removes it.
var built struct {
	once     sync.Once
	dir, bin string
	err      error
}

// buildMountmedic returns the command built from this checkout.
func buildMountmedic(t *testing.T) string {
	t.Helper()
	built.once.Do(func() {
		if built.dir, built.err = os.MkdirTemp("", "mountmedic-deploy-test-"); built.err != nil {
			return
		}
		bin := filepath.Join(built.dir, "mountmedic")
		cmd := exec.Command("go", "build", "-o", bin, "./cmd/mountmedic")
		cmd.Dir = ".."
		if out, err := cmd.CombinedOutput(); err != nil {
			built.err = fmt.Errorf("go build ./cmd/mountmedic: %w\n%s", err, out)
			return
		}
		built.bin = bin
	})
	if built.err != nil {
		t.Fatal(built.err)
	}
	return built.bin
}

// object is one decoded manifest.
type object struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Metadata   struct {
		Name        string            `json:"name"`
		Namespace   string            `json:"namespace"`
		Labels      map[string]string `json:"labels"`
		Annotations map[string]string `json:"annotations"`
	} `json:"metadata"`
	raw []byte
}

// decodeAll splits a multi-document YAML stream into objects.
func decodeAll(t *testing.T, data []byte) []object {
	t.Helper()
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	var out []object
	for {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatalf("split YAML: %v", err)
		}
		if len(bytes.TrimSpace(doc)) == 0 {
			continue
		}
		var o object
		if err := yaml.Unmarshal(doc, &o); err != nil {
			t.Fatalf("decode manifest: %v\n%s", err, doc)
		}
		if o.Kind == "" {
			continue
		}
		o.raw = doc
		out = append(out, o)
	}
}

// kustomize renders a kustomization directory with the pinned kubectl.
func kustomize(t *testing.T, dir string) []object {
	t.Helper()
	return decodeAll(t, run(t, ".", kubectl(t), "kustomize", dir))
}

// find returns the only object of kind named name.
func find(t *testing.T, objs []object, kind, name string) object {
	t.Helper()
	for _, o := range objs {
		if o.Kind == kind && o.Metadata.Name == name {
			return o
		}
	}
	t.Fatalf("no %s %q among the rendered objects", kind, name)
	return object{}
}
