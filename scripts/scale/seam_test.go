package scale

// The seam between the harness and the code under test: the only place
// that knows how mountmedic's failover duty is wired. Everything else
// (kwok, the audit log, the cases) is about the cluster.
//
// The cluster side is `mountmedic controller`'s failover.Controller
// (ControllerConfig), with leader election among its replicas, under its
// own ServiceAccount (deploy/controller/rbac.yaml); agents never campaign.
// The node side is failover.NewHeartbeat with the agent's clients: the
// node's identity for its pods, a client of its own (NewHeartbeatClient)
// with the ServiceAccount for its Lease, and the peer check on (a shared
// key, each heartbeat's peer endpoint on loopback).

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/agent/failover"
	"github.com/mountmedic/mountmedic/agent/kubeclient"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// agentAddrs numbers the agents' loopback addresses.
var agentAddrs atomic.Int32

// failoverConfig is the agents' configuration for this run: mountmedic's
// defaults with every period multiplied by the time factor, the peer check
// on.
func (e *env) failoverConfig() failover.Config {
	c := failover.DefaultConfig()
	c.Enabled = true
	c.Namespace = agentNS
	c.HeartbeatInterval = e.scaled(c.HeartbeatInterval)
	// Validate wants whole seconds. At least 10 s: the fence window is
	// about the machine's scheduling latency, not the cluster's size, and
	// a shorter one starves on two busy cores.
	c.FenceAfter = max(e.scaled(c.FenceAfter).Round(time.Second), 2*c.HeartbeatInterval, 10*time.Second)
	c.FenceStopGrace = e.scaled(c.FenceStopGrace)
	c.APITimeout = e.scaled(c.APITimeout)
	c.PeerKeyFile = e.peerKey
	c.PeerListen, c.PeerAdvertise = "127.0.0.1:0", ""
	c.PeerTimeout = c.HeartbeatInterval / 2 // 2 s scaled down would be 0.4 s: a loaded machine's latency
	c.PeerRefresh = max(e.scaled(c.PeerRefresh), time.Second)
	return c
}

// controllerConfig is the controller's configuration for this run, scaled
// the same way.
func (e *env) controllerConfig() failover.ControllerConfig {
	a := e.failoverConfig()
	c := failover.DefaultControllerConfig()
	c.Namespace = agentNS
	c.FenceAfter = a.FenceAfter
	// The margin must cover the fence (stop grace and the time fencing
	// takes, which does not scale down).
	c.FenceMargin = max(e.scaled(c.FenceMargin), a.FenceStopGrace+5*time.Second)
	c.KubeletGrace = e.scaled(c.KubeletGrace)
	c.LeaseDuration = e.scaled(c.LeaseDuration)
	c.RenewDeadline = e.scaled(c.RenewDeadline)
	c.RetryPeriod = e.scaled(c.RetryPeriod)
	c.APITimeout = e.scaled(c.APITimeout)
	c.Recheck = max(e.scaled(c.Recheck), 200*time.Millisecond)
	return c
}

// fenceWindow is how long the controller waits after a heartbeat went
// silent.
func (e *env) fenceWindow() time.Duration {
	c := e.controllerConfig()
	return c.FenceWindow(0)
}

// controllerSpec is what the controller process is started with.
type controllerSpec struct {
	Host        string
	CAData      []byte
	Token       string
	Config      failover.ControllerConfig
	MetricsAddr string
}

const (
	roleEnv = "MOUNTMEDIC_SCALE_ROLE"
	specEnv = "MOUNTMEDIC_SCALE_SPEC"
)

// TestMain runs the controller process when the test binary is started as
// one (startController).
func TestMain(m *testing.M) {
	if os.Getenv(roleEnv) == "controller" {
		if err := runController(os.Getenv(specEnv)); err != nil {
			fmt.Fprintln(os.Stderr, "controller:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// runController is the controller process: failover.Controller under the
// mountmedic ServiceAccount, its metrics (with the Go runtime's and the
// process's) on MetricsAddr, until SIGTERM.
func runController(specFile string) error {
	data, err := os.ReadFile(specFile)
	if err != nil {
		return err
	}
	var spec controllerSpec
	if err := json.Unmarshal(data, &spec); err != nil {
		return err
	}
	// The clients `mountmedic controller` makes (cmd/mountmedic), at its
	// default rates.
	cfg := &rest.Config{Host: spec.Host, BearerToken: spec.Token, TLSClientConfig: rest.TLSClientConfig{CAData: spec.CAData},
		UserAgent: "mountmedic-controller", QPS: failover.DefaultControllerQPS, Burst: failover.DefaultControllerBurst}
	client, err := kubeclient.New(cfg)
	if err != nil {
		return err
	}
	leases, err := failover.NewLeaderElectionClient(cfg)
	if err != nil {
		return err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	c, err := failover.NewController(spec.Config, client, leases, reg)
	if err != nil {
		return err
	}
	srv := &http.Server{Addr: spec.MetricsAddr, Handler: promhttp.HandlerFor(reg, promhttp.HandlerOpts{}), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.ListenAndServe() }()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	return c.Run(klog.NewContext(ctx, klog.Background()))
}

// controllerProc is the running controller process.
type controllerProc struct {
	p       *lab.Process
	metrics string // URL of its /metrics
}

// startController starts the controller: failover.Controller with leader
// election, as `mountmedic controller` runs it, in a process of its own
// (the test binary re-executed) so that its memory can be measured alone,
// under the mountmedic-controller ServiceAccount as
// deploy/controller/rbac.yaml grants it. It returns once the process
// serves its metrics.
func (e *env) startController(t testing.TB) *controllerProc {
	t.Helper()
	cfg := e.controllerConfig()
	cfg.Identity = "controller-0"
	ports, err := lab.FreePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	spec := controllerSpec{Host: e.ctl.Host, CAData: e.ctl.CAData, Token: e.ctl.BearerToken, Config: cfg,
		MetricsAddr: fmt.Sprintf("127.0.0.1:%d", ports[0])}
	data, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	specFile := filepath.Join(t.TempDir(), "controller.json")
	if err := os.WriteFile(specFile, data, 0o600); err != nil {
		t.Fatal(err)
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), roleEnv+"=controller", specEnv+"="+specFile)
	p, err := lab.RunProcess("controller", cmd, filepath.Join(e.c.Dir, "logs", "controller.log"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Stop(10 * time.Second) })
	cp := &controllerProc{p: p, metrics: "http://" + spec.MetricsAddr + "/metrics"}
	if err := p.WaitDial("tcp", spec.MetricsAddr, time.Minute); err != nil {
		t.Fatalf("controller metrics: %v\n%s", err, p.Tail(20))
	}
	return cp
}

// startAgent starts what mountmedic runs on node n: the failover heartbeat
// with clients of its own (the node's identity for its pods, the
// ServiceAccount for its Lease on a client of its own), through the node's
// proxy. The user agents name the node so that the audit log tells each
// one's requests apart.
func (e *env) startAgent(t testing.TB, n *simNode) {
	t.Helper()
	host := "https://" + n.proxy.Addr()
	nodeCfg := e.c.NodeConfig(t, n.name)
	nodeCfg.Host, nodeCfg.UserAgent = host, "mountmedic-heartbeat/"+n.name
	nodeCfg.QPS, nodeCfg.Burst = 0, 0 // client-go's defaults, as the agent has them
	saCfg := rest.CopyConfig(e.sa)
	saCfg.Host, saCfg.UserAgent = host, "mountmedic-heartbeat/"+n.name
	saCfg.QPS, saCfg.Burst = 0, 0
	node, err := kubernetes.NewForConfig(nodeCfg)
	if err != nil {
		t.Fatal(err)
	}
	leases, err := failover.NewHeartbeatClient(saCfg)
	if err != nil {
		t.Fatal(err)
	}
	cfg := e.failoverConfig()
	cfg.NodeName, cfg.Identity = n.name, "agent-"+n.name
	// Each agent on a loopback address of its own, as nodes have theirs
	// (the peer endpoints limit each source address).
	a := agentAddrs.Add(1)
	cfg.PeerListen = fmt.Sprintf("127.3.%d.%d:0", a/250%250, 1+a%250)
	ctx, cancel := context.WithCancel(e.ctx)
	factory := informers.NewSharedInformerFactoryWithOptions(node, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", n.name).String()
		}))
	pods := factory.Core().V1().Pods().Informer()
	n.reg = prometheus.NewRegistry()
	hb, err := failover.NewHeartbeat(cfg, node, leases, pods, n.fence, n.fence, n.reg)
	if err != nil {
		cancel()
		t.Fatalf("NewHeartbeat: %v", err)
	}
	factory.Start(ctx.Done())
	done := make(chan struct{})
	logger := klog.Background().WithValues("sim", n.name)
	go func() {
		defer close(done)
		_ = hb.Run(klog.NewContext(ctx, logger))
		factory.Shutdown()
	}()
	n.stop = func() {
		cancel()
		<-done
	}
}
