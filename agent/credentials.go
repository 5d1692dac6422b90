package agent

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"slices"

	authenticationv1 "k8s.io/api/authentication/v1"
	authorizationv1 "k8s.io/api/authorization/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/agent/kubeclient"
)

// The agent's credentials.
//
// Everything the agent asks of the API server for its node (its pods, their
// claims, volumes and CSI secrets, VolumeAttachments, evictions and
// deletions, events) goes with the node's own identity, the kubelet's
// credentials: system:node:<name> in group system:nodes. The API server's
// Node authorizer and the NodeRestriction admission plugin confine that
// identity to the node's own objects, which RBAC cannot express: Secrets,
// claims and PersistentVolumes only of pods bound to the node (a PV's
// nodeStageSecretRef and nodePublishSecretRef included), evictions and
// deletions only of pods bound to it, writes only to its own Node. The
// privileged agent can read the kubelet's credentials anyway (it is root on
// the node), so using them adds nothing to what a stolen agent has; a
// cluster-wide ServiceAccount grant would.
//
// The agent's ServiceAccount is used for one thing only: the failover
// heartbeat's Lease (failover.NewHeartbeatClient), which NodeRestriction keeps a node from
// writing outside kube-node-lease. deploy/ binds it to a Role on Leases in
// the agent's namespace, narrowed by a ValidatingAdmissionPolicy to the
// Lease named after the node its pod-bound token names.

// DefaultNodeKubeconfig is where kubeadm writes a node's kubelet
// kubeconfig; its client certificate is kubelet's rotating
// /var/lib/kubelet/pki/kubelet-client-current.pem.
const DefaultNodeKubeconfig = "/etc/kubernetes/kubelet.conf"

// NodeGroup is the group of every node identity.
const NodeGroup = "system:nodes"

// ErrNotNodeIdentity is wrapped by the errors of credentials that are not
// this node's own identity.
var ErrNotNodeIdentity = errors.New("not this node's identity")

// NodeUser is the user name of node's identity.
func NodeUser(node string) string { return "system:node:" + node }

// NewNodeClient makes the client the agent acts with: the identity of node
// cfg.NodeName from the kubeconfig file cfg.NodeKubeconfig (the kubelet's),
// rate-limited by cfg.APIQPS and cfg.APIBurst (zero: the defaults). When
// the kubeconfig names a client certificate, it must be node's
// (system:node:<node> in system:nodes); credentials that carry no
// certificate (a token, an exec plugin) are judged by CheckNodeIdentity
// once the API server answers.
//
// The certificate is kept as the files the kubeconfig names, never copied:
// client-go then reads them again at each new connection (at most once a
// second) and, every five minutes, closes its connections when they
// changed, so kubelet's certificate rotation reaches the agent.
func NewNodeClient(cfg Config) (kubernetes.Interface, error) {
	rc, err := NodeRESTConfig(cfg.NodeKubeconfig, cfg.NodeName)
	if err != nil {
		return nil, err
	}
	rc.UserAgent = "mountmedic/" + cfg.Version
	if cfg.APIQPS > 0 {
		rc.QPS = cfg.APIQPS
	}
	if cfg.APIBurst > 0 {
		rc.Burst = cfg.APIBurst
	}
	c, err := kubeclient.New(rc)
	if err != nil {
		return nil, fmt.Errorf("--node-kubeconfig %s: kubernetes client: %w", cfg.NodeKubeconfig, err)
	}
	return c, nil
}

// The agent's client-side rate limit on its node's identity: kubelet's own
// defaults (kubeAPIQPS 50, kubeAPIBurst 100). A storage outage that breaks
// every volume of a node sends about three reads per volume (its pods
// afresh, its claim and PV, which the node identity may only GET by name),
// and client-go's default of 5 a second made a thousand broken volumes wait
// 400 s for them. The API server's system-nodes FlowSchema puts a node
// identity's requests in a flow of that user alone: a burst shares its
// queue with that node's kubelet (its pod status writes; its Lease and Node
// status go to system-node-high), never with another node.
const (
	DefaultAPIQPS   = 50
	DefaultAPIBurst = 100
)

// NodeRESTConfig reads the node kubeconfig at path and checks what it can
// of its identity without the API server (see NewNodeClient).
func NodeRESTConfig(path, node string) (*rest.Config, error) {
	if path == "" {
		return nil, errors.New("--node-kubeconfig is empty: the agent acts with its node's own credentials; give the kubelet's kubeconfig (" + DefaultNodeKubeconfig + " on a kubeadm node)")
	}
	if _, err := os.Stat(path); err != nil {
		return nil, fmt.Errorf("--node-kubeconfig %s: %w: the agent acts with its node's own credentials; mount the kubelet's kubeconfig read-only into the pod (deploy/daemonset.yaml) or point --node-kubeconfig at the file kubelet's --kubeconfig names", path, err)
	}
	rc, err := clientcmd.BuildConfigFromFlags("", path)
	if err != nil {
		return nil, fmt.Errorf("--node-kubeconfig %s: %w", path, err)
	}
	rc.QPS, rc.Burst = DefaultAPIQPS, DefaultAPIBurst
	certPEM := rc.CertData
	if len(certPEM) == 0 && rc.CertFile != "" {
		if certPEM, err = os.ReadFile(rc.CertFile); err != nil {
			return nil, fmt.Errorf("--node-kubeconfig %s: client certificate: %w (kubelet's client certificate must be mounted at the path the kubeconfig names)", path, err)
		}
	}
	if len(certPEM) > 0 {
		user, groups, err := certIdentity(certPEM)
		if err != nil {
			return nil, fmt.Errorf("--node-kubeconfig %s: client certificate: %w", path, err)
		}
		if err := judgeIdentity(user, groups, node); err != nil {
			return nil, fmt.Errorf("--node-kubeconfig %s: %w", path, err)
		}
	}
	return rc, nil
}

// certIdentity returns the user and groups the API server reads from a
// client certificate: its subject's common name and organizations.
func certIdentity(certPEM []byte) (user string, groups []string, err error) {
	for rest := certPEM; ; {
		var b *pem.Block
		b, rest = pem.Decode(rest)
		if b == nil {
			return "", nil, errors.New("no CERTIFICATE block")
		}
		if b.Type != "CERTIFICATE" {
			continue
		}
		cert, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			return "", nil, fmt.Errorf("parse: %w", err)
		}
		return cert.Subject.CommonName, cert.Subject.Organization, nil
	}
}

// judgeIdentity checks that user and groups are node's own identity.
func judgeIdentity(user string, groups []string, node string) error {
	if user != NodeUser(node) || !slices.Contains(groups, NodeGroup) {
		return fmt.Errorf("%w: the credentials are user %q in groups %q, want %q in group %q (the kubelet's credentials of node %s; --node-name and --node-kubeconfig must name the same node)",
			ErrNotNodeIdentity, user, groups, NodeUser(node), NodeGroup, node)
	}
	return nil
}

// CheckNodeIdentity asks the API server who client is (a SelfSubjectReview)
// and returns an error wrapping ErrNotNodeIdentity when it is not node's
// own identity; an unreachable API server is returned as is, for the
// caller to retry or let be. It also logs an error when the identity may
// list Secrets across the cluster: the API server does not confine nodes
// (--authorization-mode without Node, or system:nodes bound to more than
// the Node authorizer grants), and the agent's credentials then reach far
// beyond its node.
func CheckNodeIdentity(ctx context.Context, client kubernetes.Interface, node string) error {
	ssr, err := client.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authenticationv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("ask the API server who the node credentials are (SelfSubjectReview): %w", err)
	}
	u := ssr.Status.UserInfo
	if err := judgeIdentity(u.Username, u.Groups, node); err != nil {
		return err
	}
	sar, err := client.AuthorizationV1().SelfSubjectAccessReviews().Create(ctx, &authorizationv1.SelfSubjectAccessReview{
		Spec: authorizationv1.SelfSubjectAccessReviewSpec{ResourceAttributes: &authorizationv1.ResourceAttributes{Verb: "list", Resource: "secrets"}},
	}, metav1.CreateOptions{})
	if err == nil && sar.Status.Allowed {
		klog.FromContext(ctx).Error(nil, "The node credentials may list every Secret in the cluster: the API server does not confine nodes to their own objects (enable --authorization-mode=Node and the NodeRestriction admission plugin, and bind nothing more to system:nodes)",
			"user", u.Username)
	}
	return nil
}
