package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/agent"
	"github.com/mountmedic/mountmedic/agent/failover"
	"github.com/mountmedic/mountmedic/agent/kubeclient"
)

// controllerFlags are the controller command's flags: the failover
// controller's configuration and how to reach the API server.
type controllerFlags struct {
	cfg        failover.ControllerConfig
	kubeconfig string
	// serviceAccount is the name the controller's admission policies
	// match (agent.CheckServiceAccountName).
	serviceAccount string
	metricsAddr    string
	qps            float32
	burst          int
}

func newControllerCommand() *cobra.Command {
	f := &controllerFlags{cfg: failover.DefaultControllerConfig(), serviceAccount: agent.DefaultControllerServiceAccountName, metricsAddr: ":9810", qps: failover.DefaultControllerQPS, burst: failover.DefaultControllerBurst}
	// $POD_NAME, else the host name read at run time (runController), so
	// that --help and the docs made from it name no machine.
	if os.Getenv("POD_NAME") == "" {
		f.cfg.Identity = ""
	}
	cmd := &cobra.Command{
		Use:   "controller",
		Short: "Run the cluster side of node failover: move pods with ReadWriteOnce volumes off dead nodes",
		Long: `controller is the cluster side of the failover duty, installed by
deploy/controller/ as a Deployment of two replicas that elect one leader
through a Lease (--failover-leader-lease). Agents never run it: with
--failover they renew their node's heartbeat Lease and fence their node
when they cannot.

The leader watches the nodes (--failover-node-selector), kubelet's node
Leases and the agents' heartbeat Leases, keeping only the fields it reads.
A node is confirmed dead when it is not Ready, kubelet has shown no life for
--failover-kubelet-grace and its heartbeat has been silent past its fence
window plus --failover-fence-margin, all measured on the leader's clock from
what it saw change (a leader that just started, or whose watches just
reached the API server again after losing it, waits a full window). Right
before it taints a node or deletes a pod it re-reads the node and both
Leases from the API server and acts only if they still say dead. It fails
over at most --failover-max-nodes nodes at once, and none while at least
--failover-stand-down-share of the judged nodes (and more than two), or all
of them, are not Ready: a disrupted zone or control plane looks like that.

With --failover-dry-run it decides, records events (marked [dry-run]) and
metrics, and changes nothing. See agent/failover and deploy/README.md.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if f.cfg.Identity == "" && !cmd.Flags().Changed("failover-identity") {
				f.cfg.Identity, _ = os.Hostname()
			}
			return runController(cmd.Context(), f)
		},
	}
	fl := cmd.Flags()
	f.cfg.AddFlags(fl)
	fl.Lookup("failover-identity").Usage = "this replica's name in the leader Lease (default $POD_NAME, else the host name)"
	fl.StringVar(&f.kubeconfig, "kubeconfig", "", "kubeconfig file; empty uses the in-cluster service account")
	fl.StringVar(&f.serviceAccount, "service-account-name", f.serviceAccount, "name of the controller's ServiceAccount as its admission policies match it (the chart's fullnameOverride plus -controller); the controller refuses to start as another")
	fl.StringVar(&f.metricsAddr, "metrics-addr", f.metricsAddr, "address of /metrics, /healthz and /readyz; empty disables them")
	fl.Float32Var(&f.qps, "kube-api-qps", f.qps, "steady requests per second to the API server (events, fresh reads, taints and deletions; watches are not counted, and leader election has a rate of its own)")
	fl.IntVar(&f.burst, "kube-api-burst", f.burst, "burst of requests to the API server above --kube-api-qps")
	return cmd
}

// controllerClients makes the controller's clients from the kubeconfig
// file or the in-cluster configuration: its work's, at --kube-api-qps, and
// its leader election's, with a rate limiter of its own.
func controllerClients(f *controllerFlags) (client, leases kubernetes.Interface, err error) {
	rc, err := restConfig(f.kubeconfig)
	if err != nil {
		return nil, nil, err
	}
	if err := agent.CheckServiceAccountName(rc, f.serviceAccount); err != nil {
		return nil, nil, err
	}
	rc.UserAgent = "mountmedic-controller/" + version
	rc.QPS, rc.Burst = f.qps, f.burst
	if client, err = kubeclient.New(rc); err != nil {
		return nil, nil, fmt.Errorf("kubernetes client: %w", err)
	}
	if leases, err = failover.NewLeaderElectionClient(rc); err != nil {
		return nil, nil, err
	}
	return client, leases, nil
}

func runController(ctx context.Context, f *controllerFlags) error {
	if err := f.cfg.Validate(); err != nil {
		return err
	}
	if f.qps <= 0 || f.burst < 1 {
		return fmt.Errorf("--kube-api-qps %v and --kube-api-burst %d: both must be positive", f.qps, f.burst)
	}
	client, leases, err := controllerClients(f)
	if err != nil {
		return err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	ctl, err := failover.NewController(f.cfg, client, leases, reg)
	if err != nil {
		return err
	}
	logger := klog.FromContext(ctx)
	if f.metricsAddr != "" {
		ln, err := net.Listen("tcp", f.metricsAddr)
		if err != nil {
			return fmt.Errorf("--metrics-addr %s: %w", f.metricsAddr, err)
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		ok := func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") }
		mux.HandleFunc("/healthz", ok)
		mux.HandleFunc("/readyz", ok)
		srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
		go func() {
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				logger.Error(err, "Metrics server stopped")
			}
		}()
		defer func() {
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = srv.Shutdown(sctx)
		}()
		logger.Info("Serving metrics", "addr", ln.Addr().String())
	}
	return ctl.Run(ctx)
}
