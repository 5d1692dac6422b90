{{/* Generated from deploy/profiles/ by `go test ./deploy -run TestChart -update`. Do not edit. */}}
{{- define "mountmedic.profiles" -}}
aks:
  credentialDirs:
  - /etc/kubernetes/certs
  criSocket: unix:///run/containerd/containerd.sock
  hostNetwork: false
  identity: node
  kubeletKubeconfig: /var/lib/kubelet/kubeconfig
  kubeletRoot: /var/lib/kubelet
eks-al2023:
  credentialDirs: null
  criSocket: unix:///run/containerd/containerd.sock
  hostNetwork: false
  identity: serviceaccount
  kubeletKubeconfig: ""
  kubeletRoot: /var/lib/kubelet
eks-bottlerocket:
  credentialDirs: null
  criSocket: unix:///run/containerd/containerd.sock
  hostNetwork: false
  identity: serviceaccount
  kubeletKubeconfig: ""
  kubeletRoot: /var/lib/kubelet
gke-cos:
  credentialDirs:
  - /etc/srv/kubernetes/pki
  criSocket: unix:///run/containerd/containerd.sock
  hostNetwork: false
  identity: node
  kubeletKubeconfig: /var/lib/kubelet/kubeconfig
  kubeletRoot: /var/lib/kubelet
k0s:
  credentialDirs: null
  criSocket: unix:///run/k0s/containerd.sock
  hostNetwork: false
  identity: node
  kubeletKubeconfig: /var/lib/k0s/kubelet.conf
  kubeletRoot: /var/lib/k0s/kubelet
k3s:
  credentialDirs:
  - /var/lib/rancher/k3s/agent
  criSocket: unix:///run/k3s/containerd/containerd.sock
  hostNetwork: true
  identity: node
  kubeletKubeconfig: /var/lib/rancher/k3s/agent/kubelet.kubeconfig
  kubeletRoot: /var/lib/kubelet
kubeadm:
  credentialDirs: null
  criSocket: unix:///run/containerd/containerd.sock
  hostNetwork: false
  identity: node
  kubeletKubeconfig: /etc/kubernetes/kubelet.conf
  kubeletRoot: /var/lib/kubelet
microk8s:
  credentialDirs: null
  criSocket: unix:///var/snap/microk8s/common/run/containerd.sock
  hostNetwork: true
  identity: node
  kubeletKubeconfig: /var/snap/microk8s/current/credentials/kubelet.config
  kubeletRoot: /var/snap/microk8s/common/var/lib/kubelet
openshift:
  credentialDirs: null
  criSocket: unix:///var/run/crio/crio.sock
  hostNetwork: false
  identity: node
  kubeletKubeconfig: /var/lib/kubelet/kubeconfig
  kubeletRoot: /var/lib/kubelet
rke2:
  credentialDirs:
  - /var/lib/rancher/rke2/agent
  criSocket: unix:///run/k3s/containerd/containerd.sock
  hostNetwork: true
  identity: node
  kubeletKubeconfig: /var/lib/rancher/rke2/agent/kubelet.kubeconfig
  kubeletRoot: /var/lib/kubelet
{{- end }}
