package lab

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestFaultFSManyMounts: one daemon serves many mounts, each its own FUSE
// connection. A hang reaches every mount; aborting one connection fails the
// calls blocked on it and leaves the others blocked (the daemon lives on);
// a kill disconnects them all.
func TestFaultFSManyMounts(t *testing.T) {
	RequireRoot(t)
	dir := t.TempDir()
	var mps []string
	for i := range 5 {
		mps = append(mps, filepath.Join(dir, "m"+strconv.Itoa(i)))
	}
	f := StartFaultFSMany(t, mps)
	conns := f.Conns()
	seen := make(map[uint32]bool)
	for i, mp := range mps {
		if err := statfs(mp); err != nil {
			t.Fatalf("statfs %s: %v", mp, err)
		}
		seen[conns[i]] = true
	}
	if len(seen) != len(mps) {
		t.Fatalf("%d mounts on %d connections (%v), want one each", len(mps), len(seen), conns)
	}
	if err := os.WriteFile(filepath.Join(f.BackingDir(), "x"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := os.ReadFile(filepath.Join(mps[3], "x")); err != nil {
		t.Errorf("read through the fourth mount: %v", err)
	}

	f.Delay(200 * time.Millisecond)
	start := time.Now()
	if err := statfs(mps[2]); err != nil {
		t.Errorf("statfs of a slow mount: %v, want an answer", err)
	}
	if took := time.Since(start); took < 200*time.Millisecond {
		t.Errorf("statfs of a mount delayed 200ms answered in %s", took)
	}
	f.Delay(0)

	f.Hang()
	blocked := make([]chan error, len(mps))
	for i, mp := range mps {
		blocked[i] = make(chan error, 1)
		go func() { blocked[i] <- statfs(mp) }()
	}
	time.Sleep(blockedFor)
	for i := range mps {
		select {
		case err := <-blocked[i]:
			t.Fatalf("statfs of hung mount %d returned %v, want it blocked", i, err)
		default:
		}
	}
	p := filepath.Join(fusectlDir, strconv.FormatUint(uint64(conns[0]), 10), "abort")
	if err := os.WriteFile(p, []byte("1"), 0); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-blocked[0]:
		if !errors.Is(err, unix.ECONNABORTED) && !errors.Is(err, unix.ENOTCONN) {
			t.Errorf("statfs of the aborted mount returned %v, want ECONNABORTED", err)
		}
	case <-time.After(unblockWait):
		t.Fatal("statfs of the aborted mount still blocked")
	}
	time.Sleep(blockedFor / 4)
	for i := 1; i < len(mps); i++ {
		select {
		case err := <-blocked[i]:
			t.Fatalf("aborting connection %d unblocked mount %d (%v): the daemon must outlive one connection", conns[0], i, err)
		default:
		}
	}
	f.Release()
	for i := 1; i < len(mps); i++ {
		select {
		case err := <-blocked[i]:
			if err != nil {
				t.Errorf("statfs of mount %d after release: %v", i, err)
			}
		case <-time.After(unblockWait):
			t.Fatalf("statfs of mount %d still blocked after release", i)
		}
	}
	f.Kill()
	for i, mp := range mps[1:] {
		if err := statfs(mp); !errors.Is(err, unix.ENOTCONN) {
			t.Errorf("statfs of mount %d after the kill: %v, want ENOTCONN", i+1, err)
		}
	}
}
