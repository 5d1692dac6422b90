package deploy_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"sigs.k8s.io/yaml"

	"github.com/mountmedic/mountmedic/scripts/kubetest"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// The distribution profiles (deploy/profiles/<name>, kustomize Components)
// and the chart's profile value render the same DaemonSet: the chart's
// table of profiles, templates/_profiles.tpl, is generated from the
// Components' renders (TestChartInSync), and TestChartProfiles compares
// the two renders object by object.

// profileLayout is what a profile sets: the values of the chart's
// kubelet and criSocket knobs.
type profileLayout struct {
	// Identity is the agent's --identity: node, or serviceaccount (no
	// kubelet kubeconfig, no credentials directories).
	Identity          string   `json:"identity"`
	KubeletRoot       string   `json:"kubeletRoot"`
	KubeletKubeconfig string   `json:"kubeletKubeconfig"`
	CredentialDirs    []string `json:"credentialDirs"`
	CRISocket         string   `json:"criSocket"`
	HostNetwork       bool     `json:"hostNetwork"`
}

// profileNames lists deploy/profiles/.
func profileNames(t *testing.T) []string {
	t.Helper()
	entries, err := os.ReadDir("profiles")
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range entries {
		if e.IsDir() {
			names = append(names, e.Name())
		}
	}
	if len(names) < 10 {
		t.Fatalf("deploy/profiles has %d profiles (%v), want at least 10", len(names), names)
	}
	return names
}

// renderProfile renders the base with the profile's Component.
func renderProfile(t *testing.T, name string) []object {
	t.Helper()
	return renderOverlay(t, "profile-"+name, componentOverlay("profiles/"+name))
}

// layoutOf reads a profile's layout off its DaemonSet.
func layoutOf(t *testing.T, ds *appsv1.DaemonSet) profileLayout {
	t.Helper()
	args := ds.Spec.Template.Spec.Containers[0].Args
	var l profileLayout
	var ok [3]bool
	l.KubeletRoot, ok[0] = flagValue(args, "kubelet-root")
	l.KubeletKubeconfig, ok[1] = flagValue(args, "node-kubeconfig")
	l.CRISocket, ok[2] = flagValue(args, "cri-socket")
	l.Identity = "node"
	if id, set := flagValue(args, "identity"); set {
		l.Identity, ok[1] = id, !ok[1]
	}
	if ok != [3]bool{true, true, true} {
		t.Fatalf("DaemonSet args %q lack one of --kubelet-root, --node-kubeconfig (or --identity=serviceaccount, not both), --cri-socket", args)
	}
	for _, v := range ds.Spec.Template.Spec.Volumes {
		if strings.HasPrefix(v.Name, "kubelet-credentials-") && v.HostPath != nil {
			l.CredentialDirs = append(l.CredentialDirs, v.HostPath.Path)
		}
	}
	l.HostNetwork = ds.Spec.Template.Spec.HostNetwork
	return l
}

// profilesTemplate is templates/_profiles.tpl: every profile's layout, as
// YAML inside a named template.
func profilesTemplate(t *testing.T) []byte {
	t.Helper()
	all := map[string]profileLayout{}
	for _, name := range profileNames(t) {
		all[name] = layoutOf(t, decodeDaemonSet(t, renderProfile(t, name)))
	}
	data, err := yaml.Marshal(all)
	if err != nil {
		t.Fatal(err)
	}
	return []byte("{{/* Generated from deploy/profiles/ by `go test ./deploy -run TestChart -update`. Do not edit. */}}\n" +
		"{{- define \"mountmedic.profiles\" -}}\n" + string(data) + "{{- end }}\n")
}

// profileWant is each profile's layout as its distribution's own docs or
// source give it (cited in deploy/profiles/README.md and in each
// Component): the Components are checked against this table, not only
// against themselves.
var profileWant = map[string]profileLayout{
	"kubeadm":          {"node", "/var/lib/kubelet", "/etc/kubernetes/kubelet.conf", nil, "unix:///run/containerd/containerd.sock", false},
	"k3s":              {"node", "/var/lib/kubelet", "/var/lib/rancher/k3s/agent/kubelet.kubeconfig", []string{"/var/lib/rancher/k3s/agent"}, "unix:///run/k3s/containerd/containerd.sock", true},
	"rke2":             {"node", "/var/lib/kubelet", "/var/lib/rancher/rke2/agent/kubelet.kubeconfig", []string{"/var/lib/rancher/rke2/agent"}, "unix:///run/k3s/containerd/containerd.sock", true},
	"microk8s":         {"node", "/var/snap/microk8s/common/var/lib/kubelet", "/var/snap/microk8s/current/credentials/kubelet.config", nil, "unix:///var/snap/microk8s/common/run/containerd.sock", true},
	"k0s":              {"node", "/var/lib/k0s/kubelet", "/var/lib/k0s/kubelet.conf", nil, "unix:///run/k0s/containerd.sock", false},
	"eks-al2023":       {"serviceaccount", "/var/lib/kubelet", "", nil, "unix:///run/containerd/containerd.sock", false},
	"eks-bottlerocket": {"serviceaccount", "/var/lib/kubelet", "", nil, "unix:///run/containerd/containerd.sock", false},
	"gke-cos":          {"node", "/var/lib/kubelet", "/var/lib/kubelet/kubeconfig", []string{"/etc/srv/kubernetes/pki"}, "unix:///run/containerd/containerd.sock", false},
	"aks":              {"node", "/var/lib/kubelet", "/var/lib/kubelet/kubeconfig", []string{"/etc/kubernetes/certs"}, "unix:///run/containerd/containerd.sock", false},
	"openshift":        {"node", "/var/lib/kubelet", "/var/lib/kubelet/kubeconfig", nil, "unix:///var/run/crio/crio.sock", false},
}

// TestProfilesRender renders every profile with kustomize and checks its
// DaemonSet: the layout the distribution documents, each flag once, every
// path a flag names mounted from the host at the same path (the kubelet
// root Bidirectional, the kubeconfig and its credentials read-only), no
// bind inside the kubelet root, and the agent's own validation of the args.
func TestProfilesRender(t *testing.T) {
	bin := buildMountmedic(t)
	names := profileNames(t)
	for name := range profileWant {
		if !slices.Contains(names, name) {
			t.Errorf("profile %s has no deploy/profiles/%s", name, name)
		}
	}
	for _, name := range names {
		t.Run(name, func(t *testing.T) {
			objs := renderProfile(t, name)
			ds := decodeDaemonSet(t, objs)
			got := layoutOf(t, ds)
			want, ok := profileWant[name]
			if !ok {
				t.Fatalf("deploy/profiles/%s is not in profileWant: add its documented layout", name)
			}
			if g, w := fmt.Sprintf("%+v", got), fmt.Sprintf("%+v", want); g != w {
				t.Errorf("layout\n got %s\nwant %s", g, w)
			}
			checkLayout(t, ds)
			checkAgentArgs(t, bin, ds.Spec.Template.Spec.Containers[0].Args)
			if rb := slices.IndexFunc(objs, func(o object) bool { return o.Kind == "RoleBinding" && o.Metadata.Name == "mountmedic-scc-privileged" }); (rb >= 0) != (name == "openshift") {
				t.Errorf("the privileged SCC RoleBinding rendered: %v, want only on openshift", rb >= 0)
			}
		})
	}
}

// checkLayout checks that a DaemonSet mounts what its layout flags name.
func checkLayout(t *testing.T, ds *appsv1.DaemonSet) {
	t.Helper()
	pod := ds.Spec.Template.Spec
	c := pod.Containers[0]
	seen := map[string]bool{}
	for _, a := range c.Args[1:] {
		name, _, _ := strings.Cut(a, "=")
		if seen[name] {
			t.Errorf("flag %s given twice: %q", name, c.Args)
		}
		seen[name] = true
	}
	l := layoutOf(t, ds)
	volume := func(name string) *corev1.Volume {
		for i := range pod.Volumes {
			if pod.Volumes[i].Name == name {
				return &pod.Volumes[i]
			}
		}
		return nil
	}
	// mountOf returns the mount that holds path (the deepest).
	mountOf := func(path string) (corev1.VolumeMount, bool) {
		var best corev1.VolumeMount
		for _, m := range c.VolumeMounts {
			if (m.MountPath == path || strings.HasPrefix(path, m.MountPath+"/")) && len(m.MountPath) > len(best.MountPath) {
				best = m
			}
		}
		return best, best.Name != ""
	}
	for _, m := range c.VolumeMounts {
		v := volume(m.Name)
		if v == nil {
			t.Errorf("mount %s names no volume", m.Name)
			continue
		}
		if v.HostPath != nil && v.HostPath.Path != m.MountPath {
			t.Errorf("hostPath %s is mounted at %s: want the host's path (the files the kubeconfig names and the mount table read as the host names them)", v.HostPath.Path, m.MountPath)
		}
		if m.Name != "kubelet-root" && strings.HasPrefix(m.MountPath, l.KubeletRoot+"/") {
			t.Errorf("mount %s at %s is inside the Bidirectional kubelet root %s: the bind would reach the host", m.Name, m.MountPath, l.KubeletRoot)
		}
	}
	if m, ok := mountOf(l.KubeletRoot); !ok || m.Name != "kubelet-root" || m.MountPropagation == nil || *m.MountPropagation != corev1.MountPropagationBidirectional {
		t.Errorf("kubelet root %s: mount %+v, want the kubelet-root volume, Bidirectional", l.KubeletRoot, m)
	}
	if l.Identity == "serviceaccount" {
		if v := volume("kubelet-kubeconfig"); v != nil {
			t.Errorf("--identity=serviceaccount with the kubelet kubeconfig mounted (%+v): want no kubelet credentials", v)
		}
	} else if m, ok := mountOf(l.KubeletKubeconfig); !ok || (m.Name != "kubelet-root" && !m.ReadOnly) {
		t.Errorf("kubeconfig %s: mount %+v, want it under a read-only mount or the kubelet root", l.KubeletKubeconfig, m)
	}
	for _, d := range l.CredentialDirs {
		if m, ok := mountOf(d); !ok || m.MountPath != d || !m.ReadOnly {
			t.Errorf("credentials directory %s: mount %+v, want it mounted read-only", d, m)
		}
	}
	sock := strings.TrimPrefix(l.CRISocket, "unix://")
	if m, ok := mountOf(sock); !ok || m.MountPath != filepath.Dir(sock) || !m.ReadOnly {
		t.Errorf("CRI socket %s: mount %+v, want its directory mounted read-only", l.CRISocket, m)
	}
	if pod.HostNetwork && pod.DNSPolicy != corev1.DNSClusterFirstWithHostNet {
		t.Errorf("hostNetwork with dnsPolicy %q: want ClusterFirstWithHostNet (Service names must still resolve)", pod.DNSPolicy)
	}
}

// TestChartProfiles renders the chart with each profile and compares it
// with the base plus the profile's Component.
func TestChartProfiles(t *testing.T) {
	for _, name := range profileNames(t) {
		t.Run(name, func(t *testing.T) {
			compareRenders(t, renderProfile(t, name), helmTemplate(t, baseNamespace, "profile="+name))
		})
	}
}

// TestProfilesApply applies every profile, as kustomize and as the chart
// render it, to a real kube-apiserver: a server-side dry run (schema,
// admission, Pod Security of the privileged namespace), then for real,
// one profile after the other, and reads the DaemonSet back. The chart
// render holds its own Namespace (namespace.create), as a GitOps tool
// would apply it.
func TestProfilesApply(t *testing.T) {
	kc := kubectl(t)
	helm := lab.RequireTool(t, "helm")
	c := kubetest.Start(t, kubetest.Options{})
	k := func(args ...string) string {
		t.Helper()
		return string(run(t, ".", kc, append([]string{"--kubeconfig=" + c.Kubeconfig}, args...)...))
	}
	k("apply", "-f", "namespace.yaml")
	for _, name := range profileNames(t) {
		t.Run(name, func(t *testing.T) {
			dir := overlayDir(t, "profile-"+name, componentOverlay("profiles/"+name))
			rendered := filepath.Join(t.TempDir(), "chart.yaml")
			out := run(t, ".", helm, "template", "mountmedic", chartDir, "--namespace", baseNamespace, "--kube-version", kubeVersion, "--set", "profile="+name, "--set", "namespace.create=true")
			if err := os.WriteFile(rendered, out, 0o644); err != nil {
				t.Fatal(err)
			}
			for _, src := range [][]string{{"-k", dir}, {"-f", rendered}} {
				dry := k(append([]string{"apply", "--server-side", "--force-conflicts", "--dry-run=server"}, src...)...)
				if !strings.Contains(dry, "daemonset.apps/mountmedic serverside-applied (server dry run)") {
					t.Errorf("kubectl apply %s --dry-run=server: %s", src[1], dry)
				}
			}
			k("apply", "--server-side", "--force-conflicts", "-k", dir)
			ds, err := c.Client.AppsV1().DaemonSets(baseNamespace).Get(context.Background(), "mountmedic", metav1.GetOptions{})
			if err != nil {
				t.Fatalf("DaemonSet after apply: %v", err)
			}
			if got, want := layoutOf(t, ds), profileWant[name]; fmt.Sprintf("%+v", got) != fmt.Sprintf("%+v", want) {
				t.Errorf("applied layout\n got %+v\nwant %+v", got, want)
			}
		})
	}
}
