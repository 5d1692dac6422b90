package remount

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/mountmedic/mountmedic/probe"
)

// TestTableShareJoinsOnlyLaterReads: repairs that ask for the host table
// while a read runs share one read, and none gets a read that began
// before it asked (it may have just changed a mount).
func TestTableShareJoinsOnlyLaterReads(t *testing.T) {
	var s tableShare
	var started atomic.Int32
	release := make(chan struct{})
	fn := func() (*hostTable, error) {
		n := started.Add(1)
		if n == 1 {
			<-release
		}
		// The table says which read made it.
		return &hostTable{stacks: map[string][]*probe.Mount{"read": make([]*probe.Mount, n)}}, nil
	}
	first := make(chan int, 1)
	go func() {
		tb, _ := s.read(fn)
		first <- len(tb.stacks["read"])
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
			tb, err := s.read(fn)
			if err != nil {
				t.Error(err)
				return
			}
			got[i] = len(tb.stacks["read"])
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
}
