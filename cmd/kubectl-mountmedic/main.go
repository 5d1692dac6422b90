// Command kubectl-mountmedic is the kubectl plugin "kubectl mountmedic":
// the cluster view of mountmedic (status, the default) and the node
// drill-down (node NODE), with kubectl's standard flags from
// k8s.io/cli-runtime. It only reads; the ClusterRole mountmedic-viewer
// (deploy/viewer-rbac.yaml) is enough. Install it with krew
// (deploy/krew/mountmedic.yaml) or as any file named kubectl-mountmedic on
// PATH.
package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"k8s.io/cli-runtime/pkg/genericclioptions"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/mountmedic/mountmedic/agent/kubeclient"
	"github.com/mountmedic/mountmedic/agent/status/statuscmd"
)

// version is set at build time (-ldflags -X main.version=...), as
// mountmedic's.
var version = "dev"

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := execute(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// execute runs the plugin with args and returns its exit status.
func execute(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	root := newRootCommand()
	root.SetArgs(args)
	root.SetOut(stdout)
	root.SetErr(stderr)
	if err := root.ExecuteContext(ctx); err != nil {
		fmt.Fprintf(stderr, "kubectl mountmedic: %v\n", err)
		return 1
	}
	return 0
}

// newRootCommand is status, with node and version beside it.
func newRootCommand() *cobra.Command {
	root := statuscmd.NewStatusCommand(newConfigFlags(), version)
	root.Use = "kubectl mountmedic [NODE...]"
	root.SilenceUsage, root.SilenceErrors = true, true
	root.AddCommand(statuscmd.NewNodeCommand(newConfigFlags(), version), &cobra.Command{
		Use:   "version",
		Short: "Print the plugin's version",
		Args:  cobra.NoArgs,
		Run:   func(cmd *cobra.Command, _ []string) { fmt.Fprintln(cmd.OutOrStdout(), version) },
	})
	return root
}

// configFlags are kubectl's own flags (k8s.io/cli-runtime ConfigFlags).
type configFlags struct{ *genericclioptions.ConfigFlags }

func newConfigFlags() configFlags {
	return configFlags{genericclioptions.NewConfigFlags(true)}
}

func (c configFlags) AddFlags(fl *pflag.FlagSet) { c.ConfigFlags.AddFlags(fl) }

func (c configFlags) Client(userAgent string) (kubernetes.Interface, string, error) {
	rc, err := c.ToRESTConfig()
	if clientcmd.IsEmptyConfig(err) {
		return nil, "", fmt.Errorf("no kubeconfig found: pass --kubeconfig, set $KUBECONFIG, or write ~/.kube/config")
	}
	if err != nil {
		return nil, "", fmt.Errorf("kubeconfig: %w", err)
	}
	rc.UserAgent = userAgent
	cs, err := kubeclient.New(rc)
	ns := ""
	if c.Namespace != nil {
		ns = *c.Namespace
	}
	return cs, ns, err
}
