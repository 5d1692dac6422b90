package remount

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// TestBindSubPathBoundedOnAHungFreshVolume: a fresh volume whose daemon
// hangs before the subPath is looked up fails the bind within its bound
// (shortened here) instead of holding the repair worker; a second try while the
// first lookup is parked parks nothing more; the late lookup binds nothing;
// once the daemon answers, the bind goes through.
func TestBindSubPathBoundedOnAHungFreshVolume(t *testing.T) {
	lab.RequireRoot(t)
	k := newKubelet(t)
	root := k.Root()
	backing := t.TempDir()
	writeFile(t, filepath.Join(backing, "sub", "g"), "fresh-sub")
	publish := k.StagingPath(labDriver, "fresh")
	fs := lab.StartFaultFS(t, publish, lab.WithBackingDir(backing))
	target := filepath.Join(root, "pods", labPod, "volume-subpaths", labVolume, "app", "0")
	if err := os.MkdirAll(target, 0o750); err != nil {
		t.Fatal(err)
	}
	r, err := New(Config{KubeletRoot: root})
	if err != nil {
		t.Fatal(err)
	}
	r.lookupTimeout = 200 * time.Millisecond
	bind := func() error {
		errc := make(chan error, 1)
		go func() { errc <- r.bindSubPath(context.Background(), publish, "sub", target) }()
		select {
		case err := <-errc:
			return err
		case <-time.After(failBound):
			t.Fatalf("bindSubPath on a hung fresh volume did not return within %s", failBound)
			return nil
		}
	}

	fs.Hang()
	t.Cleanup(fs.Release)
	if err := bind(); !errors.Is(err, probe.ErrHung) {
		t.Fatalf("bind on a hung fresh volume = %v, want ErrHung", err)
	}
	if n := r.lookups.parkedCount(); n != 1 {
		t.Errorf("parked lookups = %d, want 1", n)
	}
	if err := bind(); !errors.Is(err, probe.ErrHung) {
		t.Errorf("second bind while the lookup is parked = %v, want ErrHung", err)
	}
	if n := r.lookups.parkedCount(); n != 1 {
		t.Errorf("parked lookups after a second try = %d, want still 1", n)
	}

	fs.Release()
	deadline := time.Now().Add(failBound)
	for r.lookups.parkedCount() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("the parked lookup never returned after the daemon answered")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if id := topID(t, root, target); id != 0 {
		t.Fatalf("mount %d on %s after the late lookup returned: a lookup given up on must bind nothing", id, target)
	}
	if err := bind(); err != nil {
		t.Fatalf("bind once the daemon answers = %v", err)
	}
	wantFile(t, filepath.Join(target, "g"), "fresh-sub")
}
