package e2e

import (
	"context"
	"fmt"
	"sync"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/mountmedic/mountmedic/agent/failover"
)

// SimNode is a second node with no machine behind it, beside the real one:
// the test plays its kubelet (the Node's Ready heartbeat, its Lease in
// kube-node-lease, the status of the pods bound to it) and its mountmedic
// agent's failover heartbeat Lease, every beat. It dies by falling silent,
// as a node that loses power does.
type SimNode struct {
	Name string
	c    kubernetes.Interface

	mu     sync.Mutex
	cancel context.CancelFunc
	done   chan struct{}
}

// beat is how often the simulated kubelet and agent renew their Leases
// (kubelet renews every 10 s, mountmedic's heartbeat every 5 s).
const beat = 2 * time.Second

// simFenceAfter is the simulated agent's --failover-fence-after, the
// agents' default, published in its fence plan.
const simFenceAfter = 30 * time.Second

// StartSimNode registers node name and starts beating for it.
func StartSimNode(ctx context.Context, c kubernetes.Interface, name string) (*SimNode, error) {
	n := &corev1.Node{
		// No kubernetes.io/os label: the mountmedic DaemonSet (nodeSelector
		// kubernetes.io/os=linux) puts no agent pod here; the test beats
		// the agent's heartbeat instead.
		ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{corev1.LabelHostname: name}},
	}
	if _, err := c.CoreV1().Nodes().Create(ctx, n, metav1.CreateOptions{}); err != nil {
		return nil, fmt.Errorf("create node %s: %w", name, err)
	}
	s := &SimNode{Name: name, c: c}
	if err := s.beat(ctx); err != nil {
		return nil, err
	}
	bctx, cancel := context.WithCancel(context.Background())
	s.cancel, s.done = cancel, make(chan struct{})
	go func() {
		defer close(s.done)
		t := time.NewTicker(beat)
		defer t.Stop()
		for {
			select {
			case <-bctx.Done():
				return
			case <-t.C:
				_ = s.beat(bctx)
			}
		}
	}()
	return s, nil
}

// beat renews everything a live node renews.
func (s *SimNode) beat(ctx context.Context) error {
	now := time.Now()
	node, err := s.c.CoreV1().Nodes().Get(ctx, s.Name, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("get node %s: %w", s.Name, err)
	}
	resources := corev1.ResourceList{
		corev1.ResourceCPU:    resource.MustParse("2"),
		corev1.ResourceMemory: resource.MustParse("4Gi"),
		corev1.ResourcePods:   resource.MustParse("110"),
	}
	node.Status.Capacity, node.Status.Allocatable = resources, resources
	node.Status.Addresses = []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: "192.0.2.250"}, {Type: corev1.NodeHostName, Address: s.Name}}
	node.Status.Conditions = []corev1.NodeCondition{{
		Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady", Message: "simulated kubelet is posting ready status",
		LastHeartbeatTime: metav1.NewTime(now), LastTransitionTime: readySince(node, now),
	}}
	if _, err := s.c.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("post status of node %s: %w", s.Name, err)
	}
	if err := renewLease(ctx, s.c, corev1.NamespaceNodeLease, s.Name, s.Name, 40, nil, nil, now); err != nil {
		return err
	}
	pods, err := s.runPods(ctx)
	if err != nil {
		return err
	}
	// The failover duty's heartbeat Lease: one per node, named after it, in
	// the agent's namespace, with the duty's label and the fence plan the
	// simulated agent would keep: every pod bound to the node (a real agent
	// plans only the ones the duty may move; the controller moves only pods
	// both eligible and planned).
	hb := map[string]string{failover.HeartbeatLabel: failover.HeartbeatLabelValue, "app.kubernetes.io/name": "mountmedic"}
	plan := map[string]string{failover.FencePlanAnnotation: failover.EncodeFencePlan(simFenceAfter, pods)}
	return renewLease(ctx, s.c, AgentNamespace, s.Name, "simulated-agent-"+s.Name, 30, hb, plan, now)
}

func readySince(node *corev1.Node, now time.Time) metav1.Time {
	for _, c := range node.Status.Conditions {
		if c.Type == corev1.NodeReady && c.Status == corev1.ConditionTrue {
			return c.LastTransitionTime
		}
	}
	return metav1.NewTime(now)
}

func renewLease(ctx context.Context, c kubernetes.Interface, ns, name, holder string, seconds int32, labels, annotations map[string]string, now time.Time) error {
	leases := c.CoordinationV1().Leases(ns)
	l, err := leases.Get(ctx, name, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		l = &coordinationv1.Lease{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, Labels: labels, Annotations: annotations},
			Spec: coordinationv1.LeaseSpec{
				HolderIdentity: ptr.To(holder), LeaseDurationSeconds: ptr.To(seconds),
				AcquireTime: &metav1.MicroTime{Time: now}, RenewTime: &metav1.MicroTime{Time: now},
			},
		}
		if _, err := leases.Create(ctx, l, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create lease %s/%s: %w", ns, name, err)
		}
		return nil
	}
	if err != nil {
		return fmt.Errorf("get lease %s/%s: %w", ns, name, err)
	}
	l.Spec.HolderIdentity, l.Spec.LeaseDurationSeconds = ptr.To(holder), ptr.To(seconds)
	l.Spec.RenewTime = &metav1.MicroTime{Time: now}
	if annotations != nil {
		l.Annotations = annotations
	}
	if _, err := leases.Update(ctx, l, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("renew lease %s/%s: %w", ns, name, err)
	}
	return nil
}

// runPods reports the pods bound to the node as running and ready, as its
// kubelet would once it started them.
// runPods reports the pods bound to the node running and returns the UIDs
// of those not being deleted.
func (s *SimNode) runPods(ctx context.Context) ([]string, error) {
	pods, err := s.c.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("spec.nodeName", s.Name).String()})
	if err != nil {
		return nil, fmt.Errorf("list pods of node %s: %w", s.Name, err)
	}
	var uids []string
	for i := range pods.Items {
		p := &pods.Items[i]
		if p.DeletionTimestamp == nil {
			uids = append(uids, string(p.UID))
		}
		if p.DeletionTimestamp != nil || p.Status.Phase == corev1.PodRunning {
			continue
		}
		now := metav1.Now()
		p.Status.Phase = corev1.PodRunning
		p.Status.HostIP, p.Status.PodIP = "192.0.2.250", "192.0.2.250"
		p.Status.StartTime = &now
		p.Status.Conditions = nil
		for _, t := range []corev1.PodConditionType{corev1.PodScheduled, corev1.PodInitialized, corev1.ContainersReady, corev1.PodReady} {
			p.Status.Conditions = append(p.Status.Conditions, corev1.PodCondition{Type: t, Status: corev1.ConditionTrue, LastTransitionTime: now})
		}
		p.Status.ContainerStatuses = nil
		for _, ctr := range p.Spec.Containers {
			p.Status.ContainerStatuses = append(p.Status.ContainerStatuses, corev1.ContainerStatus{
				Name: ctr.Name, Image: ctr.Image, Ready: true, Started: ptr.To(true),
				State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: now}},
			})
		}
		if _, err := s.c.CoreV1().Pods(p.Namespace).UpdateStatus(ctx, p, metav1.UpdateOptions{}); err != nil && !apierrors.IsConflict(err) {
			return nil, fmt.Errorf("post status of pod %s/%s: %w", p.Namespace, p.Name, err)
		}
	}
	return uids, nil
}

// Die stops every beat at once and returns when.
func (s *SimNode) Die() time.Time {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cancel != nil {
		s.cancel()
		<-s.done
		s.cancel = nil
	}
	return time.Now()
}

// MarkUnknown does what kube-controller-manager's node lifecycle controller
// does once a node's kubelet has been silent for its grace period (40 s): it
// sets Ready to Unknown, leaving the heartbeat time as the kubelet last
// posted it. (The e2e control plane does not run that controller: it would
// also act on the real node, which is NotReady for want of a CNI plugin.)
func (s *SimNode) MarkUnknown(ctx context.Context) error {
	node, err := s.c.CoreV1().Nodes().Get(ctx, s.Name, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("get node %s: %w", s.Name, err)
	}
	for i := range node.Status.Conditions {
		c := &node.Status.Conditions[i]
		if c.Type == corev1.NodeReady {
			c.Status, c.Reason, c.Message = corev1.ConditionUnknown, "NodeStatusUnknown", "Kubelet stopped posting node status."
			c.LastTransitionTime = metav1.Now()
		}
	}
	if _, err := s.c.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("mark node %s Unknown: %w", s.Name, err)
	}
	return nil
}

// Delete stops the node and removes it and its Leases.
func (s *SimNode) Delete(ctx context.Context) error {
	s.Die()
	for _, l := range []struct{ ns, name string }{{corev1.NamespaceNodeLease, s.Name}, {AgentNamespace, s.Name}} {
		if err := s.c.CoordinationV1().Leases(l.ns).Delete(ctx, l.name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
			return fmt.Errorf("delete lease %s/%s: %w", l.ns, l.name, err)
		}
	}
	if err := s.c.CoreV1().Nodes().Delete(ctx, s.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete node %s: %w", s.Name, err)
	}
	return nil
}
