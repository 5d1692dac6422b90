package probe

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/mountmedic/mountmedic/scripts/lab"
)

// TestWriteCheckRealFaults runs WriteCheck on real ext4 filesystems: one
// healthy, one shut down (EXT4_IOC_SHUTDOWN), one whose journal aborted
// under errors=remount-ro (a loop device over a file on a FUSE mount whose
// daemon died). It is the probe's only signal of either on Linux 6.1, where
// mountinfo shows no "shutdown" or "emergency_ro" (docs/kernel-facts.md);
// scripts/guest runs it there.
func TestWriteCheckRealFaults(t *testing.T) {
	lab.RequireRoot(t)
	lab.RequireBinary(t, "mkfs.ext4")
	dir := t.TempDir()

	healthy := lab.NewExt4(t, filepath.Join(dir, "healthy"), 16)
	shut := lab.NewExt4(t, filepath.Join(dir, "shut"), 16)
	lower := lab.StartFaultFS(t, filepath.Join(dir, "lower"))
	aborted := lab.NewExt4On(t, filepath.Join(dir, "aborted"), lower.Mountpoint(), 16)

	shut.Shutdown()
	lower.Kill()
	// Writes that reach the dead backing file abort the journal at its
	// next commit.
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		f, err := os.OpenFile(filepath.Join(aborted.Mountpoint(), "g"), os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
		if err == nil {
			_, _ = f.Write([]byte("y"))
			err = f.Sync()
			f.Close()
		}
		if n, _ := aborted.ErrorsCount(); n > 0 && err != nil {
			break
		}
	}

	for name, tc := range map[string]struct {
		path string
		want []State
	}{
		"healthy":       {healthy.Mountpoint(), []State{Healthy}},
		"shut down":     {shut.Mountpoint(), []State{Shutdown}},
		"journal abort": {aborted.Mountpoint(), []State{ReadOnly, Shutdown}},
	} {
		st, err := WriteCheck(tc.path)
		ok := false
		for _, w := range tc.want {
			ok = ok || st == w
		}
		if !ok {
			t.Errorf("%s: WriteCheck(%s) = %v (%v), want one of %v", name, tc.path, st, err, tc.want)
		}
		t.Logf("write check facts: %s: %v (%v)", name, st, err)
	}
	// The check leaves nothing behind.
	ents, err := os.ReadDir(healthy.Mountpoint())
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if e.Name() != "lost+found" {
			t.Errorf("WriteCheck left %s on the volume", e.Name())
		}
	}
}
