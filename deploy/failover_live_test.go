package deploy_test

import (
	"context"
	"fmt"
	"net/url"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	appsv1 "k8s.io/api/apps/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/retry"
	"k8s.io/utils/ptr"

	"github.com/mountmedic/mountmedic/agent/failover"
	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/scripts/kubetest"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// The failover duty in the live test. Every agent gets --failover with
// these flags, the same on every node (the duty's rule), and the controller
// (`mountmedic controller`, run on the lab node under its own
// ServiceAccount) liveControllerFlags, in place of the defaults that suit a
// real cluster (5s/30s/5s/15s/40s): the simulated node's fail-over then
// takes about 20 s instead of a minute. The heartbeat interval stays at 2 s
// so that an agent slowed down by a loaded test machine does not miss its
// first renewals (it fences when it cannot renew within two intervals of
// starting), and --failover-fence-after at 10 s so that the lab node's
// agent never fences itself while the API server is slow. Leader election
// keeps its defaults: the only replica takes a fresh Lease at once.
var (
	liveFailoverFlags = []string{
		"--failover",
		"--failover-heartbeat-interval=2s",
		"--failover-fence-after=10s",
		"--failover-fence-stop-grace=1s",
		// Below the heartbeat interval, as the agent requires with a peer
		// key (the DaemonSet passes one).
		"--failover-peer-timeout=1s",
	}
	liveControllerFlags = []string{
		"--failover-fence-after=10s",
		"--failover-fence-margin=6s",
		"--failover-kubelet-grace=5s",
	}
)

// liveControllers are kube-controller-manager's controllers for the live
// test: kubetest's defaults (the disruption controller computes the
// PodDisruptionBudget's status the eviction API judges by), the node
// lifecycle controller (it turns the dead node's Ready condition Unknown
// when its kubelet Lease stops, here after 6 s) and the taint eviction
// controller (it deletes the pods of a node tainted out-of-service, and the
// failover leader then force-deletes them).
var (
	liveControllers = append(append([]string(nil), kubetest.DefaultControllers...), "nodelifecycle", "taint-eviction-controller")
	liveKCMArgs     = []string{"--node-monitor-period=1s", "--node-monitor-grace-period=6s"}
)

// simNodeName is the second, simulated node: a Node object whose kubelet
// the test plays (it renews the node's Lease until the node "dies"), with a
// real second `mountmedic agent` whose only way to the API server is a TCP
// proxy the test cuts, and one StatefulSet pod with a ReadWriteOnce CSI
// volume published in its own lab kubelet tree.
const simNodeName = "lab-node-b"

// simNode is the simulated node of the live test.
type simNode struct {
	// name is the node's (simNodeName, or the lab node whose kubelet the
	// live test also plays).
	name        string
	cs          kubernetes.Interface
	proxy       *lab.TCPProxy
	agent       *process
	metricsAddr string
	pod         *corev1.Pod
	publish     string // the pod's CSI publish target in the node's kubelet tree

	mu        sync.Mutex
	kubeletOn bool
	cutAt     time.Time
}

// startSimNode creates the node, its kubelet Lease (renewed every 500 ms
// while the node lives), a StatefulSet "db" whose pod db-0 runs there with
// a ReadWriteOnce CSI claim, publishes that volume in a lab kubelet tree,
// and starts the node's agent with args (the DaemonSet's and the failover
// flags) behind a proxy, with the node's credentials and its pod's token.
func startSimNode(ctx context.Context, t *testing.T, c *kubetest.Cluster, bin string, args []string) *simNode {
	t.Helper()
	cs := c.Client
	if _, err := cs.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{
		Name: simNodeName, Labels: map[string]string{corev1.LabelHostname: simNodeName},
	}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create node: %v", err)
	}
	// The node lifecycle controller writes the new node too.
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		node, err := cs.CoreV1().Nodes().Get(ctx, simNodeName, metav1.GetOptions{})
		if err != nil {
			return err
		}
		now := metav1.Now()
		node.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady",
			LastHeartbeatTime: now, LastTransitionTime: now}}
		_, err = cs.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		t.Fatalf("set node %s Ready: %v", simNodeName, err)
	}
	n := &simNode{name: simNodeName, cs: cs, kubeletOn: true}
	kctx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { n.kubelet(kctx) })
	t.Cleanup(func() { stop(); wg.Wait() })

	// The StatefulSet and its pod. No StatefulSet controller runs: the pod
	// is created as it would have, owned by the StatefulSet.
	labels := map[string]string{"app": "db"}
	sts, err := cs.AppsV1().StatefulSets(appsNS).Create(ctx, &appsv1.StatefulSet{
		ObjectMeta: metav1.ObjectMeta{Name: "db"},
		Spec: appsv1.StatefulSetSpec{
			Replicas: ptr.To[int32](1),
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "db", Image: "busybox"}}},
			},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create StatefulSet: %v", err)
	}
	createClaim(ctx, t, cs, "db-0", fuseCSI, "vol-db-0")
	pod, err := cs.CoreV1().Pods(appsNS).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "db-0", Labels: labels, OwnerReferences: []metav1.OwnerReference{{
			APIVersion: "apps/v1", Kind: "StatefulSet", Name: sts.Name, UID: sts.UID, Controller: ptr.To(true)}}},
		Spec: corev1.PodSpec{
			NodeName:   simNodeName,
			Containers: []corev1.Container{{Name: "db", Image: "busybox", VolumeMounts: []corev1.VolumeMount{{Name: "data", MountPath: "/data"}}}},
			Volumes: []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{
				PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: "data-db-0"}}}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create pod db-0: %v", err)
	}
	pod.Status.Phase = corev1.PodRunning
	pod.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}
	if n.pod, err = cs.CoreV1().Pods(appsNS).UpdateStatus(ctx, pod, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("set pod db-0 running: %v", err)
	}

	// Its volume, published (a bind of the staging directory) where the
	// CSI driver would have: the fence unmounts it.
	kl := lab.NewKubelet(t, filepath.Join(t.TempDir(), "var", "lib", "kubelet"))
	staging := kl.StagingPath(fuseCSI, "vol-db-0")
	n.publish = kl.Publish(string(n.pod.UID), "pv-db-0", fuseCSI, "vol-db-0", staging, false)

	// Its agent, through the proxy.
	u, err := url.Parse(c.Config.Host)
	if err != nil {
		t.Fatal(err)
	}
	n.proxy = lab.StartTCPProxy(t, u.Host)
	n.metricsAddr = freeAddr(t)
	args = append(args, agentCredentials(ctx, t, c, simNodeName, "https://"+n.proxy.Addr())...)
	args = append(args, "--node-name="+simNodeName, "--kubelet-root="+kl.Root(),
		"--host-table=/proc/self/mountinfo", "--metrics-addr="+n.metricsAddr, "-v=2")
	n.agent = startProcess(t, "agent-"+simNodeName, []string{"POD_NAMESPACE=mountmedic", "POD_NAME=mountmedic-" + simNodeName}, bin, args...)
	return n
}

// kubelet plays the node's kubelet: it renews the node's Lease while the
// node lives.
func (n *simNode) kubelet(ctx context.Context) {
	leases := n.cs.CoordinationV1().Leases(corev1.NamespaceNodeLease)
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
	for {
		n.mu.Lock()
		on := n.kubeletOn
		n.mu.Unlock()
		if on {
			now := metav1.NowMicro()
			l, err := leases.Get(ctx, n.name, metav1.GetOptions{})
			switch {
			case apierrors.IsNotFound(err):
				_, _ = leases.Create(ctx, &coordinationv1.Lease{
					ObjectMeta: metav1.ObjectMeta{Name: n.name},
					Spec:       coordinationv1.LeaseSpec{HolderIdentity: ptr.To(n.name), LeaseDurationSeconds: ptr.To[int32](40), RenewTime: &now},
				}, metav1.CreateOptions{})
			case err == nil:
				l.Spec.RenewTime = &now
				_, _ = leases.Update(ctx, l, metav1.UpdateOptions{})
			}
		}
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
	}
}

// partition makes the node die as the control plane sees it: its kubelet
// stops renewing, and its agent, still running, loses the API server.
func (n *simNode) partition() {
	n.mu.Lock()
	n.kubeletOn = false
	n.cutAt = time.Now()
	n.mu.Unlock()
	n.proxy.Cut()
}

// heal brings it back: the agent reaches the API server again, and the
// kubelet posts Ready and renews its Lease.
func (n *simNode) heal(ctx context.Context, t *testing.T) {
	t.Helper()
	n.proxy.Restore()
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		node, err := n.cs.CoreV1().Nodes().Get(ctx, simNodeName, metav1.GetOptions{})
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
		_, err = n.cs.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		t.Fatalf("set node %s Ready again: %v", simNodeName, err)
	}
	n.mu.Lock()
	n.kubeletOn = true
	n.mu.Unlock()
}

// failoverTaint returns the out-of-service taint the duty put on the node.
func (n *simNode) failoverTaint(ctx context.Context) (*corev1.Taint, error) {
	node, err := n.cs.CoreV1().Nodes().Get(ctx, simNodeName, metav1.GetOptions{})
	if err != nil {
		return nil, err
	}
	for _, tn := range node.Spec.Taints {
		if tn.Key == failover.TaintOutOfService && tn.Value == failover.TaintValue {
			return &tn, nil
		}
	}
	return nil, nil
}

// podGone reports whether db-0 (that UID) is gone from the API.
func (n *simNode) podGone(ctx context.Context) bool {
	p, err := n.cs.CoreV1().Pods(appsNS).Get(ctx, n.pod.Name, metav1.GetOptions{})
	return apierrors.IsNotFound(err) || (err == nil && p.UID != n.pod.UID)
}

// publishMounted reports whether something other than mountmedic's guard
// is mounted at the pod's publish target in this mount namespace (the
// agents share it), and whether the guard is.
func (n *simNode) publishMounted(t *testing.T) (mounted, guarded bool) {
	t.Helper()
	infos, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(n.publish))
	if err != nil {
		t.Fatal(err)
	}
	for _, in := range infos {
		if in.Source == probe.GuardSource {
			guarded = true
		} else {
			mounted = true
		}
	}
	return mounted, guarded
}

// checkFailover checks, once the queries have their data, what the
// failover did in the API and on the simulated node, and logs its figures
// (measured, not asserted): when the node's agent fenced, when the leader
// tainted the node, and the death-to-action time the leader recorded.
func checkFailover(ctx context.Context, t *testing.T, prom *promServer, n *simNode) {
	t.Helper()
	n.mu.Lock()
	cut := n.cutAt
	n.mu.Unlock()
	taint, err := n.failoverTaint(ctx)
	switch {
	case err != nil:
		t.Errorf("read node %s: %v", simNodeName, err)
	case taint == nil:
		t.Errorf("node %s has no out-of-service taint of mountmedic after the fail-over the metrics counted", simNodeName)
	case taint.Effect != corev1.TaintEffectNoExecute:
		t.Errorf("failover taint %v: want effect NoExecute", taint)
	}
	if !n.podGone(ctx) {
		t.Errorf("pod %s/%s (uid %s) is still there after the fail-over", appsNS, n.pod.Name, n.pod.UID)
	}
	switch mounted, guarded := n.publishMounted(t); {
	case mounted:
		t.Errorf("%s is still mounted: the fenced node's agent did not unmount its pod's volume", n.publish)
	case !guarded:
		t.Errorf("%s is not guarded: the fenced node's agent (--guard, on by default) did not guard the publish target it unmounted", n.publish)
	}
	if res, err := prom.query(fmt.Sprintf(`mountmedic_failover_fences_total{node=%q}`, labNode), time.Now()); err != nil || len(res) != 1 || res[0].Value != 0 {
		t.Errorf("the lab node's agent fenced its own node (fences %v, err %v): its heartbeat renewals were slower than --failover-fence-after", res, err)
	}

	figure := func(expr string) (float64, bool) {
		res, err := prom.query(expr, time.Now())
		if err != nil || len(res) == 0 {
			t.Logf("figure %s: %v (err %v)", expr, res, err)
			return 0, false
		}
		return float64(res[0].Value), true
	}
	at := func(unix float64) float64 { return unix - float64(cut.UnixNano())/1e9 }
	var b strings.Builder
	fmt.Fprintf(&b, "failover of %s, counted from the partition (kubelet Lease stopped, agent cut off):", simNodeName)
	if v, ok := figure(fmt.Sprintf(`mountmedic_failover_heartbeat_last_success_timestamp_seconds{node=%q}`, simNodeName)); ok {
		fmt.Fprintf(&b, " last heartbeat renewal started %.1f s;", at(v))
	}
	if v, ok := figure(fmt.Sprintf(`min_over_time(timestamp(mountmedic_failover_node_fenced{node=%q} == 1)[5m:1s])`, simNodeName)); ok {
		fmt.Fprintf(&b, " fenced (first scrape showing it) %+.0f s;", at(v))
	}
	if taint != nil && taint.TimeAdded != nil {
		fmt.Fprintf(&b, " tainted out-of-service %+.0f s (taint time, 1 s resolution);", taint.TimeAdded.Sub(cut).Seconds())
	}
	if v, ok := figure(fmt.Sprintf(`mountmedic_failover_death_to_action_seconds_sum{node=%q} / mountmedic_failover_death_to_action_seconds_count{node=%q}`, labNode, labNode)); ok {
		fmt.Fprintf(&b, " death to action as the leader measured it %.1f s", v)
	}
	t.Log(b.String())
}

// healFailover brings the simulated node back and waits until its agent
// has lifted the fence and the leader has removed its taint.
func healFailover(ctx context.Context, t *testing.T, prom *promServer, n *simNode) {
	t.Helper()
	start := time.Now()
	n.heal(ctx, t)
	waitQuery(ctx, t, prom, fmt.Sprintf(`mountmedic_failover_node_fenced{node=%q} == 0`, simNodeName))
	waitQuery(ctx, t, prom, fmt.Sprintf(`mountmedic_failover_nodes_recovered_total{node=%q} > 0`, labNode))
	taint, err := n.failoverTaint(ctx)
	if err != nil || taint != nil {
		t.Errorf("node %s after it recovered: failover taint %v (err %v), want none", simNodeName, taint, err)
	}
	if res, err := prom.query(fmt.Sprintf(`mountmedic_failover_fences_total{node=%q}`, labNode), time.Now()); err != nil || len(res) != 1 || res[0].Value != 0 {
		t.Errorf("the lab node's agent fenced its own node (fences %v, err %v)", res, err)
	}
	t.Logf("%s back: fence lifted and taint removed, seen by Prometheus %.0f s after the partition healed", simNodeName, time.Since(start).Seconds())
}
