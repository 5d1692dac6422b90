// Package e2e runs mountmedic end to end on a real single-node Kubernetes
// cluster built on this machine, and measures it against the naive way.
//
// The node: etcd, kube-apiserver, kube-controller-manager and kube-scheduler
// (scripts/kubetest), Debian's containerd and runc, and kubelet, with the
// real k8s-csi-s3 node plugin (scripts/csilab: s3driver and s3fs against
// versitygw on loopback) registered with kubelet through a registration
// socket in plugins_registry. containerd and kubelet run in a PID namespace
// of their own whose init is a copy of the test binary (Main), inside the
// private mount namespace of the fault lab (probe/lab), with /var/lib/kubelet,
// /var/lib/containerd, /run/containerd and /var/log/pods bound from
// temporary directories: nothing reaches the host's paths, and the teardown
// (killing the node's init kills every process of the node) leaves no
// mounts, processes or cgroups behind.
//
// This package is test support plus the e2e tests; it is imported from
// _test.go files only.
package e2e
