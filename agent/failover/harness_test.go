package failover

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	appsv1 "k8s.io/api/apps/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/retry"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	"github.com/mountmedic/mountmedic/agent/kubeclient"
	"github.com/mountmedic/mountmedic/scripts/kubetest"

	"github.com/mountmedic/mountmedic/scripts/lab"
)

// The simulated cluster: real etcd, kube-apiserver and
// kube-controller-manager (node lifecycle, attach/detach, pod GC,
// StatefulSet, taint eviction, PV binder); nodes are Node objects whose
// kubelet Lease, Ready condition, volumesInUse and pod status the test
// keeps up while the node "lives"; each node's mountmedic agent is a real
// Heartbeat talking to the API server through a TCP proxy that the test
// cuts to partition it, with a recording fence as its CRI and mount seam.
// The test plays two components that do not run here, each marked where it
// acts: the scheduler (it binds unscheduled pods of a case to the first
// living node of the case) and the CSI external-attacher (it sets
// status.attached on every VolumeAttachment of the test driver, as a real
// attacher does once ControllerPublishVolume succeeded).

const (
	testDriver   = "failover.csi.mountmedic.test"
	testSC       = "failover-test"
	caseLabel    = "failover.mountmedic.test/case"
	zoneLabel    = "topology.kubernetes.io/zone"
	adcAnnotaton = "volumes.kubernetes.io/controller-managed-attach-detach"
	agentNS      = "mountmedic"
)

// kcmControllers are the kube-controller-manager controllers failover
// needs, besides kubetest's defaults.
var kcmControllers = append(slices.Clone(kubetest.DefaultControllers),
	"nodelifecycle", "attachdetach", "podgc", "statefulset", "taint-eviction-controller", "persistentvolume-binder")

type harness struct {
	c     *kubetest.Cluster
	admin kubernetes.Interface
	// sa is the mountmedic ServiceAccount's config: the agents' heartbeats
	// run under deploy/rbac.yaml, not as an admin; ctl is the controller's
	// own ServiceAccount, under deploy/controller/'s RBAC.
	sa     *rest.Config
	ctl    *rest.Config
	ctx    context.Context
	cancel context.CancelFunc

	mu        sync.Mutex
	nodes     map[string]*simNode
	placement map[string][]*simNode // namespace -> nodes in preference order
	attached  map[string]time.Time  // VolumeAttachment name -> when the test's attacher marked it
}

// startHarness starts the control plane with kcmArgs appended to the
// controller manager's flags, applies deploy/'s RBAC and starts the test's
// scheduler and attacher.
func startHarness(t testing.TB, kcmArgs ...string) *harness {
	c := kubetest.Start(t, kubetest.Options{Controllers: kcmControllers, ControllerManagerArgs: kcmArgs})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	h := &harness{c: c, admin: c.Client, ctx: ctx, cancel: cancel, nodes: map[string]*simNode{},
		placement: map[string][]*simNode{}, attached: map[string]time.Time{}}

	deploy, err := filepath.Abs("../../deploy")
	if err != nil {
		t.Fatal(err)
	}
	// The controller's admission policy too: every case proves the
	// controller does its job within it. Not no-force-detach-policy.yaml:
	// the cases that force-detach opt in (--failover-force-detach).
	for _, f := range []string{"namespace.yaml", "serviceaccount.yaml", "rbac.yaml", "controller/serviceaccount.yaml", "controller/rbac.yaml",
		"controller/admission-policy.yaml"} {
		if out, err := c.Kubectl("apply", "-f", filepath.Join(deploy, f)); err != nil {
			t.Fatalf("kubectl apply deploy/%s: %v\n%s", f, err, out)
		}
	}
	h.sa = c.ServiceAccountConfig(t, agentNS, "mountmedic")
	h.ctl = c.ServiceAccountConfig(t, agentNS, "mountmedic-controller")

	if _, err := h.admin.StorageV1().CSIDrivers().Create(ctx, &storagev1.CSIDriver{
		ObjectMeta: metav1.ObjectMeta{Name: testDriver},
		Spec:       storagev1.CSIDriverSpec{AttachRequired: ptr.To(true)},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create CSIDriver: %v", err)
	}
	bind := storagev1.VolumeBindingImmediate
	if _, err := h.admin.StorageV1().StorageClasses().Create(ctx, &storagev1.StorageClass{
		ObjectMeta:        metav1.ObjectMeta{Name: testSC},
		Provisioner:       "kubernetes.io/no-provisioner",
		VolumeBindingMode: &bind,
	}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create StorageClass: %v", err)
	}
	h.startSchedulerAndAttacher(t)
	return h
}

// startSchedulerAndAttacher plays the scheduler and the external attacher.
func (h *harness) startSchedulerAndAttacher(t testing.TB) {
	unscheduled := informers.NewSharedInformerFactoryWithOptions(h.admin, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.FieldSelector = "spec.nodeName=" }))
	pods := unscheduled.Core().V1().Pods().Informer()
	schedule := func(obj any) {
		if pod, ok := obj.(*corev1.Pod); ok && pod.Spec.NodeName == "" && pod.DeletionTimestamp == nil {
			go h.bind(pod)
		}
	}
	if _, err := pods.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: schedule, UpdateFunc: func(_, n any) { schedule(n) }}); err != nil {
		t.Fatal(err)
	}
	all := informers.NewSharedInformerFactory(h.admin, 0)
	vas := all.Storage().V1().VolumeAttachments().Informer()
	attach := func(obj any) {
		if va, ok := obj.(*storagev1.VolumeAttachment); ok && va.Spec.Attacher == testDriver && !va.Status.Attached && va.DeletionTimestamp == nil {
			go h.attach(va)
		}
	}
	if _, err := vas.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: attach, UpdateFunc: func(_, n any) { attach(n) }}); err != nil {
		t.Fatal(err)
	}
	unscheduled.Start(h.ctx.Done())
	all.Start(h.ctx.Done())
	t.Cleanup(func() {
		h.cancel() // the informers stop with the context; Shutdown waits for them
		unscheduled.Shutdown()
		all.Shutdown()
	})
}

// bind plays the scheduler: the first living node of the pod's namespace.
func (h *harness) bind(pod *corev1.Pod) {
	h.mu.Lock()
	var target string
	for _, n := range h.placement[pod.Namespace] {
		if n.alive() {
			target = n.name
			break
		}
	}
	h.mu.Unlock()
	if target == "" {
		return
	}
	err := h.admin.CoreV1().Pods(pod.Namespace).Bind(h.ctx, &corev1.Binding{
		ObjectMeta: metav1.ObjectMeta{Namespace: pod.Namespace, Name: pod.Name, UID: pod.UID},
		Target:     corev1.ObjectReference{Kind: "Node", Name: target},
	}, metav1.CreateOptions{})
	if err != nil && !apierrors.IsConflict(err) && !apierrors.IsNotFound(err) && h.ctx.Err() == nil {
		klog.Background().Info("test scheduler: bind failed", "pod", klog.KObj(pod), "err", err)
	}
}

// attach plays the CSI external-attacher: ControllerPublishVolume
// "succeeded", so the attachment is marked attached.
func (h *harness) attach(va *storagev1.VolumeAttachment) {
	va = va.DeepCopy()
	va.Status.Attached = true
	if _, err := h.admin.StorageV1().VolumeAttachments().UpdateStatus(h.ctx, va, metav1.UpdateOptions{}); err != nil {
		if !apierrors.IsConflict(err) && !apierrors.IsNotFound(err) && h.ctx.Err() == nil {
			klog.Background().Info("test attacher: update failed", "volumeAttachment", va.Name, "err", err)
		}
		return
	}
	h.mu.Lock()
	if _, ok := h.attached[va.Name]; !ok {
		h.attached[va.Name] = time.Now()
	}
	h.mu.Unlock()
}

// attachedAt says when the test's attacher marked an attachment attached.
func (h *harness) attachedAt(name string) (time.Time, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	at, ok := h.attached[name]
	return at, ok
}

// saClient is a client with the mountmedic ServiceAccount's token, through
// host when it is not empty (a proxy).
func (h *harness) saClient(t testing.TB, host string) kubernetes.Interface {
	cfg := rest.CopyConfig(h.sa)
	if host != "" {
		cfg.Host = host
	}
	cl, err := kubeclient.New(cfg)
	if err != nil {
		t.Fatalf("service account client: %v", err)
	}
	return cl
}

// nodeClient is a client with node's own identity (system:node:<node>, as
// the agent acts), through host when it is not empty (a proxy).
func (h *harness) nodeClient(t testing.TB, node, host string) kubernetes.Interface {
	cfg := h.c.NodeConfig(t, node)
	if host != "" {
		cfg.Host = host
	}
	cl, err := kubeclient.New(cfg)
	if err != nil {
		t.Fatalf("node client: %v", err)
	}
	return cl
}

// allowLeaderLease lets the controller's ServiceAccount update the leader
// Lease name, as deploy/controller/'s Role does for the shipped name
// (mountmedic-failover-leader) only: each case elects its own leader.
func (h *harness) allowLeaderLease(t testing.TB, name string) {
	t.Helper()
	role := &rbacv1.Role{
		ObjectMeta: metav1.ObjectMeta{Namespace: agentNS, Name: "test-" + name},
		Rules: []rbacv1.PolicyRule{{APIGroups: []string{"coordination.k8s.io"}, Resources: []string{"leases"},
			ResourceNames: []string{name}, Verbs: []string{"update"}}},
	}
	if _, err := h.admin.RbacV1().Roles(agentNS).Create(h.ctx, role, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatalf("create role for leader lease %s: %v", name, err)
	}
	rb := &rbacv1.RoleBinding{
		ObjectMeta: metav1.ObjectMeta{Namespace: agentNS, Name: "test-" + name},
		RoleRef:    rbacv1.RoleRef{APIGroup: "rbac.authorization.k8s.io", Kind: "Role", Name: role.Name},
		Subjects:   []rbacv1.Subject{{Kind: "ServiceAccount", Namespace: agentNS, Name: "mountmedic-controller"}},
	}
	if _, err := h.admin.RbacV1().RoleBindings(agentNS).Create(h.ctx, rb, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatalf("bind role for leader lease %s: %v", name, err)
	}
}

// fastConfig is the agents' failover configuration with test timings (the
// controller manager of the tests runs a 6 s node monitor grace period).
func fastConfig() Config {
	c := DefaultConfig()
	c.Enabled = true
	c.Namespace = agentNS
	c.HeartbeatInterval = time.Second
	c.FenceAfter = 4 * time.Second
	c.FenceStopGrace = time.Second
	c.APITimeout = 5 * time.Second
	return c
}

// fastControllerConfig is the controller's, with the same test timings,
// judging the case's nodes only.
func fastControllerConfig(caseName string) ControllerConfig {
	c := DefaultControllerConfig()
	c.Namespace = agentNS
	c.Identity = "controller-" + caseName
	c.LeaderLease = "failover-leader-" + caseName
	c.NodeSelector = caseLabel + "=" + caseName
	c.FenceAfter = 4 * time.Second
	c.FenceMargin = 6 * time.Second
	c.KubeletGrace = 5 * time.Second
	c.LeaseDuration = 4 * time.Second
	c.RenewDeadline = 3 * time.Second
	c.RetryPeriod = time.Second
	c.Recheck = 500 * time.Millisecond
	c.APITimeout = 5 * time.Second
	return c
}

// scenario is one case's nodes, namespace and controllers: cfg is its
// agents' configuration, ctl its controllers'.
type scenario struct {
	h    *harness
	t    testing.TB
	name string
	ns   string
	cfg  Config
	ctl  ControllerConfig
}

func (h *harness) scenario(t testing.TB, name string) *scenario {
	ns := "case-" + name
	h.c.CreateNamespace(t, ns)
	s := &scenario{h: h, t: t, name: name, ns: ns, cfg: fastConfig(), ctl: fastControllerConfig(name)}
	h.allowLeaderLease(t, s.ctl.LeaderLease)
	t.Cleanup(func() {
		if t.Failed() {
			s.dump()
		}
	})
	return s
}

// dump logs what the cluster holds for the scenario, and the controller
// manager's lines about it, to explain a failure.
func (s *scenario) dump() {
	ctx := context.Background()
	if pods, err := s.h.admin.CoreV1().Pods(s.ns).List(ctx, metav1.ListOptions{}); err == nil {
		for _, p := range pods.Items {
			s.t.Logf("pod %s uid %s node %q phase %s deleting %v", p.Name, p.UID, p.Spec.NodeName, p.Status.Phase, p.DeletionTimestamp != nil)
		}
	}
	if vas, err := s.h.admin.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{}); err == nil {
		for _, va := range vas.Items {
			s.t.Logf("volumeattachment %s pv %s node %s attached %v deleting %v", va.Name, ptr.Deref(va.Spec.Source.PersistentVolumeName, ""),
				va.Spec.NodeName, va.Status.Attached, va.DeletionTimestamp != nil)
		}
	}
	if nodes, err := s.h.admin.CoreV1().Nodes().List(ctx, metav1.ListOptions{LabelSelector: caseLabel + "=" + s.name}); err == nil {
		for _, n := range nodes.Items {
			s.t.Logf("node %s taints %v volumesAttached %v volumesInUse %v", n.Name, n.Spec.Taints, n.Status.VolumesAttached, n.Status.VolumesInUse)
		}
	}
	data, err := os.ReadFile(filepath.Join(s.h.c.Dir, "logs", "kube-controller-manager.log"))
	if err != nil {
		return
	}
	var lines []string
	for _, l := range strings.Split(string(data), "\n") {
		if strings.Contains(l, s.name+"-") || strings.Contains(l, s.ns) {
			lines = append(lines, l)
		}
	}
	if len(lines) > 60 {
		lines = lines[len(lines)-60:]
	}
	s.t.Logf("kube-controller-manager about %s:\n%s", s.ns, strings.Join(lines, "\n"))
}

// simNode is a simulated node: its Node object, a kubelet the test plays
// (Lease, Ready, volumesInUse, pod status) and optionally a real
// mountmedic Heartbeat behind a proxy.
type simNode struct {
	h     *harness
	name  string
	proxy *lab.TCPProxy
	fence *recordingFence
	hb    *Heartbeat

	mu          sync.Mutex
	kubeletOn   bool
	agentCancel context.CancelFunc
	agentDone   chan struct{}
}

func (n *simNode) alive() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.kubeletOn
}

// addNode creates a node of the scenario, placed in its namespace's
// scheduling order; withAgent runs its mountmedic heartbeat.
func (s *scenario) addNode(name string, withAgent bool) *simNode {
	t, h := s.t, s.h
	t.Helper()
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{
		Name:        name,
		Labels:      map[string]string{caseLabel: s.name, zoneLabel: "zone-" + s.name, corev1.LabelHostname: name},
		Annotations: map[string]string{adcAnnotaton: "true"},
	}}
	node, err := h.admin.CoreV1().Nodes().Create(h.ctx, node, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create node %s: %v", name, err)
	}
	// The node lifecycle and attach/detach controllers write the new node
	// too: retry on conflicts.
	err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
		node, err := h.admin.CoreV1().Nodes().Get(h.ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		now := metav1.Now()
		node.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady",
			LastHeartbeatTime: now, LastTransitionTime: now}}
		node.Status.Capacity = corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("8"), corev1.ResourceMemory: resource.MustParse("16Gi"), corev1.ResourcePods: resource.MustParse("110")}
		node.Status.Allocatable = node.Status.Capacity
		_, err = h.admin.CoreV1().Nodes().UpdateStatus(h.ctx, node, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		t.Fatalf("set node %s Ready: %v", name, err)
	}
	n := &simNode{h: h, name: name, kubeletOn: true}
	go n.kubelet(h.ctx)
	if withAgent {
		n.startAgent(t, s.cfg)
	}
	// After the proxy's cleanup is registered, so it runs before it.
	t.Cleanup(func() {
		n.stopAgent()
		_ = h.admin.CoreV1().Nodes().Delete(context.Background(), name, metav1.DeleteOptions{})
	})
	h.mu.Lock()
	h.nodes[name] = n
	h.placement[s.ns] = append(h.placement[s.ns], n)
	h.mu.Unlock()
	return n
}

// startAgent runs the node's Heartbeat through a fresh proxy.
func (n *simNode) startAgent(t testing.TB, cfg Config) {
	u, err := url.Parse(n.h.sa.Host)
	if err != nil {
		t.Fatal(err)
	}
	if n.proxy == nil {
		n.proxy = lab.StartTCPProxy(t, u.Host)
		n.fence = &recordingFence{}
	}
	cfg.NodeName = n.name
	cfg.Identity = "agent-" + n.name
	// As the command wires it: the node's pods with the node's own
	// identity, the heartbeat Lease with the ServiceAccount.
	node := n.h.nodeClient(t, n.name, "https://"+n.proxy.Addr())
	ctx, cancel := context.WithCancel(n.h.ctx)
	// The node's pod informer, which the agent owns in the command: started
	// here, read by the heartbeat, stopped with it.
	factory := informers.NewSharedInformerFactoryWithOptions(node, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", n.name).String()
		}))
	pods := factory.Core().V1().Pods().Informer()
	leaseCfg := rest.CopyConfig(n.h.sa)
	leaseCfg.Host = "https://" + n.proxy.Addr()
	leases, err := NewHeartbeatClient(leaseCfg)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	hb, err := NewHeartbeat(cfg, node, leases, pods, n.fence, n.fence, prometheus.NewRegistry())
	if err != nil {
		cancel()
		t.Fatalf("NewHeartbeat: %v", err)
	}
	factory.Start(ctx.Done())
	done := make(chan struct{})
	n.mu.Lock()
	n.hb, n.agentCancel, n.agentDone = hb, cancel, done
	n.mu.Unlock()
	go func() {
		defer close(done)
		logger := klog.Background().WithValues("sim", "agent")
		_ = hb.Run(klog.NewContext(ctx, logger))
		factory.Shutdown()
	}()
}

func (n *simNode) stopAgent() {
	n.mu.Lock()
	cancel, done := n.agentCancel, n.agentDone
	n.agentCancel = nil
	n.mu.Unlock()
	if cancel != nil {
		cancel()
		<-done
	}
}

// kill makes the node die: its kubelet stops, its agent loses the network
// and then stops.
func (n *simNode) kill() {
	n.mu.Lock()
	n.kubeletOn = false
	n.mu.Unlock()
	if n.proxy != nil {
		n.proxy.Cut()
	}
	n.stopAgent()
}

// partition cuts the node off the API server: kubelet silent, the agent
// running but unable to renew (it fences after FenceAfter).
func (n *simNode) partition() {
	n.mu.Lock()
	n.kubeletOn = false
	n.mu.Unlock()
	if n.proxy != nil {
		n.proxy.Cut()
	}
}

// stopKubelet silences only the kubelet: the agent still renews.
func (n *simNode) stopKubelet() {
	n.mu.Lock()
	n.kubeletOn = false
	n.mu.Unlock()
}

// revive brings the node back: kubelet posts Ready and renews its Lease,
// the agent's network returns.
func (n *simNode) revive(t testing.TB) {
	if n.proxy != nil {
		n.proxy.Restore()
	}
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		node, err := n.h.admin.CoreV1().Nodes().Get(n.h.ctx, n.name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		now := metav1.Now()
		for i := range node.Status.Conditions {
			if node.Status.Conditions[i].Type == corev1.NodeReady {
				node.Status.Conditions[i] = corev1.NodeCondition{Type: corev1.NodeReady, Status: corev1.ConditionTrue,
					Reason: "KubeletReady", LastHeartbeatTime: now, LastTransitionTime: now}
			}
		}
		_, err = n.h.admin.CoreV1().Nodes().UpdateStatus(n.h.ctx, node, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		t.Fatalf("set node %s Ready again: %v", n.name, err)
	}
	n.mu.Lock()
	n.kubeletOn = true
	n.mu.Unlock()
}

// kubelet plays the node's kubelet while the node lives: it renews the
// node Lease, reports the attached volumes as in use (a kubelet mounts
// them), and reports its pods Running and Ready.
func (n *simNode) kubelet(ctx context.Context) {
	leases := n.h.admin.CoordinationV1().Leases(corev1.NamespaceNodeLease)
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
	for {
		if n.alive() {
			n.beat(ctx, leases)
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

func (n *simNode) beat(ctx context.Context, leases interface {
	Get(context.Context, string, metav1.GetOptions) (*coordinationv1.Lease, error)
	Create(context.Context, *coordinationv1.Lease, metav1.CreateOptions) (*coordinationv1.Lease, error)
	Update(context.Context, *coordinationv1.Lease, metav1.UpdateOptions) (*coordinationv1.Lease, error)
}) {
	now := metav1.NowMicro()
	l, err := leases.Get(ctx, n.name, metav1.GetOptions{})
	switch {
	case apierrors.IsNotFound(err):
		_, _ = leases.Create(ctx, &coordinationv1.Lease{
			ObjectMeta: metav1.ObjectMeta{Name: n.name, Namespace: corev1.NamespaceNodeLease},
			Spec:       coordinationv1.LeaseSpec{HolderIdentity: ptr.To(n.name), LeaseDurationSeconds: ptr.To[int32](40), RenewTime: &now},
		}, metav1.CreateOptions{})
	case err == nil:
		l.Spec.RenewTime = &now
		_, _ = leases.Update(ctx, l, metav1.UpdateOptions{})
	}
	node, err := n.h.admin.CoreV1().Nodes().Get(ctx, n.name, metav1.GetOptions{})
	if err != nil {
		return
	}
	var inUse []corev1.UniqueVolumeName
	for _, v := range node.Status.VolumesAttached {
		inUse = append(inUse, v.Name)
	}
	if !slices.Equal(inUse, node.Status.VolumesInUse) && n.alive() {
		node.Status.VolumesInUse = inUse
		_, _ = n.h.admin.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{})
	}
	pods, err := n.h.admin.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("spec.nodeName", n.name).String()})
	if err != nil {
		return
	}
	for i := range pods.Items {
		p := &pods.Items[i]
		if !n.alive() {
			return
		}
		if p.DeletionTimestamp != nil {
			// Containers stopped: kubelet removes the pod for good.
			_ = n.h.admin.CoreV1().Pods(p.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{
				GracePeriodSeconds: new(int64), Preconditions: &metav1.Preconditions{UID: &p.UID}})
			continue
		}
		if p.Status.Phase == corev1.PodRunning {
			continue
		}
		now := metav1.Now()
		p.Status.Phase = corev1.PodRunning
		p.Status.StartTime = &now
		p.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: now}}
		_, _ = n.h.admin.CoreV1().Pods(p.Namespace).UpdateStatus(ctx, p, metav1.UpdateOptions{})
	}
}

// statefulSet creates a one-replica StatefulSet whose pod mounts an RWO
// claim of the test's CSI driver, bound to a static PV, and waits until
// its pod runs on the first node of the namespace with the volume attached
// and in use there.
func (s *scenario) statefulSet(name string, annotations map[string]string) *corev1.PersistentVolume {
	t, h := s.t, s.h
	t.Helper()
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: "pv-" + s.ns + "-" + name},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
			AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
			StorageClassName:              testSC,
			ClaimRef:                      &corev1.ObjectReference{Namespace: s.ns, Name: "data-" + name + "-0"},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver: testDriver, VolumeHandle: "vol-" + s.ns + "-" + name}},
		},
	}
	pv, err := h.admin.CoreV1().PersistentVolumes().Create(h.ctx, pv, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create PV: %v", err)
	}
	t.Cleanup(func() {
		_ = h.admin.CoreV1().PersistentVolumes().Delete(context.Background(), pv.Name, metav1.DeleteOptions{})
	})
	labels := map[string]string{"app": name}
	sts := &appsv1.StatefulSet{
		ObjectMeta: metav1.ObjectMeta{Namespace: s.ns, Name: name},
		Spec: appsv1.StatefulSetSpec{
			Replicas: ptr.To[int32](1),
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels, Annotations: annotations},
				Spec: corev1.PodSpec{
					Containers: []corev1.Container{{Name: "db", Image: "busybox",
						VolumeMounts: []corev1.VolumeMount{{Name: "data", MountPath: "/data"}}}},
					TerminationGracePeriodSeconds: ptr.To[int64](30),
				},
			},
			VolumeClaimTemplates: []corev1.PersistentVolumeClaim{{
				ObjectMeta: metav1.ObjectMeta{Name: "data"},
				Spec: corev1.PersistentVolumeClaimSpec{
					AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
					StorageClassName: ptr.To(testSC),
					Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
				},
			}},
		},
	}
	if _, err := h.admin.AppsV1().StatefulSets(s.ns).Create(h.ctx, sts, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create StatefulSet: %v", err)
	}
	h.mu.Lock()
	firstNode := h.placement[s.ns][0]
	h.mu.Unlock()
	s.waitAttachedInUse(pv, firstNode.name)
	firstNode.mu.Lock()
	hasAgent := firstNode.hb != nil
	firstNode.mu.Unlock()
	if hasAgent && annotations[Annotation] != "false" {
		// The controller moves only what the node's published fence plan
		// holds: a case that kills the node needs the pod in it.
		s.waitPublished(firstNode.name, s.podOf(h.ctx, name).UID)
	}
	return pv
}

// waitPublished waits until node's heartbeat Lease publishes a fence plan
// holding uid.
func (s *scenario) waitPublished(node string, uid types.UID) {
	s.t.Helper()
	s.waitFor("fence plan of "+node+" to hold pod "+string(uid), 30*time.Second, func(ctx context.Context) (bool, error) {
		l, err := s.h.admin.CoordinationV1().Leases(agentNS).Get(ctx, node, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return false, nil
		}
		return err == nil && planOf(l).has(string(uid)), err
	})
}

// uniqueVolume is the attach/detach controller's name of a CSI volume.
func uniqueVolume(pv *corev1.PersistentVolume) corev1.UniqueVolumeName {
	return corev1.UniqueVolumeName("kubernetes.io/csi/" + pv.Spec.CSI.Driver + "^" + pv.Spec.CSI.VolumeHandle)
}

// waitAttachedInUse waits until pv is attached to node, reported in use
// by its kubelet, and the pod using it runs there.
func (s *scenario) waitAttachedInUse(pv *corev1.PersistentVolume, node string) {
	s.t.Helper()
	s.waitFor(fmt.Sprintf("volume %s attached and in use on %s", pv.Name, node), 60*time.Second, func(ctx context.Context) (bool, error) {
		n, err := s.h.admin.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		if !slices.Contains(n.Status.VolumesInUse, uniqueVolume(pv)) {
			return false, nil
		}
		va := s.attachment(ctx, pv.Name, node)
		return va != nil && va.Status.Attached, nil
	})
}

// attachment returns the VolumeAttachment of pv on node, or nil.
func (s *scenario) attachment(ctx context.Context, pv, node string) *storagev1.VolumeAttachment {
	list, err := s.h.admin.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil
	}
	for i := range list.Items {
		va := &list.Items[i]
		if va.Spec.NodeName == node && va.Spec.Source.PersistentVolumeName != nil && *va.Spec.Source.PersistentVolumeName == pv {
			return va
		}
	}
	return nil
}

func (s *scenario) waitFor(what string, timeout time.Duration, cond func(context.Context) (bool, error)) {
	s.t.Helper()
	if err := waitFor(s.h.ctx, timeout, cond); err != nil {
		s.t.Fatalf("wait for %s: %v", what, err)
	}
}

func waitFor(ctx context.Context, timeout time.Duration, cond func(context.Context) (bool, error)) error {
	var last error
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		ok, err := cond(ctx)
		if err != nil {
			last = err
			return false, nil
		}
		return ok, nil
	})
	if err != nil && last != nil {
		return fmt.Errorf("%w (last error: %v)", err, last)
	}
	return err
}

// controller starts a failover controller of the scenario under its own
// ServiceAccount (deploy/controller/'s RBAC); stop it with the returned
// function (it waits).
func (s *scenario) controller(cfg ControllerConfig, identity string) (*Controller, *prometheus.Registry, func()) {
	s.t.Helper()
	return s.controllerWith(cfg, identity, ctlOptions{})
}

// ctlOptions change how a test's controller reaches the API server.
type ctlOptions struct {
	// host, when not empty, is a proxy in front of the API server.
	host string
	// wrap wraps the client's transport (to count requests).
	wrap func(http.RoundTripper) http.RoundTripper
	// watchHook wraps the informers' list-watches (Controller.watchHook).
	watchHook func(kind string, lw cache.ListerWatcher) cache.ListerWatcher
	// qps and burst, when qps is set, replace the work client's rate
	// (the leader election client keeps its own).
	qps   float32
	burst int
}

func (s *scenario) controllerWith(cfg ControllerConfig, identity string, o ctlOptions) (*Controller, *prometheus.Registry, func()) {
	s.t.Helper()
	cfg.Identity = identity
	reg := prometheus.NewRegistry()
	rc := rest.CopyConfig(s.h.ctl)
	if o.host != "" {
		rc.Host = o.host
	}
	rc.WrapTransport = o.wrap
	// The clients `mountmedic controller` makes (cmd/mountmedic).
	rc.QPS, rc.Burst = DefaultControllerQPS, DefaultControllerBurst
	if o.qps > 0 {
		rc.QPS, rc.Burst = o.qps, o.burst
	}
	client, err := kubeclient.New(rc)
	if err != nil {
		s.t.Fatalf("controller client: %v", err)
	}
	leases, err := NewLeaderElectionClient(rc)
	if err != nil {
		s.t.Fatalf("controller leader election client: %v", err)
	}
	c, err := NewController(cfg, client, leases, reg)
	if err != nil {
		s.t.Fatalf("NewController: %v", err)
	}
	c.watchHook = o.watchHook
	ctx, cancel := context.WithCancel(s.h.ctx)
	done := make(chan struct{})
	go func() {
		defer close(done)
		logger := klog.Background().WithValues("sim", identity)
		if err := c.Run(klog.NewContext(ctx, logger)); err != nil {
			s.t.Errorf("controller %s: %v", identity, err)
		}
	}()
	stop := func() {
		cancel()
		<-done
	}
	s.t.Cleanup(stop)
	return c, reg, stop
}

// ourTaint returns the out-of-service taint mountmedic put on node.
func (s *scenario) ourTaint(ctx context.Context, node string) (*corev1.Taint, error) {
	n, err := s.h.admin.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	for _, t := range n.Spec.Taints {
		if t.Key == TaintOutOfService && t.Value == TaintValue {
			return &t, nil
		}
	}
	return nil, nil
}

// events lists the events.k8s.io events with reason about the object
// named name (in the node events' namespace "default" for nodes).
func (s *scenario) events(ctx context.Context, ns, kind, name, reason string) []string {
	list, err := s.h.admin.EventsV1().Events(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil
	}
	var out []string
	for _, e := range list.Items {
		if e.Regarding.Kind == kind && e.Regarding.Name == name && e.Reason == reason && e.ReportingController == ReportingController {
			out = append(out, e.Note)
		}
	}
	return out
}

// metric reads a counter or gauge value from reg.
func metric(t testing.TB, reg prometheus.Gatherer, name string, labels map[string]string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatalf("gather metrics: %v", err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			if matches(m, labels) {
				switch {
				case m.Counter != nil:
					return m.GetCounter().GetValue()
				case m.Gauge != nil:
					return m.GetGauge().GetValue()
				case m.Histogram != nil:
					return float64(m.GetHistogram().GetSampleCount())
				}
			}
		}
	}
	return 0
}

func matches(m *dto.Metric, labels map[string]string) bool {
	for _, lp := range m.GetLabel() {
		if v, ok := labels[lp.GetName()]; ok && v != lp.GetValue() {
			return false
		}
	}
	return true
}

// recordingFence is the CRI and mount seam of a simulated node: it records
// what the fence stopped and unmounted.
type recordingFence struct {
	mu       sync.Mutex
	stopped  map[string]time.Time // pod UID -> first stop
	unmounts map[string]int
	// mounted are the pod UIDs MountedPods reports: the pods with CSI
	// mounts on the node.
	mounted []string
}

func (f *recordingFence) StopPodContainers(_ context.Context, podUIDs []string, _ time.Duration) []PodResult {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.stopped == nil {
		f.stopped = map[string]time.Time{}
	}
	out := make([]PodResult, len(podUIDs))
	for i, uid := range podUIDs {
		if _, ok := f.stopped[uid]; !ok {
			f.stopped[uid] = time.Now()
		}
		out[i].N = 1
	}
	return out
}

func (f *recordingFence) UnmountPodVolumes(_ context.Context, podUIDs []string) []PodResult {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.unmounts == nil {
		f.unmounts = map[string]int{}
	}
	out := make([]PodResult, len(podUIDs))
	for i, uid := range podUIDs {
		f.unmounts[uid]++
		out[i].N = 1
	}
	return out
}

func (f *recordingFence) MountedPods(context.Context) ([]string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.mounted), nil
}

func (f *recordingFence) stoppedAt(uid string) (time.Time, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	at, ok := f.stopped[uid]
	return at, ok
}

func (f *recordingFence) stoppedPods() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for uid := range f.stopped {
		out = append(out, uid)
	}
	slices.Sort(out)
	return out
}
