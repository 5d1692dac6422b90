package remount

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
)

// stackedMounts is how many binds the hostile pod stacks in its
// container's mount namespace (MOUNTMEDIC_STACKED_MOUNTS to change it).
// The kernel's fs.mount-max (100,000 by default) bounds a namespace's
// mounts: a larger ask is cut to what it leaves room for, which is the
// most a hostile pod can stack.
var stackedMounts = envInt("MOUNTMEDIC_STACKED_MOUNTS", 100_000)

func envInt(name string, def int) int {
	if n, err := strconv.Atoi(os.Getenv(name)); err == nil && n > 0 {
		return n
	}
	return def
}

// stackedDead is how many binds of the dead volume it stacks: more than
// probe.DefaultMaxDevMounts, the most a read keeps.
const stackedDead = 5_000

// TestStackedMountsBoundedRead: the hostile actor is a pod's root (a
// user-namespaced pod's, or a privileged one's), who can mount in its
// container's mount namespace. During a repair of its volume it has
// stacked binds of a tmpfs under long mount points up to the kernel's
// limit (about 100,000 mounts, a 29 MB table) and 5,000 binds of the
// volume itself there. The repairs read only the containers' own
// namespaces, streamed, keeping the lines of the dead device up to a cap:
// the test binary's peak RSS grows by less than the stacked table would
// cost read whole, and the other pod's volume, repaired at the same time,
// heals.
func TestStackedMountsBoundedRead(t *testing.T) {
	d := startDriverLab(t, Config{})
	one := func(name string) podDef {
		return podDef{name: name, ctrs: []ctrDef{{name: "app", mounts: []corev1.VolumeMount{{Name: testVolumeName, MountPath: "/data"}}}}}
	}
	hv := d.newVolume(t, "stacked", one("hostile"))
	ov := d.newVolume(t, "bystander", one("other"))
	c := hv.pods[0].ctrs["app"]
	stacked := stackedRoom(t, c.Pid(), stackedMounts)
	t.Logf("stacking %d + %d binds in pid %d's mount namespace", stacked, stackedDead, c.Pid())

	err := inContainerNamespace(t, c.Pid(), func() error {
		// A tmpfs of the pod's own holds the mount points (each its own:
		// binds stacked on one mount point cost every lookup a walk up
		// the stack), under a long name, as a hostile pod would choose
		// to make each line long.
		base := filepath.Join(c.Root(), "stack")
		if err := os.MkdirAll(base, 0o755); err != nil {
			return err
		}
		if err := unix.Mount("stack", base, "tmpfs", 0, "size=64m,nr_inodes=200k"); err != nil {
			return fmt.Errorf("mount tmpfs: %w", err)
		}
		long := filepath.Join(base, strings.Repeat("x", 200))
		src := filepath.Join(base, "src")
		for _, dir := range []string{long, src} {
			if err := os.MkdirAll(dir, 0o755); err != nil {
				return err
			}
		}
		vol := filepath.Join(c.Root(), "data")
		// The volume's binds one by one; then a batch of binds of src,
		// copied whole by recursive binds (each copy one mount more, the
		// bind of the batch's directory): binds made one at a time cost
		// the kernel more with every mount there (here 30,000 took 70 s,
		// 60,000 through copies 0.1 s), and a hostile pod copies.
		bind := func(from, dir string, flags uintptr) error {
			if err := unix.Mkdir(dir, 0o755); err != nil {
				return err
			}
			if err := unix.Mount(from, dir, "", unix.MS_BIND|flags, ""); err != nil {
				return fmt.Errorf("bind %s at %s: %w", from, dir, err)
			}
			return nil
		}
		for i := range stackedDead {
			if err := bind(vol, filepath.Join(long, "d"+strconv.Itoa(i)), 0); err != nil {
				return err
			}
		}
		const batch = 1000
		first := filepath.Join(long, "0")
		if err := os.Mkdir(first, 0o755); err != nil {
			return err
		}
		made := 0
		for ; made < min(batch, stacked); made++ {
			if err := bind(src, filepath.Join(first, strconv.Itoa(made)), 0); err != nil {
				return err
			}
		}
		for copies := 1; made+batch+1 <= stacked; copies++ {
			if err := bind(first, filepath.Join(long, strconv.Itoa(copies)), unix.MS_REC); err != nil {
				return err
			}
			made += batch + 1
		}
		return nil
	})
	if err != nil {
		t.Fatalf("stack mounts in the container: %v", err)
	}
	lines, size := tableSize(t, c.Pid())
	t.Logf("the hostile container's mount table: %d lines, %d bytes", lines, size)

	d.drv.Kill()
	d.markDead(t, hv, ov)
	d.restartDriver(t)

	before := resetPeakRSS(t)
	type result struct{ re, ls Outcome }
	results := make([]result, 2)
	vols := []*realVolume{hv, ov}
	var wg sync.WaitGroup
	for i, rv := range vols {
		wg.Go(func() {
			ctx := context.Background()
			results[i].re = d.r.Restage(ctx, rv.vol)
			results[i].ls = d.r.LiveSwap(ctx, rv.vol)
		})
	}
	wg.Wait()
	peak := peakRSS(t)
	for i, name := range []string{"hostile", "bystander"} {
		logOutcome(t, name+" restage", results[i].re)
		logOutcome(t, name+" liveswap", results[i].ls)
	}
	if r := results[1]; !r.ls.Healed {
		t.Errorf("the bystander's volume: LiveSwap healed %t, err %v; want healed beside the stacked pod", r.ls.Healed, r.ls.Err)
	}
	wantViews(t, ov.views("bystander"))
	// Read whole, as before, each read of the stacked table held it and a
	// parsed entry per line: more than 32 MiB.
	grew := peak - before
	t.Logf("peak RSS during the repairs: %d KiB (%d KiB before, +%d KiB)", peak>>10, before>>10, grew>>10)
	if grew > 16<<20 && !raceEnabled { // the race detector's shadow memory grows with the heap
		t.Errorf("peak RSS grew by %d KiB during the repairs, want under 16 MiB: the stacked table was held", grew>>10)
	}
	t.Logf("the hostile pod's LiveSwap: healed %t, err %v", results[0].ls.Healed, results[0].ls.Err)
}

// tableSize counts the lines and bytes of pid's mount table, streamed, so
// that the test's own RSS stays what the agent's would be.
func tableSize(t *testing.T, pid int) (lines, size int) {
	t.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	r := bufio.NewReaderSize(f, 64<<10)
	for {
		l, err := r.ReadSlice('\n')
		size += len(l)
		if err == nil {
			lines++
			continue
		}
		if errors.Is(err, bufio.ErrBufferFull) {
			continue
		}
		if !errors.Is(err, io.EOF) {
			t.Fatal(err)
		}
		return lines, size
	}
}

// stackedRoom returns want, or less when fs.mount-max leaves pid's mount
// namespace room for fewer: its mounts now, the pod's tmpfs and the
// stackedDead binds come first.
func stackedRoom(t *testing.T, pid, want int) int {
	t.Helper()
	b, err := os.ReadFile("/proc/sys/fs/mount-max")
	if err != nil {
		t.Fatalf("read fs.mount-max: %v", err)
	}
	limit, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatalf("fs.mount-max %q: %v", b, err)
	}
	table, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		t.Fatal(err)
	}
	room := limit - strings.Count(string(table), "\n") - 1 - stackedDead
	if want > room {
		t.Logf("fs.mount-max %d leaves room for %d binds, not %d: stacking %d", limit, room+stackedDead, want+stackedDead, room)
		return room
	}
	return want
}

// inContainerNamespace runs fn in the mount namespace of pid, on a thread
// of its own (inMountNamespace: never the main thread).
func inContainerNamespace(t *testing.T, pid int, fn func() error) error {
	t.Helper()
	nsfd, err := unix.Open(fmt.Sprintf("/proc/%d/ns/mnt", pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(nsfd)
	var fnErr error
	if err := inMountNamespace(Syscalls{}.orHost(), nsfd, func() { fnErr = fn() }); err != nil {
		return err
	}
	return fnErr
}

// resetPeakRSS resets the process's peak RSS (clear_refs 5) and returns
// its RSS.
func resetPeakRSS(t *testing.T) int64 {
	t.Helper()
	runtime.GC()
	if err := os.WriteFile("/proc/self/clear_refs", []byte("5"), 0); err != nil {
		t.Fatalf("reset peak RSS: %v", err)
	}
	return statusKiB(t, "VmRSS")
}

func peakRSS(t *testing.T) int64 { return statusKiB(t, "VmHWM") }

func statusKiB(t *testing.T, key string) int64 {
	t.Helper()
	f, err := os.Open("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		v, ok := strings.CutPrefix(sc.Text(), key+":")
		if !ok {
			continue
		}
		n, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		return n << 10
	}
	t.Fatalf("no %s in /proc/self/status", key)
	return 0
}
