package probe_test

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

// TestCheckInHungAndSymlinks: CheckIn keeps CheckPath's rules on a hung
// FUSE mount (the open blocks as much as statfs: Hung at the deadline, and
// Hung at once while that probe has not returned), tells a dead mount
// apart, and refuses a symlink inside the root, relative or absolute.
func TestCheckInHungAndSymlinks(t *testing.T) {
	lab.RequireRoot(t)
	root := t.TempDir()
	fs := lab.StartFaultFS(t, filepath.Join(root, "vol"))
	p := probe.NewProber(probe.Config{Timeout: 300 * time.Millisecond})
	ctx := context.Background()
	if st, err := p.CheckIn(ctx, root, "/vol"); st != probe.Healthy {
		t.Fatalf("healthy mount: %s, %v", st, err)
	}
	if err := os.Symlink("/vol", filepath.Join(root, "abs")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("vol", filepath.Join(root, "rel")); err != nil {
		t.Fatal(err)
	}
	for _, link := range []string{"/abs", "rel", "/rel/."} {
		if st, err := p.CheckIn(ctx, root, link); st == probe.Healthy || !errors.Is(err, probe.ErrSymlinkInRoot) {
			t.Errorf("CheckIn through symlink %s: %s, %v; want ErrSymlinkInRoot", link, st, err)
		}
	}

	fs.Hang()
	for i := range 2 {
		if st, err := p.CheckIn(ctx, root, "/vol"); st != probe.Hung || !errors.Is(err, probe.ErrHung) {
			t.Errorf("hung mount, probe %d: %s, %v; want Hung", i, st, err)
		}
	}
	fs.Abort()
	deadline := time.Now().Add(10 * time.Second)
	for {
		st, err := p.CheckIn(ctx, root, "/vol")
		if st.Broken() && st != probe.Hung {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("aborted mount: %s, %v; want a broken state", st, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
