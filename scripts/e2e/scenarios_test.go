package e2e_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/utils/ptr"

	"github.com/mountmedic/mountmedic/agent/status"
	"github.com/mountmedic/mountmedic/scripts/e2e"
)

// A scenario runs the agent with its flags (added to deploy/'s) and then,
// once per run, its own workload through a fault.
type scenario struct {
	name string
	args []string
	// mounter is the FUSE daemon of the workload's volume: s3fs when
	// empty, or rclone (k8s-csi-s3's mounter attribute).
	mounter string
	run     func(t *testing.T, e *env, ns string)
}

var scenarios = []scenario{
	{name: "live", run: liveScenario},
	{name: "restart", args: []string{"--tiers=restage,restart,evict,unmount"}, run: restartScenario},
	// Runs repeat within the eviction window: lift the per-node budget.
	{name: "evict", args: []string{"--tiers=restage,evict,unmount", "--max-evictions=100"}, run: evictScenario},
	{name: "hung", run: hungScenario},
	{name: "driver-down", run: driverDownScenario},
	// The same on a second FUSE daemon, rclone; its hung daemon, woken up
	// after the repair, unmounts the re-staged staging mount by its path.
	{name: "live-rclone", mounter: "rclone", run: liveScenario},
	{name: "hung-rclone", mounter: "rclone", run: hungScenario},
	{name: "driver-down-rclone", mounter: "rclone", run: driverDownScenario},
	// 15 FUSE daemons die (or hang) at once, one shared by 4 pods, beside
	// 10 healthy volumes; 2 of the 15 opted out (many_test.go).
	{name: "many", run: manyScenario},
	{name: "many-hung", run: manyHungScenario},
	// A publish target loses its mount while the plugin is down; its
	// last part SIGKILLs the agent, and deploys it again.
	{name: "guard", run: guardScenario},
	{name: "dry-run", args: []string{"--dry-run"}, run: dryRunScenario},
	// The naive way runs while the agent only watches (dry run).
	{name: "naive", args: []string{"--dry-run"}, run: naiveScenario},
	{name: "steady", run: steadyScenario},
	// A second, simulated node dies; the duty's defaults (fence window 30 s
	// + 15 s, kubelet grace 40 s) set the pace.
	{name: "failover", args: []string{"--failover"}, run: failoverScenario},
	// The real node's agent is cut off the API server alone and fences the
	// node (it deploys itself behind a proxy the test cuts).
	{name: "fence", args: []string{"--failover"}, run: fenceScenario},
	// The real node is partitioned (kubelet and agent) while a pod writes;
	// the controller moves it to a simulated node in each mode, with and
	// without a flood of the peer endpoint; the bucket says whether the
	// old pod wrote after the replacement's first write.
	{name: "partition", args: []string{"--failover"}, run: partitionScenario},
}

// pluginDown is how long the node plugin stays down in a plugin-crash
// scenario: a DaemonSet's crashed pod is back in about that time.
const pluginDown = time.Second

// healBound bounds every wait for a heal: a heal later than this is a
// failure (a miss in the figures), not a slow run.
const healBound = 3 * time.Minute

// outage is one crash of the node plugin, as the test saw it.
type outage struct {
	start time.Time // the plugin was killed
	bad   time.Time // the container logged its first failed read
	back  time.Time // the restarted plugin answers on its socket
}

// crash kills the node plugin (its whole process tree: s3driver and every
// s3fs), waits until the container sees the failure, and starts the plugin
// again down after the kill (never, when down is 0: the caller does).
func (e *env) crash(t *testing.T, ctx context.Context, w *wl, pod *corev1.Pod, down time.Duration) outage {
	t.Helper()
	o := outage{start: time.Now()}
	e.n.Driver.Kill()
	var err error
	if o.bad, err = w.WaitLogTime(ctx, pod, "bad", o.start); err != nil {
		t.Fatal(err)
	}
	if down == 0 {
		return o
	}
	time.Sleep(time.Until(o.start.Add(down)))
	o.back = e.bringBack(t)
	return o
}

// bringBack restarts the node plugin and returns when it answers.
func (e *env) bringBack(t *testing.T) time.Time {
	t.Helper()
	if err := e.n.Driver.Restart(); err != nil {
		t.Fatal(err)
	}
	return time.Now()
}

// detected waits for the agent's VolumeBroken event on the workload and
// records fault -> detected.
func (e *env) detected(t *testing.T, ctx context.Context, scenario, ns string, o outage) time.Time {
	t.Helper()
	at, ev, err := e.agent.WaitEvent(ctx, ns, "VolumeBroken", o.start)
	if err != nil {
		t.Fatal(err)
	}
	e.figs.Duration(scenario, "fault -> detected", at.Sub(o.start))
	t.Logf("detected %s after the fault: %s", at.Sub(o.start).Round(time.Millisecond), ev.Note)
	return at
}

// healed waits for the container (of pod, or of the workload's pod that
// replaced it) to read both mounts again after the outage, and records
// driver back -> healed and fault -> healed.
func (e *env) healed(t *testing.T, ctx context.Context, scenario string, w *wl, pod *corev1.Pod, o outage) time.Time {
	t.Helper()
	hctx, cancel := context.WithTimeout(ctx, healBound)
	defer cancel()
	at, err := w.WaitLogTime(hctx, pod, "ok", o.bad)
	if err != nil {
		e.figs.Miss(scenario, "driver back -> healed", "s")
		t.Fatalf("not healed within %s: %v\n%s\nagent log:\n%s", healBound, err, w.Describe(ctx), e.agent.LogTail(30))
	}
	if !o.back.IsZero() {
		e.figs.Duration(scenario, "driver back -> healed", at.Sub(o.back))
	}
	e.figs.Duration(scenario, "fault -> healed", at.Sub(o.start))
	t.Logf("healed %s after the fault", at.Sub(o.start).Round(time.Millisecond))
	return at
}

// metric scrapes one summed sample of the agent's metrics.
func (e *env) metric(t *testing.T, ctx context.Context, name string, labels ...string) float64 {
	t.Helper()
	m, err := e.agent.Metrics(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return e2e.Sum(m, name, labels...)
}

// samePod checks that the workload still has its one pod, with its files
// readable, and returns its current state.
func samePod(t *testing.T, ctx context.Context, w *wl, before *corev1.Pod) *corev1.Pod {
	t.Helper()
	after := w.pod(t, ctx)
	if after.UID != before.UID {
		t.Fatalf("pod UID = %s, want %s (the pod was replaced)", after.UID, before.UID)
	}
	return after
}

// liveScenario: the plugin crashes and is back a second later; the agent
// re-stages the volume and swaps the fresh mount into the running container.
func liveScenario(t *testing.T, e *env, ns string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	w := e.workload(t, ctx, ns)
	pod := w.pod(t, ctx)
	swaps := e.metric(t, ctx, "mountmedic_repairs_total", `tier="liveswap"`, `result="success"`)

	o := e.crash(t, ctx, w, pod, pluginDown)
	e.detected(t, ctx, e.scenario, ns, o)
	e.healed(t, ctx, e.scenario, w, pod, o)

	after := samePod(t, ctx, w, pod)
	if got, want := restarts(after), restarts(pod); got != want {
		t.Errorf("container restarts = %d, want %d (live tier: no restart)", got, want)
	}
	if got := e.metric(t, ctx, "mountmedic_repairs_total", `tier="liveswap"`, `result="success"`); got <= swaps {
		t.Errorf("mountmedic_repairs_total{tier=liveswap,result=success} = %v, want more than %v", got, swaps)
	}
	e.statusAfterHeal(t, ctx, o)
}

// statusAfterHeal reads the cluster view (mountmedic status) of the node
// from the real API server: its volumes healthy again per the condition
// the agent keeps on its Node, the last repair the one just seen.
func (e *env) statusAfterHeal(t *testing.T, ctx context.Context, o outage) {
	t.Helper()
	var row status.Node
	err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		v, err := status.Read(ctx, e.c.Client, status.Options{Namespace: "mountmedic", Nodes: []string{e.n.Name},
			HeartbeatInterval: 10 * time.Second, FenceAfter: 30 * time.Second, StaleAfter: 15 * time.Minute})
		if err != nil || len(v.Nodes) != 1 {
			return false, err
		}
		row = v.Nodes[0]
		return row.Volumes.State == "healthy" && row.LastRepair != nil && row.LastRepair.Outcome == "repaired" && !row.LastRepair.At.Before(o.start.Truncate(time.Second)), nil
	})
	if err != nil {
		t.Errorf("mountmedic status of %s after the heal = %+v (last repair %+v), want volumes healthy and the repair just seen: %v", e.n.Name, row.Volumes, row.LastRepair, err)
	}
}

// restartScenario: live swap off; the agent re-stages and restarts the
// container, which kubelet starts again on the fresh mount.
func restartScenario(t *testing.T, e *env, ns string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	w := e.workload(t, ctx, ns)
	pod := w.pod(t, ctx)

	o := e.crash(t, ctx, w, pod, pluginDown)
	e.detected(t, ctx, "restart", ns, o)
	e.healed(t, ctx, "restart", w, pod, o)

	var after *corev1.Pod
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		after = samePod(t, ctx, w, pod)
		return restarts(after) == restarts(pod)+1, nil
	})
	if err != nil {
		t.Errorf("container restarts = %d, want %d (restart tier: one restart)", restarts(after), restarts(pod)+1)
	}
}

// evictScenario: live swap and restart off; the agent re-stages and evicts
// the pod. A PodDisruptionBudget at its limit holds the eviction (the agent
// says so in an event) until the budget is lifted.
func evictScenario(t *testing.T, e *env, ns string) {
	ctx, cancel := context.WithTimeout(context.Background(), 6*time.Minute)
	defer cancel()
	w := e.workload(t, ctx, ns)
	pod := w.pod(t, ctx)
	pdbs := e.c.Client.PolicyV1().PodDisruptionBudgets(ns)
	pdb := &policyv1.PodDisruptionBudget{
		ObjectMeta: metav1.ObjectMeta{Name: "reader", Namespace: ns},
		Spec: policyv1.PodDisruptionBudgetSpec{
			MinAvailable: ptr.To(intstr.FromInt32(1)),
			Selector:     &metav1.LabelSelector{MatchLabels: map[string]string{"app": w.Name}},
		},
	}
	if _, err := pdbs.Create(ctx, pdb, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		got, err := pdbs.Get(ctx, pdb.Name, metav1.GetOptions{})
		return err == nil && got.Status.ObservedGeneration == got.Generation && got.Status.CurrentHealthy == 1 && got.Status.DisruptionsAllowed == 0, nil
	})
	if err != nil {
		t.Fatalf("PodDisruptionBudget never reached its limit (1 healthy, 0 disruptions allowed): %v", err)
	}

	o := e.crash(t, ctx, w, pod, pluginDown)
	e.detected(t, ctx, "evict", ns, o)
	blocked, ev, err := e.agent.WaitEvent(ctx, ns, "EvictionBlocked", o.start)
	if err != nil {
		t.Fatal(err)
	}
	e.figs.Duration("evict", "fault -> eviction blocked (PDB)", blocked.Sub(o.start))
	t.Logf("eviction blocked: %s", ev.Note)
	if cur := w.current(t, ctx); cur.UID != pod.UID {
		t.Fatalf("pod %s replaced while its PodDisruptionBudget forbids it", pod.Name)
	}

	released := time.Now()
	if err := pdbs.Delete(ctx, pdb.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	ectx, ecancel := context.WithTimeout(ctx, 2*time.Minute)
	defer ecancel()
	if _, _, err := e.agent.WaitEvent(ectx, ns, "Evicting", released); err != nil {
		e.figs.Miss("evict", "budget lifted -> new pod reads", "s")
		t.Fatalf("the agent did not evict once the budget allowed it: %v", err)
	}
	hctx, hcancel := context.WithTimeout(ctx, healBound)
	defer hcancel()
	next, err := w.WaitRunning(hctx, string(pod.UID))
	if err != nil {
		e.figs.Miss("evict", "budget lifted -> new pod reads", "s")
		t.Fatalf("no replacement pod ran: %v\n%s\nagent log:\n%s", err, w.Describe(ctx), e.agent.LogTail(30))
	}
	ok, err := w.WaitLogTime(hctx, next, "ok", released)
	if err != nil {
		e.figs.Miss("evict", "budget lifted -> new pod reads", "s")
		t.Fatalf("replacement pod %s never read its files: %v\n%s", next.Name, err, w.Describe(ctx))
	}
	e.figs.Duration("evict", "budget lifted -> new pod reads", ok.Sub(released))
	if err := w.ReadFiles(ctx, next); err != nil {
		t.Fatal(err)
	}
}

// hungScenario: the volume's FUSE daemon hangs (SIGSTOP) instead of dying;
// the agent sees the probe pass its deadline, aborts the connection through
// fusectl and heals the volume; the driver never went away.
func hungScenario(t *testing.T, e *env, ns string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	w := e.workload(t, ctx, ns)
	pod := w.pod(t, ctx)
	pid, err := daemonOf(e.mounterName(), w.Handle)
	if err != nil {
		t.Fatal(err)
	}
	stalls := e.metric(t, ctx, "mountmedic_stall_probes_total")
	o := outage{start: time.Now()}
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatalf("stop %s (pid %d): %v", e.mounterName(), pid, err)
	}
	t.Cleanup(func() { _ = syscall.Kill(pid, syscall.SIGKILL) })
	detected := e.detected(t, ctx, e.scenario, ns, o)
	// Who found the hang: the stall watch (a probe it started on a
	// request waiting in the connection) or a probe cycle of its own.
	stalls = e.metric(t, ctx, "mountmedic_stall_probes_total") - stalls
	e.figs.Value(e.scenario, "stall-watch probes, fault -> detected", "", stalls)
	t.Logf("the stall watch started %v probes between the fault and the detection", stalls)
	// The container's read blocks in the hung daemon; only the abort ends it
	// (ECONNABORTED): the "bad" line proves the agent aborted the connection.
	if o.bad, err = w.WaitLogTime(ctx, pod, "bad", o.start); err != nil {
		t.Fatal(err)
	}
	e.figs.Duration(e.scenario, "hang -> aborted", o.bad.Sub(o.start))
	healed := e.healed(t, ctx, e.scenario, w, pod, o)
	e.fromBlockedRead(t, w, pod, o, detected, healed)
	if after := samePod(t, ctx, w, pod); restarts(after) != restarts(pod) {
		t.Errorf("container restarts = %d, want %d (live tier)", restarts(after), restarts(pod))
	}
	if e.mounter == "rclone" {
		e.wakeStaleDaemon(t, ctx, w, pod, pid)
	}
}

// fromBlockedRead records the hang as the workload saw it: from the start
// of its first read that blocked on the stopped daemon (a read the
// container logged as slow after the stop) to the detection and to the
// heal. A read that began before the stop waited on the hang only from
// the stop: its start counts as the stop's.
func (e *env) fromBlockedRead(t *testing.T, w *wl, pod *corev1.Pod, o outage, detected, healed time.Time) {
	t.Helper()
	slow, err := w.SlowReads(pod, o.start)
	if err != nil || len(slow) == 0 {
		e.figs.Miss(e.scenario, "first blocked read -> healed", "s")
		t.Errorf("no read of the container blocked on the hung daemon (slow reads %v, %v): the hang was not the user's", slow, err)
		return
	}
	blocked := slow[0]
	for _, s := range slow[1:] {
		if s.Before(blocked) {
			blocked = s
		}
	}
	if blocked.Before(o.start) {
		blocked = o.start
	}
	e.figs.Duration(e.scenario, "fault -> first blocked read", blocked.Sub(o.start))
	e.figs.Duration(e.scenario, "first blocked read -> detected", detected.Sub(blocked))
	e.figs.Duration(e.scenario, "first blocked read -> healed", healed.Sub(blocked))
	t.Logf("the first blocked read began %s after the fault; healed %s after it",
		blocked.Sub(o.start).Round(time.Millisecond), healed.Sub(blocked).Round(time.Millisecond))
}

// wakeStaleDaemon lets the hung daemon of the aborted connection go on
// (SIGCONT). rclone then exits and unmounts its mountpoint by path, which
// holds the re-staged mount by now: the agent must stage the volume again,
// and a pod started afterwards must read the volume through FUSE, not the
// node's bare staging directory.
func (e *env) wakeStaleDaemon(t *testing.T, ctx context.Context, w *wl, pod *corev1.Pod, pid int) {
	t.Helper()
	staging := e2e.StagingPath(w.Handle)
	woken := time.Now()
	// The agent killed it with the abort; a reaped one is gone (ESRCH).
	if err := syscall.Kill(pid, syscall.SIGCONT); err != nil && !errors.Is(err, syscall.ESRCH) {
		t.Fatalf("continue %s (pid %d): %v", e.mounterName(), pid, err)
	}
	gone, err := waitProcessGone(ctx, pid)
	if err != nil {
		t.Logf("the stale daemon (pid %d) did not exit: %v", pid, err)
	} else {
		t.Logf("the stale daemon exited %s after SIGCONT", gone.Sub(woken).Round(time.Millisecond))
	}
	// Whether rclone's exit takes the re-staged mount with it depends on
	// how far it gets before it exits: either the staging mount was never
	// lost, or the agent stages the volume again. Either way it must be a
	// FUSE mount, and stay one over a few probe intervals.
	steady := 0
	if err := wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, 2*time.Minute, true, func(context.Context) (bool, error) {
		if fs, err := fstypeAt(staging); err == nil && strings.HasPrefix(fs, "fuse") {
			steady++
		} else {
			steady = 0
		}
		return steady >= 12, nil
	}); err != nil {
		fs, ferr := fstypeAt(staging)
		t.Fatalf("staging path %s after the stale daemon woke: file system %q, %v; want a FUSE mount\nagent log:\n%s", staging, fs, ferr, e.agent.LogTail(30))
	}
	// A repair of it is over by now: its event is there or there is none.
	ectx, ecancel := context.WithTimeout(ctx, 2*time.Second)
	defer ecancel()
	if at, ev, err := e.agent.WaitEvent(ectx, w.Namespace, "VolumeRepaired", woken); err == nil {
		e.figs.Duration(e.scenario, "stale daemon woken -> staging restored", at.Sub(woken))
		t.Logf("the stale daemon unmounted the staging mount; the agent: %s", ev.Note)
	} else {
		t.Logf("the stale daemon left the staging mount in place")
	}
	// A new pod is published from the staging mount.
	if err := e.c.Client.CoreV1().Pods(w.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	next, err := w.WaitRunning(ctx, string(pod.UID))
	if err != nil {
		t.Fatalf("no new pod running after the old one was deleted: %v\n%s", err, w.Describe(ctx))
	}
	target := filepath.Join(e2e.KubeletRoot, "pods", string(next.UID), "volumes", "kubernetes.io~csi", w.PV, "mount")
	if fs, err := fstypeAt(target); err != nil || !strings.HasPrefix(fs, "fuse") {
		t.Errorf("the new pod's volume %s: file system %q, %v; want FUSE (published from the node's disk?)", target, fs, err)
	}
	if _, err := w.WaitLogTime(ctx, next, "ok", woken); err != nil {
		t.Errorf("the new pod does not read its files: %v", err)
	}
}

// fstypeAt is the file system type of the mount on top at path, from our
// mount table.
func fstypeAt(path string) (string, error) {
	infos, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(path))
	if err != nil {
		return "", err
	}
	if len(infos) == 0 {
		return "", fmt.Errorf("%s is not a mount point", path)
	}
	return infos[len(infos)-1].FSType, nil
}

// waitProcessGone waits until pid has exited (or is a zombie).
func waitProcessGone(ctx context.Context, pid int) (time.Time, error) {
	for {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			return time.Now(), nil
		}
		if f := strings.Fields(string(b)); len(f) > 2 && f[2] == "Z" {
			return time.Now(), nil
		}
		select {
		case <-ctx.Done():
			return time.Time{}, ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// daemonOf finds the FUSE daemon (s3fs or rclone) serving the volume with
// handle: the one whose mount point argument is the volume's staging path
// (s3fs rewrites its "bucket:/prefix" argument in place, so that one cannot
// be matched).
func daemonOf(name, handle string) (int, error) {
	staging := e2e.StagingPath(handle)
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return 0, err
	}
	var found []int
	var seen []string
	for _, en := range entries {
		pid, err := strconv.Atoi(en.Name())
		if err != nil {
			continue
		}
		data, err := os.ReadFile(filepath.Join("/proc", en.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(strings.TrimRight(string(data), "\x00"), "\x00")
		if filepath.Base(args[0]) != name {
			continue
		}
		seen = append(seen, strings.Join(args, " "))
		if slices.Contains(args, staging) {
			found = append(found, pid)
		}
	}
	if len(found) != 1 {
		return 0, fmt.Errorf("%s processes mounting %s: %v, want exactly one (%s processes: %q)", name, staging, found, name, seen)
	}
	return found[0], nil
}

// driverDownScenario: the plugin stays down. The agent reports the driver
// down, evicts nothing (a new pod could not mount either) and keeps its
// repair attempts few; once the plugin is back it heals in place.
func driverDownScenario(t *testing.T, e *env, ns string) {
	const down = 20 * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	w := e.workload(t, ctx, ns)
	pod := w.pod(t, ctx)
	evictions := e.metric(t, ctx, "mountmedic_evictions_total")
	attempts := e.metric(t, ctx, "mountmedic_repairs_total")

	o := e.crash(t, ctx, w, pod, 0)
	e.detected(t, ctx, e.scenario, ns, o)
	at, ev, err := e.agent.WaitEvent(ctx, ns, "DriverDown", o.start)
	if err != nil {
		t.Fatal(err)
	}
	e.figs.Duration(e.scenario, "fault -> DriverDown event", at.Sub(o.start))
	t.Logf("driver down: %s", ev.Note)
	time.Sleep(time.Until(o.start.Add(down)))
	if got := e.metric(t, ctx, "mountmedic_evictions_total"); got != evictions {
		t.Errorf("mountmedic_evictions_total went from %v to %v while the driver was down, want no eviction", evictions, got)
	}
	tries := e.metric(t, ctx, "mountmedic_repairs_total") - attempts
	e.figs.Value(e.scenario, fmt.Sprintf("repair attempts in %s down", down), "", tries)
	evs, err := e.agent.Events(ctx, ns)
	if err != nil {
		t.Fatal(err)
	}
	for _, ev := range evs {
		if ev.Reason == "Evicting" {
			t.Errorf("agent evicted while the driver was down: %s", ev.Note)
		}
	}
	if cur := w.current(t, ctx); cur.UID != pod.UID {
		t.Fatalf("pod replaced while the driver was down")
	}

	o.back = e.bringBack(t)
	e.healed(t, ctx, e.scenario, w, pod, o)
	if after := samePod(t, ctx, w, pod); restarts(after) != restarts(pod) {
		t.Errorf("container restarts = %d, want %d (live tier once the driver is back)", restarts(after), restarts(pod))
	}
}

// dryRunScenario: with --dry-run the agent reports (events, metrics) and
// changes nothing: the mounts stay dead, the pod and container stay.
func dryRunScenario(t *testing.T, e *env, ns string) {
	const watch = 15 * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	w := e.workload(t, ctx, ns)
	pod := w.pod(t, ctx)
	planned := e.metric(t, ctx, "mountmedic_repairs_total", `result="dry_run"`)

	o := e.crash(t, ctx, w, pod, pluginDown)
	e.detected(t, ctx, "dry-run", ns, o)
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		return e.metric(t, ctx, "mountmedic_repairs_total", `result="dry_run"`) > planned, nil
	})
	if err != nil {
		t.Fatalf("mountmedic_repairs_total{result=dry_run} stayed at %v: the dry run reported no plan", planned)
	}
	time.Sleep(time.Until(o.back.Add(watch)))

	lines, err := w.Log(pod, true)
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range lines {
		if l.Text == "ok" && l.Time.After(o.bad) {
			t.Errorf("the container read its files again at %s: the dry run changed a mount", l.Time)
		}
	}
	if cur := w.current(t, ctx); cur.UID != pod.UID || restarts(cur) != restarts(pod) {
		t.Errorf("pod %s (restarts %d) is now %s (restarts %d): the dry run changed the pod", pod.UID, restarts(pod), cur.UID, restarts(cur))
	}
	evs, err := e.agent.Events(ctx, ns)
	if err != nil {
		t.Fatal(err)
	}
	for _, ev := range evs {
		if !strings.HasPrefix(ev.Note, "[dry-run]") {
			t.Errorf("event %s without the [dry-run] mark: %s", ev.Reason, ev.Note)
		}
	}
	var st syscall.Statfs_t
	if err := syscall.Statfs(e2e.StagingPath(w.Handle), &st); !errors.Is(err, syscall.ENOTCONN) {
		t.Errorf("statfs(staging of %s) = %v, want ENOTCONN: the dry run touched the mount", w.Handle, err)
	}
}
