// Package statuscmd is the read-only cluster views as commands: status (a
// row per node) and node (one node in detail), for mountmedic and for the
// kubectl plugin kubectl-mountmedic. The caller gives where the API
// client comes from (Kubeconfig): mountmedic binds client-go's kubeconfig
// flags, the plugin k8s.io/cli-runtime's, so that the agent's binary
// carries no cli-runtime.
package statuscmd

import (
	"cmp"
	"encoding/json"
	"fmt"
	"io"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/yaml"

	"github.com/mountmedic/mountmedic/agent/status"
)

// Kubeconfig is where a command's API client comes from: kubectl's
// standard flags and the client they make.
type Kubeconfig interface {
	// AddFlags binds the flags (--kubeconfig, --context, --as, -n...).
	AddFlags(fl *pflag.FlagSet)
	// Client makes the client with userAgent, and returns the namespace
	// -n names ("" when not given).
	Client(userAgent string) (kubernetes.Interface, string, error)
}

// viewFlags are the flags of the read-only views: the Kubeconfig's, the
// output format and the failover windows.
type viewFlags struct {
	kube    Kubeconfig
	version string
	output  string
	opts    status.Options
}

// DefaultNamespace is mountmedic's namespace when -n is not given (the
// kubeconfig context's namespace is the user's, not mountmedic's).
const DefaultNamespace = "mountmedic"

func newViewFlags(fl *pflag.FlagSet, kube Kubeconfig, version string) *viewFlags {
	f := &viewFlags{kube: kube, version: version, output: "table",
		opts: status.Options{FenceAfter: 30 * time.Second, HeartbeatInterval: 10 * time.Second, StaleAfter: 15 * time.Minute}}
	kube.AddFlags(fl)
	if n := fl.Lookup("namespace"); n != nil {
		n.Usage = "namespace of the mountmedic agents and their heartbeat Leases (default " + DefaultNamespace + ")"
	}
	fl.StringVarP(&f.output, "output", "o", f.output, "table, wide, json or yaml")
	fl.StringVar(&f.opts.Name, "name", status.DefaultName, "the install's name, which its objects' names start with (the Helm chart's fullnameOverride): the admission policies <name>-agent-events and <name>-failover-events vouch for the events shown")
	fl.DurationVar(&f.opts.FenceAfter, "fence-after", f.opts.FenceAfter, "the agents' --failover-fence-after: a heartbeat silent longer reads fenced")
	fl.DurationVar(&f.opts.HeartbeatInterval, "heartbeat-interval", f.opts.HeartbeatInterval, "the agents' --failover-heartbeat-interval: a heartbeat 1.5 intervals old reads silent")
	return f
}

// client checks the output format and makes the API client.
func (f *viewFlags) client() (kubernetes.Interface, error) {
	switch f.output {
	case "table", "wide", "json", "yaml":
	default:
		return nil, fmt.Errorf("--output %q: want table, wide, json or yaml", f.output)
	}
	cs, ns, err := f.kube.Client("mountmedic-status/" + f.version)
	if err != nil {
		return nil, err
	}
	f.opts.Namespace = cmp.Or(ns, DefaultNamespace)
	return cs, nil
}

// print writes v as json or yaml; table reports false for the caller's
// own table.
func (f *viewFlags) print(w io.Writer, v any) (table bool, err error) {
	switch f.output {
	case "json":
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return false, enc.Encode(v)
	case "yaml":
		data, err := yaml.Marshal(v)
		if err != nil {
			return false, err
		}
		_, err = w.Write(data)
		return false, err
	}
	return true, nil
}

// NewStatusCommand is "status [NODE...]"; version goes into the user
// agent.
func NewStatusCommand(kube Kubeconfig, version string) *cobra.Command {
	var broken bool
	var f *viewFlags
	cmd := &cobra.Command{
		Use:   "status [NODE...]",
		Short: "Show the cluster: per node, broken pod volume mounts, the last repair, failover state",
		Long: `status reads what the API server already has and prints one row per node:
its pod volume mounts as the agent's PodVolumeMountsBroken condition counts
them (by driver and state), the last repair that node's agent reported (from
its events, only those the admission policy mountmedic-agent-events vouches
for: written by that node's own identity) and its failover state (heartbeat
Lease, fence, mountmedic's out-of-service taint). It only reads: nodes, the
agents' events, the admission policy and the heartbeat Leases; the
ClusterRole mountmedic-viewer is enough. "node NODE" shows one node in
detail.

It takes kubectl's flags (--context, --as, -n...). The kubectl plugin
kubectl-mountmedic runs it when no other command is named.`,
		RunE: func(cmd *cobra.Command, nodes []string) error {
			cs, err := f.client()
			if err != nil {
				return err
			}
			f.opts.Nodes = nodes
			f.opts.Now = time.Now()
			v, err := status.Read(cmd.Context(), cs, f.opts)
			if err != nil {
				return err
			}
			if broken {
				v = v.Unhealthy()
			}
			if table, err := f.print(cmd.OutOrStdout(), v); !table {
				return err
			}
			return v.Table(cmd.OutOrStdout(), f.opts.Now, f.output == "wide")
		},
	}
	f = newViewFlags(cmd.Flags(), kube, version)
	cmd.Flags().BoolVar(&broken, "broken", false, "only nodes whose volumes are not healthy, or whose failover state is not ok/off")
	return cmd
}

// NewNodeCommand is "node NODE".
func NewNodeCommand(kube Kubeconfig, version string) *cobra.Command {
	var f *viewFlags
	cmd := &cobra.Command{
		Use:   "node NODE",
		Short: "Show one node: its volumes, its agent, its pods' volumes and what its agent did",
		Long: `node shows one node in detail: its row of status, its agent's pod, the
pods on it with claims or CSI volumes, and the events its agent wrote (the
newest 50). An event is shown only when it names the node as its
reportingInstance and was created while the admission policy
mountmedic-agent-events was in force: that policy admits such an event only
from the node's own identity (its kubelet's credentials, or its agent's
node-bound ServiceAccount token), so an event someone else wrote to mislead
is not shown; how many were left out is said. The ClusterRole
mountmedic-viewer is enough.`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			cs, err := f.client()
			if err != nil {
				return err
			}
			f.opts.Now = time.Now()
			d, err := status.ReadNode(cmd.Context(), cs, f.opts, args[0])
			if err != nil {
				return err
			}
			if table, err := f.print(cmd.OutOrStdout(), d); !table {
				return err
			}
			return d.Table(cmd.OutOrStdout(), f.opts.Now, f.output == "wide")
		},
	}
	f = newViewFlags(cmd.Flags(), kube, version)
	return cmd
}
