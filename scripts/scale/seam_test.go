package scale

// The seam between the harness and the code under test: the only place
// that knows how mountmedic's failover duty is wired. Everything else
// (kwok, the audit log, the cases) is about the cluster.
//
// On main (before issue 11's controller and heartbeat changes) the cluster
// side is failover.Controller with leader election, run by every agent
// (--failover-leader-candidate defaults to true), and the heartbeat is
// failover.NewHeartbeat with the agent's clients.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
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
	coordinationv1client "k8s.io/client-go/kubernetes/typed/coordination/v1"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/agent/failover"
	"github.com/mountmedic/mountmedic/probe/lab"
)

// agentsCampaign: every agent also runs a failover.Controller that
// campaigns for the leader Lease, as the DaemonSet ships on main. Set it to
// false once agents never campaign (issue 11, item 1).
var agentsCampaign = true

// outageMayFence: main's heartbeat fences when the API server is away
// longer than FenceAfter, whatever the cause, and deletes the fenced pods
// when it comes back. The outage case then reports those fences and
// deletions as the baseline instead of failing on them. Set it to false
// once an outage is not a death (issue 11, item 3): the case then asserts
// 0 fences and 0 deletions.
var outageMayFence = true

// failoverConfig is the duty's configuration for this run: mountmedic's
// defaults with every period multiplied by the time factor.
func (e *env) failoverConfig() failover.Config {
	c := failover.DefaultConfig()
	c.Enabled = true
	c.Namespace = agentNS
	c.LeaderLease = failover.DefaultLeaderLease
	c.NodeSelector = ""
	c.HeartbeatInterval = e.scaled(c.HeartbeatInterval)
	// Validate wants whole seconds, and a margin at least 5 s above the
	// stop grace (the time fencing takes does not scale down).
	c.FenceAfter = max(e.scaled(c.FenceAfter).Round(time.Second), 2*c.HeartbeatInterval)
	c.FenceStopGrace = e.scaled(c.FenceStopGrace)
	c.FenceMargin = max(e.scaled(c.FenceMargin), c.FenceStopGrace+5*time.Second)
	c.KubeletGrace = e.scaled(c.KubeletGrace)
	c.LeaseDuration = e.scaled(c.LeaseDuration)
	c.RenewDeadline = e.scaled(c.RenewDeadline)
	c.RetryPeriod = e.scaled(c.RetryPeriod)
	c.APITimeout = e.scaled(c.APITimeout)
	c.EvalInterval = max(e.scaled(c.EvalInterval), 200*time.Millisecond)
	return c
}

// fenceWindow is how long the controller waits after a heartbeat went
// silent.
func (e *env) fenceWindow() time.Duration {
	c := e.failoverConfig()
	return c.FenceWindow(0)
}

// controllerSpec is what the controller process is started with.
type controllerSpec struct {
	Host        string
	CAData      []byte
	Token       string
	Config      failover.Config
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
	cfg := &rest.Config{Host: spec.Host, BearerToken: spec.Token, TLSClientConfig: rest.TLSClientConfig{CAData: spec.CAData},
		UserAgent: "mountmedic-controller"}
	client, err := kubernetes.NewForConfig(cfg)
	if err != nil {
		return err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	c, err := failover.NewController(spec.Config, client, reg)
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

// startController starts "the controller": on main, failover.Controller
// with leader election, in a process of its own (the test binary
// re-executed) so that its memory can be measured alone, under the
// mountmedic ServiceAccount as deploy/rbac.yaml grants it. It returns once
// the process serves its metrics.
func (e *env) startController(t testing.TB) *controllerProc {
	t.Helper()
	cfg := e.failoverConfig()
	cfg.Identity = "controller-0"
	ports, err := lab.FreePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	spec := controllerSpec{Host: e.sa.Host, CAData: e.sa.CAData, Token: e.sa.BearerToken, Config: cfg,
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

// leasesAs sends Lease requests through leases and the rest through the
// embedded client, as the agent wires them (agent.WithLeases).
type leasesAs struct {
	kubernetes.Interface
	leases kubernetes.Interface
}

func (c leasesAs) CoordinationV1() coordinationv1client.CoordinationV1Interface {
	return c.leases.CoordinationV1()
}

// startAgent starts what mountmedic runs on node n: the failover heartbeat
// with clients of its own (the node's identity for its pods, the
// ServiceAccount for its Lease), through the node's proxy, and, when
// agentsCampaign, a standby failover.Controller campaigning for the leader
// Lease as every agent does on main. The user agents name the node so that
// the audit log tells each one's requests apart.
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
	sa, err := kubernetes.NewForConfig(saCfg)
	if err != nil {
		t.Fatal(err)
	}
	cfg := e.failoverConfig()
	cfg.NodeName, cfg.Identity = n.name, "agent-"+n.name
	ctx, cancel := context.WithCancel(e.ctx)
	factory := informers.NewSharedInformerFactoryWithOptions(node, 0,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) {
			o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", n.name).String()
		}))
	pods := factory.Core().V1().Pods().Informer()
	n.reg = prometheus.NewRegistry()
	hb, err := failover.NewHeartbeat(cfg, leasesAs{Interface: node, leases: sa}, pods, n.fence, n.fence, n.reg)
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
	var campaignDone chan struct{}
	if agentsCampaign {
		candCfg := rest.CopyConfig(saCfg)
		candCfg.UserAgent = "mountmedic-candidate/" + n.name
		cand, err := kubernetes.NewForConfig(candCfg)
		if err != nil {
			t.Fatal(err)
		}
		ctrl, err := failover.NewController(cfg, cand, nil)
		if err != nil {
			t.Fatalf("NewController: %v", err)
		}
		campaignDone = make(chan struct{})
		go func() {
			defer close(campaignDone)
			_ = ctrl.Run(klog.NewContext(ctx, logger.V(2)))
		}()
	}
	n.stop = func() {
		cancel()
		<-done
		if campaignDone != nil {
			<-campaignDone
		}
	}
}
