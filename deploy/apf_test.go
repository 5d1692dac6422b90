package deploy_test

import (
	"context"
	"net/http"
	"sync"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"

	"github.com/mountmedic/mountmedic/scripts/kubetest"
)

// flowSchemaHeader and priorityLevelHeader are the headers in which
// kube-apiserver names the UIDs of the FlowSchema and the priority level a
// request was classified by.
const (
	flowSchemaHeader    = "X-Kubernetes-PF-FlowSchema-UID"
	priorityLevelHeader = "X-Kubernetes-PF-PriorityLevel-UID"
)

// headerRecorder keeps the FlowSchema and priority level UIDs of the last
// response.
type headerRecorder struct {
	rt        http.RoundTripper
	mu        sync.Mutex
	last      string
	lastLevel string
}

func (r *headerRecorder) RoundTrip(req *http.Request) (*http.Response, error) {
	resp, err := r.rt.RoundTrip(req)
	if err == nil {
		r.mu.Lock()
		r.last = resp.Header.Get(flowSchemaHeader)
		r.lastLevel = resp.Header.Get(priorityLevelHeader)
		r.mu.Unlock()
	}
	return resp, err
}

func (r *headerRecorder) priorityLevel() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.lastLevel
}

func (r *headerRecorder) flowSchema() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.last
}

// TestHeartbeatFlowSchema applies the base to a real kube-apiserver and
// checks, from the API server's own classification of each request, that
// the mountmedic ServiceAccount's heartbeat Lease writes go to the
// mountmedic-heartbeat FlowSchema, and that its other requests (reading
// the Lease, reading pods) do not. The failover peer check's readiness
// probe (/readyz, agent/failover probeAPI) is in the exempt priority level
// for the ServiceAccount and for a node's identity alike, where no flood
// of a flow (with a stolen agent token) reaches it; a read of a Node by
// the ServiceAccount is not.
func TestHeartbeatFlowSchema(t *testing.T) {
	kc := kubectl(t)
	c := kubetest.Start(t, kubetest.Options{})
	ctx := context.Background()
	run(t, ".", kc, "--kubeconfig="+c.Kubeconfig, "apply", "-k", ".")
	fs, err := c.Client.FlowcontrolV1().FlowSchemas().Get(ctx, "mountmedic-heartbeat", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("FlowSchema after apply: %v", err)
	}
	if fs.Namespace != "" {
		t.Errorf("FlowSchema namespace = %q, want none (cluster-scoped)", fs.Namespace)
	}
	plc, err := c.Client.FlowcontrolV1().PriorityLevelConfigurations().Get(ctx, "mountmedic-heartbeat", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("PriorityLevelConfiguration after apply: %v", err)
	}
	if plc.Spec.Limited == nil || ptr.Deref(plc.Spec.Limited.LendablePercent, -1) != 0 {
		t.Errorf("priority level %+v: want a limited level lending none of its seats", plc.Spec)
	}

	// The agent writes its Lease with a token bound to its pod, which names
	// its node (the heartbeat Lease policy refuses any other token).
	agentPod := createRadiusPod(ctx, t, c.Client, "mountmedic", "mountmedic-node-1", "node-1", "mountmedic", "")
	rec := &headerRecorder{}
	cfg := c.PodTokenConfig(t, agentPod)
	cfg.WrapTransport = func(rt http.RoundTripper) http.RoundTripper { rec.rt = rt; return rec }
	sa, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		t.Fatal(err)
	}
	other := c.ServiceAccountConfig(t, "mountmedic", "someone-else")
	otherRec := &headerRecorder{}
	other.WrapTransport = func(rt http.RoundTripper) http.RoundTripper { otherRec.rt = rt; return otherRec }
	otherClient, err := kubernetes.NewForConfig(rest.CopyConfig(other))
	if err != nil {
		t.Fatal(err)
	}

	leases := sa.CoordinationV1().Leases("mountmedic")
	now := metav1.NewMicroTime(time.Now())
	l, err := leases.Create(ctx, &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: "node-1"},
		Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To("agent"), RenewTime: &now}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create heartbeat lease as the agent: %v", err)
	}
	check := func(what string, r *headerRecorder, want bool) {
		t.Helper()
		got := r.flowSchema()
		if got == "" {
			t.Errorf("%s: no %s header in the response", what, flowSchemaHeader)
		} else if (got == string(fs.UID)) != want {
			t.Errorf("%s: classified by FlowSchema %s, mountmedic-heartbeat is %s; want matched = %v", what, got, fs.UID, want)
		}
	}
	check("create heartbeat lease", rec, true)
	if _, err := leases.Update(ctx, l, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("update heartbeat lease: %v", err)
	}
	check("update heartbeat lease", rec, true)
	if _, err := leases.Get(ctx, "node-1", metav1.GetOptions{}); err != nil {
		t.Fatalf("get heartbeat lease: %v", err)
	}
	check("get heartbeat lease", rec, false)
	// Refused (the ServiceAccount reads nothing but Leases), and still not
	// classified as a heartbeat: APF classifies before authorization.
	if _, err := sa.CoreV1().Pods("default").List(ctx, metav1.ListOptions{Limit: 1}); !apierrors.IsForbidden(err) {
		t.Fatalf("list pods as the agent's ServiceAccount: err = %v, want forbidden", err)
	}
	check("list pods", rec, false)
	// Another ServiceAccount's lease write (refused by RBAC) is not
	// classified as a heartbeat: the level is the agents' alone.
	_, _ = otherClient.CoordinationV1().Leases("mountmedic").Update(ctx, l, metav1.UpdateOptions{})
	check("another ServiceAccount's lease update", otherRec, false)

	exempt, err := c.Client.FlowcontrolV1().PriorityLevelConfigurations().Get(ctx, "exempt", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	nodeRec := &headerRecorder{}
	nodeCfg := c.NodeConfig(t, "node-1")
	nodeCfg.WrapTransport = func(rt http.RoundTripper) http.RoundTripper { nodeRec.rt = rt; return nodeRec }
	asNode, err := kubernetes.NewForConfig(nodeCfg)
	if err != nil {
		t.Fatal(err)
	}
	checkExempt := func(what string, r *headerRecorder, want bool) {
		t.Helper()
		if got := r.priorityLevel(); got == "" {
			t.Errorf("%s: no %s header in the response", what, priorityLevelHeader)
		} else if (got == string(exempt.UID)) != want {
			t.Errorf("%s: priority level %s, exempt is %s; want exempt = %v", what, got, exempt.UID, want)
		}
	}
	for who, cs := range map[string]kubernetes.Interface{"the agent's ServiceAccount": sa, "a node": asNode} {
		r := map[string]*headerRecorder{"the agent's ServiceAccount": rec, "a node": nodeRec}[who]
		if err := cs.Discovery().RESTClient().Get().AbsPath("/readyz").Do(ctx).Error(); err != nil {
			t.Errorf("/readyz as %s: %v", who, err)
		}
		checkExempt("/readyz as "+who, r, true)
	}
	_, _ = sa.CoreV1().Nodes().Get(ctx, "node-1", metav1.GetOptions{})
	checkExempt("get a Node as the agent's ServiceAccount", rec, false)
}
