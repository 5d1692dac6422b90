package remount

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/scripts/lab"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

func TestMain(m *testing.M) { lab.Main(m) }

// Root tests of the toolbox on real mounts in the lab's private mount
// namespace. The tests of the Repairer against a real CSI driver are in
// driver_test.go.

const (
	labDriver = "lab.csi.example.com"
	labHandle = "vol-1"
	labVolume = "pv-1"
	labPod    = "0b5f2c1e-8d44-4c1a-9f1e-2b7c7f0a9d11"
)

// failBound bounds waits that only a bug makes long: a safety net, not a
// timing assertion.
const failBound = 30 * time.Second

// newKubelet lays out a lab kubelet root in a short temporary directory
// (CSI socket paths under it must fit a sockaddr_un) and detaches every
// mount left below it when the test ends.
func newKubelet(t testing.TB) *lab.Kubelet {
	t.Helper()
	dir, err := os.MkdirTemp("", "mmr")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	k := lab.NewKubelet(t, filepath.Join(dir, "kubelet"))
	t.Cleanup(func() { detachAll(t, k.Root()) })
	return k
}

// detachAll lazily unmounts every mount below root, stacks included. It
// first checks that the process's main thread is still in our mount
// namespace: a swap that ran on it would have left it in a container's (see
// inMountNamespace), and /proc/self would describe the container.
func detachAll(t testing.TB, root string) {
	if self, err := os.Readlink("/proc/self/ns/mnt"); err == nil {
		if ours, _ := os.Readlink("/proc/thread-self/ns/mnt"); self != ours {
			t.Errorf("the main thread is in mount namespace %s, not ours %s: a swap ran on it", self, ours)
		}
	}
	for range 64 {
		ms, err := mountinfo.GetMounts(func(in *mountinfo.Info) (skip, stop bool) {
			return !kubelet.Under(root, in.Mountpoint), false
		})
		if err != nil {
			t.Errorf("detach all: %v", err)
			return
		}
		var paths []string
		for _, m := range ms {
			if !slices.Contains(paths, m.Mountpoint) {
				paths = append(paths, m.Mountpoint)
			}
		}
		if len(paths) == 0 {
			return
		}
		slices.SortFunc(paths, func(a, b string) int { return depth(b) - depth(a) })
		for _, p := range paths {
			if err := unix.Unmount(p, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
				t.Errorf("detach %s: %v", p, err)
			}
		}
	}
	data, _ := os.ReadFile("/proc/self/mountinfo")
	t.Errorf("detach all: mounts still below %s:\n%s", root, data)
}

// table reads our mount table below root.
func table(t testing.TB, root string) *hostTable {
	t.Helper()
	tab, err := readHostTable("/proc", root)
	if err != nil {
		t.Fatal(err)
	}
	return tab
}

// topID is the ID of the mount on top at path, 0 when none.
func topID(t testing.TB, root, path string) int {
	t.Helper()
	if m := table(t, root).top(path); m != nil {
		return m.ID
	}
	return 0
}

// statfsErr runs statfs on path and returns its error, or ErrHung when it
// has not returned within d (the goroutine then stays blocked until the
// mount is aborted).
func statfsErr(path string, d time.Duration) error {
	errc := make(chan error, 1)
	go func() {
		var st unix.Statfs_t
		errc <- unix.Statfs(path, &st)
	}()
	select {
	case err := <-errc:
		return err
	case <-time.After(d):
		return probe.ErrHung
	}
}

func writeFile(t testing.TB, path, data string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}

// wantFile fails unless path reads data.
func wantFile(t testing.TB, path, data string) {
	t.Helper()
	got, err := os.ReadFile(path)
	if err != nil || string(got) != data {
		t.Errorf("read %s = %q, %v; want %q", path, got, err, data)
	}
}

// labVolumeFS mounts a FaultFS as the staging mount of a volume and
// publishes it for labPod; the backing directory holds f ("old") and
// sub/g ("old-sub").
type labVolumeFS struct {
	fs      *lab.FaultFS
	staging string
	target  string
	subPath string
}

func newLabVolume(t testing.TB, k *lab.Kubelet, handle, volume string) *labVolumeFS {
	t.Helper()
	backing := t.TempDir()
	writeFile(t, filepath.Join(backing, "f"), "old")
	writeFile(t, filepath.Join(backing, "sub", "g"), "old-sub")
	staging := k.StagingPath(labDriver, handle)
	fs := lab.StartFaultFS(t, staging, lab.WithBackingDir(backing))
	target := k.Publish(labPod, volume, labDriver, handle, staging, false)
	sub := k.SubPath(labPod, volume, "app", 0, filepath.Join(target, "sub"))
	return &labVolumeFS{fs: fs, staging: staging, target: target, subPath: sub}
}

func (v *labVolumeFS) dev() probe.Dev { return probe.Dev{Major: 0, Minor: v.fs.Conn()} }

// freshFS mounts a FaultFS at another staging path below the kubelet root,
// holding f ("fresh") and sub/g ("fresh-sub"): the volume as a repair
// brings it back.
func freshFS(t testing.TB, k *lab.Kubelet, handle string) string {
	t.Helper()
	backing := t.TempDir()
	writeFile(t, filepath.Join(backing, "f"), "fresh")
	writeFile(t, filepath.Join(backing, "sub", "g"), "fresh-sub")
	p := k.StagingPath(labDriver, handle)
	lab.StartFaultFS(t, p, lab.WithBackingDir(backing))
	return p
}

func TestUnmountDeepestFirstAndIdempotent(t *testing.T) {
	lab.RequireRoot(t)
	k := newKubelet(t)
	root := k.Root()
	v := newLabVolume(t, k, labHandle, labVolume)
	// Two healthy nested mounts: unmounting the outer one first would
	// take the inner one with it, and the action would say "path gone".
	outer := k.EmptyDir(labPod, "cache", true)
	inner := filepath.Join(outer, "deep", "er")
	if err := os.MkdirAll(inner, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", inner, "tmpfs", 0, ""); err != nil {
		t.Fatal(err)
	}
	v.fs.Kill()
	if err := statfsErr(v.target, failBound); !errors.Is(err, unix.ENOTCONN) {
		t.Fatalf("statfs of the dead publish target = %v, want ENOTCONN", err)
	}

	u := &Unmounter{Root: root}
	paths := []string{outer, v.staging, inner, v.target, v.subPath}
	ctx := context.Background()
	acts, err := u.Unmount(ctx, paths)
	if err != nil {
		t.Fatalf("Unmount = %v", err)
	}
	if len(acts) != len(paths) {
		t.Fatalf("Unmount gave %d actions, want %d: %v", len(acts), len(paths), acts)
	}
	for i, a := range acts {
		if !strings.HasPrefix(a.Detail, "mount ") || strings.Contains(a.Detail, "not mounted") {
			t.Errorf("action %d %v: want an unmount of a mount", i, a)
		}
		if i > 0 && depth(a.Path) > depth(acts[i-1].Path) {
			t.Errorf("action %d unmounts %s after the shallower %s", i, a.Path, acts[i-1].Path)
		}
	}
	if got := Unmounted(acts); got != len(paths) {
		t.Errorf("Unmounted(first Unmount) = %d, want %d", got, len(paths))
	}
	if i, j := slices.IndexFunc(acts, func(a Action) bool { return a.Path == inner }), slices.IndexFunc(acts, func(a Action) bool { return a.Path == outer }); i > j {
		t.Errorf("inner mount unmounted after the outer one: %v", acts)
	}
	for _, p := range paths {
		if id := topID(t, root, p); id != 0 {
			t.Errorf("mount %d still at %s", id, p)
		}
	}

	again, err := u.Unmount(ctx, paths)
	if err != nil {
		t.Fatalf("second Unmount = %v", err)
	}
	for _, a := range again {
		if !strings.Contains(a.Detail, "not mounted") || a.Err != nil {
			t.Errorf("second Unmount: %v, want nothing to do", a)
		}
	}
	if got := Unmounted(again); got != 0 {
		t.Errorf("Unmounted(second Unmount) = %d, want 0", got)
	}
}

func TestAbortFUSEUnblocksHungMount(t *testing.T) {
	lab.RequireRoot(t)
	k := newKubelet(t)
	v := newLabVolume(t, k, labHandle, labVolume)
	v.fs.Hang()
	blocked := make(chan error, 1)
	go func() {
		var st unix.Statfs_t
		blocked <- unix.Statfs(v.staging, &st)
	}()
	select {
	case err := <-blocked:
		t.Fatalf("statfs of the hung mount returned %v, want it blocked", err)
	case <-time.After(300 * time.Millisecond):
	}

	u := &Unmounter{Root: k.Root()}
	at := &probe.Mount{Path: v.staging, ID: topID(t, k.Root(), v.staging), Dev: v.dev()}
	acts, err := u.AbortFUSE(context.Background(), v.dev(), at)
	if err != nil {
		t.Fatalf("AbortFUSE = %v (%v)", err, acts)
	}
	select {
	case err := <-blocked:
		if !errors.Is(err, unix.ECONNABORTED) {
			t.Errorf("blocked statfs returned %v after the abort, want ECONNABORTED", err)
		}
	case <-time.After(failBound):
		t.Fatalf("statfs still blocked %s after the abort", failBound)
	}
	if err := statfsErr(v.staging, failBound); !errors.Is(err, unix.ENOTCONN) {
		t.Errorf("statfs after the abort = %v, want ENOTCONN", err)
	}
	// The mount is still there to unmount lazily; aborting again is fine.
	if _, err := u.AbortFUSE(context.Background(), v.dev(), at); err != nil {
		t.Errorf("second AbortFUSE = %v", err)
	}
}

// plantSymlink makes pods/<uid>/volumes/kubernetes.io~csi/<volume> a
// symlink to a directory outside the kubelet root whose "mount" holds a
// tmpfs with a marker file, and returns the publish path through the
// symlink and the real path outside.
func plantSymlink(t testing.TB, root, uid, volume string) (target, outside string) {
	t.Helper()
	outDir := t.TempDir()
	outside = filepath.Join(outDir, "mount")
	if err := os.MkdirAll(outside, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", outside, "tmpfs", 0, ""); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(outside, unix.MNT_DETACH) })
	writeFile(t, filepath.Join(outside, "marker"), "outside")
	volDir := filepath.Join(root, "pods", uid, "volumes", kubelet.CSIPluginDir, volume)
	if err := os.MkdirAll(filepath.Dir(volDir), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outDir, volDir); err != nil {
		t.Fatal(err)
	}
	return filepath.Join(volDir, "mount"), outside
}

// outsideMounts lists the mount IDs at path, outside any kubelet root, in
// table order.
func outsideMounts(t testing.TB, path string) []int {
	t.Helper()
	ms, err := mountinfo.GetMounts(func(in *mountinfo.Info) (skip, stop bool) {
		return in.Mountpoint != path, false
	})
	if err != nil {
		t.Fatal(err)
	}
	var ids []int
	for _, m := range ms {
		ids = append(ids, m.ID)
	}
	return ids
}

func TestRefusePlantedSymlink(t *testing.T) {
	lab.RequireRoot(t)
	k := newKubelet(t)
	root := k.Root()
	const uid = "7d0c3a52-5a1b-4c33-9d0e-0c6a1f3b2e44"
	target, outside := plantSymlink(t, root, uid, labVolume)
	// A second pod whose mount directory itself is the symlink.
	const uid2 = "a1b2c3d4-0000-4000-8000-000000000002"
	last := filepath.Join(root, "pods", uid2, "volumes", kubelet.CSIPluginDir, labVolume, "mount")
	if err := os.MkdirAll(filepath.Dir(last), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, last); err != nil {
		t.Fatal(err)
	}
	before := outsideMounts(t, outside)
	if len(before) != 1 {
		t.Fatalf("mounts at %s = %v, want the tmpfs", outside, before)
	}
	fresh := freshFS(t, k, "fresh")
	ctx := context.Background()

	for _, p := range []string{target, last} {
		if _, err := openSafe(root, p); !errors.Is(err, errUnsafePath) || !strings.Contains(err.Error(), p) {
			t.Errorf("openSafe(%s) = %v, want errUnsafePath naming the path", p, err)
		}
		acts, err := (&Unmounter{Root: root}).Unmount(ctx, []string{p})
		if !errors.Is(err, errUnsafePath) || len(acts) != 1 || !strings.Contains(acts[0].Err.Error(), p) {
			t.Errorf("Unmount(%s) = %v, %v; want one refused action naming it", p, acts, err)
		}
		acts, err = (&overMounter{Root: root}).overMount(ctx, fresh, &probe.Mount{Path: p})
		if !errors.Is(err, errUnsafePath) {
			t.Errorf("overMount onto %s = %v, %v; want errUnsafePath", p, acts, err)
		}
	}
	if after := outsideMounts(t, outside); !slices.Equal(after, before) {
		t.Errorf("mounts at %s went from %v to %v: something outside the kubelet root was touched", outside, before, after)
	}
	wantFile(t, filepath.Join(outside, "marker"), "outside")
	if _, err := os.Stat(filepath.Join(outside, "f")); err == nil {
		t.Errorf("the fresh volume's file shows outside the kubelet root")
	}
}

func TestOverMountDeadAndHung(t *testing.T) {
	for _, fault := range []string{"dead", "hung"} {
		t.Run(fault, func(t *testing.T) {
			lab.RequireRoot(t)
			k := newKubelet(t)
			root := k.Root()
			v := newLabVolume(t, k, labHandle, labVolume)
			slave := lab.StartContainer(t, "slave", lab.PropagationSlave, map[string]string{"/data": v.target}, lab.WithChroot())
			private := lab.StartContainer(t, "private", lab.PropagationPrivate, map[string]string{"/data": v.target}, lab.WithChroot())
			fresh := freshFS(t, k, "fresh")
			deadID := topID(t, root, v.staging)
			if fault == "dead" {
				v.fs.Kill()
			} else {
				v.fs.Hang()
				t.Cleanup(v.fs.Abort) // runs before the faultfs cleanup; frees what the test left blocked
			}

			done := make(chan error, 1)
			go func() {
				_, err := (&overMounter{Root: root}).overMount(context.Background(), fresh, &probe.Mount{Path: v.staging, ID: deadID})
				done <- err
			}()
			select {
			case err := <-done:
				if err != nil {
					t.Fatalf("overMount = %v", err)
				}
			case <-time.After(failBound):
				t.Fatalf("overMount on a %s mount did not return", fault)
			}
			// The staging mount's peers (the publish target) and their
			// slaves (the HostToContainer container) receive it.
			wantFile(t, filepath.Join(v.staging, "f"), "fresh")
			wantFile(t, filepath.Join(v.target, "f"), "fresh")
			wantFile(t, slave.Path("/data/f"), "fresh")
			// The private container and the subPath bind keep the dead
			// mount (not read when hung: it would block).
			if fault == "dead" {
				if err := statfsErr(private.Path("/data"), failBound); !errors.Is(err, unix.ENOTCONN) {
					t.Errorf("statfs in the private container = %v, want ENOTCONN", err)
				}
				if err := statfsErr(v.subPath, failBound); !errors.Is(err, unix.ENOTCONN) {
					t.Errorf("statfs of the subPath bind = %v, want ENOTCONN", err)
				}
			}
			// The dead mount stays below.
			if s := table(t, root).stack(v.staging); len(s) != 2 || s[0].ID != deadID {
				t.Errorf("stack at the staging path = %d mounts, want the dead one below the fresh one", len(s))
			}
		})
	}
}

func TestSwapIntoContainers(t *testing.T) {
	lab.RequireRoot(t)
	k := newKubelet(t)
	root := k.Root()
	v := newLabVolume(t, k, labHandle, labVolume)
	binds := map[string]string{"/data": v.target, "/data-sub": v.subPath, "/ro": v.target}
	private := lab.StartContainer(t, "private", lab.PropagationPrivate, binds, lab.WithChroot(), lab.WithReadOnly("/ro"))
	slave := lab.StartContainer(t, "slave", lab.PropagationSlave, binds, lab.WithChroot(), lab.WithReadOnly("/ro"))
	v.fs.Kill()

	// The host side as a re-stage leaves it: a fresh publish target.
	fresh := freshFS(t, k, "fresh")
	if err := unix.Unmount(v.target, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(fresh, v.target, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}

	pids := []int{private.Pid(), slave.Pid(), os.Getpid()}
	targets, err := planSwap("", pids, []probe.Dev{v.dev()}, "/", v.target)
	if err != nil {
		t.Fatalf("planSwap = %v", err)
	}
	if len(targets) != 6 {
		t.Fatalf("planSwap = %d targets, want 3 per container: %+v", len(targets), targets)
	}
	for _, tg := range targets {
		if tg.ContainerPath == "/ro" && !tg.ReadOnly {
			t.Errorf("target %s: want read-only", tg.label())
		}
		if tg.ContainerPath == "/data-sub" && tg.SubDir != "sub" {
			t.Errorf("target %s: SubDir %q, want sub", tg.label(), tg.SubDir)
		}
	}

	// Dry-run first: nothing changes.
	before := mountTables(t, private.Pid(), slave.Pid())
	acts, err := (&swapper{Root: root, DryRun: true}).Swap(context.Background(), targets)
	if err != nil {
		t.Fatalf("dry-run Swap = %v", err)
	}
	for _, a := range acts {
		if !a.DryRun || a.Detail == "" {
			t.Errorf("dry-run action %v: want a planned step", a)
		}
	}
	if after := mountTables(t, private.Pid(), slave.Pid()); after != before {
		t.Errorf("dry-run Swap changed the containers' mount tables")
	}

	acts, err = (&swapper{Root: root}).Swap(context.Background(), targets)
	if err != nil {
		t.Fatalf("Swap = %v (%v)", err, acts)
	}
	for _, c := range []*lab.Container{private, slave} {
		wantFile(t, c.Path("/data/f"), "fresh")
		wantFile(t, c.Path("/data-sub/g"), "fresh-sub")
		wantFile(t, c.Path("/ro/f"), "fresh")
		if err := os.WriteFile(c.Path("/ro/new"), []byte("x"), 0o644); !errors.Is(err, unix.EROFS) {
			t.Errorf("write under the read-only mount = %v, want EROFS", err)
		}
		if err := os.WriteFile(c.Path("/data/new"), []byte("x"), 0o644); err != nil {
			t.Errorf("write under the writable mount = %v", err)
		}
	}
	// The slave container's swapped volume still receives host mounts.
	ms, err := processMounts("/proc", slave.Pid(), probe.Dev{Major: 0, Minor: devOf(t, fresh).Minor})
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range ms {
		if m.Path == "/data" && propagationOf(m.Optional) != propagationHostToContainer {
			t.Errorf("slave container's swapped /data has propagation %q, want a slave", m.Optional)
		}
	}
	// Nothing dead is left in view.
	if left, _ := planSwap("", pids, []probe.Dev{v.dev()}, "/", v.target); len(left) != 0 {
		t.Errorf("after Swap, planSwap still finds %v", left)
	}
}

// mountTables concatenates the mount tables of pids.
func mountTables(t testing.TB, pids ...int) string {
	t.Helper()
	var b strings.Builder
	for _, pid := range pids {
		data, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "mountinfo"))
		if err != nil {
			t.Fatal(err)
		}
		b.Write(data)
	}
	return b.String()
}

func devOf(t testing.TB, path string) probe.Dev {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		t.Fatal(err)
	}
	return probe.Dev{Major: unix.Major(st.Dev), Minor: unix.Minor(st.Dev)}
}

func TestFindHoldersOfDeadMount(t *testing.T) {
	lab.RequireRoot(t)
	k := newKubelet(t)
	v := newLabVolume(t, k, labHandle, labVolume)
	f, err := os.Open(filepath.Join(v.target, "f"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	cmd := exec.Command("sleep", "600")
	cmd.Dir = filepath.Join(v.target, "sub")
	cmd.ExtraFiles = []*os.File{f} // fd 3
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	v.fs.Kill()

	check := func(when string, ids ...int) {
		t.Helper()
		hs, err := holdersOf(context.Background(), "", v.dev(), ids...)
		if err != nil {
			t.Fatalf("holdersOf %s = %v", when, err)
		}
		var cwd, fd bool
		for _, h := range hs {
			if h.Pid != cmd.Process.Pid {
				continue
			}
			cwd = cwd || h.Kind == holdCwd
			fd = fd || (h.Kind == holdFD && h.FD == 3)
		}
		if !cwd || !fd {
			t.Errorf("holdersOf %s = %v; want pid %d by cwd and by fd 3", when, hs, cmd.Process.Pid)
		}
	}
	check("on the dead mount")
	// Detached, the mounts show in no table: their IDs find the holders.
	ids := []int{topID(t, k.Root(), v.target), topID(t, k.Root(), v.staging), topID(t, k.Root(), v.subPath)}
	if _, err := (&Unmounter{Root: k.Root()}).Unmount(context.Background(), []string{v.subPath, v.target, v.staging}); err != nil {
		t.Fatal(err)
	}
	check("after the lazy unmount", ids...)

	// Several dead filesystems at once: each holder once, under its own.
	other := probe.Dev{Major: 0, Minor: v.dev().Minor + 1000}
	detached := map[int]probe.Dev{}
	for _, id := range ids {
		detached[id] = v.dev()
	}
	hs, err := findHolders(context.Background(), "", []int{cmd.Process.Pid}, []probe.Dev{other, v.dev()}, detached)
	if err != nil {
		t.Fatal(err)
	}
	n := map[holdKind]int{}
	for _, h := range hs {
		n[h.Kind]++
		if h.Dev != v.dev() {
			t.Errorf("holder %v on %s, want %s", h, h.Dev, v.dev())
		}
	}
	if n[holdCwd] != 1 || n[holdFD] != 1 {
		t.Errorf("holders over two dead filesystems = %v; want the cwd and fd 3 once each", hs)
	}
}

func TestDryRunChangesNothing(t *testing.T) {
	lab.RequireRoot(t)
	k := newKubelet(t)
	root := k.Root()
	v := newLabVolume(t, k, labHandle, labVolume)
	v.fs.Kill()
	fresh := freshFS(t, k, "fresh")
	before, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	var acts []Action
	a, err := (&Unmounter{Root: root, DryRun: true}).Unmount(ctx, []string{v.subPath, v.target, v.staging})
	if err != nil {
		t.Fatal(err)
	}
	acts = append(acts, a...)
	if a, err = (&Unmounter{Root: root, DryRun: true}).AbortFUSE(ctx, v.dev(), &probe.Mount{Path: v.staging, ID: topID(t, root, v.staging)}); err != nil {
		t.Fatal(err)
	}
	acts = append(acts, a...)
	if a, err = (&overMounter{Root: root, DryRun: true}).overMount(ctx, fresh, &probe.Mount{Path: v.staging, ID: topID(t, root, v.staging)}); err != nil {
		t.Fatal(err)
	}
	acts = append(acts, a...)
	for _, a := range acts {
		if !a.DryRun || a.Err != nil || a.Took != 0 {
			t.Errorf("dry-run action %v: want planned, no error, no time", a)
		}
	}
	after, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	if string(before) != string(after) {
		t.Errorf("dry-run changed the mount table")
	}
}

// TestSwapNeverLeavesMainThreadInContainer: Go parks, rather than ends, the
// main thread when a goroutine exits locked on it, and /proc/self describes
// the main thread. Entering containers must never happen there, or the
// process reads a container's mount table as its own.
func TestSwapNeverLeavesMainThreadInContainer(t *testing.T) {
	lab.RequireRoot(t)
	c := lab.StartContainer(t, "ns", lab.PropagationPrivate, nil)
	ours, err := os.Readlink("/proc/thread-self/ns/mnt")
	if err != nil {
		t.Fatal(err)
	}
	theirs, err := os.Readlink(c.MountNS())
	if err != nil || theirs == ours {
		t.Fatalf("container namespace %s (%v), ours %s", theirs, err, ours)
	}
	nsfd, err := unix.Open(c.MountNS(), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(nsfd)
	// One P: the main thread, which holds it while the test's goroutines
	// run, is then the likely one to pick up a new goroutine.
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(1))
	onMain := 0
	for range 300 {
		var inside string
		if err := inMountNamespace(hostSyscalls(), nsfd, func() {
			inside, _ = os.Readlink("/proc/thread-self/ns/mnt")
			if unix.Gettid() == unix.Getpid() {
				onMain++
			}
		}); err != nil {
			t.Fatal(err)
		}
		if inside != theirs {
			t.Fatalf("fn ran in namespace %s, want the container's %s", inside, theirs)
		}
		if self, _ := os.Readlink("/proc/self/ns/mnt"); self != ours {
			t.Fatalf("the main thread is in namespace %s after a swap, want ours %s (fn ran on the main thread %d times)", self, ours, onMain)
		}
	}
	if onMain != 0 {
		t.Errorf("fn ran on the main thread %d times", onMain)
	}
}

// TestPropagationFacts asserts what the package documentation says a host
// unmount does to containers: it never takes their own bind away; the fresh
// mounts of a re-stage form a new peer group that a HostToContainer
// container does not receive; and once every host member of the old group
// is gone, the container's bind is private.
func TestPropagationFacts(t *testing.T) {
	lab.RequireRoot(t)
	k := newKubelet(t)
	root := k.Root()
	v := newLabVolume(t, k, labHandle, labVolume)
	binds := map[string]string{"/data": v.target, "/data-sub": v.subPath}
	slave := lab.StartContainer(t, "slave", lab.PropagationSlave, binds, lab.WithChroot())
	private := lab.StartContainer(t, "private", lab.PropagationPrivate, binds, lab.WithChroot())
	v.fs.Kill()
	mountAt := func(c *lab.Container, path string) *processMount {
		t.Helper()
		ms, err := processMounts("/proc", c.Pid(), v.dev())
		if err != nil {
			t.Fatal(err)
		}
		for i := range ms {
			if ms[i].Path == path && !ms[i].Covered {
				return &ms[i]
			}
		}
		return nil
	}
	if m := mountAt(slave, "/data"); m == nil || propagationOf(m.Optional) != propagationHostToContainer {
		t.Fatalf("slave container's /data = %+v, want a slave of the volume's peer group", m)
	}

	// Unmount the publish target and staging mount, stage and publish
	// afresh: the containers keep their dead binds, and the slave does not
	// receive the fresh publish.
	if _, err := (&Unmounter{Root: root}).Unmount(context.Background(), []string{v.target, v.staging}); err != nil {
		t.Fatal(err)
	}
	fresh := freshFS(t, k, "fresh")
	if err := unix.Mount(fresh, v.target, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	for _, c := range []*lab.Container{slave, private} {
		for _, p := range []string{"/data", "/data-sub"} {
			if mountAt(c, p) == nil {
				t.Errorf("%s: the dead bind at %s is gone after host unmounts, want it kept", c.Path("/"), p)
			}
		}
		if err := statfsErr(c.Path("/data"), failBound); !errors.Is(err, unix.ENOTCONN) {
			t.Errorf("statfs %s after a fresh publish on the host = %v, want ENOTCONN (not received)", c.Path("/data"), err)
		}
	}
	if m := mountAt(slave, "/data"); m == nil || propagationOf(m.Optional) != propagationHostToContainer {
		t.Errorf("slave's /data = %+v, want still a slave while the host subPath bind is in the group", m)
	}

	// The last host member goes: the slave's bind turns private.
	if _, err := (&Unmounter{Root: root}).Unmount(context.Background(), []string{v.subPath}); err != nil {
		t.Fatal(err)
	}
	if m := mountAt(slave, "/data"); m == nil || propagationOf(m.Optional) != propagationNone {
		t.Errorf("slave's /data after the last host member went = %+v, want a private mount", m)
	}
}

// TestAbortReachesOnlyTheVolumesOwnConnection: a repair works from the
// agent's snapshot of the volume, and the kernel hands a dead filesystem's
// device number (its FUSE connection's number) to the next FUSE mount as
// soon as the old one ends. Found in the e2e run: a stale repair of a hung
// volume, whose pod was being torn down, aborted the connection of the
// next volume on the node while its first pod wrote, and that pod never
// read its volume. Here the snapshot's dead device is another volume's
// filesystem, hung with a request waiting, mounted only at that volume's
// staging path: neither the re-stage's abort nor the Unmount tier's may
// touch it.
func TestAbortReachesOnlyTheVolumesOwnConnection(t *testing.T) {
	lab.RequireRoot(t)
	k := newKubelet(t)
	mine := newLabVolume(t, k, labHandle, labVolume) // re-staged: healthy
	other := k.StagingPath(labDriver, "other-volume")
	ofs := lab.StartFaultFS(t, other)
	reused := probe.Dev{Major: 0, Minor: ofs.Conn()}
	ofs.Hang()
	t.Cleanup(ofs.Release)
	blocked := make(chan error, 1)
	go func() {
		var st unix.Statfs_t
		blocked <- unix.Statfs(other, &st)
	}()
	select {
	case err := <-blocked:
		t.Fatalf("statfs of the hung mount returned %v, want it blocked", err)
	case <-time.After(300 * time.Millisecond):
	}

	r, err := New(Config{KubeletRoot: k.Root()})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	vr := kubelet.VolumeRequest{Driver: labDriver, VolumeHandle: labHandle, StageUnstage: true,
		StagingPath: mine.staging, TargetPath: mine.target, PodUID: labPod}
	v := &Volume{Driver: labDriver, VolumeHandle: labHandle, Stage: vr, Hung: true,
		Backend: &probe.Backend{Dev: reused, Kind: probe.BackendFUSE},
		Pods: []PodVolume{{Publish: vr, Dead: []*probe.Mount{
			{Path: mine.target, Dev: reused, Target: kubelet.Target{Kind: kubelet.KindPublish, PodUID: labPod}},
			{Path: mine.subPath, Dev: reused, Target: kubelet.Target{Kind: kubelet.KindSubPath, PodUID: labPod}},
		}}}}

	// The Unmount tier (a terminating pod of the volume).
	o := r.Unmount(context.Background(), v)
	if n := ops(o.Actions)[opAbortFUSE]; n != 0 {
		t.Errorf("Unmount of volume %s wrote %d FUSE aborts for device %s, mounted only at another volume's staging path %s (%v)", labHandle, n, reused, other, o.Actions)
	}
	// The host repair's abort (the re-stage tier).
	h := &hostRun{r: r, v: v, logger: klog.Background(), staging: mine.staging, dead: deadDevs(v)}
	if h.table, err = readHostTable(r.procDir, r.root); err != nil {
		t.Fatal(err)
	}
	h.pods = []*podPlan{{pv: &v.Pods[0], uid: labPod, target: mine.target, subPaths: []subPathBind{{path: mine.subPath}}}}
	h.abortHung(context.Background())
	if n := ops(h.actions)[opAbortFUSE]; n != 0 {
		t.Errorf("the re-stage of volume %s wrote %d FUSE aborts for device %s, mounted only at another volume's staging path %s (%v)", labHandle, n, reused, other, h.actions)
	}

	select {
	case err := <-blocked:
		t.Fatalf("the other volume's blocked statfs returned %v before its daemon answered: its connection was aborted", err)
	default:
	}
	ofs.Release()
	select {
	case err := <-blocked:
		if err != nil {
			t.Errorf("the other volume's statfs = %v once its daemon answered, want nil", err)
		}
	case <-time.After(failBound):
		t.Fatalf("the other volume's statfs still blocked %s after its daemon was released", failBound)
	}
}
