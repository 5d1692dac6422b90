package main

import (
	"sync"
	"testing"

	"golang.org/x/sys/unix"
)

// TestNoGoroutineRunsOnMainThread: the kernel hands a process-directed
// signal to the main thread first, and a main thread waiting on a hung FUSE
// daemon never runs the handler, so SIGTERM is lost (see init). The test
// binary runs package main's init too: while the main goroutine waits for
// the tests, goroutines doing blocking work must land on any thread but
// the main one.
func TestNoGoroutineRunsOnMainThread(t *testing.T) {
	pid := unix.Getpid()
	var (
		wg     sync.WaitGroup
		mu     sync.Mutex
		onMain int
	)
	for range 200 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 50 {
				// A syscall that blocks hands the thread over: the
				// goroutine resumes wherever the scheduler puts it.
				_ = unix.Nanosleep(&unix.Timespec{Nsec: 100_000}, nil)
				if unix.Gettid() == pid {
					mu.Lock()
					onMain++
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	if onMain > 0 {
		t.Fatalf("goroutines ran %d times on the main thread (tid %d): a blocked FUSE call there would swallow SIGTERM", onMain, pid)
	}
}
