package e2e_test

import (
	"context"
	"crypto/rand"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/mountmedic/mountmedic/agent/failover"
	"github.com/mountmedic/mountmedic/scripts/csilab"
	"github.com/mountmedic/mountmedic/scripts/e2e"
)

// Figures of the partition scenario.
const (
	figLateWrites = "writes from the fenced side after the replacement's first write"
	figWriteGap   = "fenced side's last write -> replacement's first write"
	figCutToMoved = "partition -> replacement's first write"
)

// A partition pass: the controller's mode, whether a hostile pod floods
// the agent's peer endpoint during the partition, and whether a stolen
// agent token floods the heartbeat FlowSchema's flow.
type partitionPass struct {
	name     string
	mode     failover.Mode
	flood    bool
	apfFlood bool
}

var partitionPasses = []partitionPass{
	{name: "force-delete", mode: failover.ModeForceDelete},
	{name: "taint", mode: failover.ModeTaint},
	{name: "force-delete-flood", mode: failover.ModeForceDelete, flood: true},
	{name: "force-delete-apf-flood", mode: failover.ModeForceDelete, apfFlood: true},
}

// partitionScenario: the real node, with a writing pod on a ReadWriteOnce
// volume, loses the API server: kubelet and the agent (both its node
// identity and its in-cluster connection) go through the node's link,
// which the test cuts. The test plays the node lifecycle controller (the
// node Unknown, the unreachable NoSchedule taint, its pods not Ready);
// mountmedic's controller, under deploy/controller's RBAC and admission
// policies, fails the pod over once the node's fence window has passed,
// and the replacement runs on a simulated node, where the test writes its
// first file to the bucket. The volume's backend (the S3 server's objects)
// is the judge: no object the old pod writes may land after the
// replacement's first write. An opted-out pod (its annotation flipped to
// opted-in during the partition, by a hostile user) and a pod of an
// excluded namespace share the node with it: they are neither fenced nor
// moved, and the controller says so on them (FailoverLeft). Each pass (a
// controller mode, with or without a flood of the agent's peer endpoint)
// moves a new writer; the opted-out and excluded pods stay through all.
func partitionScenario(t *testing.T, e *env, ns string) {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	c := e.c.Client
	excluded := ns + "-excluded"
	policy := "--failover-exclude-namespaces=" + excluded

	// The peer check's key, so that the agent serves its peer endpoint.
	key := make([]byte, 32)
	_, _ = rand.Read(key)
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "mountmedic-peer-key", Namespace: e2e.AgentNamespace},
		Data: map[string][]byte{"key": key}}
	if _, err := c.CoreV1().Secrets(e2e.AgentNamespace).Create(ctx, secret, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		e.agent.APIServer = ""
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		_ = c.CoreV1().Secrets(e2e.AgentNamespace).Delete(ctx, secret.Name, metav1.DeleteOptions{})
		if err := e.agent.Deploy(ctx, "--failover"); err != nil {
			t.Errorf("deploy the agent back on the API server itself: %v", err)
		}
	})
	// Both of the agent's identities go through the node's link.
	e.agent.APIServer = e.n.APIProxy.Addr()
	if err := e.agent.Deploy(ctx, "--failover", policy); err != nil {
		t.Fatal(err)
	}
	deployDir, err := filepath.Abs(filepath.Join("..", "..", "deploy", "controller"))
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"admission-policy.yaml", "no-force-detach-policy.yaml"} {
		f := filepath.Join(deployDir, f)
		if out, err := e.c.Kubectl("apply", "-f", f); err != nil {
			t.Fatalf("apply %s: %v\n%s", f, err, out)
		}
		t.Cleanup(func() { _, _ = e.c.Kubectl("delete", "--ignore-not-found", "-f", f) })
	}
	ctl, err := e2e.StartController(t, e.c, "--failover-mode="+string(partitionPasses[0].mode), policy)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("controller log:\n%s\nagent log:\n%s", ctl.LogTail(60), e.agent.LogTail(60))
		}
	})

	// Pods that must stay: they tolerate what the node lifecycle
	// controller's taints evict for, as the moved writer does.
	stay := func(name string, ann map[string]string) (*wl, *corev1.Pod) {
		w, err := e.n.DeployWorkloadWith(ctx, name, e2e.WorkloadOptions{Writes: true, PodAnnotations: ann, Tolerations: lostNodeTolerations})
		if err != nil {
			t.Fatalf("%v\n%s", err, e.diagnostics(name))
		}
		t.Cleanup(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			if err := w.Delete(ctx); err != nil {
				t.Errorf("delete workload %s: %v", name, err)
			}
		})
		ww := &wl{Workload: w}
		return ww, ww.pod(t, ctx)
	}
	optOut, optOutPod := stay(ns+"-optout", map[string]string{"mountmedic.io/failover": "false"})
	excl, exclPod := stay(excluded, nil)

	for i, p := range partitionPasses {
		if i > 0 {
			if err := ctl.Restart("--failover-mode="+string(p.mode), policy); err != nil {
				t.Fatal(err)
			}
		}
		ok := t.Run(p.name, func(t *testing.T) {
			e.partitionPass(t, ctx, ns, p, ctl)
			for _, s := range []struct {
				w   *wl
				pod *corev1.Pod
			}{{optOut, optOutPod}, {excl, exclPod}} {
				e.stayed(t, ctx, s.w, s.pod)
			}
		})
		if !ok {
			return
		}
	}
}

// lostNodeTolerations tolerate what the real node carries (NotReady: no
// CNI plugin) and the node lifecycle controller's unreachable NoExecute
// taint (it would evict the pods of a lost node after 5 minutes; the e2e
// runs no such controller), but not the unreachable NoSchedule taint: a
// replacement never lands on the lost node.
var lostNodeTolerations = []corev1.Toleration{
	{Key: corev1.TaintNodeNotReady, Operator: corev1.TolerationOpExists},
	{Key: corev1.TaintNodeUnreachable, Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute},
}

// partitionPass runs one pass of the partition scenario with a new
// writer in namespace <base>-<pass>.
func (e *env) partitionPass(t *testing.T, ctx context.Context, base string, p partitionPass, ctl *e2e.Controller) {
	c := e.c.Client
	ns := base + "-" + p.name
	row := "partition " + p.name
	w, err := e.n.DeployWorkloadWith(ctx, ns, e2e.WorkloadOptions{Writes: true, Tolerations: lostNodeTolerations})
	if err != nil {
		t.Fatalf("%v\n%s", err, e.diagnostics(ns))
	}
	mw := &wl{Workload: w}
	old := mw.pod(t, ctx)
	if old.Spec.NodeName != e.n.Name {
		t.Fatalf("the writer %s runs on %s, want %s", old.Name, old.Spec.NodeName, e.n.Name)
	}
	// The node the replacement goes to; it joins after the writer runs.
	sim, err := e2e.StartSimNode(ctx, c, "sim-"+ns)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
		defer cancel()
		if err := sim.Delete(ctx); err != nil {
			t.Error(err)
		}
		// Pods bound to the simulated node have no kubelet to finish them.
		pods, _ := c.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
		for _, pod := range pods.Items {
			if pod.Spec.NodeName == sim.Name {
				_ = c.CoreV1().Pods(ns).Delete(ctx, pod.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
			}
		}
		if err := w.Delete(ctx); err != nil {
			t.Errorf("delete workload %s: %v", ns, err)
		}
	})
	// The agent publishes a plan with the writer; the controller watches
	// both nodes for a full window before it trusts a silence.
	time.Sleep(planWait)
	hb, err := c.CoordinationV1().Leases(e2e.AgentNamespace).Get(ctx, e.n.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if plan := hb.Annotations[failover.FencePlanAnnotation]; !strings.Contains(plan, string(old.UID)) {
		t.Fatalf("the agent's fence plan %s does not hold the writer %s", plan, old.UID)
	}

	var flood *peerFlood
	if p.flood {
		addr := hb.Annotations[failover.PeerAddressAnnotation]
		if addr == "" {
			t.Fatalf("the agent's heartbeat Lease advertises no peer address: %v", hb.Annotations)
		}
		flood = startPeerFlood(addr)
		defer flood.stop()
	}
	var hbFlood *apfFlood
	if p.apfFlood {
		hbFlood = startAPFFlood(t, e, e.n.Name)
		defer hbFlood.stop()
	}

	cut := time.Now()
	e.n.APIProxy.Cut()
	restored := false
	restore := func() {
		if restored {
			return
		}
		restored = true
		e.n.APIProxy.Restore()
	}
	defer restore()
	// A hostile user opts the opted-out pod in while its node is cut off:
	// the node never planned (nor fenced) it, so it must not move.
	optOut := base + "-optout"
	flip := func(v string) error {
		patch := fmt.Sprintf(`{"metadata":{"annotations":{"mountmedic.io/failover":%q}}}`, v)
		pods, err := c.CoreV1().Pods(optOut).List(ctx, metav1.ListOptions{})
		if err != nil {
			return err
		}
		for _, pod := range pods.Items {
			if _, err := c.CoreV1().Pods(optOut).Patch(ctx, pod.Name, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
				return err
			}
		}
		return nil
	}
	if err := flip("true"); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := flip("false"); err != nil {
			t.Error(err)
		}
	}()

	// The node lifecycle controller's part, after its grace period.
	time.Sleep(time.Until(cut.Add(nodeMonitorGrace)))
	if err := e.markLost(ctx, e.n.Name); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := e.unmarkLost(context.Background(), e.n.Name); err != nil {
			t.Error(err)
		}
	}()

	// The controller fails the writer over; its replacement runs on the
	// simulated node.
	var next *corev1.Pod
	err = wait2(ctx, 3*time.Minute, func(ctx context.Context) bool {
		pods, err := w.Pods(ctx)
		if err != nil {
			return false
		}
		for i := range pods {
			if pods[i].UID != old.UID && pods[i].Spec.NodeName == sim.Name && pods[i].Status.Phase == corev1.PodRunning {
				next = &pods[i]
				return true
			}
		}
		return false
	})
	if err != nil {
		e.figs.Miss(row, figCutToMoved, "s")
		t.Fatalf("no replacement of %s runs on %s 3 minutes after the partition:\n%s\ncontroller log:\n%s", old.Name, sim.Name, w.Describe(ctx), ctl.LogTail(40))
	}
	// The replacement's first write, after a listing of what the old pod
	// wrote: every object of the old pod missing from it landed after
	// this point (or during the listing itself, which counts against us).
	before := e.writesOf(t, ns, old.Name)
	if err := e.n.S3.PutObject(csilab.Bucket, ns+"/w/"+next.Name+"-1", []byte("1\n")); err != nil {
		t.Fatal(err)
	}
	first := time.Now()
	e.figs.Duration(row, figCutToMoved, first.Sub(cut))
	if len(before) == 0 {
		t.Fatalf("the writer %s wrote nothing the bucket holds", old.Name)
	}
	last := latest(before)
	if !last.After(cut) {
		t.Errorf("the writer's last object landed at %s, before the partition (%s): it never wrote while cut off, so this pass proves nothing", last.Format(time.RFC3339Nano), cut.Format(time.RFC3339Nano))
	}
	e.figs.Duration(row, figWriteGap, first.Sub(last))

	// What the controller did, and what it left.
	if p.mode == failover.ModeTaint {
		// The opted-out and excluded pods do not tolerate the taint and
		// were never fenced: the controller must not taint the node, and
		// force-deletes only the planned writer.
		n, err := c.CoreV1().Nodes().Get(ctx, e.n.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, taint := range n.Spec.Taints {
			if taint.Key == failover.TaintOutOfService {
				t.Errorf("node %s has the out-of-service taint %+v: it would evict the unfenced opted-out and excluded pods", e.n.Name, taint)
			}
		}
	}
	for _, left := range []string{optOut, base + "-excluded"} {
		if err := e.waitControllerEvent(ctx, left, failover.ReasonFailoverLeft, cut); err != nil {
			t.Errorf("no %s event on the pod of %s after the partition: %v", failover.ReasonFailoverLeft, left, err)
		}
	}

	// Keep watching the old side, then heal the partition and wait until
	// kubelet has torn the old pod down: a write buffered on the node and
	// flushed late would land by then.
	time.Sleep(10 * time.Second)
	if flood != nil {
		sent, busy := flood.stop()
		t.Logf("peer endpoint flood: %d requests sent, %d answered 429", sent, busy)
		if sent < 1000 {
			t.Errorf("the peer endpoint flood sent only %d requests", sent)
		}
	}
	if hbFlood != nil {
		sent, throttled, refused := hbFlood.stop()
		t.Logf("heartbeat flow flood: %d Lease writes sent, %d throttled (429), %d refused by admission", sent, throttled, refused)
		if sent < 1000 {
			t.Errorf("the heartbeat flow flood sent only %d Lease writes", sent)
		}
	}
	restore()
	podDir := filepath.Join(e2e.KubeletRoot, "pods", string(old.UID))
	if err := wait2(ctx, 3*time.Minute, func(context.Context) bool {
		_, err := os.Stat(podDir)
		return os.IsNotExist(err)
	}); err != nil {
		t.Errorf("kubelet did not tear the failed-over pod %s down within 3 minutes of the partition's end\n%s", old.UID, e.nodeMounts())
	}
	after := e.writesOf(t, ns, old.Name)
	var late []string
	for k, at := range after {
		if _, ok := before[k]; !ok {
			late = append(late, fmt.Sprintf("%s at %s", k, at.Format(time.RFC3339Nano)))
		}
	}
	e.figs.Value(row, figLateWrites, "", float64(len(late)))
	if len(late) > 0 {
		t.Errorf("two writers: %d objects of the old pod %s landed after its replacement's first write (%s): %v", len(late), old.Name, first.Format(time.RFC3339Nano), late)
	}
	t.Logf("%s: replacement's first write %s after the partition; the old pod's last write %s before it; %d after",
		p.name, first.Sub(cut).Round(time.Millisecond), first.Sub(last).Round(time.Millisecond), len(late))
}

// writesOf maps the objects the pod named pod wrote in namespace ns's
// prefix to when each landed (the backend file's modification time).
func (e *env) writesOf(t *testing.T, ns, pod string) map[string]time.Time {
	t.Helper()
	dir := filepath.Join(e.n.S3.Root, csilab.Bucket, ns, "w")
	ents, err := os.ReadDir(dir)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	out := map[string]time.Time{}
	for _, ent := range ents {
		if !strings.HasPrefix(ent.Name(), pod+"-") {
			continue
		}
		if fi, err := ent.Info(); err == nil {
			out[ent.Name()] = fi.ModTime()
		}
	}
	return out
}

func latest(m map[string]time.Time) time.Time {
	var l time.Time
	for _, at := range m {
		if at.After(l) {
			l = at
		}
	}
	return l
}

// stayed checks that a pod mountmedic may not move is still the workload's
// pod on the real node, and kept writing (it was not fenced).
func (e *env) stayed(t *testing.T, ctx context.Context, w *wl, pod *corev1.Pod) {
	t.Helper()
	got, err := e.c.Client.CoreV1().Pods(w.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
	if err != nil || got.UID != pod.UID || got.DeletionTimestamp != nil || got.Spec.NodeName != e.n.Name {
		t.Errorf("pod %s/%s (%s) must stay on %s: got %v, %v", w.Namespace, pod.Name, pod.UID, e.n.Name, describeOrNil(got), err)
		return
	}
	writes := e.writesOf(t, w.Namespace, pod.Name)
	if l := latest(writes); time.Since(l) > 30*time.Second {
		t.Errorf("pod %s/%s wrote last at %s: it must keep writing (neither fenced nor moved)", w.Namespace, pod.Name, l.Format(time.RFC3339Nano))
	}
}

func describeOrNil(p *corev1.Pod) string {
	if p == nil {
		return "none"
	}
	return fmt.Sprintf("uid %s on %s, deleting %v", p.UID, p.Spec.NodeName, p.DeletionTimestamp != nil)
}

// markLost does what kube-controller-manager's node lifecycle controller
// does to a node whose kubelet fell silent past its grace period: Ready
// Unknown, the unreachable NoSchedule taint, and its pods not Ready.
func (e *env) markLost(ctx context.Context, name string) error {
	c := e.c.Client
	node, err := c.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return err
	}
	for i := range node.Status.Conditions {
		cond := &node.Status.Conditions[i]
		cond.Status, cond.Reason, cond.Message = corev1.ConditionUnknown, "NodeStatusUnknown", "Kubelet stopped posting node status."
		cond.LastTransitionTime = metav1.Now()
	}
	if node, err = c.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("mark node %s Unknown: %w", name, err)
	}
	node.Spec.Taints = append(node.Spec.Taints, corev1.Taint{Key: corev1.TaintNodeUnreachable, Effect: corev1.TaintEffectNoSchedule, TimeAdded: ptrNow()})
	if _, err := c.CoreV1().Nodes().Update(ctx, node, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("taint node %s unreachable: %w", name, err)
	}
	pods, err := c.CoreV1().Pods("").List(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=" + name})
	if err != nil {
		return err
	}
	for i := range pods.Items {
		pod := &pods.Items[i]
		for j := range pod.Status.Conditions {
			if pod.Status.Conditions[j].Type == corev1.PodReady {
				pod.Status.Conditions[j].Status = corev1.ConditionFalse
				pod.Status.Conditions[j].LastTransitionTime = metav1.Now()
			}
		}
		if _, err := c.CoreV1().Pods(pod.Namespace).UpdateStatus(ctx, pod, metav1.UpdateOptions{}); err != nil && !apierrors.IsConflict(err) && !apierrors.IsNotFound(err) {
			return fmt.Errorf("mark pod %s/%s not Ready: %w", pod.Namespace, pod.Name, err)
		}
	}
	return nil
}

func ptrNow() *metav1.Time {
	n := metav1.Now()
	return &n
}

// unmarkLost takes the unreachable taint away once the node is back, and
// any out-of-service taint of mountmedic (the real node stays NotReady for
// want of a CNI plugin, so the controller would not lift it).
func (e *env) unmarkLost(ctx context.Context, name string) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	return wait.PollUntilContextCancel(ctx, 500*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		node, err := e.c.Client.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		var keep []corev1.Taint
		for _, taint := range node.Spec.Taints {
			if taint.Key != corev1.TaintNodeUnreachable && !(taint.Key == failover.TaintOutOfService && taint.Value == failover.TaintValue) {
				keep = append(keep, taint)
			}
		}
		node.Spec.Taints = keep
		delete(node.Annotations, failover.FailedOverAnnotation)
		_, err = e.c.Client.CoreV1().Nodes().Update(ctx, node, metav1.UpdateOptions{})
		return err == nil, nil
	})
}

// waitControllerEvent waits for an event of the failover controller with
// reason in namespace ns since since.
func (e *env) waitControllerEvent(ctx context.Context, ns, reason string, since time.Time) error {
	return wait2(ctx, time.Minute, func(ctx context.Context) bool {
		list, err := e.c.Client.EventsV1().Events(ns).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false
		}
		for i := range list.Items {
			ev := &list.Items[i]
			if ev.ReportingController == failover.ReportingController && ev.Reason == reason && !e2e.EventTime(ev).Before(since.Truncate(time.Second)) {
				return true
			}
		}
		return false
	})
}

// peerFlood is a hostile pod on the node network: unauthenticated checks
// at the agent's peer endpoint, as fast as 8 connections go.
type peerFlood struct {
	sent, busy atomic.Int64
	cancel     context.CancelFunc
	wg         sync.WaitGroup
	once       sync.Once
}

func startPeerFlood(addr string) *peerFlood {
	ctx, cancel := context.WithCancel(context.Background())
	f := &peerFlood{cancel: cancel}
	cl := &http.Client{Timeout: 2 * time.Second}
	for i := range 8 {
		f.wg.Go(func() {
			nonce := make([]byte, 32)
			for n := 0; ctx.Err() == nil; n++ {
				_, _ = rand.Read(nonce)
				u := fmt.Sprintf("http://%s/failover/v1/can-renew?nonce=%x&from=flooder-%d-%d&auth=%x", addr, nonce, i, n, nonce)
				req, _ := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
				resp, err := cl.Do(req)
				f.sent.Add(1)
				if err == nil {
					if resp.StatusCode == http.StatusTooManyRequests {
						f.busy.Add(1)
					}
					resp.Body.Close()
				}
			}
		})
	}
	return f
}

// stop ends the flood and returns the requests sent and those answered 429.
func (f *peerFlood) stop() (sent, busy int64) {
	f.once.Do(func() {
		f.cancel()
		f.wg.Wait()
	})
	return f.sent.Load(), f.busy.Load()
}
