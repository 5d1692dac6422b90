package scale

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/retry"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	"github.com/mountmedic/mountmedic/agent/failover"
	"github.com/mountmedic/mountmedic/scripts/kubetest"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

const (
	agentNS    = "mountmedic"
	workNS     = "scale"
	kwokLabel  = "scale.mountmedic.test/kwok"
	kwokLive   = "managed"
	kwokDead   = "dead"
	testDriver = "scale.csi.mountmedic.test"
	harnessUA  = "scale-harness"
)

// env is one scale run: the control plane, kwok, the nodes and what the
// harness observed.
type env struct {
	t     testing.TB
	c     *kubetest.Cluster
	admin kubernetes.Interface
	sa    *rest.Config
	// ctl is the controller's ServiceAccount (deploy/controller/rbac.yaml).
	ctl *rest.Config
	// peerKey is the agents' shared peer-check key (the Secret
	// mountmedic-peer-key's).
	peerKey string
	ctx     context.Context
	cancel  context.CancelFunc
	factor  float64
	nodes   int
	hbs     int
	shm     string // scratch directory on tmpfs: etcd data, audit log
	audit   *auditLog
	kwok    *lab.Process
	ctrl    *controllerProc // the controller, once started

	sim []*simNode // the nodes with a heartbeat, in name order

	mu      sync.Mutex
	tainted map[string]time.Time // node -> when the harness first saw mountmedic's taint
}

// simNode is a kwok node with a real heartbeat.
type simNode struct {
	name  string
	proxy *lab.TCPProxy
	fence *recordingFence
	reg   *prometheus.Registry
	stop  func()
}

func envInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil && v > 0 {
		return v
	}
	return def
}

func envFloat(name string, def float64) float64 {
	if v, err := strconv.ParseFloat(os.Getenv(name), 64); err == nil && v > 0 {
		return v
	}
	return def
}

// scaled multiplies a default period by the time factor.
func (e *env) scaled(d time.Duration) time.Duration {
	return time.Duration(float64(d) * e.factor).Round(time.Millisecond)
}

func nodeName(i int) string { return fmt.Sprintf("node-%05d", i) }

// startEnv brings the whole cluster up: control plane with audit log,
// kube-controller-manager, deploy/'s RBAC, N kwok nodes Ready, the
// workloads of the heartbeat nodes, static heartbeat Leases for the others.
func startEnv(t *testing.T) *env {
	e := &env{t: t,
		factor:  envFloat("MOUNTMEDIC_SCALE_TIME", 0.2),
		nodes:   envInt("MOUNTMEDIC_SCALE_NODES", 300),
		hbs:     envInt("MOUNTMEDIC_SCALE_HEARTBEATS", 100),
		tainted: map[string]time.Time{},
	}
	e.hbs = min(e.hbs, e.nodes)
	kwokBin := lab.RequireTool(t, "kwok")
	stages := kwokStages(t, kwokBin, e.factor)

	shm, err := os.MkdirTemp("/dev/shm", "mountmedic-scale-")
	if err != nil {
		shm = t.TempDir()
	}
	t.Cleanup(func() { os.RemoveAll(shm) })
	e.shm = shm
	policy := filepath.Join(shm, "audit-policy.yaml")
	if err := os.WriteFile(policy, []byte(auditPolicy), 0o644); err != nil {
		t.Fatal(err)
	}
	auditFile := filepath.Join(shm, "audit.log")
	kcmGrace := e.scaled(50 * time.Second)
	c := kubetest.Start(t, kubetest.Options{
		Controllers: []string{"nodelifecycle", "taint-eviction-controller"},
		ControllerManagerArgs: []string{
			"--node-monitor-period=" + max(e.scaled(5*time.Second), time.Second).String(),
			"--node-monitor-grace-period=" + kcmGrace.String(),
		},
		APIServerArgs: []string{
			"--audit-policy-file=" + policy,
			"--audit-log-path=" + auditFile,
			"--audit-log-maxsize=0",
			"--audit-log-mode=batch",
			"--audit-log-batch-max-wait=1s",
			"--max-requests-inflight=800",
			"--max-mutating-requests-inflight=400",
		},
		EtcdDataDir: filepath.Join(shm, "etcd"),
	})
	e.c = c
	if keep := os.Getenv("MOUNTMEDIC_SCALE_LOGS"); keep != "" {
		// Runs before the cluster's own cleanup removes its directory.
		t.Cleanup(func() {
			klog.Flush()
			if out, err := exec.Command("cp", "-r", filepath.Join(c.Dir, "logs"), keep).CombinedOutput(); err != nil {
				t.Logf("keep logs in %s: %v: %s", keep, err, out)
			}
		})
	}
	// klog (the heartbeats', the candidates') goes to a file, not the test log.
	logf, err := os.Create(filepath.Join(c.Dir, "logs", "agents.log"))
	if err != nil {
		t.Fatal(err)
	}
	fs := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(fs)
	_ = fs.Set("logtostderr", "false")
	_ = fs.Set("alsologtostderr", "false")
	_ = fs.Set("stderrthreshold", "FATAL")
	klog.SetOutput(logf)
	t.Cleanup(func() { klog.Flush(); klog.SetOutput(io.Discard); logf.Close() })

	e.ctx, e.cancel = context.WithCancel(context.Background())
	t.Cleanup(e.cancel)
	adminCfg := rest.CopyConfig(c.Config)
	adminCfg.UserAgent = harnessUA
	adminCfg.QPS, adminCfg.Burst = 500, 1000
	if e.admin, err = kubernetes.NewForConfig(adminCfg); err != nil {
		t.Fatal(err)
	}
	e.audit = tailAudit(e.ctx, auditFile)

	deploy, err := filepath.Abs("../../deploy")
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"namespace.yaml", "serviceaccount.yaml", "rbac.yaml"} {
		if out, err := c.Kubectl("apply", "-f", filepath.Join(deploy, f)); err != nil {
			t.Fatalf("kubectl apply deploy/%s: %v\n%s", f, err, out)
		}
	}
	for _, f := range []string{"controller/serviceaccount.yaml", "controller/rbac.yaml"} {
		if out, err := c.Kubectl("apply", "-f", filepath.Join(deploy, f)); err != nil {
			t.Fatalf("kubectl apply deploy/%s: %v\n%s", f, err, out)
		}
	}
	e.sa = c.ServiceAccountConfig(t, agentNS, "mountmedic")
	e.ctl = c.ServiceAccountConfig(t, agentNS, "mountmedic-controller")
	e.peerKey = filepath.Join(t.TempDir(), "peer-key")
	if err := os.WriteFile(e.peerKey, []byte("scale-test-peer-key-0123456789abcdef0123456789"), 0o400); err != nil {
		t.Fatal(err)
	}
	c.CreateNamespace(t, workNS)

	start := time.Now()
	e.createNodes(t)
	e.startKwok(t, kwokBin, stages)
	e.waitReady(t, e.nodes)
	e.createWorkloads(t)
	e.watch(t)
	t.Logf("%d kwok nodes Ready, %d with workloads, in %s", e.nodes, e.hbs, time.Since(start).Round(time.Second))
	return e
}

// auditPolicy records every request once, when it completes, with who made
// it (user, user agent), verb and object; no bodies.
const auditPolicy = `apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: ["RequestReceived", "ResponseStarted"]
rules:
- level: Metadata
`

// kwokStages are the node stages kwok runs: node-initialize (Ready,
// addresses, capacity) and node-heartbeat-with-lease (the Ready heartbeat
// in the node status, which kubelet posts every 5 min when it has a Lease:
// kwok's default is 10 min with jitter), both from kwok's module as
// tools.sh copied them next to the binary, with the status period scaled
// by the time factor. The node Lease itself is renewed by kwok's lease
// controller (--node-lease-duration-seconds).
func kwokStages(t testing.TB, bin string, factor float64) string {
	t.Helper()
	real, err := filepath.EvalSymlinks(bin)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(filepath.Dir(real), "stages")
	var docs []string
	docs = append(docs, `apiVersion: config.kwok.x-k8s.io/v1alpha1
kind: KwokConfiguration
options:
  nodeLeaseParallelism: 32
  nodePlayStageParallelism: 8
  podPlayStageParallelism: 4
  podsOnNodeSyncParallelism: 4
`)
	for _, f := range []string{"node-initialize.yaml", "node-heartbeat-with-lease.yaml"} {
		data, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			t.Fatalf("kwok stage %s (scripts/tools.sh kwok copies kwok's stages next to its binary): %v", f, err)
		}
		s := string(data)
		s = strings.Replace(s, "durationMilliseconds: 600000", fmt.Sprintf("durationMilliseconds: %d", int(600000*factor)), 1)
		s = strings.Replace(s, "jitterDurationMilliseconds: 610000", fmt.Sprintf("jitterDurationMilliseconds: %d", int(610000*factor)), 1)
		docs = append(docs, s)
	}
	out := filepath.Join(t.TempDir(), "kwok.yaml")
	if err := os.WriteFile(out, []byte(strings.Join(docs, "\n---\n")), 0o644); err != nil {
		t.Fatal(err)
	}
	return out
}

// parallel runs f(i) for i in [0, n) on workers goroutines.
func parallel(n, workers int, f func(i int) error) error {
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	next := make(chan int)
	for range workers {
		wg.Go(func() {
			for i := range next {
				if err := f(i); err != nil {
					select {
					case errs <- err:
					default:
					}
				}
			}
		})
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	close(errs)
	return <-errs
}

func (e *env) createNodes(t testing.TB) {
	t.Helper()
	err := parallel(e.nodes, 16, func(i int) error {
		name := nodeName(i)
		node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{
			Name:   name,
			Labels: map[string]string{kwokLabel: kwokLive, corev1.LabelHostname: name, "type": "kwok"},
			Annotations: map[string]string{"node.alpha.kubernetes.io/ttl": "0",
				"volumes.kubernetes.io/controller-managed-attach-detach": "true"},
		}}
		if _, err := e.admin.CoreV1().Nodes().Create(e.ctx, node, metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("create node %s: %w", name, err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// startKwok runs kwok on the admin kubeconfig, managing the nodes labelled
// kwokLabel=kwokLive: a node relabelled kwokDead is one whose kubelet died.
func (e *env) startKwok(t testing.TB, bin, stages string) {
	t.Helper()
	leaseSeconds := max(int(math.Round(40*e.factor)), 4)
	cmd := exec.Command(bin,
		"--kubeconfig="+e.c.Kubeconfig,
		"--config="+stages,
		"--manage-nodes-with-label-selector="+kwokLabel+"="+kwokLive,
		"--node-lease-duration-seconds="+strconv.Itoa(leaseSeconds),
		"--node-ip=10.0.0.1",
		"-v=WARN",
	)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	p, err := lab.RunProcess("kwok", cmd, filepath.Join(e.c.Dir, "logs", "kwok.log"))
	if err != nil {
		t.Fatal(err)
	}
	e.kwok = p
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("last lines of kwok:\n%s", p.Tail(20))
		}
		p.Stop(10 * time.Second)
	})
}

// waitReady waits until want nodes are Ready and have a kubelet Lease.
func (e *env) waitReady(t testing.TB, want int) {
	t.Helper()
	var ready, leases int
	err := wait.PollUntilContextTimeout(e.ctx, time.Second, 5*time.Minute, true, func(ctx context.Context) (bool, error) {
		if e.kwok.Exited() {
			return false, fmt.Errorf("kwok exited: %v\n%s", e.kwok.ExitError(), e.kwok.Tail(20))
		}
		nodes, err := e.admin.CoreV1().Nodes().List(ctx, metav1.ListOptions{ResourceVersion: "0"})
		if err != nil {
			return false, nil
		}
		ready = 0
		for _, n := range nodes.Items {
			if isReady(&n) {
				ready++
			}
		}
		ls, err := e.admin.CoordinationV1().Leases(corev1.NamespaceNodeLease).List(ctx, metav1.ListOptions{ResourceVersion: "0"})
		if err != nil {
			return false, nil
		}
		leases = len(ls.Items)
		return ready >= want && leases >= want, nil
	})
	if err != nil {
		t.Fatalf("wait for %d nodes Ready with a Lease (ready %d, leases %d): %v", want, ready, leases, err)
	}
}

func isReady(n *corev1.Node) bool {
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return c.Status == corev1.ConditionTrue
		}
	}
	return false
}

// createWorkloads gives each heartbeat node one pod the controller may
// fail over (a StatefulSet's pod with a bound ReadWriteOnce CSI volume) and
// every other node a heartbeat Lease that no agent renews (as if its agent
// ran: the controller then watches one heartbeat Lease per node, as in a
// cluster where every node runs the agent). The test plays the PV binder
// (the claims are bound at creation).
func (e *env) createWorkloads(t testing.TB) {
	t.Helper()
	cfg := e.failoverConfig()
	err := parallel(e.nodes, 16, func(i int) error {
		name := nodeName(i)
		if i >= e.hbs {
			now := metav1.NewMicroTime(time.Now())
			l := &coordinationv1.Lease{
				ObjectMeta: metav1.ObjectMeta{Namespace: agentNS, Name: name, Labels: map[string]string{
					failover.HeartbeatLabel: failover.HeartbeatLabelValue, "app.kubernetes.io/name": "mountmedic"}},
				Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To("agent-" + name),
					LeaseDurationSeconds: ptr.To(int32(cfg.FenceAfter / time.Second)), AcquireTime: &now, RenewTime: &now},
			}
			_, err := e.admin.CoordinationV1().Leases(agentNS).Create(e.ctx, l, metav1.CreateOptions{})
			return err
		}
		return e.createPod(name)
	})
	if err != nil {
		t.Fatalf("create workloads: %v", err)
	}
	for i := range e.hbs {
		name := nodeName(i)
		u, err := url.Parse(e.c.Server)
		if err != nil {
			t.Fatal(err)
		}
		n := &simNode{name: name, proxy: lab.StartTCPProxy(t, u.Host), fence: &recordingFence{}}
		e.sim = append(e.sim, n)
	}
}

// createPod creates node's PV, bound claim and pod (if missing).
func (e *env) createPod(node string) error {
	ctx := e.ctx
	pvName, claim, pod := "pv-"+node, "data-"+node, "app-"+node
	fs := corev1.PersistentVolumeFilesystem
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: pvName},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:               corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
			AccessModes:            []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: testDriver, VolumeHandle: pvName}},
			ClaimRef:               &corev1.ObjectReference{Namespace: workNS, Name: claim},
			VolumeMode:             &fs,
		},
	}
	if _, err := e.admin.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil && !isExists(err) {
		return fmt.Errorf("create pv %s: %w", pvName, err)
	}
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: workNS, Name: claim},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:   corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
			VolumeName:  pvName,
		},
	}
	got, err := e.admin.CoreV1().PersistentVolumeClaims(workNS).Create(ctx, pvc, metav1.CreateOptions{})
	if err == nil {
		got.Status.Phase = corev1.ClaimBound
		got.Status.AccessModes = pvc.Spec.AccessModes
		got.Status.Capacity = pvc.Spec.Resources.Requests
		if _, err := e.admin.CoreV1().PersistentVolumeClaims(workNS).UpdateStatus(ctx, got, metav1.UpdateOptions{}); err != nil {
			return fmt.Errorf("bind claim %s: %w", claim, err)
		}
	} else if !isExists(err) {
		return fmt.Errorf("create claim %s: %w", claim, err)
	}
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: workNS, Name: pod, OwnerReferences: []metav1.OwnerReference{{
			APIVersion: "apps/v1", Kind: "StatefulSet", Name: "app", UID: types.UID("5ca1ab1e-0000-4000-8000-000000000001"), Controller: ptr.To(true)}}},
		Spec: corev1.PodSpec{
			NodeName:   node,
			Containers: []corev1.Container{{Name: "app", Image: "app"}},
			Volumes: []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{
				PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim}}}},
		},
	}
	if _, err := e.admin.CoreV1().Pods(workNS).Create(ctx, p, metav1.CreateOptions{}); err != nil && !isExists(err) {
		return fmt.Errorf("create pod %s: %w", pod, err)
	}
	return nil
}

func isExists(err error) bool {
	var s interface{ Status() metav1.Status }
	return errors.As(err, &s) && s.Status().Reason == metav1.StatusReasonAlreadyExists
}

// watch records when mountmedic's taint first appears on each node.
func (e *env) watch(t testing.TB) {
	f := informers.NewSharedInformerFactoryWithOptions(e.admin, 0)
	nodes := f.Core().V1().Nodes().Informer()
	onNode := func(obj any) {
		n, ok := obj.(*corev1.Node)
		if !ok {
			return
		}
		for _, tn := range n.Spec.Taints {
			if tn.Key == failover.TaintOutOfService && tn.Value == failover.TaintValue {
				e.mu.Lock()
				if _, seen := e.tainted[n.Name]; !seen {
					e.tainted[n.Name] = time.Now()
				}
				e.mu.Unlock()
			}
		}
	}
	if _, err := nodes.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: onNode, UpdateFunc: func(_, n any) { onNode(n) }}); err != nil {
		t.Fatal(err)
	}
	f.Start(e.ctx.Done())
	f.WaitForCacheSync(e.ctx.Done())
	t.Cleanup(func() { e.cancel(); f.Shutdown() })
}

// taintedSince lists the nodes first tainted at or after since.
func (e *env) taintedSince(since time.Time) map[string]time.Time {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := map[string]time.Time{}
	for n, at := range e.tainted {
		if !at.Before(since) {
			out[n] = at
		}
	}
	return out
}

// killKubelet makes kwok stop acting for node: no more Lease renewals or
// status, as when its kubelet (or the whole machine) stops.
func (e *env) killKubelet(node string) error {
	patch := fmt.Sprintf(`{"metadata":{"labels":{%q:%q}}}`, kwokLabel, kwokDead)
	if _, err := e.admin.CoreV1().Nodes().Patch(e.ctx, node, types.MergePatchType, []byte(patch), metav1.PatchOptions{}); err != nil {
		return err
	}
	return e.freezeLease(node)
}

// deadHolder holds the kubelet Lease of a node whose kubelet the harness
// killed.
const deadHolder = "harness-dead-kubelet"

// freezeLease stops node's kubelet Lease from being renewed, as a dead
// kubelet's is: renewed one last time now, by a holder that never renews
// and holds it for an hour. The relabel alone does not always stop kwok:
// it renews the Leases it holds until its node watch tells it a node is no
// longer managed, and it takes a node up again when it reads it by name,
// without its label selector (kwok 0.8's lease sync). After an API server
// restart a relabelled node's Lease was renewed by kwok every 2 s for the
// whole wait, so kube-controller-manager kept it Ready and the controller
// rightly saw a living kubelet ("one node dies: node-00099 never tainted",
// the last CI runs of stops 19 and 21). kwok renews only a Lease it holds
// or one that expired: it leaves this one alone. The renew time moves:
// kube-controller-manager's lease circuit breaker (1.37) stops judging
// every node while a Lease it sees expired has a newer version than the
// one it saved when the renew time last moved, and a change that kept the
// renew time would stay such a version for good.
func (e *env) freezeLease(node string) error {
	leases := e.admin.CoordinationV1().Leases(corev1.NamespaceNodeLease)
	return retry.RetryOnConflict(retry.DefaultRetry, func() error {
		l, err := leases.Get(e.ctx, node, metav1.GetOptions{})
		if err != nil {
			return fmt.Errorf("kubelet Lease of %s: %w", node, err)
		}
		l.Spec.HolderIdentity = ptr.To(deadHolder)
		l.Spec.LeaseDurationSeconds = ptr.To(int32(3600))
		l.Spec.RenewTime = ptr.To(metav1.NewMicroTime(time.Now()))
		_, err = leases.Update(e.ctx, l, metav1.UpdateOptions{})
		return err
	})
}

// kill makes a heartbeat node die: kubelet silent, the agent cut off and
// then gone (it cannot release its Lease).
func (e *env) kill(n *simNode) error {
	if err := e.killKubelet(n.name); err != nil {
		return err
	}
	n.proxy.Cut()
	go n.stop()
	return nil
}

// scrape reads the controller's metrics.
func scrape(u string) (map[string]float64, error) {
	resp, err := http.Get(u)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	p := expfmt.NewTextParser(model.LegacyValidation)
	mfs, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		return nil, err
	}
	out := map[string]float64{}
	for name, mf := range mfs {
		for _, m := range mf.GetMetric() {
			key := name
			var labels []string
			for _, l := range m.GetLabel() {
				labels = append(labels, l.GetName()+"="+l.GetValue())
			}
			slices.Sort(labels)
			if len(labels) > 0 {
				key += "{" + strings.Join(labels, ",") + "}"
			}
			switch {
			case m.Counter != nil:
				out[key] += m.GetCounter().GetValue()
			case m.Gauge != nil:
				out[key] += m.GetGauge().GetValue()
			case m.Histogram != nil:
				out[key] += float64(m.GetHistogram().GetSampleCount())
			}
		}
	}
	return out, nil
}

// vmHWM is a process's peak resident set size (bytes).
func vmHWM(pid int) float64 {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(data), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "VmHWM:" {
			kb, _ := strconv.ParseFloat(f[1], 64)
			return kb * 1024
		}
	}
	return 0
}

// recordingFence is the CRI and mount seam of a simulated node: it records
// when the fence first stopped each pod (there are no containers).
type recordingFence struct {
	mu      sync.Mutex
	stopped []time.Time // one per fence (first stop of a pod set)
	uids    map[string]bool
}

func (f *recordingFence) StopPodContainers(_ context.Context, podUIDs []string, _ time.Duration) []failover.PodResult {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.uids == nil {
		f.uids = map[string]bool{}
	}
	fresh := false
	for _, u := range podUIDs {
		if !f.uids[u] {
			f.uids[u], fresh = true, true
		}
	}
	if fresh {
		f.stopped = append(f.stopped, time.Now())
	}
	out := make([]failover.PodResult, len(podUIDs))
	for i := range out {
		out[i].N = 1
	}
	return out
}

func (f *recordingFence) UnmountPodVolumes(_ context.Context, podUIDs []string) []failover.PodResult {
	return make([]failover.PodResult, len(podUIDs))
}

func (f *recordingFence) MountedPods(context.Context) ([]string, error) { return nil, nil }

// fencesSince lists when this node fenced a pod it had not fenced before,
// at or after since.
func (f *recordingFence) fencesSince(since time.Time) []time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []time.Time
	for _, at := range f.stopped {
		if !at.Before(since) {
			out = append(out, at)
		}
	}
	return out
}
