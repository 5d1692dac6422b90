package probe

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestTableReaderJoinsOnlyLaterReads: callers that ask for the table while
// a read runs share one read, and none gets a read that began before it
// asked (it may have just changed a mount).
func TestTableReaderJoinsOnlyLaterReads(t *testing.T) {
	var started atomic.Int32
	release := make(chan struct{})
	tr := NewTableReader("/proc/self/mountinfo", Options{})
	tr.read = func(context.Context, string, Options) (*Inventory, error) {
		n := started.Add(1)
		if n == 1 {
			<-release
		}
		// The inventory says which read made it.
		return &Inventory{Mounts: make([]*Mount, n)}, nil
	}
	ctx := context.Background()
	first := make(chan int, 1)
	go func() {
		inv, _ := tr.Read(ctx)
		first <- len(inv.Mounts)
	}()
	for started.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	const askers = 20
	got := make([]int, askers)
	var wg sync.WaitGroup
	var asked atomic.Int32
	for i := range askers {
		wg.Go(func() {
			asked.Add(1)
			inv, err := tr.Read(ctx)
			if err != nil {
				t.Error(err)
				return
			}
			got[i] = len(inv.Mounts)
		})
	}
	for asked.Load() < askers {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(20 * time.Millisecond) // let them queue; the result holds either way
	close(release)
	wg.Wait()
	if n := <-first; n != 1 {
		t.Errorf("first caller got read %d, want 1", n)
	}
	for i, n := range got {
		if n < 2 {
			t.Errorf("asker %d got read %d, which began before it asked", i, n)
		}
	}
	reads := started.Load()
	t.Logf("%d callers, %d reads", askers+1, reads)
	if reads > askers {
		t.Errorf("%d reads for %d callers: none shared", reads, askers+1)
	}
	if last := tr.Last(); last == nil || len(last.Mounts) != int(reads) {
		t.Errorf("Last() = %v, want the newest read (%d)", last, reads)
	}
}
