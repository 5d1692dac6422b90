package lab

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

// StartMountNamespace starts a process (unshare(1) running sleep) in a
// mount namespace of its own, a copy of the caller's, and returns the path
// of its mount table, /proc/<pid>/mountinfo: the same mounts as the
// caller's under other mount IDs, as the host's /proc/1/mountinfo is to a
// hostPID container. propagation is unshare's --propagation: "unchanged"
// keeps every mount a peer of the caller's (unmounts here reach it as they
// reach the host through a Bidirectional volume), "private" cuts it off.
// The process is killed when the test ends.
func StartMountNamespace(t testing.TB, propagation string) string {
	t.Helper()
	cmd := exec.Command("unshare", "--mount", "--propagation", propagation, "sleep", "3600")
	if err := cmd.Start(); err != nil {
		t.Fatalf("start a process in a mount namespace of its own: %v", err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	ours, err := os.Readlink("/proc/thread-self/ns/mnt")
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join("/proc", strconv.Itoa(cmd.Process.Pid))
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		// unshare has made its namespace (and set the propagation) once it
		// has become sleep.
		ns, err := os.Readlink(filepath.Join(dir, "ns", "mnt"))
		comm, _ := os.ReadFile(filepath.Join(dir, "comm"))
		if err == nil && ns != ours && strings.TrimSpace(string(comm)) == "sleep" {
			return filepath.Join(dir, "mountinfo")
		}
		if time.Now().After(deadline) {
			t.Fatalf("unshare (pid %d) never entered a mount namespace of its own", cmd.Process.Pid)
		}
	}
}
