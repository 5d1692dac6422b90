package main

import (
	"encoding/json"
	"fmt"
	"time"

	"github.com/spf13/cobra"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/mountmedic/mountmedic/agent/kubeclient"
	"github.com/mountmedic/mountmedic/agent/status"
)

// statusFlags are the status command's flags.
type statusFlags struct {
	kubeconfig, context string
	output              string
	opts                status.Options
	broken              bool
}

func newStatusCommand() *cobra.Command {
	f := &statusFlags{output: "table", opts: status.Options{Namespace: "mountmedic", FenceAfter: 30 * time.Second,
		HeartbeatInterval: 10 * time.Second, StaleAfter: 15 * time.Minute}}
	cmd := &cobra.Command{
		Use:   "status [NODE...]",
		Short: "Show the cluster: per node, broken pod volume mounts, the last repair, failover state",
		Long: `status reads what the API server already has and prints one row per node:
its pod volume mounts as the agent's PodVolumeMountsBroken condition counts
them (by driver and state), the last repair an agent reported about its pods
(from the agents' events) and its failover state (heartbeat Lease, fence,
mountmedic's out-of-service taint). It only reads: nodes, events, the
heartbeat Leases and the agents' pods in --namespace.

Installed as kubectl-mountmedic on PATH (a link to mountmedic), it is the
kubectl plugin "kubectl mountmedic".`,
		RunE: func(cmd *cobra.Command, args []string) error {
			return runStatus(cmd, f, args)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.kubeconfig, "kubeconfig", "", "kubeconfig file (default $KUBECONFIG, then ~/.kube/config)")
	fl.StringVar(&f.context, "context", "", "kubeconfig context (default the current one)")
	fl.StringVarP(&f.output, "output", "o", f.output, "table or json")
	fl.StringVarP(&f.opts.Namespace, "namespace", "n", f.opts.Namespace, "namespace of the mountmedic agents and their heartbeat Leases")
	fl.BoolVar(&f.broken, "broken", false, "only nodes whose volumes are not healthy, or whose failover state is not ok/off")
	fl.DurationVar(&f.opts.FenceAfter, "fence-after", f.opts.FenceAfter, "the agents' --failover-fence-after: a heartbeat silent longer reads fenced")
	fl.DurationVar(&f.opts.HeartbeatInterval, "heartbeat-interval", f.opts.HeartbeatInterval, "the agents' --failover-heartbeat-interval: a heartbeat 1.5 intervals old reads silent")
	return cmd
}

func runStatus(cmd *cobra.Command, f *statusFlags, nodes []string) error {
	if f.output != "table" && f.output != "json" {
		return fmt.Errorf("--output %q: want table or json", f.output)
	}
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = f.kubeconfig
	rc, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{CurrentContext: f.context}).ClientConfig()
	if err != nil {
		return fmt.Errorf("kubeconfig: %w (set --kubeconfig or $KUBECONFIG)", err)
	}
	rc.UserAgent = "mountmedic-status/" + version
	cs, err := kubeclient.New(rc)
	if err != nil {
		return err
	}
	f.opts.Nodes = nodes
	f.opts.Now = time.Now()
	v, err := status.Read(cmd.Context(), cs, f.opts)
	if err != nil {
		return err
	}
	if f.broken {
		v = v.Unhealthy()
	}
	if f.output == "json" {
		enc := json.NewEncoder(cmd.OutOrStdout())
		enc.SetIndent("", "  ")
		return enc.Encode(v)
	}
	return v.Table(cmd.OutOrStdout(), f.opts.Now)
}
