package lab

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestContainerChrootReadOnlyCgroup(t *testing.T) {
	RequireRoot(t)
	src := t.TempDir()
	if err := os.WriteFile(filepath.Join(src, "f"), []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	const uid = "0d6f7c1a-2b3c-4d5e-8f90-a1b2c3d4e5f6"
	const id = "c0ffee0123456789abcdef0123456789abcdef0123456789abcdef0123456789"
	var dirs []string
	t.Run("running", func(t *testing.T) {
		c := StartContainer(t, "c", PropagationPrivate, map[string]string{"/data": src, "/ro": src},
			WithChroot(), WithReadOnly("/ro"), WithPodCgroup(uid, id))
		// Chrooted: its root is the container root, its mountinfo shows
		// container paths.
		if got, err := os.ReadFile(c.Path("/data/f")); err != nil || string(got) != "x" {
			t.Errorf("read %s = %q, %v", c.Path("/data/f"), got, err)
		}
		info, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(c.Pid()), "mountinfo"))
		if err != nil || !strings.Contains(string(info), " /data ") || !strings.Contains(string(info), " /ro ro,") {
			t.Errorf("container mountinfo (%v) lacks /data or a read-only /ro:\n%s", err, info)
		}
		if err := os.WriteFile(c.Path("/ro/g"), []byte("y"), 0o644); !errors.Is(err, unix.EROFS) {
			t.Errorf("write under the read-only bind = %v, want EROFS", err)
		}
		cg, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(c.Pid()), "cgroup"))
		if err != nil || !strings.Contains(string(cg), "/kubepods/besteffort/pod"+uid+"/"+id+"\n") {
			t.Errorf("container cgroup (%v) = %q, want .../kubepods/besteffort/pod%s/%s", err, cg, uid, id)
		}
		h, err := cgroupHierarchy()
		if err != nil {
			t.Fatal(err)
		}
		for _, line := range strings.Split(strings.TrimSpace(string(cg)), "\n") {
			// hierarchy-ID:controllers:path; the one the lab used names the container.
			if f := strings.SplitN(line, ":", 3); len(f) == 3 && strings.Contains(f[2], id) {
				dirs = append(dirs, filepath.Join(h, f[2]))
				break
			}
		}
	})
	// Cleanup removed the cgroup directories.
	if len(dirs) == 0 {
		t.Fatalf("no cgroup path found")
	}
	for _, d := range dirs {
		if _, err := os.Stat(d); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("cgroup %s left behind: %v", d, err)
		}
	}
}
