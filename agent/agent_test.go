package agent_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/mountmedic/mountmedic/agent"
	"github.com/mountmedic/mountmedic/agent/coldpages"
	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/remount"
	"github.com/mountmedic/mountmedic/scripts/kubetest"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

func mustQuantity(s string) resource.Quantity { return resource.MustParse(s) }

// replicaSet creates a ReplicaSet object to own test pods (no controller
// runs it: the test creates its pods) and returns the owner reference.
func (e *env) replicaSet(name string, labels map[string]string) *metav1.OwnerReference {
	e.t.Helper()
	one := int32(1)
	rs := &appsv1.ReplicaSet{
		ObjectMeta: metav1.ObjectMeta{Namespace: testNamespace, Name: name},
		Spec: appsv1.ReplicaSetSpec{
			Replicas: &one,
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "app", Image: "busybox"}}},
			},
		},
	}
	rs, err := e.admin.AppsV1().ReplicaSets(testNamespace).Create(context.Background(), rs, metav1.CreateOptions{})
	if err != nil {
		e.t.Fatalf("create ReplicaSet: %v", err)
	}
	yes := true
	return &metav1.OwnerReference{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: rs.Name, UID: rs.UID, Controller: &yes, BlockOwnerDeletion: &yes}
}

// deadVolume lays out a volume of the lab driver for pod in the lab kubelet
// tree (staging FaultFS, publish bind, subPath bind of "sub"), then kills
// its FUSE daemon. It returns the publish path.
func (e *env) deadVolume(v *volume, pod *corev1.Pod) string {
	e.t.Helper()
	fs := lab.StartFaultFS(e.t, v.staging)
	if err := os.Mkdir(filepath.Join(fs.BackingDir(), "sub"), 0o755); err != nil {
		e.t.Fatal(err)
	}
	pub := e.kubelet.Publish(string(pod.UID), v.pv.Name, labDriver, v.handle, v.staging, false)
	e.kubelet.SubPath(string(pod.UID), v.pv.Name, "app", 1, filepath.Join(pub, "sub"))
	fs.Kill()
	return pub
}

// mountID returns the ID of the top mount at path in this process's table,
// 0 when nothing is mounted there.
func mountID(t *testing.T, path string) int {
	t.Helper()
	infos, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(path))
	if err != nil {
		t.Fatal(err)
	}
	id := 0
	for _, in := range infos {
		id = max(id, in.ID)
	}
	return id
}

func TestAgentDryRunReportsAndChangesNothing(t *testing.T) {
	e := newEnv(t, nil)
	labels := map[string]string{"app": "dry"}
	v := e.createVolume("dry", nil)
	pod := e.createPod("dry-0", v, podOptions{owner: e.replicaSet("dry", labels), labels: labels, subPath: "sub"})
	e.deadVolume(v, pod)

	cfg := e.config()
	cfg.DryRun = true
	a := e.startAgent(cfg, agent.Deps{})

	e.waitEvent(pod.UID, string(agent.ReasonVolumeBroken), "Disconnected", "[dry-run]")
	e.waitEvent(v.pvc.UID, string(agent.ReasonVolumeBroken), "Disconnected")
	e.waitEvent(pod.UID, string(agent.ReasonEvicting), "[dry-run] would evict")
	e.waitFor("the dry-run eviction in the metrics", func() (bool, error) {
		n, _ := a.metric(`mountmedic_evictions_total{result="dry_run"}`)
		return n >= 1, nil
	})
	for _, kind := range []string{"publish", "staging", "subpath"} {
		n, ok := a.metric(`mountmedic_stale_mounts{driver="` + labDriver + `",kind="` + kind + `",state="Disconnected"}`)
		if !ok || n != 1 {
			t.Errorf("mountmedic_stale_mounts for %s = %v (present %v), want 1", kind, n, ok)
		}
	}

	// Nothing changed: the pod is there and not terminating. (Without a
	// repairer no tier touches a mount: TestAgentDryRunDriverDown checks
	// the mounts.)
	got, err := e.admin.CoreV1().Pods(testNamespace).Get(context.Background(), pod.Name, metav1.GetOptions{})
	if err != nil || got.DeletionTimestamp != nil {
		t.Errorf("pod after a dry run: %v, deletion %v; want it untouched", err, got.DeletionTimestamp)
	}
	checkDryRunMarks(t, e, pod.UID)
}

// TestAgentDryRunDriverDown runs the agent in dry-run with a (dry-run)
// repairer while the volume's driver is not registered: it reports what a
// real run would do, wait for the driver, and changes no mount.
func TestAgentDryRunDriverDown(t *testing.T) {
	e := newEnv(t, nil)
	labels := map[string]string{"app": "dry"}
	v := e.createVolume("dry", nil)
	pod := e.createPod("dry-0", v, podOptions{owner: e.replicaSet("dry", labels), labels: labels, subPath: "sub"})
	pub := e.deadVolume(v, pod)
	before := mountID(t, pub)

	rep := e.dryRunRepairer()
	cfg := e.config()
	cfg.DryRun = true
	e.startAgent(cfg, agent.Deps{Repairer: rep})

	e.waitEvent(pod.UID, string(agent.ReasonVolumeBroken), "Disconnected", "[dry-run]")
	e.waitEvent(pod.UID, string(agent.ReasonDriverDown), "[dry-run]", labDriver)
	if after := mountID(t, pub); after != before {
		t.Errorf("publish target mount %d became %d in a dry run", before, after)
	}
	got, err := e.admin.CoreV1().Pods(testNamespace).Get(context.Background(), pod.Name, metav1.GetOptions{})
	if err != nil || got.DeletionTimestamp != nil {
		t.Errorf("pod after a dry run: %v, deletion %v; want it untouched", err, got.DeletionTimestamp)
	}
	checkDryRunMarks(t, e, pod.UID)
}

// checkDryRunMarks fails for every event about uid without the [dry-run]
// mark.
func checkDryRunMarks(t *testing.T, e *env, uid types.UID) {
	t.Helper()
	for _, r := range e.reasons(uid) {
		if !strings.Contains(r, "[dry-run]") {
			t.Errorf("dry-run event without the [dry-run] mark: %s", r)
		}
	}
}

func TestAgentEvictionWaitsForPodDisruptionBudget(t *testing.T) {
	e := newEnv(t, kubetest.DefaultControllers)
	ctx := context.Background()
	labels := map[string]string{"app": "web"}
	v := e.createVolume("web", nil)
	pod := e.createPod("web-0", v, podOptions{owner: e.replicaSet("web", labels), labels: labels})
	one := intstr.FromInt32(1)
	pdb, err := e.admin.PolicyV1().PodDisruptionBudgets(testNamespace).Create(ctx, &policyv1.PodDisruptionBudget{
		ObjectMeta: metav1.ObjectMeta{Namespace: testNamespace, Name: "web"},
		Spec:       policyv1.PodDisruptionBudgetSpec{MinAvailable: &one, Selector: &metav1.LabelSelector{MatchLabels: labels}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create PDB: %v", err)
	}
	e.waitFor("the disruption controller to count the pod", func() (bool, error) {
		p, err := e.admin.PolicyV1().PodDisruptionBudgets(testNamespace).Get(ctx, "web", metav1.GetOptions{})
		return err == nil && p.Status.ObservedGeneration == p.Generation && p.Status.CurrentHealthy == 1, err
	})
	e.deadVolume(v, pod)

	cfg := e.config()
	cfg.Tiers = remount.NewTierSet(remount.TierEvict)
	a := e.startAgent(cfg, agent.Deps{})

	e.waitEvent(pod.UID, string(agent.ReasonEvictionBlocked), "PodDisruptionBudget")
	if n, _ := a.metric(`mountmedic_evictions_total{result="blocked_by_pdb"}`); n < 1 {
		t.Errorf("mountmedic_evictions_total{blocked_by_pdb} = %v, want at least 1", n)
	}
	if p, err := e.admin.CoreV1().Pods(testNamespace).Get(ctx, pod.Name, metav1.GetOptions{}); err != nil || p.DeletionTimestamp != nil {
		t.Fatalf("pod evicted while its PodDisruptionBudget forbade it (err %v)", err)
	}

	// The budget allows one disruption: the next attempt evicts.
	zero := intstr.FromInt32(0)
	pdb, err = e.admin.PolicyV1().PodDisruptionBudgets(testNamespace).Get(ctx, pdb.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	pdb.Spec.MinAvailable = &zero
	if _, err := e.admin.PolicyV1().PodDisruptionBudgets(testNamespace).Update(ctx, pdb, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("relax PDB: %v", err)
	}
	e.waitEvent(pod.UID, string(agent.ReasonEvicting), "evicted the pod")
	e.waitFor("the pod to be terminating", func() (bool, error) {
		p, err := e.admin.CoreV1().Pods(testNamespace).Get(ctx, pod.Name, metav1.GetOptions{})
		return err == nil && p.DeletionTimestamp != nil, err
	})
	if n, _ := a.metric(`mountmedic_evictions_total{result="evicted"}`); n != 1 {
		t.Errorf("mountmedic_evictions_total{evicted} = %v, want 1", n)
	}
}

func TestAgentNeverEvictsUnownedPod(t *testing.T) {
	e := newEnv(t, nil)
	v := e.createVolume("lone", nil)
	pod := e.createPod("lone", v, podOptions{})
	e.deadVolume(v, pod)

	cfg := e.config()
	cfg.Tiers = remount.NewTierSet(remount.TierEvict, remount.TierDelete)
	a := e.startAgent(cfg, agent.Deps{})

	e.waitEvent(pod.UID, string(agent.ReasonNotRepaired), "no controller owner")
	e.waitFor("the refusal in the metrics", func() (bool, error) {
		n, _ := a.metric(`mountmedic_evictions_total{result="no_controller"}`)
		return n >= 1, nil
	})
	// Give the agent several more cycles: still there, never deleted.
	time.Sleep(time.Second)
	p, err := e.admin.CoreV1().Pods(testNamespace).Get(context.Background(), pod.Name, metav1.GetOptions{})
	if err != nil || p.DeletionTimestamp != nil {
		t.Fatalf("a pod without a controller was deleted or evicted (err %v)", err)
	}
}

func TestAgentHonoursClaimOptOut(t *testing.T) {
	e := newEnv(t, nil)
	labels := map[string]string{"app": "optout"}
	v := e.createVolume("optout", nil)
	v.pvc.Annotations = map[string]string{agent.OptOutAnnotation: "false"}
	var err error
	if v.pvc, err = e.admin.CoreV1().PersistentVolumeClaims(testNamespace).Update(context.Background(), v.pvc, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	pod := e.createPod("optout-0", v, podOptions{owner: e.replicaSet("optout", labels), labels: labels})
	e.deadVolume(v, pod)

	cfg := e.config()
	cfg.Tiers = remount.NewTierSet(remount.TierEvict)
	a := e.startAgent(cfg, agent.Deps{})

	e.waitEvent(pod.UID, string(agent.ReasonRepairOptedOut), agent.OptOutAnnotation)
	time.Sleep(time.Second)
	if n, _ := a.metric(`mountmedic_evictions_total{result="evicted"}`); n != 0 {
		t.Errorf("evicted %v pods of an opted-out claim, want 0", n)
	}
	// Still probed and counted.
	if n, _ := a.metric(`mountmedic_stale_mounts{driver="` + labDriver + `",kind="publish",state="Disconnected"}`); n != 1 {
		t.Errorf("opted-out broken volume not counted: stale_mounts = %v, want 1", n)
	}
}

// TestAgentAPIFootprint checks that the agent reads the API the way kubelet
// does: one list and watch of its own node's pods, each volume's PV once,
// nothing cluster-wide, and no steady stream of requests for healthy
// volumes.
func TestAgentAPIFootprint(t *testing.T) {
	e := newEnv(t, nil)
	for i := 0; i < 5; i++ {
		name := "ok-" + strconv.Itoa(i)
		v := e.createVolume(name, nil)
		pod := e.createPod(name, v, podOptions{})
		lab.StartFaultFS(t, v.staging)
		e.kubelet.Publish(string(pod.UID), v.pv.Name, labDriver, v.handle, v.staging, false)
	}
	client, rec := e.countingClient()
	cfg := e.config()
	// The executable's unused pages are given back all along (the
	// default is 30 s after start, then every 5 minutes): the agent
	// keeps its steady state, asking nothing of the API server.
	cfg.ReleaseCode = 300 * time.Millisecond
	var releases atomic.Int32
	var releaseErr atomic.Value
	release := func() (coldpages.Result, error) {
		res, err := coldpages.Release()
		if err == nil && res.Advised == 0 {
			err = fmt.Errorf("no mapping of the executable advised: %+v", res)
		}
		if err != nil {
			releaseErr.Store(err)
		}
		releases.Add(1)
		return res, err
	}
	a := e.startAgent(cfg, agent.Deps{Client: client, ReleaseCode: release})
	// The node condition's first write (a GET of its Node, then a PATCH of
	// its status) comes with the first cycle; it is written again only on a
	// change or every 5 minutes.
	// Each volume's PV is read once, ahead of any repair.
	nodePath := "/api/v1/nodes/" + e.node
	deadline := time.Now().Add(30 * time.Second)
	for (rec.snapshot()["PATCH "+nodePath+"/status"] == 0 || pvGets(rec.snapshot()) < 5) && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	start := rec.snapshot()
	time.Sleep(3 * time.Second) // ~30 probe cycles
	end := rec.snapshot()

	for key, n := range end {
		method, path, _ := strings.Cut(key, " ")
		if key == "GET "+nodePath && n == 1 {
			continue // the condition's transition time, read once
		}
		if strings.HasPrefix(path, "/api/v1/persistentvolumes/") && method == "GET" && n == 1 {
			continue // a volume's PV, read once ahead of any repair
		}
		if key == "GET /api/v1/events" && n == 1 {
			continue // the eviction budget's rebuild, once at start
		}
		if (method == "GET" || method == "WATCH") && path != "/api/v1/pods" {
			t.Errorf("agent read %s %d times; at steady state with healthy volumes it reads only its pods (and its Node once)", key, n)
		}
		if d := n - start[key]; d > 0 && method != "WATCH" {
			t.Errorf("%s: %d more requests during 3s of healthy steady state, want none", key, d)
		}
	}
	if end["PATCH "+nodePath+"/status"] != 1 {
		t.Errorf("node condition writes = %d, want 1 (healthy from the start)", end["PATCH "+nodePath+"/status"])
	}
	if n, _ := a.metric(`mountmedic_kubelet_mounts{kind="publish"}`); n != 5 {
		t.Errorf("mountmedic_kubelet_mounts{publish} = %v, want 5", n)
	}
	if n := releases.Load(); n < 2 {
		t.Errorf("the agent gave back its executable's unused pages %d times in over 3s, want one every %s", n, cfg.ReleaseCode)
	}
	if err := releaseErr.Load(); err != nil {
		t.Errorf("coldpages.Release in the agent: %v", err)
	}
	t.Logf("requests by the agent: %v", end)
}

// TestAgentHungMountsDoNotGrowThreads runs the agent over hung FUSE mounts
// for many probe cycles: each hung mount holds one blocked probe, and no
// cycle adds goroutines or threads on top.
func TestAgentHungMountsDoNotGrowThreads(t *testing.T) {
	e := newEnv(t, nil)
	const n = 100
	for i := 0; i < n; i++ {
		fs := lab.StartFaultFS(t, e.kubelet.StagingPath(labDriver, "hung-"+strconv.Itoa(i)))
		fs.Hang()
		t.Cleanup(fs.Abort)
	}
	cfg := e.config()
	cfg.ProbeTimeout = 50 * time.Millisecond
	base := threads(t)
	a := e.startAgent(cfg, agent.Deps{})
	e.waitFor("every mount to be seen hung", func() (bool, error) {
		v, _ := a.metric("mountmedic_hung_probes")
		return v == n, nil
	})
	time.Sleep(time.Second)
	g1, t1 := runtime.NumGoroutine(), threads(t)
	time.Sleep(3 * time.Second) // ~30 more cycles over the hung mounts
	g2, t2 := runtime.NumGoroutine(), threads(t)
	t.Logf("goroutines %d -> %d, threads %d (before the agent) -> %d -> %d over 3s with %d hung mounts", g1, g2, base, t1, t2, n)
	if g2 > g1+10 {
		t.Errorf("goroutines grew from %d to %d over 30 cycles of %d hung mounts", g1, g2, n)
	}
	if t2 > t1+4 {
		t.Errorf("threads grew from %d to %d over 30 cycles of %d hung mounts", t1, t2, n)
	}
	if t2-base > n+16 {
		t.Errorf("the agent added %d threads for %d hung mounts, want about one per hung mount plus a constant", t2-base, n)
	}
}

func threads(t testing.TB) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "Threads:"); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	t.Fatal("no Threads line in /proc/self/status")
	return 0
}

// TestAgentSeesShutdownWithoutResync shuts an ext4 volume down under the
// agent, which then counts it Shutdown within a few probe cycles: the
// shutdown shows only in the super options, which no mount-table
// notification reports, and the resync is far away.
func TestAgentSeesShutdownWithoutResync(t *testing.T) {
	lab.RequireBinary(t, "mkfs.ext4")
	e := newEnv(t, nil)
	v := e.createVolume("ext4", nil)
	pod := e.createPod("ext4-0", v, podOptions{})
	fs := lab.NewExt4(t, v.staging, 16)
	e.kubelet.Publish(string(pod.UID), v.pv.Name, labDriver, v.handle, v.staging, false)
	cfg := e.config()
	cfg.Resync = 10 * time.Minute
	cfg.Tiers = remount.TierSet(0)
	a := e.startAgent(cfg, agent.Deps{})
	if n, _ := a.metric(`mountmedic_stale_mounts{driver="` + labDriver + `",kind="publish",state="Shutdown"}`); n != 0 {
		t.Fatalf("stale mounts before the shutdown = %v, want 0", n)
	}
	fs.Shutdown()
	e.waitFor("the shutdown to be counted", func() (bool, error) {
		n, _ := a.metric(`mountmedic_stale_mounts{driver="` + labDriver + `",kind="publish",state="Shutdown"}`)
		return n == 1, nil
	})
}

// TestAgentFreesTerminatingPods deletes two pods whose volume is dead; no
// kubelet runs, so they stay Terminating. The agent lazily unmounts their
// dead mounts so that kubelet could finish, and with the opt-in
// force-delete tier force-deletes the one a controller owns once it is
// past its deadline; the one without an owner is never force-deleted.
func TestAgentFreesTerminatingPods(t *testing.T) {
	e := newEnv(t, nil)
	ctx := context.Background()
	labels := map[string]string{"app": "gone"}
	owned := e.createVolume("owned", nil)
	ownedPod := e.createPod("owned-0", owned, podOptions{owner: e.replicaSet("gone", labels), labels: labels, subPath: "sub"})
	ownedPub := e.deadVolume(owned, ownedPod)
	lone := e.createVolume("lone", nil)
	lonePod := e.createPod("lone-0", lone, podOptions{})
	lonePub := e.deadVolume(lone, lonePod)
	one := int64(1)
	for _, p := range []string{ownedPod.Name, lonePod.Name} {
		if err := e.admin.CoreV1().Pods(testNamespace).Delete(ctx, p, metav1.DeleteOptions{GracePeriodSeconds: &one}); err != nil {
			t.Fatalf("delete pod %s: %v", p, err)
		}
	}
	cfg := e.config()
	cfg.Tiers = remount.NewTierSet(remount.TierUnmount, remount.TierForceDelete)
	cfg.ForceDeleteAfter = time.Second
	e.startAgent(cfg, e.withRepairer(cfg, remount.Config{}, agent.Deps{}))

	e.waitEvent(ownedPod.UID, string(agent.ReasonVolumeRepaired), "lazily unmounted")
	e.waitEvent(lonePod.UID, string(agent.ReasonVolumeRepaired), "lazily unmounted")
	for _, pub := range []string{ownedPub, lonePub} {
		if id := mountID(t, pub); id != 0 {
			t.Errorf("%s is still mount %d after the unmount tier", pub, id)
		}
	}
	e.waitFor("the owned pod to be force-deleted", func() (bool, error) {
		_, err := e.admin.CoreV1().Pods(testNamespace).Get(ctx, ownedPod.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	})
	e.waitEvent(lonePod.UID, string(agent.ReasonNotRepaired), "no controller owner")
	if _, err := e.admin.CoreV1().Pods(testNamespace).Get(ctx, lonePod.Name, metav1.GetOptions{}); err != nil {
		t.Errorf("the pod without an owner was force-deleted: %v", err)
	}
}

// TestAgentLeavesFencedPodsAlone: a pod the failover heartbeat fenced (its
// node is cut off from the API server) is reported and never repaired or
// evicted, even though its volume is dead.
func TestAgentLeavesFencedPodsAlone(t *testing.T) {
	e := newEnv(t, nil)
	labels := map[string]string{"app": "fenced"}
	v := e.createVolume("fenced", nil)
	pod := e.createPod("fenced-0", v, podOptions{owner: e.replicaSet("fenced", labels), labels: labels})
	e.deadVolume(v, pod)
	cfg := e.config()
	cfg.Tiers = remount.NewTierSet(remount.TierEvict)
	a := e.startAgent(cfg, agent.Deps{Fenced: func(uid string) bool { return uid == string(pod.UID) }})
	e.waitEvent(pod.UID, string(agent.ReasonNotRepaired), "fenced")
	time.Sleep(time.Second)
	if n, _ := a.metric(`mountmedic_evictions_total{result="evicted"}`); n != 0 {
		t.Errorf("evicted %v fenced pods, want 0", n)
	}
}

// TestAgentWaitsOutKubeletsPublishWindow: kubelet writes vol_data.json
// before it calls NodePublishVolume. A publish target in that window is not
// a broken volume, and the agent must not re-stage a volume kubelet is
// setting up (it raced kubelet's subPath bind in the e2e); once the window
// passes with the target still unmounted, the agent reports it although no
// mount-table change says so. A Pending pod's unpublished target (kubelet
// publishing slower than the window) is left alone.
func TestAgentWaitsOutKubeletsPublishWindow(t *testing.T) {
	e := newEnv(t, nil)
	ctx := context.Background()
	labels := map[string]string{"app": "window"}
	v := e.createVolume("window", nil)
	lab.StartFaultFS(t, v.staging)
	pod := e.createPod("window-0", v, podOptions{owner: e.replicaSet("window", labels), labels: labels})
	target := e.kubelet.PreparePublish(string(pod.UID), v.pv.Name, labDriver, v.handle)
	// The window ends 4 s from now.
	e.kubelet.AgeVolData(target, probe.DefaultPublishGrace-4*time.Second)
	windowEnds := time.Now().Add(4 * time.Second)

	pv := e.createVolume("pending", nil)
	lab.StartFaultFS(t, pv.staging)
	pending := e.createPod("pending-0", pv, podOptions{owner: e.replicaSet("pending", labels), labels: labels})
	pending.Status = corev1.PodStatus{Phase: corev1.PodPending}
	pending, err := e.admin.CoreV1().Pods(testNamespace).UpdateStatus(ctx, pending, metav1.UpdateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	slow := e.kubelet.PreparePublish(string(pending.UID), pv.pv.Name, labDriver, pv.handle)
	e.kubelet.AgeVolData(slow, time.Minute)

	cfg := e.config()
	cfg.DryRun = true
	e.startAgent(cfg, agent.Deps{})
	ev := e.waitEvent(pod.UID, string(agent.ReasonVolumeBroken), "Missing")
	if at := ev.EventTime.Time; at.Before(windowEnds.Add(-time.Second)) {
		t.Errorf("the unpublished target was reported at %v, inside kubelet's publish window (until %v): %s", at, windowEnds, ev.Note)
	}
	// The Pending pod's target was past the window from the start, so its
	// report would have come first.
	if got := e.reasons(pending.UID); len(got) != 0 {
		t.Errorf("a Pending pod's publish target kubelet has not mounted yet got events %q, want none", got)
	}
}

// TestAgentDryRunGuardPlansOnce: a dry run says once that it would guard a
// running pod's publish target that lost its mount, counts it once
// although every probe cycle finds the target unguarded, and mounts
// nothing.
func TestAgentDryRunGuardPlansOnce(t *testing.T) {
	e := newEnv(t, nil)
	labels := map[string]string{"app": "dryguard"}
	v := e.createVolume("dryguard", nil)
	lab.StartFaultFS(t, v.staging)
	pod := e.createPod("dryguard-0", v, podOptions{owner: e.replicaSet("dryguard", labels), labels: labels})
	target := e.kubelet.PreparePublish(string(pod.UID), v.pv.Name, labDriver, v.handle)
	e.kubelet.AgeVolData(target, time.Minute)
	rep := e.dryRunRepairer()
	cfg := e.config()
	cfg.DryRun = true
	a := e.startAgent(cfg, agent.Deps{Repairer: rep})
	e.waitEvent(pod.UID, string(agent.ReasonVolumeGuarded), "[dry-run]", "would mount a read-only guard")
	// Later cycles find the target unguarded again.
	e.waitFor("three more probe cycles", func() (bool, error) {
		n, _ := a.metric(`mountmedic_scan_duration_seconds_count`)
		return n >= 4, nil
	})
	if n, _ := a.metric(`mountmedic_guards_total{result="dry_run"}`); n != 1 {
		t.Errorf("mountmedic_guards_total{result=dry_run} = %v, want 1", n)
	}
	if id := mountID(t, target); id != 0 {
		t.Errorf("the dry run mounted %d at %s", id, target)
	}
	n := 0
	for _, r := range e.reasons(pod.UID) {
		if strings.HasPrefix(r, string(agent.ReasonVolumeGuarded)) {
			n++
		}
	}
	if n != 1 {
		t.Errorf("%d VolumeGuarded events, want 1", n)
	}
}
