package e2e_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/scripts/e2e"
)

// The node of the many scenario: many FUSE daemons die at once, each the
// backend of its own volume, one of them the backend of a volume several
// pods share; healthy volumes of the same driver and pods that opted out
// live beside them.
const (
	manyDead     = 12 // workloads whose daemon dies, one pod each
	manyShared   = 4  // pods of the workload whose one daemon dies
	manyHealthy  = 10 // workloads whose daemon lives
	manyOptedOut = 2  // workloads whose daemon dies, claim opted out
	// optOutWatch is how long after the last heal an opted-out volume
	// must still be broken and untouched: several probe cycles (2 s).
	optOutWatch = 10 * time.Second
	// manyThreadSlack is the agent's threads a repair burst may add to one
	// per hung daemon: its repairs' own blocking calls (mounts, the CSI
	// and CRI clients, setns), at most --max-concurrent-repairs (4) at a
	// time, and the Go runtime's.
	manyThreadSlack = 16
)

// manyWorkload is one workload of the many scenario and what the test saw
// of it before the fault.
type manyWorkload struct {
	ns   string // its namespace
	kind string // "dead", "shared", "healthy" or "opted-out"
	opts e2e.WorkloadOptions
	// w is the workload once deployed, pods its pods once they run.
	w    *wl
	pods []corev1.Pod
	// staging is the mount ID of the volume's staging mount before the
	// fault; pid its FUSE daemon.
	staging int
	pid     int
}

// manyScenario: the FUSE daemons of 15 volumes die at once (SIGKILL, the
// node plugin stays up), one of them shared by 4 pods: 18 pods lose their
// volume. The 16 of them whose claim may be repaired read again, without a
// restart, while the 10 healthy volumes of the same driver beside them are
// left alone (same staging mount, same pod, no restart, no event), and the
// 2 whose claim opted out (mountmedic.io/repair: "false") stay broken and
// unrepaired.
func manyScenario(t *testing.T, e *env, ns string) { manyFault(t, e, ns, syscall.SIGKILL) }

// manyHungScenario is manyScenario with the 15 daemons hung (SIGSTOP)
// instead: every connection but the opted-out ones is aborted, and its
// pods read again; the opted-out pods stay blocked in their read.
func manyHungScenario(t *testing.T, e *env, ns string) { manyFault(t, e, ns, syscall.SIGSTOP) }

// manyFault runs the many scenarios: sig is the fault of the daemons.
func manyFault(t *testing.T, e *env, ns string, sig syscall.Signal) {
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	all := e.manyWorkloads(t, ctx, ns)
	table := e.n.MountTable()
	for _, m := range all {
		mnt := mountAt(t, table, e2e.StagingPath(m.w.Handle))
		if mnt == nil {
			t.Fatalf("%s: no staging mount at %s", m.ns, e2e.StagingPath(m.w.Handle))
		}
		m.staging = mnt.ID
		pid, err := daemonOf("s3fs", m.w.Handle)
		if err != nil {
			t.Fatal(err)
		}
		m.pid = pid
	}

	disruptive := func() float64 {
		return e.metric(t, ctx, "mountmedic_repairs_total", `tier="restart"`) + e.metric(t, ctx, "mountmedic_evictions_total")
	}
	before := disruptive()
	threads0 := e.metric(t, ctx, "go_threads")
	start := time.Now()
	broken, daemons := 0, 0
	for _, m := range all {
		if m.kind == "healthy" {
			continue
		}
		if err := syscall.Kill(m.pid, sig); err != nil {
			t.Fatalf("signal %v to the s3fs of %s (pid %d): %v", sig, m.ns, m.pid, err)
		}
		if sig == syscall.SIGSTOP {
			// Before the workloads' deletion (cleanups run last first):
			// kubelet unmounts them.
			t.Cleanup(func() { _ = syscall.Kill(m.pid, syscall.SIGKILL) })
		}
		broken += len(m.pods)
		daemons++
	}
	t.Logf("%s to the FUSE daemons of %d pods' volumes", unix.SignalName(sig), broken)

	// The agent's threads meanwhile: a probe stuck in a hung daemon holds
	// one until the abort, and nothing else may pile up.
	var threads float64
	sampled := make(chan struct{})
	sampling, stopSampling := context.WithCancel(ctx)
	go func() {
		defer close(sampled)
		for sampling.Err() == nil {
			if m, err := e.agent.Metrics(sampling); err == nil {
				threads = max(threads, e2e.Sum(m, "go_threads"))
			}
			time.Sleep(200 * time.Millisecond)
		}
	}()

	// Every pod of a dead volume that may be repaired reads again.
	var mu sync.Mutex
	var heals, bads []time.Duration
	var errs []string
	var wg sync.WaitGroup
	for _, m := range all {
		if m.kind != "dead" && m.kind != "shared" {
			continue
		}
		for i := range m.pods {
			wg.Go(func() {
				p := &m.pods[i]
				hctx, cancel := context.WithTimeout(ctx, healBound)
				defer cancel()
				bad, err := m.w.WaitLogTime(hctx, p, "bad", start)
				var ok time.Time
				if err == nil {
					ok, err = m.w.WaitLogTime(hctx, p, "ok", bad)
				}
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					errs = append(errs, fmt.Sprintf("%s/%s: %v", p.Namespace, p.Name, err))
					return
				}
				heals, bads = append(heals, ok.Sub(start)), append(bads, bad.Sub(start))
			})
		}
	}
	wg.Wait()
	stopSampling()
	<-sampled
	e.figs.Value(e.scenario, "agent threads, peak over before the fault", "", threads-threads0)
	t.Logf("agent threads: %v before the fault, %v at the peak, for %d daemons", threads0, threads, daemons)
	if sig == syscall.SIGSTOP && threads-threads0 > float64(daemons+manyThreadSlack) {
		t.Errorf("agent threads peaked at %v, %v before the fault, for %d hung daemons; want at most one per hung daemon and %d more", threads, threads0, daemons, manyThreadSlack)
	}
	if len(errs) > 0 {
		e.figs.Miss(e.scenario, "fault -> all healed", "s")
		t.Fatalf("%d of %d pods did not read again within %s:\n%s\nagent log:\n%s", len(errs), broken-manyOptedOut, healBound, strings.Join(errs, "\n"), e.agent.LogTail(40))
	}
	slices.Sort(heals)
	if sig == syscall.SIGSTOP {
		// A hung read fails (ECONNABORTED) only when the agent aborts
		// its connection.
		e.figs.Duration(e.scenario, "hang -> all aborted", slices.Max(bads))
	}
	e.figs.Duration(e.scenario, "fault -> first healed", heals[0])
	e.figs.Duration(e.scenario, "fault -> all healed", heals[len(heals)-1])
	t.Logf("%d pods healed: first %s, median %s, last %s after the kill", len(heals),
		heals[0].Round(time.Millisecond), heals[len(heals)/2].Round(time.Millisecond), heals[len(heals)-1].Round(time.Millisecond))

	// Nothing else was touched: the healed pods are the same pods, never
	// restarted; the healthy volumes kept their mount and their pods; the
	// opted-out volumes are still broken, on the same dead mount, several
	// probe cycles after the last heal.
	time.Sleep(optOutWatch)
	events := 0
	for _, m := range all {
		pods, err := m.w.Pods(ctx)
		if err != nil {
			t.Fatal(err)
		}
		slices.SortFunc(pods, func(a, b corev1.Pod) int { return strings.Compare(a.Name, b.Name) })
		if got, want := podsByName(pods), podsByName(m.pods); !slices.Equal(got, want) {
			t.Errorf("%s (%s): pods %v, want %v (none replaced)", m.ns, m.kind, got, want)
			continue
		}
		for i := range pods {
			if got, want := restarts(&pods[i]), restarts(&m.pods[i]); got != want {
				t.Errorf("%s/%s (%s): container restarts %d, want %d", m.ns, pods[i].Name, m.kind, got, want)
			}
		}
		evs, err := e.agent.Events(ctx, m.ns)
		if err != nil {
			t.Fatal(err)
		}
		events += len(evs)
		mnt := mountAt(t, table, e2e.StagingPath(m.w.Handle))
		switch m.kind {
		case "healthy":
			if mnt == nil || mnt.ID != m.staging {
				t.Errorf("%s (healthy): staging mount %v, want mount %d untouched", m.ns, mnt, m.staging)
			}
			if len(evs) > 0 {
				t.Errorf("%s (healthy): agent events %s, want none", m.ns, eventList(evs))
			}
			if lines, err := m.w.Log(&pods[0], true); err != nil || slices.ContainsFunc(lines, func(l e2e.LogLine) bool { return l.Text == "bad" }) {
				t.Errorf("%s (healthy): container log %v (%v), want no failed read", m.ns, lines, err)
			}
		case "opted-out":
			if mnt == nil || mnt.ID != m.staging {
				t.Errorf("%s (opted out): staging mount %v, want the dead mount %d left alone", m.ns, mnt, m.staging)
			}
			if slices.ContainsFunc(evs, func(ev eventsv1.Event) bool { return ev.Reason == "VolumeRepaired" }) {
				t.Errorf("%s (opted out): agent events %s, want no repair", m.ns, eventList(evs))
			}
			// A dead volume keeps failing; a hung one keeps its reader
			// blocked: its connection was never aborted.
			lines, err := m.w.Log(&pods[0], true)
			last := ""
			for _, l := range lines {
				if l.Text == "ok" || l.Text == "bad" { // not a slow read's line
					last = l.Text
				}
			}
			if want := map[syscall.Signal]string{syscall.SIGKILL: "bad", syscall.SIGSTOP: "ok"}[sig]; err != nil || last != want {
				t.Errorf("%s (opted out): container log %v (%v), want %q last", m.ns, lines, err, want)
			}
			t.Logf("%s (opted out): agent events %s", m.ns, eventList(evs))
		}
	}
	e.figs.Value(e.scenario, fmt.Sprintf("agent events in the %d namespaces", len(all)), "", float64(events))
	// The node's event budget (agent/events.go: a burst of 25, then one a
	// second; the rest summed up on the Node): without it, each of the 18
	// pods and its claim would have had an event per step.
	if budget := 25 + int(time.Since(start)/time.Second) + 1; events > budget {
		t.Errorf("agent events in the %d namespaces = %d, want at most %d (the node's budget since the fault)", len(all), events, budget)
	}
	nodeEvs, err := e.agent.Events(ctx, metav1.NamespaceDefault)
	if err != nil {
		t.Fatal(err)
	}
	var summaries []string
	for _, ev := range nodeEvs {
		if ev.Regarding.Kind == "Node" && !e2e.EventTime(&ev).Before(start.Truncate(time.Second)) {
			summaries = append(summaries, ev.Reason+": "+ev.Note)
		}
	}
	t.Logf("agent events in the %d namespaces: %d; on the Node since the fault: %q", len(all), events, summaries)
	if got := disruptive() - before; got != 0 {
		t.Errorf("restarts and evictions = %v, want 0 (every container reachable by the live swap)", got)
	}
}

// manyWorkloads deploys the many scenario's workloads at once and waits
// until every pod reads its files; they are deleted when the test ends.
func (e *env) manyWorkloads(t *testing.T, ctx context.Context, ns string) []*manyWorkload {
	t.Helper()
	var all []*manyWorkload
	add := func(kind string, n int, opts e2e.WorkloadOptions) {
		for i := range n {
			name := fmt.Sprintf("%s-%s", ns, kind)
			if n > 1 {
				name = fmt.Sprintf("%s-%02d", name, i)
			}
			all = append(all, &manyWorkload{ns: name, kind: kind, opts: opts})
		}
	}
	add("dead", manyDead, e2e.WorkloadOptions{})
	add("shared", 1, e2e.WorkloadOptions{Replicas: manyShared})
	add("healthy", manyHealthy, e2e.WorkloadOptions{})
	add("opted-out", manyOptedOut, e2e.WorkloadOptions{ClaimAnnotations: map[string]string{"mountmedic.io/repair": "false"}})

	begin := time.Now()
	var mu sync.Mutex
	var errs []string
	var wg sync.WaitGroup
	for _, m := range all {
		wg.Go(func() {
			opts := m.opts
			opts.NoWait = true
			w, err := e.n.DeployWorkloadWith(ctx, m.ns, opts)
			if err == nil {
				m.w = &wl{Workload: w}
				m.pods, err = w.WaitPods(ctx, int(max(m.opts.Replicas, 1)))
			}
			if err != nil {
				mu.Lock()
				errs = append(errs, err.Error())
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("node mounts:\n%s", e.nodeMounts())
		}
		ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
		defer cancel()
		var wg sync.WaitGroup
		for _, m := range all {
			if m.w == nil {
				continue // never created
			}
			wg.Go(func() {
				if err := m.w.Delete(ctx); err != nil {
					t.Errorf("delete workload %s: %v\n%s", m.ns, err, m.w.Describe(context.Background()))
				}
			})
		}
		wg.Wait()
	})
	if len(errs) > 0 {
		t.Fatalf("deploy the workloads:\n%s\n%s", strings.Join(errs, "\n"), e.diagnostics(ns))
	}
	t.Logf("%d workloads (%d pods) running and written in %s", len(all), manyDead+manyShared+manyHealthy+manyOptedOut, time.Since(begin).Round(time.Millisecond))
	return all
}

// podsByName lists the names and UIDs of pods.
func podsByName(pods []corev1.Pod) []string {
	var out []string
	for _, p := range pods {
		out = append(out, p.Name+"/"+string(p.UID))
	}
	slices.Sort(out)
	return out
}

// eventList is a failure message's list of events.
func eventList(evs []eventsv1.Event) string {
	var out []string
	for _, ev := range evs {
		out = append(out, ev.Reason+": "+ev.Note)
	}
	return fmt.Sprintf("%q", out)
}
