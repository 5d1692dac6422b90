package e2e

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/mountmedic/mountmedic/scripts/kubetest"
)

// Layout is how a distribution lays a node out where the agent looks: the
// file kubelet's --kubeconfig names and the credentials it names in turn,
// containerd's root, state directory and socket, and the lab's overlay of
// deploy/ (the DaemonSet for that layout, with the profile a user of that
// distribution lists). The kubelet root is /var/lib/kubelet in every
// layout here.
type Layout struct {
	// Name is the layout's (and its deploy/profiles/ Component's) name.
	Name string
	// KubeletKubeconfig is kubelet's --kubeconfig.
	KubeletKubeconfig string
	// ContainerdRoot and ContainerdState are containerd's root and state
	// directories; its socket is containerd.sock in the state directory.
	ContainerdRoot  string
	ContainerdState string
	// Overlay is the kustomize directory under scripts/e2e that the agent
	// is deployed from (Agent.Deploy adds the run's settings to it).
	Overlay string
	// kubeletFlags are kubelet's flags for this layout's paths.
	kubeletFlags []string
	// writeCredentials writes KubeletKubeconfig and what it names for
	// node, with server as the API server's address.
	writeCredentials func(t testing.TB, c *kubetest.Cluster, l Layout, node, server string)
}

// ContainerdSocket is where the layout's containerd serves the CRI.
func (l Layout) ContainerdSocket() string { return filepath.Join(l.ContainerdState, "containerd.sock") }

// KubeadmLayout is kubeadm's node: kubelet.conf in /etc/kubernetes naming
// the rotating client certificate under the kubelet root, and Debian's
// containerd at its defaults. deploy/ as shipped is for this layout.
var KubeadmLayout = Layout{
	Name:              "kubeadm",
	KubeletKubeconfig: KubeletKubeconfig,
	ContainerdRoot:    ContainerdRoot,
	ContainerdState:   ContainerdState,
	Overlay:           "deploy",
	kubeletFlags:      []string{"--kubeconfig=" + KubeletKubeconfig, "--root-dir=" + KubeletRoot},
	writeCredentials: func(t testing.TB, c *kubetest.Cluster, l Layout, node, server string) {
		c.WriteNodeKubeconfig(t, l.KubeletKubeconfig, KubeletRoot, node, server)
	},
}

// K3sAgentDir is k3s' <data-dir>/agent with the default data dir.
const K3sAgentDir = "/var/lib/rancher/k3s/agent"

// K3sLayout is a k3s node, read from k3s-io/k3s: pkg/agent/config/config.go
// (get) writes kubelet's kubeconfig to <data-dir>/agent/kubelet.kubeconfig
// through deps.KubeConfig (pkg/daemons/control/deps/deps.go), which names
// client-kubelet.crt, client-kubelet.key and server-ca.crt beside it as
// files, not inline data; its containerd's root is <data-dir>/agent/containerd
// and pkg/agent/config/config_linux.go puts its state and socket in
// /run/k3s/containerd. pkg/daemons/agent/agent_linux.go gives kubelet
// --kubeconfig and no --root-dir (but in rootless mode), so the root is
// kubelet's default. The kubeconfig's server is on loopback: the agent's
// local load balancer (pkg/agent/proxy/apiproxy.go, APIServerURL; port 6444
// by default); here it is the node's proxy to the API server, also on
// loopback, on a free port.
var K3sLayout = Layout{
	Name:              "k3s",
	KubeletKubeconfig: filepath.Join(K3sAgentDir, "kubelet.kubeconfig"),
	ContainerdRoot:    filepath.Join(K3sAgentDir, "containerd"),
	ContainerdState:   "/run/k3s/containerd",
	Overlay:           "k3s",
	kubeletFlags:      []string{"--kubeconfig=" + filepath.Join(K3sAgentDir, "kubelet.kubeconfig")},
	writeCredentials:  writeK3sCredentials,
}

// writeK3sCredentials writes node's credentials as k3s' agent does: the
// client certificate and key and the server CA as files in the agent
// directory, and a kubeconfig naming them (cluster "local", context
// "Default", user "user", as deps.KubeConfig's template has them).
func writeK3sCredentials(t testing.TB, c *kubetest.Cluster, l Layout, node, server string) {
	t.Helper()
	dir := filepath.Dir(l.KubeletKubeconfig)
	cert, key := c.NodeCredentials(t, node)
	files := map[string][]byte{
		"client-kubelet.crt": cert,
		"client-kubelet.key": key,
		"server-ca.crt":      c.Config.TLSClientConfig.CAData,
	}
	for name, data := range files {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			t.Fatalf("write the k3s agent's %s: %v", name, err)
		}
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["local"] = &clientcmdapi.Cluster{Server: server, CertificateAuthority: filepath.Join(dir, "server-ca.crt")}
	cfg.AuthInfos["user"] = &clientcmdapi.AuthInfo{
		ClientCertificate: filepath.Join(dir, "client-kubelet.crt"),
		ClientKey:         filepath.Join(dir, "client-kubelet.key"),
	}
	cfg.Contexts["Default"] = &clientcmdapi.Context{Cluster: "local", AuthInfo: "user", Namespace: "default"}
	cfg.CurrentContext = "Default"
	if err := clientcmd.WriteToFile(*cfg, l.KubeletKubeconfig); err != nil {
		t.Fatalf("write the k3s kubelet kubeconfig: %v", err)
	}
}

// nodePaths are the node's directories that get a bind of a directory of
// the node's own: the kubelet root, containerd's directories, the pod logs
// and the kubeconfig's directory, but those inside another of them (the
// outer bind holds them: k3s keeps containerd's root in its agent
// directory).
func (l Layout) nodePaths() []string {
	all := []string{KubeletRoot, l.ContainerdRoot, l.ContainerdState, PodLogs, ContainerLogs, filepath.Dir(l.KubeletKubeconfig)}
	var out []string
	for _, p := range all {
		inside := false
		for _, q := range all {
			if strings.HasPrefix(p, q+"/") {
				inside = true
			}
		}
		if !inside {
			out = append(out, p)
		}
	}
	return out
}
