package main

import (
	"fmt"

	"github.com/spf13/pflag"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/mountmedic/mountmedic/agent/kubeclient"
)

// kubeconfigFlags are kubectl's standard kubeconfig flags as client-go
// binds them (clientcmd.RecommendedConfigOverrideFlags: --context, --as,
// --cluster, -n, --server, --token...), for mountmedic status and node;
// the plugin kubectl-mountmedic binds k8s.io/cli-runtime's, which would
// add 18 MB to the agent's binary.
type kubeconfigFlags struct {
	rules     *clientcmd.ClientConfigLoadingRules
	overrides clientcmd.ConfigOverrides
}

func newKubeconfigFlags() *kubeconfigFlags {
	return &kubeconfigFlags{rules: clientcmd.NewDefaultClientConfigLoadingRules()}
}

func (k *kubeconfigFlags) AddFlags(fl *pflag.FlagSet) {
	fl.StringVar(&k.rules.ExplicitPath, "kubeconfig", "", "kubeconfig file (default $KUBECONFIG, then ~/.kube/config)")
	clientcmd.BindOverrideFlags(&k.overrides, fl, clientcmd.RecommendedConfigOverrideFlags(""))
}

func (k *kubeconfigFlags) Client(userAgent string) (kubernetes.Interface, string, error) {
	rc, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(k.rules, &k.overrides).ClientConfig()
	if clientcmd.IsEmptyConfig(err) {
		return nil, "", fmt.Errorf("no kubeconfig found: pass --kubeconfig, set $KUBECONFIG, or write ~/.kube/config")
	}
	if err != nil {
		return nil, "", fmt.Errorf("kubeconfig: %w", err)
	}
	rc.UserAgent = userAgent
	cs, err := kubeclient.New(rc)
	return cs, k.overrides.Context.Namespace, err
}
