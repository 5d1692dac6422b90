// Package kubeclient builds the Kubernetes clients of mountmedic's commands
// with only the API groups mountmedic calls: core, storage, policy, events,
// coordination, authentication and authorization (the agent's check of
// its own identity), and admissionregistration (mountmedic status reads the
// policy that vouches for the agents' events).
//
// client-go's kubernetes.NewForConfig makes a client of every API group the
// cluster serves, and so links every group's client, apply configurations
// and watch code into the binary: about 35 MB of code and read-only data,
// much of it touched at start-up and held in the agent's resident memory on
// every node. This Clientset holds the five groups and nothing else. Like
// NewForConfig it shares one HTTP client and one rate limiter (QPS, Burst)
// between them: the limit applies to the agent's requests in all. A test
// reads every call of an API group in the commands' code and fails when
// Clientset lacks the group.
package kubeclient

import (
	"fmt"
	"net/http"

	"k8s.io/client-go/kubernetes"
	admissionregistrationv1 "k8s.io/client-go/kubernetes/typed/admissionregistration/v1"
	authenticationv1 "k8s.io/client-go/kubernetes/typed/authentication/v1"
	authorizationv1 "k8s.io/client-go/kubernetes/typed/authorization/v1"
	coordinationv1 "k8s.io/client-go/kubernetes/typed/coordination/v1"
	corev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	eventsv1 "k8s.io/client-go/kubernetes/typed/events/v1"
	policyv1 "k8s.io/client-go/kubernetes/typed/policy/v1"
	storagev1 "k8s.io/client-go/kubernetes/typed/storage/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/flowcontrol"
)

// Clientset is a kubernetes.Interface with the API groups mountmedic
// calls. Any other group's method panics (the embedded interface is nil):
// mountmedic's commands call none, and a test that does uses
// kubernetes.NewForConfig.
type Clientset struct {
	kubernetes.Interface

	core         *corev1.CoreV1Client
	storage      *storagev1.StorageV1Client
	policy       *policyv1.PolicyV1Client
	events       *eventsv1.EventsV1Client
	coordination *coordinationv1.CoordinationV1Client
	authn        *authenticationv1.AuthenticationV1Client
	authz        *authorizationv1.AuthorizationV1Client
	admission    *admissionregistrationv1.AdmissionregistrationV1Client
}

func (c *Clientset) CoreV1() corev1.CoreV1Interface                         { return c.core }
func (c *Clientset) StorageV1() storagev1.StorageV1Interface                { return c.storage }
func (c *Clientset) PolicyV1() policyv1.PolicyV1Interface                   { return c.policy }
func (c *Clientset) EventsV1() eventsv1.EventsV1Interface                   { return c.events }
func (c *Clientset) CoordinationV1() coordinationv1.CoordinationV1Interface { return c.coordination }
func (c *Clientset) AuthenticationV1() authenticationv1.AuthenticationV1Interface {
	return c.authn
}
func (c *Clientset) AuthorizationV1() authorizationv1.AuthorizationV1Interface { return c.authz }

// AdmissionregistrationV1 serves mountmedic status, which reads the
// admission policy that vouches for the agents' events.
func (c *Clientset) AdmissionregistrationV1() admissionregistrationv1.AdmissionregistrationV1Interface {
	return c.admission
}

// New returns a Clientset for rc, as kubernetes.NewForConfig would: one
// HTTP client, and one token-bucket rate limiter of rc.QPS and rc.Burst
// unless rc has a RateLimiter, shared by every group.
func New(rc *rest.Config) (*Clientset, error) {
	c := *rc
	if c.UserAgent == "" {
		c.UserAgent = rest.DefaultKubernetesUserAgent()
	}
	httpClient, err := rest.HTTPClientFor(&c)
	if err != nil {
		return nil, err
	}
	return NewForConfigAndClient(&c, httpClient)
}

// NewForConfigAndClient is New with the HTTP client given.
func NewForConfigAndClient(rc *rest.Config, httpClient *http.Client) (*Clientset, error) {
	c := *rc
	if c.RateLimiter == nil && c.QPS > 0 {
		if c.Burst <= 0 {
			return nil, fmt.Errorf("burst is required to be greater than 0 when RateLimiter is not set and QPS is set to greater than 0")
		}
		c.RateLimiter = flowcontrol.NewTokenBucketRateLimiter(c.QPS, c.Burst)
	}
	var cs Clientset
	var err error
	if cs.core, err = corev1.NewForConfigAndClient(&c, httpClient); err != nil {
		return nil, err
	}
	if cs.storage, err = storagev1.NewForConfigAndClient(&c, httpClient); err != nil {
		return nil, err
	}
	if cs.policy, err = policyv1.NewForConfigAndClient(&c, httpClient); err != nil {
		return nil, err
	}
	if cs.events, err = eventsv1.NewForConfigAndClient(&c, httpClient); err != nil {
		return nil, err
	}
	if cs.coordination, err = coordinationv1.NewForConfigAndClient(&c, httpClient); err != nil {
		return nil, err
	}
	if cs.authn, err = authenticationv1.NewForConfigAndClient(&c, httpClient); err != nil {
		return nil, err
	}
	if cs.authz, err = authorizationv1.NewForConfigAndClient(&c, httpClient); err != nil {
		return nil, err
	}
	if cs.admission, err = admissionregistrationv1.NewForConfigAndClient(&c, httpClient); err != nil {
		return nil, err
	}
	return &cs, nil
}
