package agent

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/mountmedic/mountmedic/remount"
	"github.com/mountmedic/mountmedic/scripts/kubetest"
	"github.com/mountmedic/mountmedic/scripts/lab"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// TestRepairReadsPodsFresh: a run whose pods came from a cache that has not
// caught up (right after a partition) acts only on pods the API server
// still has under the same UID on this node: a pod force-deleted, or
// replaced under its name by another UID, is never swapped, restarted or
// evicted. The pod that is still there is repaired.
func TestRepairReadsPodsFresh(t *testing.T) {
	lab.RequireRoot(t)
	c := kubetest.Start(t, kubetest.Options{})
	c.CreateNamespace(t, "apps")
	ctx := context.Background()
	cfg := DefaultConfig()
	cfg.NodeName = lab.DefaultNodeName
	cfg.KubeletRoot = t.TempDir()
	cfg.MetricsAddr = ""
	cfg.Version = "test"
	rep := &fakeRepairer{}
	a, err := New(cfg, Deps{Client: c.Client, Repairer: rep, DriverCaps: func(context.Context, string) (kubelet.NodeCapabilities, error) {
		return kubelet.NodeCapabilities{}, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	// Each run reads the pods anew, so that each case below meets the
	// API server's answer after its own change (a shared LIST would also
	// miss the pods created after it, for another reason).
	a.nodePods.maxAge = 0
	newPod := func(name string) *corev1.Pod {
		p, err := c.Client.CoreV1().Pods("apps").Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: "apps", Name: name},
			Spec:       corev1.PodSpec{NodeName: cfg.NodeName, Containers: []corev1.Container{{Name: "app", Image: "busybox"}}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	forceDelete := func(p *corev1.Pod) {
		if err := c.Client.CoreV1().Pods("apps").Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}); err != nil {
			t.Fatal(err)
		}
	}
	// runFor runs the ladder from the live swap (a residual: the host was
	// re-staged before the partition) for the cached pod.
	runFor := func(cached *corev1.Pod) []string {
		bv := &brokenVolume{key: "vol/" + string(cached.UID), csi: true, driver: "lab.csi", volumeHandle: "h",
			pods: map[string]*podUse{string(cached.UID): {uid: string(cached.UID)}}}
		rs := &residual{vol: bv, r: &resolved{
			vol:         &remount.Volume{Driver: "lab.csi", VolumeHandle: "h", Pods: []remount.PodVolume{{Publish: kubelet.VolumeRequest{PodUID: cached.UID}}}},
			pods:        []*corev1.Pod{cached},
			restageable: true, needSwap: true,
			ownBinds: map[string][]string{string(cached.UID): {"c1"}},
		}}
		j := &job{key: bv.key, vol: bv, active: []*corev1.Pod{cached}, since: time.Now(), resume: rs}
		a.run(ctx, j)
		return rep.take()
	}

	live := newPod("live")
	if got := runFor(live); len(got) == 0 || got[0] != "liveswap" {
		t.Fatalf("tiers for a pod that is still there: %v, want liveswap", got)
	}
	deleted := newPod("deleted")
	forceDelete(deleted)
	if got := runFor(deleted); len(got) != 0 {
		t.Errorf("tiers for a force-deleted pod the cache still has: %v, want none", got)
	}
	old := newPod("replaced")
	forceDelete(old)
	now := newPod("replaced")
	if now.UID == old.UID {
		t.Fatal("the replacement has the same UID")
	}
	if got := runFor(old); len(got) != 0 {
		t.Errorf("tiers for a pod replaced under its name (uid %s, cached %s): %v, want none", now.UID, old.UID, got)
	}
}

// TestNodePodsSharesAList: the runs that ask for the node's pods within
// maxAge of a LIST's start share it, in flight or done; a later run, or one
// after a failed LIST, gets a new one; a run that stops waiting does not
// cancel the LIST the others wait for.
func TestNodePodsSharesAList(t *testing.T) {
	now := time.Unix(1000, 0)
	var (
		mu      sync.Mutex
		calls   int
		fail    bool
		release = make(chan struct{})
	)
	n := &nodePods{
		maxAge:  time.Second,
		timeout: time.Minute,
		now:     func() time.Time { mu.Lock(); defer mu.Unlock(); return now },
		list: func(ctx context.Context) (*corev1.PodList, error) {
			mu.Lock()
			calls++
			f := fail
			mu.Unlock()
			select {
			case <-release:
			case <-ctx.Done():
				return nil, ctx.Err()
			}
			if f {
				return nil, context.DeadlineExceeded
			}
			return &corev1.PodList{Items: []corev1.Pod{{ObjectMeta: metav1.ObjectMeta{Namespace: "a", Name: "p", UID: "u1"}}}}, nil
		},
	}
	advance := func(d time.Duration) { mu.Lock(); now = now.Add(d); mu.Unlock() }
	listed := func() int { mu.Lock(); defer mu.Unlock(); return calls }

	// A run that gives up while the LIST is in flight does not cancel it.
	ctx, cancel := context.WithCancel(context.Background())
	quit := make(chan error, 1)
	go func() { _, err := n.read(ctx); quit <- err }()
	for listed() == 0 {
		time.Sleep(time.Millisecond)
	}
	cancel()
	if err := <-quit; err != context.Canceled {
		t.Fatalf("read after its caller gave up: %v, want context.Canceled", err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 10)
	for range 10 {
		wg.Go(func() {
			l, err := n.read(context.Background())
			if err == nil && l.pod("a", "p") == nil {
				err = errors.New("pod a/p missing from the shared LIST")
			}
			errs <- err
		})
	}
	time.Sleep(50 * time.Millisecond) // let them join the LIST in flight
	close(release)
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if got := listed(); got != 1 {
		t.Fatalf("11 reads within maxAge of a LIST made %d LISTs, want 1", got)
	}
	// A copy each: a run that changes its pod changes no other's.
	l, _ := n.read(context.Background())
	l.pod("a", "p").UID = "changed"
	if got := l.pod("a", "p").UID; got != "u1" {
		t.Fatalf("pod UID %s after another reader changed its copy, want u1", got)
	}

	advance(900 * time.Millisecond)
	if _, err := n.read(context.Background()); err != nil || listed() != 1 {
		t.Fatalf("read 0.9 s after the LIST started: err %v, %d LISTs; want the same LIST", err, listed())
	}
	advance(200 * time.Millisecond)
	if _, err := n.read(context.Background()); err != nil || listed() != 2 {
		t.Fatalf("read 1.1 s after the LIST started: err %v, %d LISTs; want a new LIST", err, listed())
	}
	mu.Lock()
	fail = true
	mu.Unlock()
	advance(2 * time.Second)
	if _, err := n.read(context.Background()); err == nil {
		t.Fatal("read of a failing LIST: no error")
	}
	mu.Lock()
	fail = false
	mu.Unlock()
	if _, err := n.read(context.Background()); err != nil || listed() != 4 {
		t.Fatalf("read right after a failed LIST: err %v, %d LISTs; want a new LIST (4)", err, listed())
	}
}

// TestNodePodsListEndsWithTheAgent: a LIST in flight when the agent stops
// ends with it, not at its own deadline (an hour here), and the agent can
// wait for it. The runs' own deadlines still do not end it.
func TestNodePodsListEndsWithTheAgent(t *testing.T) {
	started := make(chan struct{})
	n := &nodePods{
		maxAge:  time.Second,
		timeout: time.Hour,
		now:     time.Now,
		list: func(ctx context.Context) (*corev1.PodList, error) {
			close(started)
			<-ctx.Done()
			return nil, ctx.Err()
		},
	}
	life, stop := context.WithCancel(context.Background())
	n.live(life)
	run, giveUp := context.WithCancel(context.Background())
	read := make(chan error, 1)
	go func() { _, err := n.read(run); read <- err }()
	<-started
	giveUp()
	if err := <-read; !errors.Is(err, context.Canceled) {
		t.Fatalf("read after its run gave up = %v, want context.Canceled", err)
	}
	stop()
	waited := make(chan struct{})
	go func() { n.wait(); close(waited) }()
	select {
	case <-waited:
	case <-time.After(time.Minute):
		t.Fatal("the LIST was still in flight a minute after the agent stopped (its own deadline is an hour)")
	}
	l := n.last
	select {
	case <-l.done:
	default:
		t.Fatal("nodePods.wait returned with the LIST in flight")
	}
	if !errors.Is(l.err, context.Canceled) {
		t.Errorf("the LIST ended with %v, want the agent's end (context.Canceled)", l.err)
	}
}
