package agent

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"

	"k8s.io/client-go/rest"
)

// DefaultServiceAccountName is the agent's ServiceAccount as deploy/ and
// the chart at its defaults name it: the name the admission policies match
// (deploy/heartbeat-lease-policy.yaml, deploy/identity/serviceaccount).
const DefaultServiceAccountName = "mountmedic"

// DefaultControllerServiceAccountName is the failover controller's
// ServiceAccount as deploy/controller and the chart name it, which its
// admission policies match.
const DefaultControllerServiceAccountName = "mountmedic-controller"

// ErrServiceAccountName is wrapped by CheckServiceAccountName's errors:
// the agent or the controller runs as a ServiceAccount the admission
// policies do not match.
var ErrServiceAccountName = errors.New("the ServiceAccount is not the one the admission policies match")

// CheckServiceAccountName reads the ServiceAccount that rc's bearer token
// names (its subject claim, read without verifying the token: the API
// server verifies it at each request) and returns an error wrapping
// ErrServiceAccountName unless its name is want (--service-account-name).
// The policies match the ServiceAccount by name in CEL, which kustomize's
// namePrefix and nameSuffix do not rewrite: an install renamed that way
// leaves a stolen token of the renamed account unconfined, so the agent
// and the controller refuse to start in it. rc without a token, or a token that is no
// ServiceAccount's, is let be (the identity check judges it).
func CheckServiceAccountName(rc *rest.Config, want string) error {
	token := rc.BearerToken
	if token == "" && rc.BearerTokenFile != "" {
		data, err := os.ReadFile(rc.BearerTokenFile)
		if err != nil {
			return nil
		}
		token = strings.TrimSpace(string(data))
	}
	ns, name, ok := serviceAccountOfToken(token)
	if !ok || name == want {
		return nil
	}
	return fmt.Errorf("%w: it runs as the ServiceAccount %s/%s, but the admission policies it was installed with match the name %q (--service-account-name), so a stolen token of %s would not be confined by them. "+
		"A kustomize namePrefix or nameSuffix renames the ServiceAccount but not the policies' CEL: leave mountmedic's objects unrenamed, or install with the Helm chart's fullnameOverride, which renames the policies and sets --service-account-name (docs/install.md, \"Names\")",
		ErrServiceAccountName, ns, name, want, name)
}

// serviceAccountOfToken returns the namespace and name a ServiceAccount
// JWT's subject claim names (system:serviceaccount:<ns>:<name>).
func serviceAccountOfToken(token string) (ns, name string, ok bool) {
	parts := strings.Split(token, ".")
	if len(parts) != 3 {
		return "", "", false
	}
	payload, err := base64.RawURLEncoding.DecodeString(strings.TrimRight(parts[1], "="))
	if err != nil {
		return "", "", false
	}
	var claims struct {
		Sub string `json:"sub"`
	}
	if json.Unmarshal(payload, &claims) != nil {
		return "", "", false
	}
	rest, found := strings.CutPrefix(claims.Sub, ServiceAccountPrefix)
	if !found {
		return "", "", false
	}
	ns, name, found = strings.Cut(rest, ":")
	if !found || ns == "" || name == "" || strings.Contains(name, ":") {
		return "", "", false
	}
	return ns, name, true
}
