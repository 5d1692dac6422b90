package probe

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/scripts/lab"
)

// TestReadTableWhileMountsChurn: a node repairing a thousand volumes
// unmounts and mounts all the time, and the kernel gives a freed mount ID
// to the next mount at once, so one read of a big live table can list an
// ID twice (the mount freed during the read, and the one that took its
// ID). Such a read is read again, not refused: found at 1,000 hung
// volumes, where a re-stage's own table read failed this way three times
// in a row and the volume was sent down the repair ladder.
func TestReadTableWhileMountsChurn(t *testing.T) {
	lab.RequireRoot(t)
	dir := t.TempDir()
	const mounts = 1500
	paths := make([]string, mounts)
	for i := range paths {
		paths[i] = filepath.Join(dir, fmt.Sprint(i))
		if err := os.Mkdir(paths[i], 0o755); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mount("churn", paths[i], "tmpfs", 0, "size=4k"); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for _, p := range paths {
			_ = unix.Unmount(p, unix.MNT_DETACH)
		}
	})
	ctx, stop := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	for w := range 2 {
		wg.Go(func() {
			for i := w; ctx.Err() == nil; i = (i + 2) % mounts {
				// The ID freed here is the next mount's.
				if err := unix.Unmount(paths[i], 0); err != nil {
					t.Errorf("unmount %s: %v", paths[i], err)
					return
				}
				if err := unix.Mount("churn", paths[i], "tmpfs", 0, "size=4k"); err != nil {
					t.Errorf("mount %s: %v", paths[i], err)
					return
				}
			}
		})
	}
	failed := 0
	const reads = 100
	for range reads {
		if _, err := ReadFile("/proc/thread-self/mountinfo", Options{}); err != nil {
			failed++
			t.Log(err)
		}
	}
	stop()
	wg.Wait()
	if failed > 0 {
		t.Errorf("%d of %d reads of the live table failed while mounts churned, want none", failed, reads)
	}
}
