package remount

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// Hostile pods (issue 12): what a container user can make the live swap do.

// nestedUser is a non-root process of a container that made its own user
// and mount namespace (unshare -Urm) inside the container's, and waits for
// a line on its standard input before it tries to make its copy of the
// read-only volume writable and write into it.
type nestedUser struct {
	cmd   *exec.Cmd
	in    io.WriteCloser
	out   *bufio.Reader
	pid   int
	mount string
}

// startNestedUser starts the process in c's mount namespace and c's cgroup
// (where the cgroup scan finds it as one of the pod's), as uid 65534.
// mountPath is the volume's mount point in c's mount namespace.
func startNestedUser(t *testing.T, c *lab.Container, uid types.UID, id, mountPath string) *nestedUser {
	t.Helper()
	for _, bin := range []string{"nsenter", "setpriv", "unshare", "mount"} {
		if _, err := exec.LookPath(bin); err != nil {
			t.Skipf("%s not installed: %v", bin, err)
		}
	}
	// The test's temporary directories are 0700: let the user reach the
	// mount point, as any user of a container reaches its volume.
	for dir := filepath.Dir(mountPath); dir != "/" && dir != os.TempDir(); dir = filepath.Dir(dir) {
		if err := os.Chmod(dir, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	script := `echo ready $$; read go; ` +
		`if mount -o remount,bind,rw "$1" 2>&1; then echo REMOUNTED; fi; ` +
		`if echo pwned > "$1/pwned" 2>/dev/null; then echo WROTE; fi; echo done`
	cmd := exec.Command("nsenter", "-t", strconv.Itoa(c.Pid()), "-m", "--",
		"setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
		"unshare", "-Urm", "--propagation", "unchanged", "sh", "-c", script, "sh", mountPath)
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	outp, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	n := &nestedUser{cmd: cmd, in: in, out: bufio.NewReader(outp), mount: mountPath}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	line, err := n.out.ReadString('\n')
	if err != nil || !strings.HasPrefix(line, "ready ") {
		t.Fatalf("nested user: %q, %v", line, err)
	}
	if n.pid, err = strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(line, "ready "))); err != nil {
		t.Fatal(err)
	}
	// Into the container's cgroup, as a process the container forked.
	dirs, err := filepath.Glob(filepath.Join("/sys/fs/cgroup", "*", "mountmedic-lab-*", "kubepods", "besteffort", "pod"+string(uid), id))
	if more, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup", "mountmedic-lab-*", "kubepods", "besteffort", "pod"+string(uid), id)); err == nil {
		dirs = append(dirs, more...)
	}
	if err != nil || len(dirs) != 1 {
		t.Fatalf("cgroup of container %s: %v %v", id, dirs, err)
	}
	if err := os.WriteFile(filepath.Join(dirs[0], "cgroup.procs"), []byte(strconv.Itoa(n.pid)), 0); err != nil {
		t.Fatalf("move the nested user into %s: %v", dirs[0], err)
	}
	return n
}

// try lets the process try and returns what it printed.
func (n *nestedUser) try(t *testing.T) string {
	t.Helper()
	if _, err := io.WriteString(n.in, "go\n"); err != nil {
		t.Fatal(err)
	}
	done := make(chan string, 1)
	go func() {
		b, _ := io.ReadAll(n.out)
		done <- string(b)
	}()
	select {
	case out := <-done:
		return out
	case <-time.After(30 * time.Second):
		t.Fatal("nested user did not finish")
		return ""
	}
}

// TestLiveSwapReadOnlyStaysReadOnly: a non-root process of a pod makes its
// own user and mount namespace (unshare -Urm) before the repair, and one
// after it; neither may make the read-only volume writable after a live
// swap (mount -o remount,bind,rw), nor write into it. The swap goes only
// into the container's own mount namespace, never into the nested one.
func TestLiveSwapReadOnlyStaysReadOnly(t *testing.T) {
	d := startDriverLab(t, Config{})
	const prefix = "rovol"
	rv := d.newVolume(t, prefix, podDef{name: "ro", ctrs: []ctrDef{{name: "reader", readOnly: []string{"/data"},
		mounts: []corev1.VolumeMount{{Name: testVolumeName, MountPath: "/data", ReadOnly: true}}}}})
	c := rv.pods[0].ctrs["reader"]
	mountPath := filepath.Join(c.Root(), "data")
	uid, id := rv.pods[0].uid, rv.vol.Pods[0].Containers[0].ContainerID
	before := startNestedUser(t, c, uid, id, mountPath)

	d.drv.Kill()
	d.markDead(t, rv)
	d.restartDriver(t)
	_, ls := repair(t, d.r, rv.vol)
	if !ls.Healed {
		t.Fatalf("LiveSwap: healed %t, err %v", ls.Healed, ls.Err)
	}
	wantViews(t, rv.views(prefix))
	for _, a := range ls.Actions {
		if a.Op == opSwap && strings.Contains(a.Path, fmt.Sprintf("pid %d:", before.pid)) {
			t.Errorf("swapped into the nested namespace of pid %d: %v", before.pid, a)
		}
	}
	after := startNestedUser(t, c, uid, id, mountPath)
	for name, n := range map[string]*nestedUser{"made before the swap": before, "made after the swap": after} {
		out := n.try(t)
		t.Logf("nested user namespace %s: %s", name, out)
		if strings.Contains(out, "REMOUNTED") || strings.Contains(out, "WROTE") {
			t.Errorf("nested user namespace %s made the read-only volume writable: %s", name, out)
		}
	}
	if _, err := os.Stat(filepath.Join(rv.pods[0].target, "pwned")); err == nil {
		t.Errorf("a file written through the read-only volumeMount is in the volume")
	}
}

// TestSwapRefusesForeignNamespaceOwner: a mount namespace that the
// process's own user namespace does not own is refused, and so is one owned
// by another user namespace than ours (a user-namespaced pod), read-only or
// read-write: its root (the hostile actor, root of the pod's user
// namespace) could remount a moved mount writable or clear nosuid, nodev
// or noexec on it. A plain container's namespace, owned by ours, is not.
// Swap says so for each target and changes nothing.
func TestSwapRefusesForeignNamespaceOwner(t *testing.T) {
	lab.RequireRoot(t)
	start := func(args ...string) int {
		cmd := exec.Command(args[0], args[1:]...)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		// unshare execs in place: wait until cmd's process is sleep.
		pid := cmd.Process.Pid
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			if exe, _ := os.Readlink(fmt.Sprintf("/proc/%d/exe", pid)); strings.HasSuffix(exe, "/sleep") {
				return pid
			}
			if time.Now().After(deadline) {
				t.Fatalf("%v did not start", args)
			}
		}
	}
	check := func(pid int) error {
		nsfd, err := unix.Open(fmt.Sprintf("/proc/%d/ns/mnt", pid), unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		defer unix.Close(nsfd)
		return checkNamespaceOwner("/proc", pid, nsfd)
	}
	// A mount namespace made first, then a user namespace: the process's
	// user namespace does not own its mount namespace.
	pid := start("unshare", "-m", "--", "unshare", "-U", "sleep", "60")
	if err := check(pid); !errors.Is(err, errForeignNamespace) {
		t.Errorf("mount namespace not owned by the process's user namespace: %v, want errForeignNamespace", err)
	}
	// A user-namespaced container.
	userns := start("unshare", "-Urm", "sleep", "60")
	if err := check(userns); !errors.Is(err, errForeignNamespace) {
		t.Errorf("user-namespaced container: %v, want errForeignNamespace", err)
	}
	// A plain container.
	if err := check(start("unshare", "-m", "sleep", "60")); err != nil {
		t.Errorf("plain container: %v", err)
	}
	// Swap refuses every target there, read-write included, in dry-run
	// and for real, and names the reason.
	for _, dry := range []bool{true, false} {
		s := &swapper{DryRun: dry, Root: t.TempDir()}
		acts, err := s.Swap(context.Background(), []swapTarget{
			{Pid: userns, ContainerPath: "/data", Source: "/nonexistent"},
			{Pid: userns, ContainerPath: "/ro", Source: "/nonexistent", ReadOnly: true},
		})
		if !errors.Is(err, errForeignNamespace) || len(acts) != 2 {
			t.Errorf("Swap into a user-namespaced container (dry-run %t) = %v, %v; want two refused actions", dry, acts, err)
		}
		for _, a := range acts {
			if !errors.Is(a.Err, errForeignNamespace) {
				t.Errorf("Swap into a user-namespaced container (dry-run %t): action %v, want errForeignNamespace", dry, a)
			}
		}
	}
}

// TestPodOfFirstCgroupSegment: a process of pod A that made (in a writable
// cgroup) .../podA/<ctrA>/pod<B>/<ctrB> is A's, never B's: it cannot take
// B's container entry. A process whose v1 hierarchies disagree on its pod
// is nobody's.
func TestPodOfFirstCgroupSegment(t *testing.T) {
	const (
		podA = "0a0a0a0a-0000-4000-8000-00000000000a"
		podB = "0b0b0b0b-0000-4000-8000-00000000000b"
	)
	ctrA, ctrB := strings.Repeat("a", 64), strings.Repeat("b", 64)
	base := "/kubepods/besteffort/"
	procs := map[int]string{
		10: "0::" + base + "pod" + podA + "/" + ctrA + "\n",
		11: "0::" + base + "pod" + podA + "/" + ctrA + "/pod" + podB + "/" + ctrB + "\n",
		12: "0::" + base + "pod" + podB + "/" + ctrB + "\n",
		// systemd driver, B's container
		13: "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + strings.ReplaceAll(podB, "-", "_") +
			".slice/cri-containerd-" + ctrB + ".scope\n",
		// v1 hierarchies that disagree
		9: "4:memory:" + base + "pod" + podB + "/" + ctrB + "\n3:pids:" + base + "pod" + podA + "/" + ctrA + "\n",
	}
	dir := t.TempDir()
	for pid, cg := range procs {
		p := filepath.Join(dir, strconv.Itoa(pid))
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(p, "cgroup"), []byte(cg), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for uid, want := range map[string][]int{podA: {10, 11}, podB: {12, 13}} {
		got, err := PodPIDs(dir, uid)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got, want) {
			t.Errorf("PodPIDs(%s) = %v, want %v", uid, got, want)
		}
	}
	snap, err := takeSnapshot(dir)
	if err != nil {
		t.Fatal(err)
	}
	pp := snap.podProcs(map[types.UID][]string{podA: {ctrA}, podB: {ctrB}})
	if got := pp[podB].byContainer[ctrB]; got != 12 {
		t.Errorf("process of B's container %d, want 12", got)
	}
	if got := pp[podA].byContainer[ctrA]; got != 10 {
		t.Errorf("process of A's container %d, want 10", got)
	}
}

// TestVerifyRefusesPlantedSymlink: a container that replaces a directory on
// the way to its volume's mount point with an absolute symlink to a healthy
// place cannot make verification report its view healthy: the path is
// resolved inside the container's root without following symlinks.
func TestVerifyRefusesPlantedSymlink(t *testing.T) {
	lab.RequireRoot(t)
	healthy := t.TempDir()
	if err := os.Mkdir(filepath.Join(healthy, "data"), 0o755); err != nil {
		t.Fatal(err)
	}
	c := lab.StartContainer(t, "planter", lab.PropagationPrivate, nil, lab.WithChroot())
	// In the container, /vol/data was its volume; /vol is now a symlink to
	// an absolute path that exists on the host (and not in the container).
	if err := os.Symlink(healthy, filepath.Join(c.Root(), "vol")); err != nil {
		t.Fatal(err)
	}
	r, err := New(Config{KubeletRoot: t.TempDir(), Probe: probe.Config{Timeout: 2 * time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	// and /data2, the mount point itself, is one.
	if err := os.Symlink(filepath.Join(healthy, "data"), filepath.Join(c.Root(), "data2")); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"/vol/data", "/data2"} {
		acts, err := r.verify(context.Background(), []place{containerPlace("/proc", c.Pid(), p)})
		t.Logf("verify %s: %v (%v)", p, err, acts)
		if err == nil {
			t.Errorf("a container view of %s through a planted symlink verified healthy", p)
		} else if !errors.Is(err, probe.ErrSymlinkInRoot) {
			t.Errorf("verify error %v, want ErrSymlinkInRoot", err)
		}
	}
	// A real directory in the container verifies.
	if err := os.MkdirAll(filepath.Join(c.Root(), "real", "data"), 0o755); err != nil {
		t.Fatal(err)
	}
	if _, err := r.verify(context.Background(), []place{containerPlace("/proc", c.Pid(), "/real/data")}); err != nil {
		t.Errorf("verify of a real path in the container: %v", err)
	}
}

// TestBlockedDriverIsDown: a driver that accepts connections and blocks in
// every call (NodeGetCapabilities included) is down for every tier: each
// returns ErrDriverUnavailable and touches no mount, as for a dead socket.
func TestBlockedDriverIsDown(t *testing.T) {
	d := startDriverLab(t, Config{})
	const prefix = "blocked"
	rv := d.newVolume(t, prefix, podDef{name: "p", ctrs: []ctrDef{{name: "app",
		mounts: []corev1.VolumeMount{{Name: testVolumeName, MountPath: "/data"}}}}})
	d.drv.Kill()
	d.markDead(t, rv)
	sock := d.drv.Socket()
	if err := os.Remove(sock); err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	blocked := &fakeDriver{block: true}
	serveUnix(t, sock, func(s *grpc.Server) { registerDriver(s, blocked) })
	r := d.repairer(t, Config{CSI: CSIOptions{ProbeTimeout: 300 * time.Millisecond,
		StageTimeout: 300 * time.Millisecond, PublishTimeout: 300 * time.Millisecond}})
	before := mountTables(t, append([]int{os.Getpid()}, rv.pids()...)...)
	for _, tier := range []func(context.Context, *Volume) Outcome{r.Restage, r.LiveSwap, r.Restart} {
		o := tier(context.Background(), rv.vol)
		logOutcome(t, "blocked driver", o)
		if o.Healed || !errors.Is(o.Err, ErrDriverUnavailable) {
			t.Errorf("%s with a blocked driver: healed %t, err %v; want ErrDriverUnavailable", o.Tier, o.Healed, o.Err)
		}
		if n := ops(o.Actions); n[opUnmount]+n[opAbortFUSE]+n[opStage]+n[opPublish]+n[opSwap]+n[opStopContainer] != 0 {
			t.Errorf("%s with a blocked driver acted: %v", o.Tier, n)
		}
	}
	if blocked.capsCalls.Load() == 0 {
		t.Errorf("the blocked driver was never asked")
	}
	if after := mountTables(t, append([]int{os.Getpid()}, rv.pids()...)...); after != before {
		t.Errorf("the mount tables changed while the driver was blocked")
	}
}

// errKilled is what every mount change returns once the "agent" is dead.
var errKilled = errors.New("killed")

// killAfter is the host's syscalls with move_mount beneath refused (the
// kernel's EINVAL for a locked or shared parent, or before 6.5: the
// fallback) and the agent killed after n mount changes (move_mount,
// umount2): later changes fail and nothing is cleaned up.
func killAfter(n int) Syscalls {
	h := hostSyscalls()
	var mu sync.Mutex
	left := n
	change := func() bool {
		mu.Lock()
		defer mu.Unlock()
		if left == 0 {
			return false
		}
		left--
		return true
	}
	return Syscalls{
		MoveMount: func(fromDirfd int, fromPath string, toDirfd int, toPath string, flags int) error {
			if flags&moveMountBeneath != 0 {
				return unix.EINVAL
			}
			if !change() {
				return errKilled
			}
			return h.MoveMount(fromDirfd, fromPath, toDirfd, toPath, flags)
		},
		Unmount: func(target string, flags int) error {
			if !change() {
				return errKilled
			}
			return h.Unmount(target, flags)
		},
	}
}

// hasMountAt reports whether the container process pid has a mount at
// path (a chroot container's mountinfo shows container paths).
func hasMountAt(t *testing.T, pid int, path string) bool {
	t.Helper()
	ms, err := mountinfoOf(pid)
	if err != nil {
		t.Fatal(err)
	}
	return slices.Contains(ms, path)
}

func mountinfoOf(pid int) ([]string, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		return nil, err
	}
	var out []string
	for _, l := range strings.Split(string(data), "\n") {
		if f := strings.Fields(l); len(f) > 4 {
			out = append(out, f[4])
		}
	}
	return out, nil
}

// TestSwapCrashNeverLeavesTheBareDirectory: the fallback swap (no mount
// beneath) killed after each of its mount changes never leaves the
// container's volume path without a mount of the volume (where the
// container would write into its own root filesystem and a later repair
// would find nothing dead and call it healed); the next run finishes it.
func TestSwapCrashNeverLeavesTheBareDirectory(t *testing.T) {
	d := startDriverLab(t, Config{})
	const prefix = "crash"
	rv := d.newVolume(t, prefix, podDef{name: "p", ctrs: []ctrDef{{name: "app",
		mounts: []corev1.VolumeMount{{Name: testVolumeName, MountPath: "/data"}}}}})
	c := rv.pods[0].ctrs["app"]
	for n := range 3 {
		t.Run(fmt.Sprintf("killed after %d changes", n), func(t *testing.T) {
			d.drv.Kill()
			d.markDead(t, rv)
			d.restartDriver(t)
			if o := d.r.Restage(context.Background(), rv.vol); !o.Healed {
				t.Fatalf("Restage: %v", o.Err)
			}
			o := d.repairer(t, Config{Sys: killAfter(n)}).LiveSwap(context.Background(), rv.vol)
			logOutcome(t, "liveswap killed", o)
			if !hasMountAt(t, c.Pid(), "/data") {
				t.Fatalf("killed after %d mount changes: nothing is mounted at the container's /data", n)
			}
			// The next run finishes the swap.
			if o := d.r.LiveSwap(context.Background(), rv.vol); !o.Healed {
				t.Fatalf("LiveSwap after the crash: %v", o.Err)
			}
			wantViews(t, rv.views(prefix))
		})
	}
}

// TestAbortFUSEPinsTheConnection: the dead volume's FUSE filesystem goes
// away between the table the repair read and its abort, and a new FUSE
// mount takes its place (the kernel hands the freed device number, the
// connection's number, out again). The abort must not reach the new
// connection.
func TestAbortFUSEPinsTheConnection(t *testing.T) {
	lab.RequireRoot(t)
	k := newKubelet(t)
	path := k.StagingPath(labDriver, "pin")
	old := lab.StartFaultFS(t, path)
	at := &probe.Mount{Path: path, ID: topID(t, k.Root(), path), Dev: devOf(t, path)}
	dead := at.Dev
	// The old filesystem ends (daemon gone, mount detached) ...
	old.Kill()
	if err := unix.Unmount(path, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	// ... and a new one is mounted at the same path.
	lab.StartFaultFS(t, path)
	if got := devOf(t, path); got != dead {
		t.Skipf("the kernel did not hand device %s out again (got %s)", dead, got)
	}
	t.Logf("device %s reused: mount %d at %s, was mount %d", dead, topID(t, k.Root(), path), path, at.ID)
	acts, err := (&Unmounter{Root: k.Root()}).AbortFUSE(context.Background(), dead, at)
	t.Logf("AbortFUSE: %v (%v)", err, acts)
	if err := statfsErr(path, 5*time.Second); err != nil {
		t.Errorf("the new filesystem on the reused device number after the abort: %v; the abort reached it", err)
	}
}

// TestPodCgroupOnlyUnderKubepods: a process joins a pod only when its pod
// cgroup sits where kubelet makes pod cgroups (kubepods, its QoS classes,
// cgroupfs or systemd naming, seen from our cgroup namespace or another).
// The hostile actor is anyone on the node who can make a cgroup named
// pod<uid> elsewhere (user.slice, a delegated systemd service): its
// processes must not join that pod's PIDs, where a swap would enter them.
func TestPodCgroupOnlyUnderKubepods(t *testing.T) {
	const uid = "0a0a0a0a-0000-4000-8000-00000000000a"
	sd := strings.ReplaceAll(uid, "-", "_")
	ctr := strings.Repeat("c", 64)
	for _, tc := range []struct {
		name, path string
		want       bool
	}{
		{"cgroupfs besteffort", "/kubepods/besteffort/pod" + uid + "/" + ctr, true},
		{"cgroupfs guaranteed", "/kubepods/pod" + uid + "/" + ctr, true},
		{"cgroupfs below a cgroup root", "/mountmedic-lab-0a/kubepods/burstable/pod" + uid + "/" + ctr, true},
		{"systemd guaranteed", "/kubepods.slice/kubepods-pod" + sd + ".slice/cri-containerd-" + ctr + ".scope", true},
		{"systemd burstable", "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + sd + ".slice/cri-containerd-" + ctr + ".scope", true},
		{"systemd below a cgroup root", "/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod" + sd + ".slice/" + ctr, true},
		{"other cgroup namespace, QoS shared", "/../../pod" + uid + "/" + ctr, true},
		{"other cgroup namespace, kubepods shared", "/../../../besteffort/pod" + uid + "/" + ctr, true},
		{"other cgroup namespace, kubepods shown", "/../../../../kubepods/besteffort/pod" + uid + "/" + ctr, true},
		{"kind node, cgroupfs, host cgroup namespace", "/system.slice/docker-" + ctr + ".scope/kubepods/besteffort/pod" + uid + "/" + ctr, true},
		{"kind node, systemd, host cgroup namespace", "/system.slice/docker-" + ctr + ".scope/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod" + sd + ".slice/cri-containerd-" + ctr + ".scope", true},
		{"podman node", "/machine.slice/libpod-" + ctr + ".scope/kubepods/pod" + uid + "/" + ctr, true},
		{"kubepods in a user's session scope", "/user.slice/user-1000.slice/session-3.scope/kubepods/pod" + uid + "/x", false},
		{"kubepods in a scope below a user's service", "/user.slice/user-1000.slice/user@1000.service/app.slice/run-1.scope/kubepods/pod" + uid + "/x", false},
		{"kubepods in a scope deeper in system.slice", "/system.slice/foo.slice/x.scope/kubepods/pod" + uid + "/x", false},
		{"kubepods in a scope of a service", "/system.slice/evil.service/x.scope/kubepods/pod" + uid + "/x", false},
		{"user.slice", "/user.slice/pod" + uid + "/" + ctr, false},
		{"user.slice seen from another namespace", "/../../../user.slice/pod" + uid + "/" + ctr, false},
		{"kubepods inside a delegated service", "/user.slice/user-1000.slice/user@1000.service/kubepods/besteffort/pod" + uid + "/x", false},
		{"kubepods inside a system service", "/system.slice/evil.service/kubepods/pod" + uid + "/x", false},
		{"no kubepods", "/pod" + uid + "/" + ctr, false},
		{"wrong parent", "/kubepods/besteffort/other/pod" + uid + "/" + ctr, false},
		{"systemd wrong parent slice", "/kubepods.slice/kubepods-besteffort.slice/evil-pod" + sd + ".slice/x", false},
		{"systemd outside kubepods", "/user.slice/user-pod" + sd + ".slice/x", false},
	} {
		got, _, ok := podOfCgroup([]byte("0::" + tc.path + "\n"))
		if ok != tc.want || (ok && got != uid) {
			t.Errorf("%s: podOfCgroup(%s) = %q, %t; want pod %t", tc.name, tc.path, got, ok, tc.want)
		}
	}
}
