package e2e_test

import (
	"bytes"
	"os/exec"
	"reflect"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/mountmedic/mountmedic/scripts/lab"
)

// TestLabOverlays checks that each layout's overlay (what the e2e node
// runs) is the DaemonSet a user of that layout applies, changed only where
// the lab needs it (scripts/e2e/deploy/lab): kubeadm's is deploy/ as
// shipped, k3s' the base with the k3s profile's Component, exactly as
// deploy/profiles/README.md gives it. A friendlier profile in the lab
// than in the repository would make TestK3s prove nothing.
func TestLabOverlays(t *testing.T) {
	kubectl := lab.RequireTool(t, "kubectl")
	for name, dirs := range map[string]struct{ user, lab string }{
		"kubeadm": {user: "../../deploy", lab: "deploy"},
		"k3s":     {user: "k3s/user", lab: "k3s"},
	} {
		t.Run(name, func(t *testing.T) {
			want := renderDir(t, kubectl, dirs.user)
			got := renderDir(t, kubectl, dirs.lab)
			if len(got) != len(want) {
				t.Fatalf("%s renders %d objects, %s %d", dirs.lab, len(got), dirs.user, len(want))
			}
			found := false
			for i := range want {
				if want[i]["kind"] == "DaemonSet" {
					labEdits(t, want[i])
					found = true
				}
				if !reflect.DeepEqual(got[i], want[i]) {
					g, _ := yaml.Marshal(got[i])
					w, _ := yaml.Marshal(want[i])
					t.Errorf("object %d of %s differs from %s with the lab's changes:\n--- got\n%s\n--- want\n%s", i, dirs.lab, dirs.user, g, w)
				}
			}
			if !found {
				t.Errorf("%s renders no DaemonSet", dirs.user)
			}
		})
	}
}

// labEdits makes in a rendered DaemonSet (as a map) the changes that
// scripts/e2e/deploy/lab makes.
func labEdits(t *testing.T, ds map[string]any) {
	t.Helper()
	spec := dig(t, ds, "spec", "template", "spec")
	spec["hostNetwork"] = true
	spec["dnsPolicy"] = "ClusterFirstWithHostNet"
	c := spec["containers"].([]any)[0].(map[string]any)
	c["image"] = "mountmedic:e2e"
	c["imagePullPolicy"] = "Never"
	for _, probe := range []string{"livenessProbe", "readinessProbe"} {
		dig(t, c, probe, "httpGet")["host"] = "127.0.0.1"
	}
}

// dig returns the map at path in m.
func dig(t *testing.T, m map[string]any, path ...string) map[string]any {
	t.Helper()
	for _, k := range path {
		next, ok := m[k].(map[string]any)
		if !ok {
			t.Fatalf("no map at %q (%v)", k, path)
		}
		m = next
	}
	return m
}

// renderDir renders a kustomization directory with the pinned kubectl.
func renderDir(t *testing.T, kubectl, dir string) []map[string]any {
	t.Helper()
	out, err := exec.Command(kubectl, "kustomize", dir).Output()
	if err != nil {
		t.Fatalf("kubectl kustomize %s: %v", dir, err)
	}
	var objs []map[string]any
	for _, doc := range bytes.Split(out, []byte("\n---\n")) {
		var o map[string]any
		if err := yaml.Unmarshal(doc, &o); err != nil {
			t.Fatalf("decode %s: %v", dir, err)
		}
		if o != nil {
			objs = append(objs, o)
		}
	}
	return objs
}
