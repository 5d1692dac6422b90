package failover

import (
	"context"
	"os"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// BenchmarkNodeDeathToAttach measures the time from a node's death to its
// StatefulSet pod's replacement having its ReadWriteOnce volume attached on
// another node, on one real control plane with Kubernetes' default timings
// (node monitor grace period 50 s, pod toleration of unreachable nodes
// 300 s, attach/detach controller's 6 minute wait before it force-detaches
// a volume still in use), in three lanes at once, each in its own zone
// with a node that dies and one that lives:
//
//	mountmedic  the failover duty with its defaults (agents' heartbeats on
//	            both nodes, the leader-elected controller)
//	manual      stock Kubernetes and the procedure of seed 001: an operator
//	            force-deletes the pod the moment the node turns NotReady
//	stock       stock Kubernetes alone
//
// The stock lanes are bounded by MOUNTMEDIC_FAILOVER_STOCK_WAIT (default
// 8m); a lane that did not get there reports the bound. Run it with
//
//	go test ./agent/failover -run '^$' -bench NodeDeathToAttach -benchtime 1x -timeout 30m
func BenchmarkNodeDeathToAttach(b *testing.B) {
	limit := 8 * time.Minute
	if v := os.Getenv("MOUNTMEDIC_FAILOVER_STOCK_WAIT"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			b.Fatalf("MOUNTMEDIC_FAILOVER_STOCK_WAIT=%q: %v", v, err)
		}
		limit = d
	}
	h := startHarness(b) // the controller manager's default timings
	for i := range b.N {
		runLanes(b, h, i, limit)
	}
}

type lane struct {
	name   string
	s      *scenario
	victim *simNode
	target *simNode
	pv     *corev1.PersistentVolume
	old    *corev1.Pod

	took     time.Duration
	attached bool
	note     string
}

func runLanes(b *testing.B, h *harness, round int, limit time.Duration) {
	suffix := ""
	if round > 0 {
		suffix = string(rune('a' + round))
	}
	cfg := DefaultConfig()
	cfg.Enabled = true
	cfg.Namespace = agentNS
	ctl := DefaultControllerConfig()
	ctl.Namespace = agentNS
	ctl.LeaderLease = "failover-leader-bench" + suffix
	ctl.NodeSelector = caseLabel + "=mountmedic" + suffix

	var lanes []*lane
	for _, name := range []string{"mountmedic", "manual", "stock"} {
		l := &lane{name: name}
		l.s = h.scenario(b, name+suffix)
		l.s.cfg, l.s.ctl = cfg, ctl
		h.allowLeaderLease(b, ctl.LeaderLease)
		agents := name == "mountmedic"
		l.victim = l.s.addNode(name+suffix+"-dies", agents)
		l.target = l.s.addNode(name+suffix+"-lives", agents)
		l.pv = l.s.statefulSet("db", nil)
		l.old = l.s.podOf(h.ctx, "db")
		lanes = append(lanes, l)
	}
	_, reg, _ := lanes[0].s.controller(ctl, "bench-leader"+suffix)
	if err := waitFor(h.ctx, time.Minute, func(context.Context) (bool, error) {
		return metric(b, reg, "mountmedic_failover_leader", nil) == 1, nil
	}); err != nil {
		b.Fatalf("wait for the failover leader: %v", err)
	}
	// Let the leader watch the nodes alive for a while, as in a cluster
	// that has been running.
	time.Sleep(ctl.FenceWindow(0))

	b.ResetTimer()
	died := time.Now()
	for _, l := range lanes {
		l.victim.kill()
	}
	var wg sync.WaitGroup
	for _, l := range lanes {
		wg.Go(func() { l.run(b, died, limit) })
	}
	wg.Wait()
	b.StopTimer()

	for _, l := range lanes {
		b.ReportMetric(l.took.Seconds(), l.name+"-s")
		if l.attached {
			b.Logf("%-10s node death -> replacement's volume attached on another node: %s%s", l.name, l.took.Round(100*time.Millisecond), l.note)
		} else {
			b.Logf("%-10s node death -> replacement's volume attached on another node: not within %s%s", l.name, limit, l.note)
		}
	}
}

// run waits for the lane's replacement to be attached on the living node,
// playing the operator in the manual lane.
func (l *lane) run(b *testing.B, died time.Time, limit time.Duration) {
	h := l.s.h
	ctx, cancel := context.WithTimeout(h.ctx, limit)
	defer cancel()
	if l.name == "manual" {
		// The operator of seed 001 watches `kubectl get nodes` and runs
		// `kubectl delete pod --grace-period=0 --force` once it says
		// NotReady.
		err := waitFor(ctx, limit, func(ctx context.Context) (bool, error) {
			n, err := h.admin.CoreV1().Nodes().Get(ctx, l.victim.name, metav1.GetOptions{})
			if err != nil {
				return false, err
			}
			for _, c := range n.Status.Conditions {
				if c.Type == corev1.NodeReady && c.Status != corev1.ConditionTrue {
					return true, nil
				}
			}
			return false, nil
		})
		if err == nil {
			uid := l.old.UID
			err = h.admin.CoreV1().Pods(l.s.ns).Delete(ctx, l.old.Name, metav1.DeleteOptions{
				GracePeriodSeconds: new(int64), Preconditions: &metav1.Preconditions{UID: &uid}})
			l.note = " (pod force-deleted " + time.Since(died).Round(time.Second).String() + " after the death)"
		}
		if err != nil {
			l.note = " (operator step failed: " + err.Error() + ")"
		}
	}
	err := waitFor(ctx, limit, func(ctx context.Context) (bool, error) {
		p := l.s.podOf(ctx, "db")
		if p == nil || p.UID == l.old.UID || p.Spec.NodeName != l.target.name {
			return false, nil
		}
		va := l.s.attachment(ctx, l.pv.Name, l.target.name)
		if va == nil || !va.Status.Attached {
			return false, nil
		}
		at, ok := h.attachedAt(va.Name)
		if ok {
			l.took, l.attached = at.Sub(died), true
		}
		return ok, nil
	})
	if err != nil {
		l.took = limit
		if p := l.s.podOf(h.ctx, "db"); p != nil && p.UID == l.old.UID {
			state := "Running on the dead node"
			if p.DeletionTimestamp != nil {
				state = "Terminating on the dead node"
			}
			l.note += " (the pod is still " + state + ")"
		}
	}
}
