package lab

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// cgroup2Magic is the f_type statfs reports for a cgroup v2 hierarchy.
const cgroup2Magic = 0x63677270

// cgroupMounts are the hierarchies a lab container may join, best first:
// cgroup v2 (unified, or hybrid's unified mount), then v1 hierarchies that
// every v1 host has and that no controller restricts.
var cgroupMounts = []string{"/sys/fs/cgroup", "/sys/fs/cgroup/unified", "/sys/fs/cgroup/pids", "/sys/fs/cgroup/systemd", "/sys/fs/cgroup/memory"}

// podCgroup is the cgroup a lab container joined, with the directories the
// lab made for it (deepest last).
type podCgroup struct {
	dirs []string
}

// joinPodCgroup makes <hierarchy>/mountmedic-lab-<random>/kubepods/besteffort/
// pod<podUID>/<containerID> and moves pid into it. The random top directory
// keeps tests that run at the same time on this machine apart.
func joinPodCgroup(pid int, podUID, containerID string) (*podCgroup, error) {
	if containerID == "" || strings.ContainsAny(containerID, "/.") || strings.ContainsAny(podUID, "/.") {
		return nil, fmt.Errorf("pod cgroup: pod UID %q and container ID %q must be plain names", podUID, containerID)
	}
	hierarchy, err := cgroupHierarchy()
	if err != nil {
		return nil, err
	}
	var nonce [6]byte
	if _, err := rand.Read(nonce[:]); err != nil {
		return nil, fmt.Errorf("pod cgroup name: %w", err)
	}
	cg := &podCgroup{}
	dir := hierarchy
	for _, name := range []string{"mountmedic-lab-" + hex.EncodeToString(nonce[:]), "kubepods", "besteffort", "pod" + podUID, containerID} {
		dir = filepath.Join(dir, name)
		if err := os.Mkdir(dir, 0o755); err != nil {
			_ = cg.remove()
			return nil, fmt.Errorf("pod cgroup: %w", err)
		}
		cg.dirs = append(cg.dirs, dir)
	}
	if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
		_ = cg.remove()
		return nil, fmt.Errorf("pod cgroup: move pid %d into %s: %w", pid, dir, err)
	}
	return cg, nil
}

// cgroupHierarchy returns the first hierarchy of cgroupMounts that is
// mounted: cgroup v2, or a v1 hierarchy.
func cgroupHierarchy() (string, error) {
	for i, p := range cgroupMounts {
		var st unix.Statfs_t
		if err := unix.Statfs(p, &st); err != nil {
			continue
		}
		if i < 2 && st.Type != cgroup2Magic {
			continue
		}
		if i >= 2 && st.Type != unix.CGROUP_SUPER_MAGIC {
			continue
		}
		return p, nil
	}
	return "", fmt.Errorf("no cgroup hierarchy mounted at any of %s", strings.Join(cgroupMounts, ", "))
}

// remove deletes the lab's directories, deepest first. The container's
// process must be gone (a cgroup with a process cannot be removed).
func (c *podCgroup) remove() error {
	var errs []error
	for i := len(c.dirs) - 1; i >= 0; i-- {
		err := os.Remove(c.dirs[i])
		// A cgroup whose last process was just reaped can answer EBUSY
		// for a moment while the kernel takes it offline.
		for try := 0; errors.Is(err, unix.EBUSY) && try < 100; try++ {
			time.Sleep(20 * time.Millisecond)
			err = os.Remove(c.dirs[i])
		}
		if err != nil && !errors.Is(err, fs.ErrNotExist) {
			errs = append(errs, fmt.Errorf("remove pod cgroup %s: %w", c.dirs[i], err))
		}
	}
	c.dirs = nil
	return errors.Join(errs...)
}

// JoinPodCgroup moves process pid into a cgroup named as kubelet's
// cgroupfs driver names a pod container's (see joinPodCgroup), as a
// stand-in for a process of that pod. Cleanup kills the process and
// removes the directories.
func JoinPodCgroup(t testing.TB, pid int, podUID, containerID string) {
	t.Helper()
	cg, err := joinPodCgroup(pid, podUID, containerID)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// A process leaves its cgroup when it exits, before it is reaped.
		_ = unix.Kill(pid, unix.SIGKILL)
		if err := cg.remove(); err != nil {
			t.Error(err)
		}
	})
}
