package e2e_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/scripts/e2e"
)

// The wake scenarios: a hung FUSE daemon (SIGSTOP) is healed around, then
// woken (SIGCONT), as a daemon stuck on a slow backend eventually is. From
// the wake until wakeWatch after it, the staging path is read every
// wakePoll: it must never be anything but a FUSE mount (or the agent's
// guard). A pod created at the wake must read its volume.
//
// The agent runs as the DaemonSet ships it (its flags, hostPID,
// securityContext), the node plugin in the node's PID namespace as a
// plugin pod is: the agent must find the stale daemon and kill it.
func init() {
	scenarios = append(scenarios,
		scenario{name: "wake", run: wakeScenario},
		scenario{name: "wake-rclone", mounter: "rclone", run: wakeScenario},
	)
}

const (
	wakePoll  = 10 * time.Millisecond
	wakeWatch = 10 * time.Second
)

func wakeScenario(t *testing.T, e *env, ns string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	w := e.workload(t, ctx, ns)
	pod := w.pod(t, ctx)
	pid, err := daemonOf(e.mounterName(), w.Handle)
	if err != nil {
		t.Fatal(err)
	}
	o := outage{start: time.Now()}
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatalf("stop %s (pid %d): %v", e.mounterName(), pid, err)
	}
	t.Cleanup(func() { _ = syscall.Kill(pid, syscall.SIGKILL) })
	e.detected(t, ctx, e.scenario, ns, o)
	if o.bad, err = w.WaitLogTime(ctx, pod, "bad", o.start); err != nil {
		t.Fatal(err)
	}
	e.healed(t, ctx, e.scenario, w, pod, o)

	// The agent kills the daemon of the connection it aborted.
	gctx, gcancel := context.WithTimeout(ctx, 5*time.Second)
	_, gerr := waitProcessGone(gctx, pid)
	gcancel()
	if gerr != nil {
		t.Errorf("the stale %s (pid %d) still runs after the repair: the agent did not kill it; its FUSE lines:\n%s",
			e.mounterName(), pid, grepLines(e.agent.LogTail(2000), "FUSE"))
	}

	staging := e2e.StagingPath(w.Handle)
	woken := time.Now()
	var watch wakeWatchResult
	var wg sync.WaitGroup
	wg.Go(func() { watch = watchStaging(staging, woken) })
	_ = syscall.Kill(pid, syscall.SIGCONT)
	// A pod created at the wake: the old one is deleted, its ReplicaSet
	// creates the next, which kubelet publishes from the staging mount.
	if err := e.c.Client.CoreV1().Pods(w.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	next, err := w.WaitRunning(ctx, string(pod.UID))
	if err != nil {
		t.Fatalf("no new pod running after the wake: %v\n%s", err, w.Describe(ctx))
	}
	wg.Wait()
	e.figs.Value(e.scenario, "stale daemon woken -> ms the staging path was not the volume's mount", "ms", float64(watch.bad.Milliseconds()))
	t.Logf("staging path over %s after the wake: %d reads, %d not a FUSE mount (%s), %d the guard", wakeWatch, watch.reads, watch.notFUSE, watch.bad, watch.guard)
	if watch.notFUSE > 0 {
		t.Errorf("the staging path %s was not the volume's mount for %s after the stale daemon woke (first: %s)", staging, watch.bad, watch.first)
	}
	if _, err := w.WaitLogTime(ctx, next, "ok", woken); err != nil {
		t.Errorf("the pod created at the wake does not read its volume: %v", err)
	}
}

// grepLines keeps the lines of text that hold s.
func grepLines(text, s string) string {
	var out []string
	for _, l := range strings.Split(text, "\n") {
		if strings.Contains(l, s) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// wakeWatchResult is what watchStaging saw.
type wakeWatchResult struct {
	reads, notFUSE, guard int
	// bad sums the time between a read that found something else than a
	// FUSE mount or the guard and the next read.
	bad   time.Duration
	first string
}

// watchStaging reads the top mount at staging every wakePoll from start
// until wakeWatch after it.
func watchStaging(staging string, start time.Time) wakeWatchResult {
	var r wakeWatchResult
	var badSince time.Time
	for now := time.Now(); now.Before(start.Add(wakeWatch)); now = time.Now() {
		r.reads++
		what, ok, guard := stagingTop(staging)
		if guard {
			r.guard++
		}
		switch {
		case !ok && badSince.IsZero():
			badSince = now
			r.notFUSE++
			if r.first == "" {
				r.first = what
			}
		case !ok:
			r.notFUSE++
		case !badSince.IsZero():
			r.bad += now.Sub(badSince)
			badSince = time.Time{}
		}
		time.Sleep(wakePoll)
	}
	if !badSince.IsZero() {
		r.bad += time.Since(badSince)
	}
	return r
}

// stagingTop describes the top mount at path: ok for a FUSE mount or the
// agent's guard.
func stagingTop(path string) (what string, ok, guard bool) {
	infos, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(path))
	switch {
	case err != nil:
		return err.Error(), false, false
	case len(infos) == 0:
		return "not a mount point (the node's disk)", false, false
	}
	top := infos[len(infos)-1]
	if top.FSType == "tmpfs" && top.Source == probe.GuardSource {
		return "the guard", true, true
	}
	return fmt.Sprintf("%s from %s", top.FSType, top.Source), strings.HasPrefix(top.FSType, "fuse"), false
}
