package status

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// EventsPolicy is the ValidatingAdmissionPolicy (and its binding) that
// admits an event of the agent's reporting controller only from the
// identity of the node its reportingInstance names
// (deploy/agent-events-policy.yaml).
const EventsPolicy = "mountmedic-agent-events"

// FailoverEventsPolicy is the ValidatingAdmissionPolicy (and its binding)
// that admits an event of the failover controller's reporting controller
// only from the controller's ServiceAccount
// (deploy/controller/failover-events-policy.yaml).
const FailoverEventsPolicy = "mountmedic-failover-events"

// DefaultName is the install's name at the defaults of deploy/ and the
// chart: every object's name starts with it. An install renamed with the
// chart's fullnameOverride names its policies after that name instead
// (Options.Name).
const DefaultName = "mountmedic"

// installed is the name of the object named def (a default name, which
// starts with DefaultName) in the install named name.
func installed(name, def string) string {
	if name == "" {
		return def
	}
	return name + strings.TrimPrefix(def, DefaultName)
}

// policyFiles names the manifest of each policy, for the warnings.
var policyFiles = map[string]string{
	EventsPolicy:         "deploy/agent-events-policy.yaml",
	FailoverEventsPolicy: "deploy/controller/failover-events-policy.yaml, with the failover controller",
}

// PolicySettle is how long after the policy and its binding were created
// an event must be created to be trusted: the API server enforces a new
// policy once its informers have loaded it, a moment after the create.
const PolicySettle = 10 * time.Second

// ViewerRole is the ClusterRole that is enough for status and the node
// drill-down (deploy/viewer-rbac.yaml).
const ViewerRole = "mountmedic-viewer"

// trust says which events claiming a reporting controller were written by
// the identity its policy holds them to: those created once the policy was
// in force, with Deny. Anyone who may create events can write one that
// claims to be the agent's; EventsPolicy refuses such a write unless it
// comes from that node's identity (its kubelet's credentials or its
// agent's node-bound ServiceAccount token), so an event created after it
// is the node's own. FailoverEventsPolicy likewise holds the failover
// controller's events to its ServiceAccount.
type trust struct {
	// policy is the ValidatingAdmissionPolicy (and binding) vouching;
	// kind its default name (EventsPolicy or FailoverEventsPolicy).
	policy, kind string
	// since: events created at or after it are vouched for; zero: none.
	since time.Time
	// why no event is vouched for, when since is zero.
	why string
}

// readTrust reads the policy kind (EventsPolicy or FailoverEventsPolicy)
// of the install named name, and its binding.
func readTrust(ctx context.Context, cs kubernetes.Interface, name, kind string) trust {
	t := readPolicy(ctx, cs, installed(name, kind), kind)
	t.kind = kind
	return t
}

func readPolicy(ctx context.Context, cs kubernetes.Interface, policy, kind string) trust {
	ar := cs.AdmissionregistrationV1()
	p, err := ar.ValidatingAdmissionPolicies().Get(ctx, policy, metav1.GetOptions{})
	if err != nil {
		return trust{policy: policy, why: policyErr("ValidatingAdmissionPolicy", policy, kind, err)}
	}
	b, err := ar.ValidatingAdmissionPolicyBindings().Get(ctx, policy, metav1.GetOptions{})
	if err != nil {
		return trust{policy: policy, why: policyErr("ValidatingAdmissionPolicyBinding", policy, kind, err)}
	}
	switch {
	case b.Spec.PolicyName != policy:
		return trust{policy: policy, why: fmt.Sprintf("the binding %s binds policy %q, not %s", policy, b.Spec.PolicyName, policy)}
	case !slices.Contains(b.Spec.ValidationActions, admissionregistrationv1.Deny):
		return trust{policy: policy, why: fmt.Sprintf("the binding %s does not deny (validationActions %v)", policy, b.Spec.ValidationActions)}
	case p.Spec.FailurePolicy != nil && *p.Spec.FailurePolicy != admissionregistrationv1.Fail:
		return trust{policy: policy, why: fmt.Sprintf("the policy %s lets a write through when it cannot be evaluated (failurePolicy %s)", policy, *p.Spec.FailurePolicy)}
	}
	since := p.CreationTimestamp.Time
	if b.CreationTimestamp.After(since) {
		since = b.CreationTimestamp.Time
	}
	return trust{policy: policy, since: since.Add(PolicySettle)}
}

func policyErr(kind, policy, def string, err error) string {
	switch {
	case apierrors.IsNotFound(err):
		return fmt.Sprintf("the %s %s is not installed (%s; an install renamed with the chart's fullnameOverride: pass --name)", kind, policy, policyFiles[def])
	case apierrors.IsForbidden(err):
		return fmt.Sprintf("cannot read the %s %s (bind the ClusterRole %s; an install renamed with the chart's fullnameOverride: pass --name): %v", kind, policy, ViewerRole, err)
	}
	return fmt.Sprintf("cannot read the %s %s: %v", kind, policy, err)
}

// vouches reports whether e (which names a node as its reportingInstance)
// was written by that node's agent.
func (t trust) vouches(e *corev1.Event) bool {
	return !t.since.IsZero() && !e.CreationTimestamp.Time.Before(t.since)
}

// ignored is the warning for n events the trust does not vouch for.
func (t trust) ignored(n int) string {
	who := "a mountmedic agent"
	if t.kind == FailoverEventsPolicy {
		who = "the mountmedic failover controller"
	}
	if t.since.IsZero() {
		return fmt.Sprintf("%d events claim to come from %s and none can be verified: %s; they are not shown", n, who, t.why)
	}
	return fmt.Sprintf("%d events claim to come from %s but were created before the admission policy %s was in force (%s): they are not shown",
		n, who, t.policy, t.since.UTC().Format(time.RFC3339))
}

// rbacHint names the viewer role after a Forbidden error.
func rbacHint(err error) string {
	if apierrors.IsForbidden(err) {
		return " (bind the ClusterRole " + ViewerRole + " to the user: deploy/viewer-rbac.yaml)"
	}
	return ""
}
