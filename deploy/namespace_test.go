package deploy_test

import (
	"regexp"
	"testing"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	"sigs.k8s.io/yaml"
)

// TestAgentServiceAccountName checks, for installs in the base namespace
// and in another (a kustomize overlay's namespace, a Helm release's), that
// the agent runs as the ServiceAccount the --identity=serviceaccount
// policies match: each policy's agent-service-account condition (a regular
// expression, RE2 in CEL as in Go) matches the DaemonSet's account in the
// install's namespace. A policy that stopped matching it would leave that
// account's cluster-wide grants unconfined.
func TestAgentServiceAccountName(t *testing.T) {
	call := regexp.MustCompile(`^request\.userInfo\.username\.matches\('([^']+)'\)$`)
	for _, ns := range []string{baseNamespace, "ops"} {
		overlay := "namespace: " + ns + "\n" + componentOverlay("identity/serviceaccount")
		renders := map[string][]object{
			"kustomize": renderOverlay(t, "sa-name-"+ns, overlay),
			"helm":      helmTemplate(t, ns, "identity=serviceaccount"),
		}
		for how, objs := range renders {
			ds := decodeDaemonSet(t, objs)
			user := "system:serviceaccount:" + ns + ":" + ds.Spec.Template.Spec.ServiceAccountName
			for _, name := range []string{"mountmedic-agent-node-writes", "mountmedic-agent-evictions"} {
				var p admissionregistrationv1.ValidatingAdmissionPolicy
				if err := yaml.Unmarshal(find(t, objs, "ValidatingAdmissionPolicy", name).raw, &p); err != nil {
					t.Fatal(err)
				}
				matched := false
				for _, mc := range p.Spec.MatchConditions {
					if mc.Name != "agent-service-account" {
						continue
					}
					g := call.FindStringSubmatch(mc.Expression)
					if g == nil {
						t.Fatalf("%s (%s, namespace %s): condition %q is not a username.matches('...') call", name, how, ns, mc.Expression)
					}
					matched = regexp.MustCompile(g[1]).MatchString(user)
				}
				if !matched {
					t.Errorf("%s (%s, namespace %s) does not match the agent's user %s", name, how, ns, user)
				}
			}
		}
	}
}
