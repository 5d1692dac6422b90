package agent_test

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime/pprof"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mountmedic/mountmedic/agent"
	"github.com/mountmedic/mountmedic/remount"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// The fault matrix at scale: a storage backend outage breaks every volume
// of a node at once. Each test lays out n broken pod volumes and 10 healthy
// pods, runs the agent (real API server, real mounts, real remount repairer)
// against a lab CSI node plugin, and checks outcomes only: every broken
// volume healed, the healthy ones untouched (same mounts, never reported),
// events within the node's budget, threads bounded. The benchmarks of
// bench_test.go time the same scenarios at a thousand volumes.

// tmpfsMagic is the f_type statfs reports for a tmpfs: what the lab CSI
// plugin stages.
const tmpfsMagic = 0x01021994

// labCSI is a CSI node plugin for the lab kubelet tree: NodeStageVolume
// mounts a fresh tmpfs on the staging path, NodePublishVolume bind-mounts
// it onto the target. Real mounts, made in the test's private mount
// namespace, so that the agent's re-stage and its verification act on real
// paths; it stands in for a driver that can stage a thousand volumes in
// seconds, which no FUSE driver here can.
type labCSI struct {
	csi.UnimplementedNodeServer
	stages, publishes atomic.Int64
	mu                sync.Mutex
	mounted           []string
}

func (d *labCSI) NodeGetCapabilities(context.Context, *csi.NodeGetCapabilitiesRequest) (*csi.NodeGetCapabilitiesResponse, error) {
	return &csi.NodeGetCapabilitiesResponse{Capabilities: []*csi.NodeServiceCapability{{
		Type: &csi.NodeServiceCapability_Rpc{Rpc: &csi.NodeServiceCapability_RPC{Type: csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME}},
	}}}, nil
}

func (d *labCSI) NodeGetInfo(context.Context, *csi.NodeGetInfoRequest) (*csi.NodeGetInfoResponse, error) {
	return &csi.NodeGetInfoResponse{NodeId: lab.DefaultNodeName}, nil
}

func (d *labCSI) NodeStageVolume(_ context.Context, req *csi.NodeStageVolumeRequest) (*csi.NodeStageVolumeResponse, error) {
	p := req.GetStagingTargetPath()
	if err := os.MkdirAll(p, 0o750); err != nil {
		return nil, err
	}
	if err := unix.Mount("labcsi", p, "tmpfs", 0, "size=1m"); err != nil {
		return nil, fmt.Errorf("mount tmpfs at %s: %w", p, err)
	}
	if err := os.Mkdir(filepath.Join(p, "sub"), 0o755); err != nil {
		return nil, err
	}
	d.record(p)
	d.stages.Add(1)
	return &csi.NodeStageVolumeResponse{}, nil
}

func (d *labCSI) NodePublishVolume(_ context.Context, req *csi.NodePublishVolumeRequest) (*csi.NodePublishVolumeResponse, error) {
	p := req.GetTargetPath()
	if err := os.MkdirAll(p, 0o750); err != nil {
		return nil, err
	}
	if err := unix.Mount(req.GetStagingTargetPath(), p, "", unix.MS_BIND, ""); err != nil {
		return nil, fmt.Errorf("bind %s at %s: %w", req.GetStagingTargetPath(), p, err)
	}
	d.record(p)
	d.publishes.Add(1)
	return &csi.NodePublishVolumeResponse{}, nil
}

func (d *labCSI) record(p string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.mounted = append(d.mounted, p)
}

// serveLabCSI serves a labCSI at the conventional socket of labDriver
// under the lab kubelet root, where the repairer finds it.
func (e *env) serveLabCSI() *labCSI {
	e.t.Helper()
	sock := filepath.Join(e.kubelet.Root(), "plugins", labDriver, "csi.sock")
	if err := os.MkdirAll(filepath.Dir(sock), 0o750); err != nil {
		e.t.Fatal(err)
	}
	ln, err := net.Listen("unix", sock)
	if err != nil {
		e.t.Fatalf("listen on %s: %v", sock, err)
	}
	d := &labCSI{}
	s := grpc.NewServer()
	csi.RegisterNodeServer(s, d)
	go s.Serve(ln)
	e.t.Cleanup(func() {
		s.Stop()
		d.mu.Lock()
		defer d.mu.Unlock()
		for i := len(d.mounted) - 1; i >= 0; i-- {
			_ = unix.Unmount(d.mounted[i], unix.MNT_DETACH)
		}
	})
	return d
}

// createPods creates n Running pods named prefix-<i> that mount the claim
// of v in container "app" with HostToContainer propagation (so a re-staged
// host mount reaches them without a live swap), a few at a time.
func (e *env) createPods(prefix string, v *volume, n int) []*corev1.Pod {
	e.t.Helper()
	out := make([]*corev1.Pod, n)
	errs := make(chan error, n)
	var wg sync.WaitGroup
	sem := make(chan struct{}, 16)
	h2c := corev1.MountPropagationHostToContainer
	for i := range n {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			ctx := context.Background()
			pod := &corev1.Pod{
				ObjectMeta: metav1.ObjectMeta{Namespace: testNamespace, Name: prefix + "-" + strconv.Itoa(i)},
				Spec: corev1.PodSpec{
					NodeName: e.node,
					Containers: []corev1.Container{{Name: "app", Image: "busybox",
						VolumeMounts: []corev1.VolumeMount{{Name: "data", MountPath: "/data", MountPropagation: &h2c}}}},
					Volumes: []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{
						PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: v.pvc.Name},
					}}},
				},
			}
			pod, err := e.admin.CoreV1().Pods(testNamespace).Create(ctx, pod, metav1.CreateOptions{})
			if err != nil {
				errs <- err
				return
			}
			now := metav1.Now()
			pod.Status = corev1.PodStatus{
				Phase:      corev1.PodRunning,
				Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: now}},
				ContainerStatuses: []corev1.ContainerStatus{{
					Name: "app", Ready: true, Image: "busybox", ImageID: "busybox",
					ContainerID: "containerd://" + fmt.Sprintf("%064x", i+1),
					State:       corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: now}},
				}},
			}
			if pod, err = e.admin.CoreV1().Pods(testNamespace).UpdateStatus(ctx, pod, metav1.UpdateOptions{}); err != nil {
				errs <- err
				return
			}
			out[i] = pod
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		e.t.Fatalf("create pods %s-*: %v", prefix, err)
	}
	return out
}

// scaleNode is a lab node with broken-to-be volumes and healthy ones.
type scaleNode struct {
	e      *env
	driver *labCSI
	// targets are the publish targets that the fault breaks.
	targets []string
	// daemon serves every volume the fault breaks.
	daemon *lab.FaultFS
	// healthy are the publish targets of the 10 pods that stay healthy,
	// with their mount IDs before the fault; healthyPods are those pods.
	healthy     map[string]int
	healthyPods []*corev1.Pod
	healthyFS   *lab.FaultFS
}

// newScaleNode lays out n pods on broken-to-be volumes: on one volume (one
// backend, one staging mount, n publish binds) when shared, else each on
// its own volume and FUSE connection (n backends), all served by one
// FaultFS daemon. Ten more pods have healthy volumes of their own, served by
// another daemon.
func newScaleNode(t testing.TB, n int, shared bool) *scaleNode {
	e := newEnv(t, nil)
	no := false
	if _, err := e.admin.StorageV1().CSIDrivers().Create(context.Background(), &storagev1.CSIDriver{
		ObjectMeta: metav1.ObjectMeta{Name: labDriver},
		Spec:       storagev1.CSIDriverSpec{AttachRequired: &no},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create CSIDriver: %v", err)
	}
	s := &scaleNode{e: e, driver: e.serveLabCSI(), healthy: make(map[string]int)}
	if shared {
		v := e.createVolume("shared", nil)
		s.daemon = lab.StartFaultFSMany(t, []string{v.staging})
		for _, pod := range e.createPods("shared", v, n) {
			s.targets = append(s.targets, e.kubelet.Publish(string(pod.UID), v.pv.Name, labDriver, v.handle, v.staging, false))
		}
	} else {
		vols := make([]*volume, n)
		stagings := make([]string, n)
		for i := range n {
			vols[i] = e.createVolume("b"+strconv.Itoa(i), nil)
			stagings[i] = vols[i].staging
		}
		s.daemon = lab.StartFaultFSMany(t, stagings)
		for i, v := range vols {
			pod := e.createPods("b"+strconv.Itoa(i), v, 1)[0]
			s.targets = append(s.targets, e.kubelet.Publish(string(pod.UID), v.pv.Name, labDriver, v.handle, v.staging, false))
		}
	}
	var vols []*volume
	var stagings []string
	for i := range 10 {
		v := e.createVolume("ok"+strconv.Itoa(i), nil)
		vols = append(vols, v)
		stagings = append(stagings, v.staging)
	}
	s.healthyFS = lab.StartFaultFSMany(t, stagings)
	for i, v := range vols {
		pod := e.createPods("ok"+strconv.Itoa(i), v, 1)[0]
		s.healthyPods = append(s.healthyPods, pod)
		pub := e.kubelet.Publish(string(pod.UID), v.pv.Name, labDriver, v.handle, v.staging, false)
		s.healthy[pub] = 0
	}
	return s
}

// snapshotHealthy records the mount IDs of the healthy publish targets.
func (s *scaleNode) snapshotHealthy(t testing.TB) {
	for p := range s.healthy {
		s.healthy[p] = topMountID(t, p)
	}
}

func topMountID(t testing.TB, path string) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	id := 0
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) > 4 && f[4] == path {
			n, _ := strconv.Atoi(f[0])
			id = max(id, n)
		}
	}
	return id
}

// healed counts the broken-to-be targets that now show a fresh lab CSI
// mount (tmpfs), each probed with statfs in parallel.
func (s *scaleNode) healed() int {
	var n atomic.Int64
	var wg sync.WaitGroup
	sem := make(chan struct{}, 8)
	for _, p := range s.targets {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			var st unix.Statfs_t
			if err := unix.Statfs(p, &st); err == nil && st.Type == tmpfsMagic {
				n.Add(1)
			}
		})
	}
	wg.Wait()
	return int(n.Load())
}

// checkHealthy fails for each healthy pod whose mount changed or that the
// agent reported on.
func (s *scaleNode) checkHealthy(t testing.TB) {
	for p, id := range s.healthy {
		if got := topMountID(t, p); got != id {
			t.Errorf("healthy publish target %s: mount %d became %d", p, id, got)
		}
		var st unix.Statfs_t
		if err := unix.Statfs(p, &st); err != nil || st.Type != lab.FUSEMagic {
			t.Errorf("healthy publish target %s: statfs %v, f_type %#x; want its FUSE mount answering", p, err, st.Type)
		}
	}
	for _, pod := range s.healthyPods {
		if evs := s.e.eventsOf(pod.UID); len(evs) > 0 {
			t.Errorf("healthy pod %s has %d events (first %s: %s), want none", pod.Name, len(evs), evs[0].Reason, evs[0].Note)
		}
	}
}

// pvGets counts the GETs of PersistentVolumes of a recorder's snapshot.
func pvGets(counts map[string]int) int {
	n := 0
	for k, v := range counts {
		if strings.HasPrefix(k, "GET /api/v1/persistentvolumes/") {
			n += v
		}
	}
	return n
}

// eventWrites counts the event writes of a recorder's snapshot.
func eventWrites(counts map[string]int) int {
	n := 0
	for k, v := range counts {
		if strings.Contains(k, "/apis/events.k8s.io/") && (strings.HasPrefix(k, "POST ") || strings.HasPrefix(k, "PATCH ")) {
			n += v
		}
	}
	return n
}

// scaleResult is what one scale run measured.
type scaleResult struct {
	// took is from the fault to every broken volume healed.
	took time.Duration
	// eventWrites counts the agent's event creates and patches from the
	// fault to one summary period after the heal.
	eventWrites int
	// threads before the agent started, and their peak during the run.
	threadsBefore, threadsPeak int
	// podGets and podLists count the agent's GETs of a pod by name and
	// its LISTs of the node's pods (the informer's first one included).
	podGets, podLists int
	// pvGets counts the agent's GETs of PVs from the fault on.
	pvGets int
	// remounted lists the paths the driver mounted more than once.
	remounted []string
	// split is where the time from the fault to the heal went.
	split faultSplit
	// cpu is the test process's CPU time (user + system) from the fault
	// to the heal: the agent's loop and repairs, and the lab driver's
	// mounts and the test's own checks, which run in the process too.
	cpu time.Duration
}

// processCPU is the test process's CPU time so far.
func processCPU(t testing.TB) time.Duration {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		t.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// profileFault writes a CPU profile of the fault window to
// $MOUNTMEDIC_SCALE_CPUPROFILE when set, to see where the repairs' CPU
// goes (go tool pprof -top -focus Restage); the returned func stops it.
func profileFault(t testing.TB) func() {
	path := os.Getenv("MOUNTMEDIC_SCALE_CPUPROFILE")
	if path == "" {
		return func() {}
	}
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		t.Fatal(err)
	}
	return func() { pprof.StopCPUProfile(); f.Close() }
}

// runScale breaks the node (dead or hung daemon), runs the agent (the
// agent's defaults, but for the probe interval and deadline, 1 s in tests;
// with defaults set, the agent's own; the API client's rate limits are the
// command's in both) and waits until every broken volume is
// healed. The 10 healthy pods' daemon answers every request 600 ms late
// (60 % of the test deadline, 30 % of the default one): slow, never hung.
func runScale(t testing.TB, n int, shared, hang, defaults bool) (*scaleNode, *runningAgent, scaleResult) {
	s := newScaleNode(t, n, shared)
	if qps, burst, ok := scaleAPILimits(t); ok {
		s.e.agentConfig.QPS, s.e.agentConfig.Burst = qps, burst
	}
	client, rec := s.e.countingClient()
	cfg := agent.DefaultConfig()
	cfg.NodeName, cfg.KubeletRoot, cfg.MetricsAddr, cfg.Version = s.e.node, s.e.kubelet.Root(), "", "test"
	if !defaults {
		cfg.ProbeInterval, cfg.ProbeTimeout = time.Second, time.Second
	}
	s.healthyFS.Delay(600 * time.Millisecond)
	var res scaleResult
	res.threadsBefore = threads(t)
	a := s.e.startAgent(cfg, s.e.withRepairer(cfg, remount.Config{}, agent.Deps{Client: client}))
	s.snapshotHealthy(t)
	time.Sleep(3 * time.Second) // a few cycles over the slow healthy daemon
	// A node's agent has run long before an outage: it has read the PVs
	// of its volumes ahead (5 a second). $MOUNTMEDIC_SCALE_COLD=1 breaks
	// the node without waiting, as if the agent had just started.
	if os.Getenv("MOUNTMEDIC_SCALE_COLD") != "1" {
		pvs := n + 10 // the broken volumes' and the healthy ones'
		if shared {
			pvs = 1 + 10
		}
		for deadline := time.Now().Add(time.Duration(pvs)*time.Second + time.Minute); pvGets(rec.snapshot()) < pvs; {
			if time.Now().After(deadline) {
				t.Fatalf("the agent read %d of the %d PVs ahead of any repair", pvGets(rec.snapshot()), pvs)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	before := eventWrites(rec.snapshot())
	pvsBefore := pvGets(rec.snapshot())
	if hang {
		s.daemon.Hang()
		t.Cleanup(func() {
			// The agent kills the daemon once it aborted every
			// connection the daemon served: nothing is left to release.
			if !s.daemon.Exited() {
				s.daemon.Release()
			}
		})
	} else {
		s.daemon.Kill()
	}
	stopProfile := profileFault(t)
	cpu0 := processCPU(t)
	start := time.Now()
	deadline := start.Add(15 * time.Minute)
	for {
		res.threadsPeak = max(res.threadsPeak, threads(t))
		h := s.healed()
		if h == n {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d broken volumes healed %s after the fault", h, n, time.Since(start).Round(time.Second))
		}
		time.Sleep(50 * time.Millisecond)
	}
	res.took = time.Since(start)
	res.cpu = processCPU(t) - cpu0
	healedAt := time.Now()
	stopProfile()
	time.Sleep(eventSummaryWait) // the agent's summary of held events
	// Every path the driver mounted more than once: a volume staged or
	// published again after its repair (by then it was healthy).
	s.driver.mu.Lock()
	mounts := map[string]int{}
	for _, p := range s.driver.mounted {
		mounts[p]++
	}
	s.driver.mu.Unlock()
	for p, c := range mounts {
		if c > 1 {
			res.remounted = append(res.remounted, fmt.Sprintf("%s (%d times)", p, c))
		}
	}
	sort.Strings(res.remounted)
	counts := rec.snapshot()
	res.eventWrites = eventWrites(counts) - before
	res.pvGets = pvGets(counts) - pvsBefore
	for k, v := range counts {
		switch {
		case k == "GET /api/v1/pods":
			res.podLists += v
		case strings.HasPrefix(k, "GET /api/v1/namespaces/") && strings.Contains(k, "/pods/"):
			res.podGets += v
		}
	}
	res.split = splitFault(rec.since(start), start, healedAt, s.e.agentConfig.QPS, s.e.agentConfig.Burst)
	t.Logf("%d volumes: %s", n, res.split)
	t.Logf("%d volumes (shared backend %v, hung %v, defaults %v): all healed %.2fs after the fault, %.2fs of the process's CPU; %d stages, %d publishes; %d event writes; threads %d before the agent, peak %d; %d pod GETs, %d pod LISTs, %d PV GETs after the fault",
		n, shared, hang, defaults, res.took.Seconds(), res.cpu.Seconds(), s.driver.stages.Load(), s.driver.publishes.Load(), res.eventWrites, res.threadsBefore, res.threadsPeak, res.podGets, res.podLists, res.pvGets)
	return s, a, res
}

// faultSplit is where the time from the fault to the heal went, from the
// agent's requests as they left its client's rate limiter.
type faultSplit struct {
	// detect is from the fault to the first repair request (a claim GET
	// or a LIST of the node's pods): the probe cycle's finding.
	detect time.Duration
	// limited is from the first repair request to the last claim GET;
	// floor is the least the client's token bucket allows for the
	// requests sent in that span (full at the start: burst of them at
	// once, then qps a second).
	limited, floor time.Duration
	// tail is from the last claim GET to the last volume healed.
	tail time.Duration
	// Requests in the limited span, by kind; eventsAfter are the event
	// writes after the last claim GET, up to the heal.
	claimGets, podLists, events, other, eventsAfter, listsAfter int
}

func (f faultSplit) String() string {
	return fmt.Sprintf("fault -> first repair request %.2fs; -> last claim GET %.2fs (token bucket floor %.2fs for %d claim GETs, %d pod LISTs, %d event writes, %d others); -> all healed %.2fs (%d event writes, %d pod LISTs meanwhile)",
		f.detect.Seconds(), f.limited.Seconds(), f.floor.Seconds(), f.claimGets, f.podLists, f.events, f.other, f.tail.Seconds(), f.eventsAfter, f.listsAfter)
}

// splitFault splits the span from the fault (start) to the heal by the
// agent's requests log (from start on).
func splitFault(log []recorded, start, healed time.Time, qps float32, burst int) faultSplit {
	var f faultSplit
	isClaim := func(k string) bool {
		return strings.HasPrefix(k, "GET /api/v1/namespaces/") && strings.Contains(k, "/persistentvolumeclaims/")
	}
	isEvent := func(k string) bool {
		return strings.Contains(k, "/apis/events.k8s.io/") && (strings.HasPrefix(k, "POST ") || strings.HasPrefix(k, "PATCH "))
	}
	first, last := -1, -1
	for i, r := range log {
		if first < 0 && (isClaim(r.key) || r.key == "GET /api/v1/pods") {
			first = i
		}
		if isClaim(r.key) {
			last = i
		}
	}
	if first < 0 || last < first {
		return f
	}
	f.detect = log[first].at.Sub(start)
	f.limited = log[last].at.Sub(log[first].at)
	f.tail = healed.Sub(log[last].at)
	for i, r := range log {
		switch {
		case i > last:
			if isEvent(r.key) && r.at.Before(healed) {
				f.eventsAfter++
			}
			if r.key == "GET /api/v1/pods" && r.at.Before(healed) {
				f.listsAfter++
			}
		case i < first:
		case isClaim(r.key):
			f.claimGets++
		case r.key == "GET /api/v1/pods":
			f.podLists++
		case isEvent(r.key):
			f.events++
		default:
			f.other++
		}
	}
	if n := last - first + 1; n > burst && qps > 0 {
		f.floor = time.Duration(float64(n-burst) / float64(qps) * float64(time.Second))
	}
	return f
}

// checkScale asserts the outcomes of a scale run.
func checkScale(t testing.TB, n int, hang bool, s *scaleNode, a *runningAgent, res scaleResult) {
	s.checkHealthy(t)
	// The node's budget: 25 at once, one a second, and one summary per
	// reason every 10 s (a handful of reasons).
	secs := res.took + eventSummaryWait
	if limit := 25 + int(secs.Seconds()) + 4*(1+int(secs/(10*time.Second))); res.eventWrites > limit {
		t.Errorf("%d event writes for %d broken volumes over %s, want at most %d (the node's budget)", res.eventWrites, n, secs.Round(time.Second), limit)
	}
	if hang && res.threadsPeak-res.threadsBefore > n+64 {
		t.Errorf("threads peaked at %d over %d before the agent for %d hung backends, want at most one per hung backend plus a constant", res.threadsPeak, res.threadsBefore, n)
	}
	// The runs of a burst read the node's pods with one shared LIST a
	// second (the agent's freshAge), never a GET per pod.
	if res.podGets > 0 {
		t.Errorf("%d GETs of pods by name for %d broken volumes, want none (the runs share LISTs of the node's pods)", res.podGets, n)
	}
	if limit := 2 + int(secs/time.Second); res.podLists > limit {
		t.Errorf("%d LISTs of the node's pods over %s, want at most %d (one a second, and the informer's)", res.podLists, secs.Round(time.Second), limit)
	}
	// Each broken volume is staged and published once: a repair never
	// comes back to a volume it healed (a probe stuck in the hung daemon
	// answers after the abort, with the replaced mount's error).
	for _, p := range res.remounted {
		t.Errorf("the driver mounted %s: re-staged or published again after its repair", p)
	}
	// The PVs were read ahead: a repair reads only the pods and claims.
	if res.pvGets > 0 && os.Getenv("MOUNTMEDIC_SCALE_COLD") != "1" {
		t.Errorf("%d GETs of PVs after the fault, want none (read ahead of the repairs)", res.pvGets)
	}
	if v, _ := a.metric(`mountmedic_repairs_total{result="success",tier="restage"}`); v < 1 {
		t.Errorf("no successful restage counted")
	}
}

// eventSummaryWait covers one summary period of the agent's event budget.
const eventSummaryWait = 11 * time.Second

func testScale(t *testing.T, n int, shared, hang bool) {
	s, a, res := runScale(t, n, shared, hang, false)
	checkScale(t, n, hang, s, a, res)
}

// TestScaleDeadVolumesOneBackend: one backend dies under n pods.
func TestScaleDeadVolumesOneBackend(t *testing.T) { testScale(t, scaleN(100), true, false) }

// TestScaleDeadBackends: n backends die at once, one pod each.
func TestScaleDeadBackends(t *testing.T) { testScale(t, scaleN(50), false, false) }

// TestScaleHungBackends: n backends hang at once, one pod each; a slow
// daemon beside them is never aborted.
func TestScaleHungBackends(t *testing.T) { testScale(t, scaleN(50), false, true) }

// BenchmarkScale times the fault matrix at a thousand volumes (n from
// $MOUNTMEDIC_SCALE_N), the agent at its defaults and with its API client's
// rate limits (--kube-api-qps, --kube-api-burst), as the command runs it: fault -> every volume healed
// (for hung backends: each connection aborted, re-staged and verified),
// the agent's event writes, and its threads. One iteration per case.
//
//	go test -run '^$' -bench Scale -benchtime 1x -timeout 60m ./agent
//
// $MOUNTMEDIC_SCALE_API=<qps>,<burst> runs the agent's client at other
// rate limits, for an A/B of them.
func BenchmarkScale(b *testing.B) {
	n := scaleN(1000)
	for _, c := range []struct {
		name         string
		shared, hang bool
	}{
		{"dead-one-backend", true, false},
		{"dead-backends", false, false},
		{"hung-backends", false, true},
	} {
		b.Run(fmt.Sprintf("%s/volumes=%d", c.name, n), func(b *testing.B) {
			var res scaleResult
			for range b.N {
				var s *scaleNode
				var a *runningAgent
				s, a, res = runScale(b, n, c.shared, c.hang, true)
				// The outcomes the tests check hold at this size too:
				// no volume staged twice, the healthy pods untouched,
				// the event and LIST budgets.
				checkScale(b, n, c.hang, s, a, res)
			}
			b.ReportMetric(res.took.Seconds(), "healed-s")
			b.ReportMetric(res.cpu.Seconds(), "cpu-s")
			b.ReportMetric(res.split.detect.Seconds(), "detect-s")
			b.ReportMetric(res.split.limited.Seconds(), "limited-s")
			b.ReportMetric(res.split.floor.Seconds(), "floor-s")
			b.ReportMetric(res.split.tail.Seconds(), "tail-s")
			b.ReportMetric(float64(res.eventWrites), "event-writes")
			b.ReportMetric(float64(res.threadsPeak-res.threadsBefore), "agent-threads-peak")
		})
	}
}

// scaleAPILimits are the agent client's rate limits from
// $MOUNTMEDIC_SCALE_API ("<qps>,<burst>", as --kube-api-qps and
// --kube-api-burst), for an A/B of them by hand; ok is false when unset
// (the command's defaults).
func scaleAPILimits(t testing.TB) (qps float32, burst int, ok bool) {
	v := os.Getenv("MOUNTMEDIC_SCALE_API")
	if v == "" {
		return 0, 0, false
	}
	q, b, found := strings.Cut(v, ",")
	fq, err1 := strconv.ParseFloat(q, 32)
	ib, err2 := strconv.Atoi(b)
	if !found || err1 != nil || err2 != nil || fq <= 0 || ib <= 0 {
		t.Fatalf("MOUNTMEDIC_SCALE_API=%q: want <qps>,<burst>, both positive, such as 100,200", v)
	}
	return float32(fq), ib, true
}

// scaleN is n, or $MOUNTMEDIC_SCALE_N when set (to run a test at another
// size by hand).
func scaleN(n int) int {
	if v, err := strconv.Atoi(os.Getenv("MOUNTMEDIC_SCALE_N")); err == nil && v > 0 {
		return v
	}
	return n
}
