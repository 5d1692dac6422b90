package agent

import (
	"context"
	"errors"
	"fmt"
	"strings"

	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/agent/kubeclient"
)

// The agent's identity modes (--identity).
//
// IdentityNode acts with the node's own credentials, the kubelet's
// (NewNodeClient): the Node authorizer and NodeRestriction confine them.
//
// IdentityServiceAccount acts with the agent's ServiceAccount token that
// kubelet projects into its pod, for nodes whose kubelet credentials the
// agent cannot use (EKS: an exec credential plugin) or where the user
// prefers it. The API server binds that token to the pod and puts the
// pod's node into the request's user as the extra
// authentication.kubernetes.io/node-name (k8s.io/apiserver
// pkg/authentication/serviceaccount/util.go NodeNameKey; feature
// ServiceAccountTokenPodNodeInfo, on by default since 1.30 and GA in 1.32).
// RBAC grants the ServiceAccount its verbs cluster-wide; the
// ValidatingAdmissionPolicies of deploy/identity/serviceaccount hold every
// write to the node that extra names. Reads cannot be held by an admission
// policy: docs/security.md says what each mode reads.
const (
	IdentityNode           = "node"
	IdentityServiceAccount = "serviceaccount"
)

// NodeNameExtra is the user extra in which the API server names the node
// of a pod-bound ServiceAccount token.
const NodeNameExtra = "authentication.kubernetes.io/node-name"

// ErrNotNodeBound is wrapped by the errors of ServiceAccount credentials
// whose token is not bound to this node.
var ErrNotNodeBound = errors.New("not a ServiceAccount token bound to this node")

// ServiceAccountPrefix starts the user name of every ServiceAccount.
const ServiceAccountPrefix = "system:serviceaccount:"

// NewServiceAccountClient makes the client the agent acts with in
// IdentityServiceAccount mode from rc (the pod's in-cluster token, or
// --kubeconfig), rate-limited like the node identity (cfg.APIQPS,
// cfg.APIBurst).
func NewServiceAccountClient(cfg Config, rc *rest.Config) (kubernetes.Interface, error) {
	rc = rest.CopyConfig(rc)
	rc.UserAgent = "mountmedic/" + cfg.Version
	rc.QPS, rc.Burst = DefaultAPIQPS, DefaultAPIBurst
	if cfg.APIQPS > 0 {
		rc.QPS = cfg.APIQPS
	}
	if cfg.APIBurst > 0 {
		rc.Burst = cfg.APIBurst
	}
	c, err := kubeclient.New(rc)
	if err != nil {
		return nil, fmt.Errorf("--identity=serviceaccount: kubernetes client: %w", err)
	}
	return c, nil
}

// CheckServiceAccountIdentity asks the API server who client is and
// returns an error wrapping ErrNotNodeBound unless it is a ServiceAccount
// whose token names node (and only node) as its node: the admission
// policies hold such a token to that node's objects, and refuse every
// write of a token that names none. An unreachable API server is
// returned as is. Like CheckNodeIdentity, it logs an error when the
// identity may list Secrets across the cluster.
func CheckServiceAccountIdentity(ctx context.Context, client kubernetes.Interface, node string) error {
	ssr, err := client.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("ask the API server who the ServiceAccount credentials are (SelfSubjectReview): %w", err)
	}
	u := ssr.Status.UserInfo
	if err := judgeServiceAccount(u, node); err != nil {
		return err
	}
	sar, err := client.AuthorizationV1().SelfSubjectAccessReviews().Create(ctx, &authorizationv1.SelfSubjectAccessReview{
		Spec: authorizationv1.SelfSubjectAccessReviewSpec{ResourceAttributes: &authorizationv1.ResourceAttributes{Verb: "list", Resource: "secrets"}},
	}, metav1.CreateOptions{})
	if err == nil && sar.Status.Allowed {
		klog.FromContext(ctx).Error(nil, "The agent's ServiceAccount may list every Secret in the cluster: bind it only to the ClusterRole mountmedic-agent (deploy/identity/serviceaccount)",
			"user", u.Username)
	}
	return nil
}

// judgeServiceAccount checks that u is a ServiceAccount whose token names
// node as its node.
func judgeServiceAccount(u authenticationv1.UserInfo, node string) error {
	if !strings.HasPrefix(u.Username, ServiceAccountPrefix) {
		return fmt.Errorf("%w: the credentials are user %q, want the agent's ServiceAccount (%s<namespace>:mountmedic): with --identity=serviceaccount give the pod's own token (no --kubeconfig) or a kubeconfig of that ServiceAccount",
			ErrNotNodeBound, u.Username, ServiceAccountPrefix)
	}
	nodes := u.Extra[NodeNameExtra]
	if len(nodes) != 1 || nodes[0] != node {
		return fmt.Errorf("%w: the token of %s names node %q in %s, want %q: use the token kubelet projects into the agent's pod (bound to the pod, so the API server names its node; Kubernetes 1.30 or later, feature ServiceAccountTokenPodNodeInfo), and let --node-name be the pod's spec.nodeName",
			ErrNotNodeBound, u.Username, nodes, NodeNameExtra, node)
	}
	return nil
}
