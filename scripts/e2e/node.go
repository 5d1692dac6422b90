package e2e

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/mountmedic/mountmedic/scripts/csilab"
	"github.com/mountmedic/mountmedic/scripts/kubetest"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// Paths of the node as kubelet, containerd and the DaemonSet see them. In
// the test's private mount namespace each is a bind of a directory under
// the node's temporary directory, so nothing reaches the host's own paths.
const (
	KubeletRoot      = "/var/lib/kubelet"
	ContainerdRoot   = "/var/lib/containerd"
	ContainerdState  = "/run/containerd"
	ContainerdSocket = ContainerdState + "/containerd.sock"
	PodLogs          = "/var/log/pods"
	ContainerLogs    = "/var/log/containers"
	// KubeletKubeconfig is kubelet's kubeconfig where kubeadm writes it, and
	// where the DaemonSet mounts it from: the node's own identity.
	KubeletKubeconfig = "/etc/kubernetes/kubelet.conf"
)

// Controllers are the kube-controller-manager controllers a node with
// workloads needs: the defaults of kubetest, plus Deployments, ReplicaSets
// and DaemonSets, the PV binder that binds a static PV to its claim, the
// publisher of kube-root-ca.crt that service account volumes read, and the
// taint eviction and pod garbage collection controllers that act on
// KEP-2268's out-of-service taint.
var Controllers = append(slices.Clone(kubetest.DefaultControllers),
	"deployment", "replicaset", "daemonset", "persistentvolume-binder", "root-ca-cert-publisher",
	// The failover scenario: the out-of-service taint's evictions.
	"taint-eviction-controller", "pod-garbage-collector-controller")

// NodeOptions configure StartNode.
type NodeOptions struct {
	// Name is the node's name (default "e2e-node").
	Name string
	// Archives are image archives (docker or OCI) imported into containerd's
	// k8s.io namespace besides the pause and busybox images.
	Archives []string
	// Layout is where the node keeps kubelet's credentials and containerd
	// (default KubeadmLayout).
	Layout Layout
}

// Node is a real Kubernetes node running on this machine: containerd, runc
// and kubelet in a PID namespace of their own, with the k8s-csi-s3 node
// plugin (against versitygw on loopback) registered with kubelet.
type Node struct {
	Name string
	// IP is the node's InternalIP (the machine's first global IPv4 address).
	IP string
	// Dir holds the node's directories, configuration and logs (logs/).
	Dir     string
	Cluster *kubetest.Cluster
	S3      *csilab.S3
	// Driver is the CSI node plugin, serving DriverSocket.
	Driver *csilab.Driver
	// CRI talks to containerd.
	CRI runtimeapi.RuntimeServiceClient
	// APIProxy is the node's link to the API server: kubelet's kubeconfig
	// (and so the agent's node identity) goes through it, so that a test
	// can partition the node (Cut) and heal it (Restore).
	APIProxy *lab.TCPProxy
	// Layout is the node's layout (NodeOptions.Layout).
	Layout Layout

	t          testing.TB
	reg        *registrar
	init       *lab.Process
	cgroupRoot string
	binds      []string
	// overlays are the directories that got an overlay for a mount point.
	overlays []string
}

// DriverSocket is the CSI node plugin's socket, where kubelet's CSI fallback
// also looks: <kubelet root>/plugins/<driver>/csi.sock.
var DriverSocket = filepath.Join(KubeletRoot, "plugins", csilab.DriverName, "csi.sock")

// registrationSocket is the driver's socket in kubelet's plugins_registry.
var registrationSocket = filepath.Join(KubeletRoot, "plugins_registry", csilab.DriverName+"-reg.sock")

// StartNode brings a node up against the cluster c and tears it down when
// the test ends: the node's processes are killed with their PID namespace,
// every mount under the node's paths is unmounted and its cgroups removed.
// It needs root, /dev/fuse, the lab's private mount namespace (Main) and the
// binaries of scripts/tools.sh (kube, s3) and scripts/deps.sh.
func StartNode(t testing.TB, c *kubetest.Cluster, opts NodeOptions) *Node {
	t.Helper()
	lab.RequireRoot(t)
	kubelet := lab.RequireTool(t, "kubelet")
	lab.RequireTool(t, "kubectl")
	for _, b := range []string{"containerd", "containerd-shim-runc-v2", "runc", "ctr", "s3fs", "rclone"} {
		lab.RequireBinary(t, b)
	}
	busybox := "/bin/busybox"
	if _, err := os.Stat(busybox); err != nil {
		lab.SkipOrFail(t, "needs %s: install the Debian package busybox-static (scripts/deps.sh)", busybox)
	}
	if opts.Name == "" {
		opts.Name = "e2e-node"
	}
	if opts.Layout.Name == "" {
		opts.Layout = KubeadmLayout
	}
	ip, err := hostIP()
	if err != nil {
		t.Fatal(err)
	}
	n := &Node{Name: opts.Name, IP: ip, Dir: t.TempDir(), Cluster: c, Layout: opts.Layout, t: t}
	n.cgroupRoot = fmt.Sprintf("/mountmedic-e2e-%d", os.Getpid())
	for _, d := range []string{"logs", "images", "config", "opt", "cni/bin", "cni/conf"} {
		if err := os.MkdirAll(filepath.Join(n.Dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(n.teardownMounts) // after the processes below are gone
	if err := n.makeCgroups(); err != nil {
		t.Fatal(err)
	}

	if err := n.bindPaths(); err != nil {
		t.Fatal(err)
	}
	// The node's own identity, system:node:<name>, laid out as the
	// layout's distribution does: kubelet and the DaemonSet's agent both
	// use it, through the node's link to the API server.
	api, err := url.Parse(c.Server)
	if err != nil {
		t.Fatal(err)
	}
	n.APIProxy = lab.StartTCPProxy(t, api.Host)
	n.Layout.writeCredentials(t, c, n.Layout, n.Name, "https://"+n.APIProxy.Addr())
	// Images first: a failed build costs no daemon.
	archives := []string{filepath.Join(n.Dir, "images", "pause.tar"), filepath.Join(n.Dir, "images", "busybox.tar")}
	if err := buildPauseImage(filepath.Join(n.Dir, "images"), archives[0]); err != nil {
		t.Fatal(err)
	}
	if err := buildBusyboxImage(busybox, archives[1]); err != nil {
		t.Fatal(err)
	}

	n.S3 = csilab.StartS3(t)
	spec, err := n.initSpec(kubelet)
	if err != nil {
		t.Fatal(err)
	}
	if err := n.startInit(spec); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.stopInit)

	// The node plugin runs in the node's PID namespace (in one of its
	// own, as a pod's container does): the DaemonSet's hostPID agent sees
	// its FUSE daemons, as on a real node.
	if err := os.MkdirAll(filepath.Dir(DriverSocket), 0o750); err != nil {
		t.Fatal(err)
	}
	n.Driver = csilab.StartDriverWith(t, DriverSocket, n.Name, csilab.DriverOptions{
		PIDNamespace: filepath.Join("/proc", strconv.Itoa(n.init.Pid()), "ns", "pid")})
	if err := os.MkdirAll(filepath.Dir(registrationSocket), 0o750); err != nil {
		t.Fatal(err)
	}
	n.reg, err = startRegistrar(csilab.DriverName, DriverSocket, registrationSocket)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.reg.stop)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := n.waitContainerd(ctx); err != nil {
		t.Fatal(n.withLogs(err))
	}
	for _, a := range append(archives, opts.Archives...) {
		if err := n.importImage(ctx, a); err != nil {
			t.Fatal(n.withLogs(err))
		}
	}
	conn, err := grpc.NewClient("unix://"+n.Layout.ContainerdSocket(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatalf("connect to containerd: %v", err)
	}
	t.Cleanup(func() { conn.Close() })
	n.CRI = runtimeapi.NewRuntimeServiceClient(conn)
	if err := n.waitNode(ctx); err != nil {
		t.Fatal(n.withLogs(err))
	}
	if err := n.reg.registered(ctx); err != nil {
		t.Fatal(n.withLogs(err))
	}
	t.Logf("node %s (%s) up: kubelet registered, driver %s registered", n.Name, n.IP, csilab.DriverName)
	return n
}

// bindPaths binds a directory of the node over each of the node's paths and
// makes the bind shared, so that mounts made under it by the node (in its
// own mount namespace) and by the CSI driver (in the test's) reach both.
func (n *Node) bindPaths() error {
	for _, p := range n.Layout.nodePaths() {
		src := filepath.Join(n.Dir, "root", p)
		if err := os.MkdirAll(src, 0o755); err != nil {
			return err
		}
		if err := n.mountPoint(p); err != nil {
			return err
		}
		if err := unix.Mount(src, p, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind %s over %s: %w", src, p, err)
		}
		n.binds = append(n.binds, p)
		if err := unix.Mount("", p, "", unix.MS_SHARED, ""); err != nil {
			return fmt.Errorf("make %s shared: %w", p, err)
		}
	}
	return nil
}

// mountPoint makes sure directory p exists in the test's mount namespace
// without creating anything on the host: when p is missing, its nearest
// existing ancestor gets an overlay (the host's directory below, an upper
// directory of the node's above), unless it is in one already, and p and
// its missing parents are created in it.
func (n *Node) mountPoint(p string) error {
	if _, err := os.Stat(p); err == nil {
		return nil
	} else if !errors.Is(err, os.ErrNotExist) {
		return err
	}
	base := filepath.Dir(p)
	for {
		_, err := os.Stat(base)
		if err == nil {
			break
		}
		if !errors.Is(err, os.ErrNotExist) {
			return err
		}
		base = filepath.Dir(base)
	}
	if !slices.ContainsFunc(n.overlays, func(o string) bool { return base == o || strings.HasPrefix(base, o+"/") }) {
		dir := filepath.Join(n.Dir, "overlay", strings.ReplaceAll(strings.Trim(base, "/"), "/", "-"))
		upper, work := filepath.Join(dir, "upper"), filepath.Join(dir, "work")
		for _, d := range []string{upper, work} {
			if err := os.MkdirAll(d, 0o755); err != nil {
				return err
			}
		}
		opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", base, upper, work)
		if err := unix.Mount("overlay", base, "overlay", 0, opts); err != nil {
			return fmt.Errorf("overlay %s to create %s in it: %w", base, p, err)
		}
		n.overlays = append(n.overlays, base)
	}
	if err := os.MkdirAll(p, 0o755); err != nil {
		return fmt.Errorf("create mount point %s: %w", p, err)
	}
	return nil
}

func (n *Node) initSpec(kubelet string) (initSpec, error) {
	cfgDir := filepath.Join(n.Dir, "config")
	containerdConfig := filepath.Join(cfgDir, "containerd.toml")
	if err := os.WriteFile(containerdConfig, []byte(n.containerdConfig()), 0o644); err != nil {
		return initSpec{}, err
	}
	ports, err := lab.FreePorts(1)
	if err != nil {
		return initSpec{}, err
	}
	kubeletConfig := filepath.Join(cfgDir, "kubelet.yaml")
	if err := os.WriteFile(kubeletConfig, []byte(n.kubeletConfig(ports[0])), 0o644); err != nil {
		return initSpec{}, err
	}
	env := nodeEnv()
	logs := filepath.Join(n.Dir, "logs")
	return initSpec{Procs: []initProc{
		{
			Name:   "containerd",
			Argv:   []string{"containerd", "--config", containerdConfig, "--log-level", "info"},
			Env:    env,
			Log:    filepath.Join(logs, "containerd.log"),
			Socket: n.Layout.ContainerdSocket(),
		},
		{
			Name: "kubelet",
			// The layout's --kubeconfig is the node's own identity: the
			// Node authorizer and NodeRestriction confine kubelet (and the
			// agent, which reads the same file) to this node's objects.
			Argv: append(append([]string{kubelet, "--config=" + kubeletConfig}, n.Layout.kubeletFlags...),
				"--hostname-override="+n.Name,
				"--node-ip="+n.IP,
				"--v=2",
			),
			Env: env,
			Log: filepath.Join(logs, "kubelet.log"),
		},
	}}, nil
}

func (n *Node) containerdConfig() string {
	return fmt.Sprintf(`version = 2
root = %[1]q
state = %[2]q
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]

[grpc]
  address = %[3]q

[ttrpc]
  address = %[4]q

[metrics]
  address = ""

[plugins."io.containerd.internal.v1.opt"]
  path = %[5]q

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = %[6]q
  # root here lacks CAP_SYS_RESOURCE in the machine's user namespace.
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = %[7]q
    conf_dir = %[8]q
`, n.Layout.ContainerdRoot, n.Layout.ContainerdState, n.Layout.ContainerdSocket(), n.Layout.ContainerdSocket()+".ttrpc",
		filepath.Join(n.Dir, "opt"), PauseImage, filepath.Join(n.Dir, "cni", "bin"), filepath.Join(n.Dir, "cni", "conf"))
}

func (n *Node) kubeletConfig(port int) string {
	return fmt.Sprintf(`apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: 127.0.0.1
port: %d
readOnlyPort: 0
healthzPort: 0
containerRuntimeEndpoint: unix://%s
cgroupDriver: cgroupfs
cgroupsPerQOS: true
cgroupRoot: %s
enforceNodeAllocatable: []
failSwapOn: false
failCgroupV1: false
podLogsDir: %s
authentication:
  anonymous:
    enabled: false
  webhook:
    enabled: false
authorization:
  mode: AlwaysAllow
# The disk is shared with other work: never evict pods for it.
evictionHard:
  memory.available: "1Mi"
  nodefs.available: "1%%"
  imagefs.available: "1%%"
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
# Volume usage walks every volume (du): not on a FUSE mount that may hang.
volumeStatsAggPeriod: 0s
serializeImagePulls: false
staticPodPath: ""
`, port, n.Layout.ContainerdSocket(), n.cgroupRoot, PodLogs)
}

// nodeEnv is the environment of the node's daemons: the test's, with the
// sbin directories on PATH (runc) and no proxy settings.
func nodeEnv() []string {
	var env []string
	path := "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	for _, kv := range os.Environ() {
		k, v, _ := strings.Cut(kv, "=")
		switch {
		case k == "PATH":
			path = v + ":/usr/local/sbin:/usr/sbin:/sbin"
		case strings.HasPrefix(k, "MOUNTMEDIC_LAB_"), strings.HasPrefix(k, "MOUNTMEDIC_E2E_"):
		case strings.EqualFold(k, "http_proxy"), strings.EqualFold(k, "https_proxy"), strings.EqualFold(k, "no_proxy"):
		default:
			env = append(env, kv)
		}
	}
	return append(env, "PATH="+path)
}

// startInit starts the node's init: a copy of the test binary, PID 1 of a
// new PID namespace, in a new mount namespace copied from the test's. It
// dies with the test binary (lab.RunProcess).
func (n *Node) startInit(spec initSpec) error {
	data, err := json.Marshal(spec)
	if err != nil {
		return fmt.Errorf("encode node init spec: %w", err)
	}
	cmd := exec.Command("/proc/self/exe", "-test.run=^$")
	cmd.Args[0] = os.Args[0]
	cmd.Env = append(os.Environ(), envNodeInit+"="+string(data))
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID | syscall.CLONE_NEWNS}
	n.init, err = lab.RunProcess("the node init", cmd, filepath.Join(n.Dir, "logs", "init.log"))
	return err
}

// MountTable is the mount table of the node's mount namespace, the one
// kubelet and containerd run in: the host's, to the DaemonSet (its
// /proc/1/mountinfo).
func (n *Node) MountTable() string {
	return filepath.Join("/proc", strconv.Itoa(n.init.Pid()), "mountinfo")
}

// stopInit kills the node's init, and with it, by the kernel's rule for a
// PID namespace whose init dies, every process of the node: containerd,
// kubelet, the shims and every container.
func (n *Node) stopInit() {
	if n.t.Failed() {
		for _, name := range []string{"init", "kubelet", "containerd"} {
			n.t.Logf("last lines of %s:\n%s", name, lab.Tail(filepath.Join(n.Dir, "logs", name+".log"), 25))
		}
	}
	if n.init != nil {
		n.init.Kill()
	}
}

// teardownMounts unmounts (lazily) every mount under the node's paths and
// directory, removes the node's cgroups and the mount points it created.
func (n *Node) teardownMounts() {
	roots := append(slices.Clone(n.binds), n.Dir)
	for range 10 {
		mounts, err := mountinfo.GetMounts(nil)
		if err != nil {
			n.t.Errorf("read mount table: %v", err)
			return
		}
		var left int
		for i := len(mounts) - 1; i >= 0; i-- {
			mp := mounts[i].Mountpoint
			if !slices.ContainsFunc(roots, func(r string) bool { return mp == r || strings.HasPrefix(mp, r+"/") }) {
				continue
			}
			left++
			if err := unix.Unmount(mp, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
				n.t.Logf("unmount %s: %v", mp, err)
			}
		}
		if left == 0 {
			break
		}
	}
	n.removeCgroups()
	for i := len(n.overlays) - 1; i >= 0; i-- {
		if err := unix.Unmount(n.overlays[i], unix.MNT_DETACH); err != nil {
			n.t.Errorf("unmount the overlay on %s: %v", n.overlays[i], err)
		}
	}
}

// cgroupHierarchies lists the mounted cgroup hierarchies: each v1
// controller directory, or the unified root.
func cgroupHierarchies() []string {
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err == nil {
		return []string{"/sys/fs/cgroup"}
	}
	var out []string
	entries, _ := os.ReadDir("/sys/fs/cgroup")
	for _, e := range entries {
		p := filepath.Join("/sys/fs/cgroup", e.Name())
		if fi, err := os.Lstat(p); err == nil && fi.IsDir() {
			out = append(out, p)
		}
	}
	return out
}

// makeCgroups creates the node's cgroup root (kubelet's cgroupRoot, under
// which it makes its QoS and pod cgroups) in every hierarchy, after removing
// the empty ones that a test binary killed before its cleanup left.
func (n *Node) makeCgroups() error {
	sweepCgroups()
	for _, h := range cgroupHierarchies() {
		dir := filepath.Join(h, n.cgroupRoot)
		if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
			return fmt.Errorf("create cgroup %s: %w", dir, err)
		}
		// A new v1 cpuset has no CPUs and no memory nodes: inherit them.
		for _, f := range []string{"cpuset.cpus", "cpuset.mems"} {
			if data, err := os.ReadFile(filepath.Join(h, f)); err == nil {
				if err := os.WriteFile(filepath.Join(dir, f), data, 0o644); err != nil {
					return fmt.Errorf("set %s of cgroup %s: %w", f, dir, err)
				}
			}
		}
	}
	return nil
}

// sweepCgroups removes the cgroup trees of earlier nodes whose test binary
// is gone (its PID namespace took every process with it, so they are empty).
func sweepCgroups() {
	for _, h := range cgroupHierarchies() {
		dirs, _ := filepath.Glob(filepath.Join(h, "mountmedic-e2e-*"))
		for _, d := range dirs {
			pid, err := strconv.Atoi(strings.TrimPrefix(filepath.Base(d), "mountmedic-e2e-"))
			if err != nil || syscall.Kill(pid, 0) == nil {
				continue
			}
			removeTree(d)
		}
	}
}

// removeTree removes a cgroup directory and its children, deepest first.
func removeTree(root string) {
	var dirs []string
	_ = filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			dirs = append(dirs, p)
		}
		return nil
	})
	for i := len(dirs) - 1; i >= 0; i-- {
		_ = os.Remove(dirs[i])
	}
}

// removeCgroups removes the node's cgroup tree in every cgroup v1
// hierarchy (or the unified one), deepest first.
func (n *Node) removeCgroups() {
	for _, h := range cgroupHierarchies() {
		root := filepath.Join(h, n.cgroupRoot)
		if _, err := os.Stat(root); err != nil {
			continue
		}
		err := wait.PollUntilContextTimeout(context.Background(), 100*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
			removeTree(root)
			_, err := os.Stat(root)
			return errors.Is(err, os.ErrNotExist), nil
		})
		if err != nil {
			n.t.Errorf("remove cgroup %s: %v", root, err)
		}
	}
}

func (n *Node) waitContainerd(ctx context.Context) error {
	return wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(context.Context) (bool, error) {
		if n.init.Exited() {
			return false, n.init.ExitError()
		}
		c, err := net.Dial("unix", n.Layout.ContainerdSocket())
		if err != nil {
			return false, nil
		}
		c.Close()
		return true, nil
	})
}

func (n *Node) importImage(ctx context.Context, archive string) error {
	cmd := exec.CommandContext(ctx, "ctr", "--address", n.Layout.ContainerdSocket(), "--namespace", "k8s.io", "images", "import", archive)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("import %s into containerd: %w: %s", archive, err, strings.TrimSpace(string(out)))
	}
	return nil
}

func (n *Node) waitNode(ctx context.Context) error {
	err := wait.PollUntilContextCancel(ctx, 200*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		if n.init.Exited() {
			return false, n.init.ExitError()
		}
		_, err := n.Cluster.Client.CoreV1().Nodes().Get(ctx, n.Name, metav1.GetOptions{})
		return err == nil, nil
	})
	if err != nil {
		return fmt.Errorf("wait for kubelet to register node %s: %w", n.Name, err)
	}
	return nil
}

// withLogs adds the ends of the node's logs to err.
func (n *Node) withLogs(err error) error {
	var b strings.Builder
	fmt.Fprintf(&b, "%v", err)
	for _, name := range []string{"init", "containerd", "kubelet"} {
		fmt.Fprintf(&b, "\n--- %s:\n%s", name, lab.Tail(filepath.Join(n.Dir, "logs", name+".log"), 15))
	}
	return errors.New(b.String())
}

// hostIP returns the first global IPv4 address of an interface that is up,
// preferring eth0: kubelet's --node-ip (never loopback).
func hostIP() (string, error) {
	ifs, err := net.Interfaces()
	if err != nil {
		return "", fmt.Errorf("list network interfaces: %w", err)
	}
	slices.SortStableFunc(ifs, func(a, b net.Interface) int {
		if a.Name == "eth0" {
			return -1
		}
		if b.Name == "eth0" {
			return 1
		}
		return 0
	})
	for _, i := range ifs {
		if i.Flags&net.FlagUp == 0 || i.Flags&net.FlagLoopback != 0 {
			continue
		}
		addrs, err := i.Addrs()
		if err != nil {
			continue
		}
		for _, a := range addrs {
			if ipn, ok := a.(*net.IPNet); ok && ipn.IP.To4() != nil && ipn.IP.IsGlobalUnicast() {
				return ipn.IP.String(), nil
			}
		}
	}
	return "", errors.New("no global IPv4 address on any interface: kubelet needs one for --node-ip")
}
