// Package e2e runs mountmedic end to end on a real single-node Kubernetes
// cluster built on this machine, and measures it against the naive way
// (scripts/e2e/bench.sh writes the figures of BENCHMARKS.md).
//
// The node: etcd, kube-apiserver, kube-controller-manager and kube-scheduler
// (scripts/kubetest), Debian's containerd and runc, and kubelet, with the
// real k8s-csi-s3 node plugin (scripts/csilab: s3driver and s3fs against
// versitygw on loopback) registered with kubelet through a registration
// socket in plugins_registry (registrar.go plays node-driver-registrar).
// kubelet has a node's own identity (a client certificate for
// system:node:<name>, laid out as kubeadm does: /etc/kubernetes/kubelet.conf
// naming /var/lib/kubelet/pki/kubelet-client-current.pem), which the API
// server confines with the Node authorizer and NodeRestriction; the
// DaemonSet's agent reads the same file, as shipped.
// Images are packed here (image.go: a static pause program, Debian's
// busybox-static) and imported with ctr; mountmedic runs as the DaemonSet of
// deploy/, its image built by scripts/image.sh, through the overlay in
// scripts/e2e/deploy.
//
// TestK3s brings up a second cluster and node after TestE2E, laid out as
// k3s lays a node out (NodeOptions.Layout, layout.go: kubelet's kubeconfig
// and the files it names in /var/lib/rancher/k3s/agent, containerd's root
// there and its socket in /run/k3s/containerd), and runs the agent as a k3s
// user deploys it: deploy/ with the profile deploy/profiles/k3s, through
// scripts/e2e/k3s. Each overlay changes deploy/ only where the lab needs it
// (scripts/e2e/deploy/lab), which TestLabOverlays checks.
//
// Isolation: containerd and kubelet run in a PID namespace of their own whose
// init is a copy of the test binary (Main, init.go), in a mount namespace
// copied from the fault lab's private one (scripts/lab), where every mount is
// made shared as on a systemd host. /var/lib/kubelet, containerd's root and
// state directories (/var/lib/containerd and /run/containerd in kubeadm's
// layout), the kubeconfig's directory, /var/log/pods and
// /var/log/containers are shared binds of temporary directories (a missing
// mount point is created in an overlay of its nearest existing ancestor,
// never on the host), so the node's mounts and the CSI
// driver's (which runs in the test's namespace) reach both namespaces and
// nothing reaches the host's paths. Pods get cgroups under
// /mountmedic-e2e-<pid> in every hierarchy. The teardown kills the node's
// init, and with it, by the kernel's rule for a PID namespace, every process
// of the node (shims and containers included); it then unmounts what is
// left and removes the cgroups. A test binary killed before its cleanups
// leaves only empty cgroups, which the next run removes.
//
// SimNode adds a second node with no machine behind it, for the failover
// scenario: the test beats its kubelet's status and Lease and its agent's
// heartbeat, and makes it die by falling silent. The fence scenario cuts
// the real node's agent off alone instead: Agent.APIServer deploys it
// behind a lab.TCPProxy that the test cuts, while kubelet keeps its own
// link, and Node.MountTable is the node's own mount table (its init's: the
// host's, to the DaemonSet), where the test checks what the fence
// unmounted.
//
// One scenario runs with go test's -run, the harness skipped (and
// TestK3s, whose name 'TestE2E' does not match):
//
//	MOUNTMEDIC_REQUIRE_ROOT=1 go test -count=1 -v -run 'TestE2E/fence$' ./scripts/e2e
//
// This package is test support plus the e2e tests; it is imported from
// _test.go files only.
package e2e
