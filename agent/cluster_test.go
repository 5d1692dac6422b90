package agent_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/agent"
	"github.com/mountmedic/mountmedic/agent/kubeclient"
	"github.com/mountmedic/mountmedic/remount"
	"github.com/mountmedic/mountmedic/scripts/csilab"
	"github.com/mountmedic/mountmedic/scripts/kubetest"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// TestMain runs the tests in the lab's private mount namespace; klog's
// flags (-v=4 after -args) show the agent's decisions.
func TestMain(m *testing.M) {
	klog.InitFlags(nil)
	code := lab.Run(m)
	// The Ceph some tests share (csilab.SharedCeph) ends with the binary.
	if err := csilab.StopSharedCeph(); err != nil {
		fmt.Fprintf(os.Stderr, "stop the Ceph lab: %v\n", err)
		if code == 0 {
			code = 1
		}
	}
	os.Exit(code)
}

// Names of the fixtures.
const (
	testNamespace = "apps"
	labDriver     = "lab.csi.mountmedic.io"
)

// env is a real control plane with mountmedic's manifests applied, a lab
// kubelet tree on this host and the API objects of the pods using it.
type env struct {
	t       testing.TB
	cluster *kubetest.Cluster
	admin   kubernetes.Interface
	// agentConfig authenticates as the agent does in the shipped DaemonSet:
	// with the lab node's own identity (system:node:<node>), read from a
	// kubeconfig laid out as kubeadm's kubelet.conf (agent.NodeRESTConfig),
	// under the Node authorizer and NodeRestriction.
	agentConfig *rest.Config
	kubelet     *lab.Kubelet
	node        string
}

// newEnv starts the control plane (with kube-controller-manager's
// disruption controller when pdb is set, for real PDB status) and applies
// deploy/ with kubectl.
func newEnv(t testing.TB, controllers []string) *env {
	t.Helper()
	lab.RequireRoot(t)
	c := kubetest.Start(t, kubetest.Options{Controllers: controllers})
	if out, err := c.Kubectl("apply", "-k", filepath.Join("..", "deploy")); err != nil {
		t.Fatalf("kubectl apply -k deploy/: %v\n%s", err, out)
	}
	c.CreateNamespace(t, testNamespace)
	e := &env{
		t: t, cluster: c, admin: c.Client,
		kubelet: lab.NewKubelet(t, filepath.Join(t.TempDir(), "kubelet")),
		node:    lab.DefaultNodeName,
	}
	e.agentConfig = nodeConfig(t, c, e.node)
	// The node's own Node object, as a real node has: the agent writes its
	// PodVolumeMountsBroken condition there.
	if _, err := c.Client.CoreV1().Nodes().Create(context.Background(), &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: e.node}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create node %s: %v", e.node, err)
	}
	return e
}

// nodeConfig is the agent's client configuration in the shipped DaemonSet:
// node's own identity from a kubeconfig that names kubelet's certificate
// file, checked as the command checks it.
func nodeConfig(t testing.TB, c *kubetest.Cluster, node string) *rest.Config {
	t.Helper()
	dir := t.TempDir()
	kubeconfig := filepath.Join(dir, "etc", "kubernetes", "kubelet.conf")
	c.WriteNodeKubeconfig(t, kubeconfig, filepath.Join(dir, "var", "lib", "kubelet"), node, "")
	rc, err := agent.NodeRESTConfig(kubeconfig, node)
	if err != nil {
		t.Fatalf("node credentials: %v", err)
	}
	return rc
}

// config is the agent configuration of the tests: this lab's kubelet root,
// fast probes, no metrics server (the handler is scraped in process).
func (e *env) config() agent.Config {
	cfg := agent.DefaultConfig()
	cfg.NodeName = e.node
	cfg.KubeletRoot = e.kubelet.Root()
	cfg.ProbeInterval = 100 * time.Millisecond
	// The agent's default deadline: a FUSE probe past it is Hung and its
	// connection aborted at once, and on a loaded test machine a fresh
	// s3fs can take longer than half a second to answer.
	cfg.ProbeTimeout = 2 * time.Second
	cfg.Resync = 2 * time.Second
	cfg.BackoffBase = 200 * time.Millisecond
	cfg.BackoffMax = 2 * time.Second
	cfg.MetricsAddr = ""
	cfg.Version = "test"
	return cfg
}

// runningAgent is an agent running in the background of a test.
type runningAgent struct {
	*agent.Agent
	cancel context.CancelFunc
	done   chan error
}

// dryRunRepairer is a remount.Repairer on the lab kubelet root that only
// plans, as a dry-run agent needs.
func (e *env) dryRunRepairer() *remount.Repairer {
	e.t.Helper()
	rep, err := remount.New(remount.Config{KubeletRoot: e.kubelet.Root(), DryRun: true})
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { rep.Close() })
	return rep
}

// withRepairer is deps with a remount.Repairer of rc on the lab kubelet
// root that verifies with the agent's prober (deps.Prober, made for cfg
// when nil), as the command wires them: one prober per process.
func (e *env) withRepairer(cfg agent.Config, rc remount.Config, deps agent.Deps) agent.Deps {
	e.t.Helper()
	if deps.Prober == nil {
		deps.Prober = agent.NewProber(cfg)
	}
	if deps.Table == nil {
		// One reader of the mount table for the loop and the repairs, as
		// the command wires them.
		deps.Table = agent.NewTableReader(cfg)
	}
	rc.KubeletRoot, rc.Prober, rc.Table = e.kubelet.Root(), deps.Prober, deps.Table
	if rc.Parallel == 0 {
		rc.Parallel = cfg.RepairSlots() // as the command wires it
	}
	rep, err := remount.New(rc)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(func() { rep.Close() })
	deps.Repairer = rep
	return deps
}

// startAgent runs an agent with the lab node's credentials until the test
// ends.
func (e *env) startAgent(cfg agent.Config, deps agent.Deps) *runningAgent {
	e.t.Helper()
	if deps.Client == nil {
		client, err := kubeclient.New(e.agentConfig)
		if err != nil {
			e.t.Fatalf("agent client: %v", err)
		}
		deps.Client = client
	}
	a, err := agent.New(cfg, deps)
	if err != nil {
		e.t.Fatalf("agent.New: %v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	ra := &runningAgent{Agent: a, cancel: cancel, done: make(chan error, 1)}
	go func() { ra.done <- a.Run(ctx) }()
	e.t.Cleanup(ra.stop)
	e.waitFor("the agent to be ready", func() (bool, error) {
		return ra.get("/readyz").code == http.StatusOK, nil
	})
	return ra
}

func (ra *runningAgent) stop() {
	ra.cancel()
	select {
	case <-ra.done:
	case <-time.After(30 * time.Second):
		panic("agent did not stop within 30s of its context ending")
	}
}

type response struct {
	code int
	body string
}

func (ra *runningAgent) get(path string) response {
	rec := httptest.NewRecorder()
	ra.Handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
	b, _ := io.ReadAll(rec.Result().Body)
	return response{rec.Code, string(b)}
}

// metric returns the value of the sample whose line starts with prefix
// (name and labels as the text format prints them), and whether it exists.
func (ra *runningAgent) metric(prefix string) (float64, bool) {
	for _, line := range strings.Split(ra.get("/metrics").body, "\n") {
		if !strings.HasPrefix(line, prefix) {
			continue
		}
		var v float64
		if _, err := fmt.Sscanf(strings.TrimSpace(line[len(prefix):]), "%g", &v); err == nil {
			return v, true
		}
	}
	return 0, false
}

// waitFor polls cond every 50ms for up to a minute.
func (e *env) waitFor(what string, cond func() (bool, error)) {
	e.t.Helper()
	var last error
	err := wait.PollUntilContextTimeout(context.Background(), 50*time.Millisecond, time.Minute, true,
		func(context.Context) (bool, error) {
			ok, err := cond()
			last = err
			return ok, nil
		})
	if err != nil {
		e.t.Fatalf("waiting for %s: %v (last error: %v)", what, err, last)
	}
}

// volume is a CSI volume of the lab driver and the API objects for it.
type volume struct {
	handle string
	pv     *corev1.PersistentVolume
	pvc    *corev1.PersistentVolumeClaim
	// staging is the staging path in the lab kubelet tree.
	staging string
}

// createVolume creates a bound PV and PVC of the lab driver.
func (e *env) createVolume(name string, pvSpec func(*corev1.PersistentVolume)) *volume {
	e.t.Helper()
	ctx := context.Background()
	v := &volume{handle: "handle-" + name}
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: "pv-" + name},
		Spec: corev1.PersistentVolumeSpec{
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Capacity:    corev1.ResourceList{corev1.ResourceStorage: mustQuantity("1Gi")},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver: labDriver, VolumeHandle: v.handle,
			}},
			ClaimRef:                      &corev1.ObjectReference{Namespace: testNamespace, Name: "claim-" + name},
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
		},
	}
	if pvSpec != nil {
		pvSpec(pv)
	}
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: testNamespace, Name: "claim-" + name},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes: pv.Spec.AccessModes,
			Resources:   corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: mustQuantity("1Gi")}},
			VolumeName:  pv.Name,
		},
	}
	var err error
	if v.pvc, err = e.admin.CoreV1().PersistentVolumeClaims(testNamespace).Create(ctx, pvc, metav1.CreateOptions{}); err != nil {
		e.t.Fatalf("create PVC: %v", err)
	}
	v.pvc.Status.Phase = corev1.ClaimBound
	if v.pvc, err = e.admin.CoreV1().PersistentVolumeClaims(testNamespace).UpdateStatus(ctx, v.pvc, metav1.UpdateOptions{}); err != nil {
		e.t.Fatalf("bind PVC: %v", err)
	}
	pv.Spec.ClaimRef.UID = v.pvc.UID
	if v.pv, err = e.admin.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
		e.t.Fatalf("create PV: %v", err)
	}
	v.staging = e.kubelet.StagingPath(labDriver, v.handle)
	return v
}

// podOptions shape a test pod.
type podOptions struct {
	owner       *metav1.OwnerReference
	annotations map[string]string
	labels      map[string]string
	subPath     string // a second volumeMount of the volume with this subPath
}

// createPod creates a Running, Ready pod on the lab node that mounts the
// volume as "data" in container "app", and returns it with its API UID.
func (e *env) createPod(name string, v *volume, o podOptions) *corev1.Pod {
	e.t.Helper()
	ctx := context.Background()
	mounts := []corev1.VolumeMount{{Name: "data", MountPath: "/data"}}
	if o.subPath != "" {
		mounts = append(mounts, corev1.VolumeMount{Name: "data", MountPath: "/sub", SubPath: o.subPath})
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: testNamespace, Name: name, Annotations: o.annotations, Labels: o.labels},
		Spec: corev1.PodSpec{
			NodeName:   e.node,
			Containers: []corev1.Container{{Name: "app", Image: "busybox", VolumeMounts: mounts}},
			Volumes: []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{
				PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: v.pvc.Name},
			}}},
		},
	}
	if o.owner != nil {
		pod.OwnerReferences = []metav1.OwnerReference{*o.owner}
	}
	pod, err := e.admin.CoreV1().Pods(testNamespace).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		e.t.Fatalf("create pod %s: %v", name, err)
	}
	now := metav1.Now()
	pod.Status = corev1.PodStatus{
		Phase:      corev1.PodRunning,
		Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: now}},
		ContainerStatuses: []corev1.ContainerStatus{{
			Name: "app", Ready: true, Image: "busybox", ImageID: "busybox",
			ContainerID: "containerd://" + strings.Repeat("ab", 32),
			State:       corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: now}},
		}},
	}
	if pod, err = e.admin.CoreV1().Pods(testNamespace).UpdateStatus(ctx, pod, metav1.UpdateOptions{}); err != nil {
		e.t.Fatalf("set pod %s running: %v", name, err)
	}
	return pod
}

// eventsOf lists the events regarding the object with uid.
func (e *env) eventsOf(uid types.UID) []eventsv1.Event {
	e.t.Helper()
	list, err := e.admin.EventsV1().Events(testNamespace).List(context.Background(), metav1.ListOptions{})
	if err != nil {
		e.t.Fatalf("list events: %v", err)
	}
	var out []eventsv1.Event
	for _, ev := range list.Items {
		if ev.Regarding.UID == uid {
			out = append(out, ev)
		}
	}
	return out
}

// waitEvent waits for an event with reason regarding uid whose note holds
// every one of parts, and returns it.
func (e *env) waitEvent(uid types.UID, reason string, parts ...string) eventsv1.Event {
	e.t.Helper()
	var found eventsv1.Event
	e.waitFor(fmt.Sprintf("a %s event %q", reason, parts), func() (bool, error) {
		for _, ev := range e.eventsOf(uid) {
			if ev.Reason != reason {
				continue
			}
			ok := true
			for _, p := range parts {
				ok = ok && strings.Contains(ev.Note, p)
			}
			if ok {
				found = ev
				return true, nil
			}
		}
		return false, nil
	})
	return found
}

// reasons lists the reasons of the events regarding uid.
func (e *env) reasons(uid types.UID) []string {
	var out []string
	for _, ev := range e.eventsOf(uid) {
		out = append(out, ev.Reason+": "+ev.Note)
	}
	return out
}

// recorder counts API requests by verb and resource, for the agent's
// client.
type recorder struct {
	mu    sync.Mutex
	count map[string]int
	// log has each request's key and when it left the client's rate
	// limiter, for the scale benchmarks' timeline.
	log  []recorded
	next http.RoundTripper
}

// recorded is one request the recorder saw.
type recorded struct {
	at  time.Time
	key string
}

func (r *recorder) RoundTrip(req *http.Request) (*http.Response, error) {
	r.mu.Lock()
	key := req.Method + " " + req.URL.Path
	if req.URL.Query().Get("watch") == "true" {
		key = "WATCH " + req.URL.Path
	}
	r.count[key]++
	r.log = append(r.log, recorded{at: time.Now(), key: key})
	r.mu.Unlock()
	return r.next.RoundTrip(req)
}

func (r *recorder) snapshot() map[string]int {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make(map[string]int, len(r.count))
	for k, v := range r.count {
		out[k] = v
	}
	return out
}

// since returns the requests the recorder saw from t on.
func (r *recorder) since(t time.Time) []recorded {
	r.mu.Lock()
	defer r.mu.Unlock()
	i := sort.Search(len(r.log), func(i int) bool { return !r.log[i].at.Before(t) })
	return slices.Clone(r.log[i:])
}

// countingClient is a client with the agent's credentials and rate limits
// (agent.NodeRESTConfig's, as the command's client has them) that counts
// its requests.
func (e *env) countingClient() (kubernetes.Interface, *recorder) {
	e.t.Helper()
	cfg := rest.CopyConfig(e.agentConfig)
	rec := &recorder{count: make(map[string]int)}
	cfg.Wrap(func(rt http.RoundTripper) http.RoundTripper { rec.next = rt; return rec })
	client, err := kubeclient.New(cfg)
	if err != nil {
		e.t.Fatalf("counting client: %v", err)
	}
	return client, rec
}
