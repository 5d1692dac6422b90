package failover

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/utils/ptr"

	"github.com/mountmedic/mountmedic/scripts/kubetest"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// BenchmarkControllerMemory measures the memory of a real `mountmedic
// controller` process leading on a real kube-apiserver that holds N Nodes
// shaped like a kubelet's (addresses, capacity, five conditions, node info,
// 50 images, 20 volumes in use, labels, managedFields written by the API
// server), N kubelet Leases and N heartbeat Leases, after it has judged
// every node and seen every Lease renewed once. It reports the process's
// RSS and peak RSS (VmRSS, VmHWM) and the Go heap in use, and its RSS
// again once it gave back the pages of its executable it no longer uses
// (30 s after start, every Lease renewed once more). N is
// MOUNTMEDIC_FAILOVER_NODES (default 5000). Run it with
//
//	go test ./agent/failover -run '^$' -bench ControllerMemory -benchtime 1x -timeout 30m
func BenchmarkControllerMemory(b *testing.B) {
	n := 5000
	if v := os.Getenv("MOUNTMEDIC_FAILOVER_NODES"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n < 1 {
			b.Fatalf("MOUNTMEDIC_FAILOVER_NODES=%q: want a positive count", v)
		}
	}
	c := kubetest.Start(b, kubetest.Options{})
	deploy, err := filepath.Abs("../../deploy")
	if err != nil {
		b.Fatal(err)
	}
	for _, f := range []string{"namespace.yaml", "serviceaccount.yaml", "rbac.yaml", "controller/serviceaccount.yaml", "controller/rbac.yaml"} {
		if out, err := c.Kubectl("apply", "-f", filepath.Join(deploy, f)); err != nil {
			b.Fatalf("kubectl apply deploy/%s: %v\n%s", f, err, out)
		}
	}
	fast := rest.CopyConfig(c.Config)
	fast.QPS, fast.Burst = 5000, 5000
	admin, err := kubernetes.NewForConfig(fast)
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	start := time.Now()
	parallel(n, 32, func(i int) error { return createSimNode(ctx, admin, i) })
	b.Logf("created %d nodes with status, %d kubelet Leases, %d heartbeat Leases in %s", n, n, n, time.Since(start).Round(time.Second))

	bin := filepath.Join(b.TempDir(), "mountmedic")
	build := exec.Command("go", "build", "-o", bin, "./cmd/mountmedic")
	build.Dir = "../.."
	if out, err := build.CombinedOutput(); err != nil {
		b.Fatalf("go build ./cmd/mountmedic: %v\n%s", err, out)
	}
	kubeconfig := saKubeconfig(b, c, agentNS, "mountmedic-controller")
	ports, err := freePort()
	if err != nil {
		b.Fatal(err)
	}
	metricsAddr := fmt.Sprintf("127.0.0.1:%d", ports)
	cmd := exec.Command(bin, "controller", "--kubeconfig="+kubeconfig, "--metrics-addr="+metricsAddr, "--failover-identity=bench", "-v=0")
	cmd.Env = append(os.Environ(), "POD_NAMESPACE="+agentNS)
	logf, err := os.Create(filepath.Join(b.TempDir(), "controller.log"))
	if err != nil {
		b.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	b.ResetTimer()
	started := time.Now()
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	if err := waitFor(ctx, 10*time.Minute, func(context.Context) (bool, error) {
		v, err := scrape(metricsAddr, "mountmedic_failover_nodes_judged")
		return v == float64(n), err
	}); err != nil {
		b.Fatalf("wait for the controller to judge %d nodes: %v", n, err)
	}
	synced := time.Since(started)
	// Every Lease renewed once, as kubelets and agents do every 10 s.
	parallel(n, 32, func(i int) error { return renewSimLeases(ctx, admin, i) })
	time.Sleep(5 * time.Second)
	b.StopTimer()

	rss, hwm := procStatus(b, cmd.Process.Pid)
	heap, err := scrape(metricsAddr, "go_memstats_heap_inuse_bytes")
	if err != nil {
		b.Fatal(err)
	}
	// The controller gives back the pages of its executable it no longer
	// uses 30 s after start (--release-code-interval): its RSS after
	// that, every Lease renewed once more.
	time.Sleep(releaseCodeFirst + 2*time.Second - time.Since(started))
	parallel(n, 32, func(i int) error { return renewSimLeases(ctx, admin, i) })
	time.Sleep(5 * time.Second)
	released, _ := procStatus(b, cmd.Process.Pid)
	b.ReportMetric(float64(n), "nodes")
	b.ReportMetric(rss/(1<<20), "rss-MiB")
	b.ReportMetric(hwm/(1<<20), "peak-rss-MiB")
	b.ReportMetric(heap/(1<<20), "heap-inuse-MiB")
	b.ReportMetric(released/(1<<20), "rss-released-MiB")
	b.Logf("controller leading %d nodes: judged all %s after start; RSS %.1f MiB, peak RSS %.1f MiB, Go heap in use %.1f MiB; RSS %.1f MiB after it gave back its executable's unused pages",
		n, synced.Round(100*time.Millisecond), rss/(1<<20), hwm/(1<<20), heap/(1<<20), released/(1<<20))
	full, _ := admin.CoreV1().Nodes().Get(ctx, simNodeName(0), metav1.GetOptions{})
	if full != nil {
		stripped, _ := stripNode(full)
		b.Logf("one node as the API server serves it: %d bytes of protobuf; as the controller keeps it: %d bytes", full.Size(), stripped.(*corev1.Node).Size())
	}
}

func simNodeName(i int) string { return fmt.Sprintf("sim-%05d", i) }

// parallel runs f(0..n-1) on workers goroutines; errors are retried once
// and then reported by panicking in the benchmark's goroutine.
func parallel(n, workers int, f func(int) error) {
	var wg sync.WaitGroup
	next := make(chan int)
	var mu sync.Mutex
	var first error
	for range workers {
		wg.Go(func() {
			for i := range next {
				if err := f(i); err != nil {
					if err = f(i); err != nil {
						mu.Lock()
						if first == nil {
							first = err
						}
						mu.Unlock()
					}
				}
			}
		})
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	if first != nil {
		panic(first)
	}
}

// createSimNode creates node i as its kubelet registers it and posts its
// status, and its kubelet and heartbeat Leases.
func createSimNode(ctx context.Context, cs kubernetes.Interface, i int) error {
	name := simNodeName(i)
	node, err := cs.CoreV1().Nodes().Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		node, err = cs.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{
			corev1.LabelHostname: name, corev1.LabelOSStable: "linux", corev1.LabelArchStable: "amd64",
			corev1.LabelTopologyZone: fmt.Sprintf("zone-%d", i%3), corev1.LabelTopologyRegion: "region-1",
			corev1.LabelInstanceTypeStable: "m5.2xlarge", "node.kubernetes.io/pool": "general",
		}, Annotations: map[string]string{"node.alpha.kubernetes.io/ttl": "0", "volumes.kubernetes.io/controller-managed-attach-detach": "true"}},
			Spec: corev1.NodeSpec{PodCIDR: fmt.Sprintf("10.%d.%d.0/24", i/256, i%256), ProviderID: "aws:///zone/i-" + name}}, metav1.CreateOptions{})
		if err != nil {
			return err
		}
	}
	now := metav1.Now()
	res := corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("8"), corev1.ResourceMemory: resource.MustParse("32Gi"),
		corev1.ResourcePods: resource.MustParse("110"), corev1.ResourceEphemeralStorage: resource.MustParse("100Gi")}
	node.Status.Capacity, node.Status.Allocatable = res, res
	node.Status.Addresses = []corev1.NodeAddress{{Type: corev1.NodeInternalIP, Address: fmt.Sprintf("10.0.%d.%d", i/256, i%256)},
		{Type: corev1.NodeHostName, Address: name}, {Type: corev1.NodeInternalDNS, Address: name + ".ec2.internal"}}
	for _, t := range []corev1.NodeConditionType{corev1.NodeMemoryPressure, corev1.NodeDiskPressure, corev1.NodePIDPressure, corev1.NodeNetworkUnavailable} {
		node.Status.Conditions = append(node.Status.Conditions, corev1.NodeCondition{Type: t, Status: corev1.ConditionFalse, Reason: "KubeletHasSufficient" + string(t),
			Message: "kubelet has sufficient resources", LastHeartbeatTime: now, LastTransitionTime: now})
	}
	node.Status.Conditions = append(node.Status.Conditions, corev1.NodeCondition{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady",
		Message: "kubelet is posting ready status", LastHeartbeatTime: now, LastTransitionTime: now})
	node.Status.NodeInfo = corev1.NodeSystemInfo{MachineID: fmt.Sprintf("%032x", i), SystemUUID: fmt.Sprintf("ec2%029x", i), BootID: fmt.Sprintf("%032x", i+1),
		KernelVersion: "6.1.0-amd64", OSImage: "Debian GNU/Linux 12 (bookworm)", ContainerRuntimeVersion: "containerd://1.7.24",
		KubeletVersion: "v1.37.1", OperatingSystem: "linux", Architecture: "amd64"}
	for j := range 50 {
		img := fmt.Sprintf("registry.example.com/team-%d/service-%d", j%7, j)
		node.Status.Images = append(node.Status.Images, corev1.ContainerImage{
			Names:     []string{img + "@sha256:" + fmt.Sprintf("%064x", j), img + ":v1." + strconv.Itoa(j)},
			SizeBytes: int64(50+j) << 20})
	}
	for j := range 20 {
		v := corev1.UniqueVolumeName(fmt.Sprintf("kubernetes.io/csi/ebs.csi.aws.com^vol-%s-%02d", name, j))
		node.Status.VolumesInUse = append(node.Status.VolumesInUse, v)
		node.Status.VolumesAttached = append(node.Status.VolumesAttached, corev1.AttachedVolume{Name: v, DevicePath: ""})
	}
	if _, err := cs.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{}); err != nil {
		return err
	}
	micro := metav1.NowMicro()
	for _, l := range []*coordinationv1.Lease{
		{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: corev1.NamespaceNodeLease},
			Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To(name), LeaseDurationSeconds: ptr.To[int32](40), RenewTime: &micro}},
		{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: agentNS, Labels: map[string]string{HeartbeatLabel: HeartbeatLabelValue}},
			Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To("mountmedic-" + name), LeaseDurationSeconds: ptr.To[int32](30), RenewTime: &micro}},
	} {
		if _, err := cs.CoordinationV1().Leases(l.Namespace).Create(ctx, l, metav1.CreateOptions{}); err != nil && !strings.Contains(err.Error(), "already exists") {
			return err
		}
	}
	return nil
}

// renewSimLeases renews node i's kubelet and heartbeat Leases once.
func renewSimLeases(ctx context.Context, cs kubernetes.Interface, i int) error {
	for _, ns := range []string{corev1.NamespaceNodeLease, agentNS} {
		l, err := cs.CoordinationV1().Leases(ns).Get(ctx, simNodeName(i), metav1.GetOptions{})
		if err != nil {
			return err
		}
		now := metav1.NowMicro()
		l.Spec.RenewTime = &now
		if _, err := cs.CoordinationV1().Leases(ns).Update(ctx, l, metav1.UpdateOptions{}); err != nil {
			return err
		}
	}
	return nil
}

// saKubeconfig writes a kubeconfig with a token of the ServiceAccount.
func saKubeconfig(b testing.TB, c *kubetest.Cluster, ns, name string) string {
	rc := c.ServiceAccountConfig(b, ns, name)
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["kubetest"] = &clientcmdapi.Cluster{Server: rc.Host, CertificateAuthorityData: rc.CAData}
	cfg.AuthInfos[name] = &clientcmdapi.AuthInfo{Token: rc.BearerToken}
	cfg.Contexts["kubetest"] = &clientcmdapi.Context{Cluster: "kubetest", AuthInfo: name}
	cfg.CurrentContext = "kubetest"
	path := filepath.Join(b.TempDir(), "kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		b.Fatal(err)
	}
	return path
}

func freePort() (int, error) {
	ports, err := lab.FreePorts(1)
	if err != nil {
		return 0, err
	}
	return ports[0], nil
}

// scrape reads one unlabelled gauge from a /metrics endpoint.
func scrape(addr, name string) (float64, error) {
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			return strconv.ParseFloat(strings.TrimSpace(v), 64)
		}
	}
	return 0, fmt.Errorf("no %s in the metrics of %s", name, addr)
}

// procStatus reads a process's VmRSS and VmHWM in bytes.
func procStatus(b testing.TB, pid int) (rss, hwm float64) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		b.Fatal(err)
	}
	for _, line := range strings.Split(string(data), "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		kb, _ := strconv.ParseFloat(f[1], 64)
		switch f[0] {
		case "VmRSS:":
			rss = kb * 1024
		case "VmHWM:":
			hwm = kb * 1024
		}
	}
	return rss, hwm
}
