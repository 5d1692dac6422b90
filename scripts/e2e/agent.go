package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"

	"github.com/mountmedic/mountmedic/agent/status"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// Where the DaemonSet of deploy/ lives once applied.
const (
	AgentNamespace = "mountmedic"
	AgentName      = "mountmedic"
	// AgentReporter is the reportingController of the agent's events.
	AgentReporter = "mountmedic.io/agent"
	// agentImageTag is the tag scripts/e2e/deploy sets.
	agentImageTag = "e2e"
)

// BuildAgentImage builds the mountmedic image with scripts/image.sh (buildah,
// storage in dir, so that nothing stays behind) and returns the archive to
// import into the node: docker.io/library/mountmedic:e2e.
func BuildAgentImage(dir string) (string, error) {
	archive := filepath.Join(dir, "mountmedic.tar")
	cmd := exec.Command("../image.sh", "--version", agentImageTag, "--archive", archive)
	cmd.Env = append(os.Environ(), "STORAGE_ROOT="+filepath.Join(dir, "storage"), "STORAGE_DRIVER=vfs")
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("scripts/image.sh: %w\n%s", err, out)
	}
	// vfs layers are plain copies: drop them now, the archive is all we need.
	if err := os.RemoveAll(filepath.Join(dir, "storage")); err != nil {
		return "", fmt.Errorf("remove the image build storage: %w", err)
	}
	return archive, nil
}

// agentImage is the image archive the package's tests share (AgentImage).
var agentImage struct {
	once    sync.Once
	dir     string
	archive string
	err     error
}

// AgentImage builds the mountmedic image once for all the tests of this
// test binary (BuildAgentImage, in a temporary directory that Main removes
// when they are done) and returns its archive.
func AgentImage() (string, error) {
	agentImage.once.Do(func() {
		agentImage.dir, agentImage.err = os.MkdirTemp("", "mountmedic-e2e-image-")
		if agentImage.err == nil {
			agentImage.archive, agentImage.err = BuildAgentImage(agentImage.dir)
		}
	})
	return agentImage.archive, agentImage.err
}

// removeAgentImage removes what AgentImage built.
func removeAgentImage() {
	if agentImage.dir != "" {
		_ = os.RemoveAll(agentImage.dir)
	}
}

// Agent is the mountmedic DaemonSet running on the node.
type Agent struct {
	node *Node
	// MetricsPort is where the agent serves /metrics on 127.0.0.1.
	MetricsPort int
	// APIServer is the host:port at which the next Deploy's pod reaches the
	// API server; empty: the cluster's own. The fence scenario points it at
	// a lab.TCPProxy, to cut the agent off alone (kubelet keeps its link).
	APIServer string
	// Pod is the agent's pod of the last Deploy.
	Pod *corev1.Pod
	dir string
}

// NewAgent prepares the agent's deployment on the node; Deploy applies it.
func (n *Node) NewAgent() (*Agent, error) {
	ports, err := lab.FreePorts(1)
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(n.Dir, "agent-overlay")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	return &Agent{node: n, MetricsPort: ports[0], dir: dir}, nil
}

// Deploy applies deploy/ through the e2e overlay of the node's layout
// (scripts/e2e/deploy for kubeadm's, scripts/e2e/k3s for k3s') with the
// agent's flags args added after deploy/'s own (which stay as shipped), and
// waits until the DaemonSet's pod of this configuration is ready.
func (a *Agent) Deploy(ctx context.Context, args ...string) error {
	base, err := filepath.Abs(a.node.Layout.Overlay)
	if err != nil {
		return err
	}
	rel, err := filepath.Rel(a.dir, base)
	if err != nil {
		return err
	}
	server := a.node.Cluster.Server
	if a.APIServer != "" {
		server = "https://" + a.APIServer
	}
	u, err := splitServer(server)
	if err != nil {
		return err
	}
	const container = "/spec/template/spec/containers/0"
	ops := []map[string]any{
		{"op": "replace", "path": container + "/ports/0/containerPort", "value": a.MetricsPort},
		// No kube-proxy on this node: the agent reaches the API server on
		// loopback, where it listens.
		{"op": "add", "path": container + "/env/-", "value": map[string]string{"name": "KUBERNETES_SERVICE_HOST", "value": u.host}},
		{"op": "add", "path": container + "/env/-", "value": map[string]string{"name": "KUBERNETES_SERVICE_PORT", "value": u.port}},
	}
	// A later flag wins over deploy/'s: metrics on loopback, on a free port
	// (the node shares the machine's network), then the scenario's flags.
	for _, arg := range append([]string{"--metrics-addr=127.0.0.1:" + strconv.Itoa(a.MetricsPort)}, args...) {
		ops = append(ops, map[string]any{"op": "add", "path": container + "/args/-", "value": arg})
	}
	patch, err := json.Marshal(ops)
	if err != nil {
		return err
	}
	kustomization := fmt.Sprintf(`apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources:
  - %s
patches:
  - target:
      kind: DaemonSet
      name: %s
    patch: '%s'
`, rel, AgentName, strings.ReplaceAll(string(patch), "'", "''"))
	if err := os.WriteFile(filepath.Join(a.dir, "kustomization.yaml"), []byte(kustomization), 0o644); err != nil {
		return err
	}
	if out, err := a.node.Cluster.Kubectl("apply", "-k", a.dir); err != nil {
		return fmt.Errorf("apply the agent: %w\n%s", err, out)
	}
	ds, err := a.node.Cluster.Client.AppsV1().DaemonSets(AgentNamespace).Get(ctx, AgentName, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("read the applied DaemonSet: %w", err)
	}
	wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
	defer cancel()
	pod, err := a.waitRollout(wctx, ds.Spec.Template.Spec.Containers[0].Args, u.port)
	if err != nil {
		return err
	}
	a.Pod = pod
	return waitEventsPolicy(ctx, a.node.Cluster.Client)
}

// waitEventsPolicy waits until the agent's events policy binding is
// status.PolicySettle old: events the agent writes from then on are
// vouched for, as on a cluster where the agent was installed before the
// fault (mountmedic status shows no repair whose event came earlier).
func waitEventsPolicy(ctx context.Context, c kubernetes.Interface) error {
	b, err := c.AdmissionregistrationV1().ValidatingAdmissionPolicyBindings().Get(ctx, status.EventsPolicy, metav1.GetOptions{})
	if err != nil {
		return fmt.Errorf("read the agent's events policy binding: %w", err)
	}
	if d := time.Until(b.CreationTimestamp.Add(status.PolicySettle)); d > 0 {
		select {
		case <-time.After(d):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

type hostPort struct{ host, port string }

func splitServer(server string) (hostPort, error) {
	s := strings.TrimPrefix(server, "https://")
	host, port, ok := strings.Cut(s, ":")
	if !ok {
		return hostPort{}, fmt.Errorf("API server URL %q has no port", server)
	}
	return hostPort{host, port}, nil
}

// waitRollout waits until the one pod of the DaemonSet runs with args and
// the API server's port, and is ready.
func (a *Agent) waitRollout(ctx context.Context, args []string, apiPort string) (*corev1.Pod, error) {
	c := a.node.Cluster.Client
	var got *corev1.Pod
	var last string
	err := wait.PollUntilContextCancel(ctx, 200*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		ds, err := c.AppsV1().DaemonSets(AgentNamespace).Get(ctx, AgentName, metav1.GetOptions{})
		if err != nil {
			last = err.Error()
			return false, nil
		}
		if !rolledOut(ds) {
			last = fmt.Sprintf("daemonset status %+v", ds.Status)
			return false, nil
		}
		pods, err := c.CoreV1().Pods(AgentNamespace).List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/name=mountmedic"})
		if err != nil {
			last = err.Error()
			return false, nil
		}
		for i := range pods.Items {
			p := &pods.Items[i]
			if p.DeletionTimestamp != nil || !slices.Equal(p.Spec.Containers[0].Args, args) ||
				!slices.Contains(p.Spec.Containers[0].Env, corev1.EnvVar{Name: "KUBERNETES_SERVICE_PORT", Value: apiPort}) {
				continue
			}
			last = describePod(p)
			for _, cond := range p.Status.Conditions {
				if cond.Type == corev1.PodReady && cond.Status == corev1.ConditionTrue {
					got = p
					return true, nil
				}
			}
		}
		return false, nil
	})
	if err != nil {
		return nil, fmt.Errorf("wait for the agent's pod to be ready: %w (last: %s)\n%s\nagent log:\n%s", err, last,
			describeNamespace(context.Background(), c, AgentNamespace), a.LogTail(20))
	}
	return got, nil
}

func rolledOut(ds *appsv1.DaemonSet) bool {
	s := ds.Status
	return s.ObservedGeneration >= ds.Generation && s.DesiredNumberScheduled == 1 &&
		s.UpdatedNumberScheduled == 1 && s.NumberAvailable == 1
}

// LogTail returns the last n lines of the agent container's log.
func (a *Agent) LogTail(n int) string {
	files, _ := filepath.Glob(filepath.Join(PodLogs, AgentNamespace+"_*", "agent", "*.log"))
	if len(files) == 0 {
		return "(no agent log)"
	}
	sort.Slice(files, func(i, j int) bool {
		fi, _ := os.Stat(files[i])
		fj, _ := os.Stat(files[j])
		return fi != nil && fj != nil && fi.ModTime().Before(fj.ModTime())
	})
	return lab.Tail(files[len(files)-1], n)
}

// Metrics scrapes the agent's /metrics and returns each sample by its
// name with labels as exposed (e.g. `mountmedic_driver_up{driver="x"}`).
func (a *Agent) Metrics(ctx context.Context) (map[string]float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, fmt.Sprintf("http://127.0.0.1:%d/metrics", a.MetricsPort), nil)
	if err != nil {
		return nil, err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, fmt.Errorf("scrape the agent: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return nil, fmt.Errorf("scrape the agent: %s: %s", resp.Status, body)
	}
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			continue
		}
		out[line[:i]] = v
	}
	return out, sc.Err()
}

// Sum adds the samples of metric name whose labels contain every one of
// labels (each `key="value"`).
func Sum(m map[string]float64, name string, labels ...string) float64 {
	var s float64
	for k, v := range m {
		base, rest, _ := strings.Cut(k, "{")
		if base != name {
			continue
		}
		ok := true
		for _, l := range labels {
			if !strings.Contains(rest, l) {
				ok = false
				break
			}
		}
		if ok {
			s += v
		}
	}
	return s
}

// Events lists the agent's events in namespace, oldest first.
func (a *Agent) Events(ctx context.Context, namespace string) ([]eventsv1.Event, error) {
	list, err := a.node.Cluster.Client.EventsV1().Events(namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return nil, fmt.Errorf("list events in %s: %w", namespace, err)
	}
	var out []eventsv1.Event
	for _, e := range list.Items {
		if e.ReportingController == AgentReporter {
			out = append(out, e)
		}
	}
	sort.Slice(out, func(i, j int) bool { return EventTime(&out[i]).Before(EventTime(&out[j])) })
	return out, nil
}

// EventTime is when an event (or the first of its series) happened.
func EventTime(e *eventsv1.Event) time.Time {
	if !e.EventTime.IsZero() {
		return e.EventTime.Time
	}
	return e.CreationTimestamp.Time
}

// WaitEvent waits for an agent event of reason in namespace that happened
// at or after since and returns its time.
func (a *Agent) WaitEvent(ctx context.Context, namespace, reason string, since time.Time) (time.Time, *eventsv1.Event, error) {
	var at time.Time
	var got *eventsv1.Event
	err := wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		evs, err := a.Events(ctx, namespace)
		if err != nil {
			return false, nil
		}
		for i := range evs {
			if t := EventTime(&evs[i]); evs[i].Reason == reason && !t.Before(since.Truncate(time.Microsecond)) {
				at, got = t, &evs[i]
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		evs, _ := a.Events(context.Background(), namespace)
		var seen []string
		for _, e := range evs {
			seen = append(seen, e.Reason+": "+e.Note)
		}
		return at, nil, fmt.Errorf("wait for a %s event in %s: %w (agent events: %q)\nagent log:\n%s", reason, namespace, err, seen, a.LogTail(20))
	}
	return at, got, nil
}
