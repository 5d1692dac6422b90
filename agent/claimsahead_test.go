package agent

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"
)

// claimGets counts the GETs of PersistentVolumeClaims the fake clientset
// answered.
func claimGets(cs *fake.Clientset) int {
	n := 0
	for _, act := range cs.Actions() {
		if act.GetVerb() == "get" && act.GetResource().Resource == "persistentvolumeclaims" {
			n++
		}
	}
	return n
}

// TestReadAheadReadsAQueuedClaimOnce: a volume queued while every repair
// slot is taken has its claim read ahead, once; its run then takes the
// claim from the cache (one GET in all) and repairs as before. An opted-out
// claim read ahead still stops the run: the run reads the same object.
func TestReadAheadReadsAQueuedClaimOnce(t *testing.T) {
	for _, optOut := range []bool{false, true} {
		c := newLadderCase(t, ladderOptions{optOut: optOut})
		idx := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{uidIndex: func(obj any) ([]string, error) {
			return []string{string(obj.(*corev1.Pod).UID)}, nil
		}})
		if err := idx.Add(c.pod); err != nil {
			t.Fatal(err)
		}
		c.a.pods = podsByUID{idx: idx}
		key := c.j.key
		c.a.broken = map[string]*brokenVolume{key: c.j.vol}
		c.a.decider.vols[key] = &volState{since: time.Now()}
		c.a.queue = []string{key}
		c.a.running = c.a.cfg.MaxConcurrentRepairs // every slot taken

		ctx := context.Background()
		c.a.startRuns(ctx)
		if c.a.reading != 1 {
			t.Fatalf("optOut %v: %d claim reads ahead for one queued volume, want 1", optOut, c.a.reading)
		}
		<-c.a.aheadDone
		c.a.reading--
		c.a.startRuns(ctx) // the same queue: nothing read twice
		if c.a.reading != 0 {
			t.Errorf("optOut %v: the queued volume's claim read ahead again", optOut)
		}
		if got := claimGets(c.cs); got != 1 {
			t.Errorf("optOut %v: %d claim GETs after the read ahead, want 1", optOut, got)
		}
		if optOut {
			c.run(t, outcomeIgnored)
		} else {
			c.run(t, outcomeHealed, "restage")
		}
		if got := claimGets(c.cs); got != 1 {
			t.Errorf("optOut %v: %d claim GETs after the run, want 1 (the run takes the claim read ahead)", optOut, got)
		}
	}
}

// TestCachedGetSharesAReadInFlight: a read of an object whose read is in
// flight takes that answer; one request for both.
func TestCachedGetSharesAReadInFlight(t *testing.T) {
	cs := fake.NewClientset(&corev1.PersistentVolumeClaim{})
	var calls atomic.Int32
	release := make(chan struct{})
	cs.PrependReactor("get", "persistentvolumeclaims", func(k8stesting.Action) (bool, runtime.Object, error) {
		calls.Add(1)
		<-release
		pvc := &corev1.PersistentVolumeClaim{}
		pvc.Namespace, pvc.Name = "apps", "data"
		return true, pvc, nil
	})
	k := &kube{client: cs, cache: newObjectCache(10, time.Minute, nil), timeout: time.Minute}
	var wg sync.WaitGroup
	got := make([]*corev1.PersistentVolumeClaim, 2)
	for i := range got {
		wg.Go(func() {
			pvc, err := k.pvc(context.Background(), "apps", "data")
			if err != nil {
				t.Errorf("pvc: %v", err)
			}
			got[i] = pvc
		})
	}
	// Both callers in: the leader in the fake server, the other waiting
	// on the leader's flight.
	for {
		k.mu.Lock()
		in := len(k.flights) == 1
		k.mu.Unlock()
		if in && calls.Load() == 1 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	time.Sleep(20 * time.Millisecond)
	close(release)
	wg.Wait()
	if n := calls.Load(); n != 1 {
		t.Errorf("%d GETs for two reads of one claim at once, want 1", n)
	}
	for i, pvc := range got {
		if pvc == nil || pvc.Name != "data" {
			t.Errorf("read %d = %v, want claim apps/data", i, pvc)
		}
	}
}
