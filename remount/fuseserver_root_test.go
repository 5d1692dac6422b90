package remount

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// blockedStatfs starts a statfs of path that the hung daemon never
// answers, and fails the test if it returns within 300 ms.
func blockedStatfs(t *testing.T, path string) <-chan error {
	t.Helper()
	blocked := make(chan error, 1)
	go func() {
		var st unix.Statfs_t
		blocked <- unix.Statfs(path, &st)
	}()
	select {
	case err := <-blocked:
		t.Fatalf("statfs of the hung mount %s returned %v, want it blocked", path, err)
	case <-time.After(300 * time.Millisecond):
	}
	return blocked
}

// waitGone waits until cond holds, within failBound.
func waitGone(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(failBound)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: still not so %s later", what, failBound)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestAbortKillsOnlyTheConnectionsServer: AbortFUSE stops the daemon of
// the hung connection before the abort and kills it after, and only it:
// a daemon of another volume lives on, and so does a daemon that serves
// the hung connection and another one that is up (it is left alone, with
// an action saying so).
func TestAbortKillsOnlyTheConnectionsServer(t *testing.T) {
	lab.RequireRoot(t)
	ctx := context.Background()
	k := newKubelet(t)
	v := newLabVolume(t, k, labHandle, labVolume)
	other := lab.StartFaultFS(t, k.StagingPath(labDriver, "other-volume"))
	many := lab.StartFaultFSMany(t, []string{k.StagingPath(labDriver, "many-1"), k.StagingPath(labDriver, "many-2")})
	u := &Unmounter{Root: k.Root()}

	// The volume's daemon is stopped, as a daemon stuck on its backend or
	// a SIGSTOP leaves it: requests queue, nobody reads them.
	if err := syscall.Kill(v.fs.Pid(), syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	waitStopped(t, v.fs.Pid())
	t.Cleanup(func() { syscall.Kill(v.fs.Pid(), syscall.SIGCONT) })
	blocked := blockedStatfs(t, v.staging)

	dry := &Unmounter{Root: k.Root(), DryRun: true}
	at := &probe.Mount{Path: v.staging, ID: topID(t, k.Root(), v.staging), Dev: v.dev()}
	acts, err := dry.AbortFUSE(ctx, v.dev(), at)
	if err != nil || ops(acts)[opKillServer] != 1 || !strings.Contains(actionOf(acts, opKillServer).Path, strconv.Itoa(v.fs.Pid())) {
		t.Errorf("dry-run AbortFUSE = %v, %v; want one planned kill of pid %d", acts, err, v.fs.Pid())
	}
	if v.fs.Exited() {
		t.Fatalf("a dry run killed the daemon")
	}

	acts, err = u.AbortFUSE(ctx, v.dev(), at)
	t.Logf("actions: %v", acts)
	if err != nil {
		t.Fatalf("AbortFUSE = %v", err)
	}
	kill := actionOf(acts, opKillServer)
	if kill.Path != "pid "+strconv.Itoa(v.fs.Pid()) || kill.Err != nil || !strings.Contains(kill.Detail, "exited") {
		t.Errorf("kill action %v; want pid %d killed and exited", kill, v.fs.Pid())
	}
	if n := ops(acts)[opKillServer]; n != 1 {
		t.Errorf("%d kill actions, want 1 (the volume's daemon only)", n)
	}
	waitGone(t, "the volume's daemon exited", v.fs.Exited)
	select {
	case err := <-blocked:
		if !errors.Is(err, unix.ECONNABORTED) && !errors.Is(err, unix.ENOTCONN) {
			t.Errorf("blocked statfs returned %v after the abort, want ECONNABORTED", err)
		}
	case <-time.After(failBound):
		t.Fatalf("statfs still blocked %s after the abort", failBound)
	}
	if other.Exited() {
		t.Errorf("the daemon of another volume was killed")
	}
	if err := statfsErr(other.Mountpoint(), failBound); err != nil {
		t.Errorf("statfs of another volume = %v, want it answering", err)
	}

	// A daemon of two connections, hung on both: it serves the second
	// one too, so aborting the first leaves it alone.
	many.Hang()
	t.Cleanup(many.Release)
	blockedMany := blockedStatfs(t, many.Mountpoint())
	mdev := probe.Dev{Minor: many.Conn()}
	at = &probe.Mount{Path: many.Mountpoint(), ID: topID(t, k.Root(), many.Mountpoint()), Dev: mdev}
	acts, err = u.AbortFUSE(ctx, mdev, at)
	t.Logf("actions: %v", acts)
	if err != nil {
		t.Fatalf("AbortFUSE of one of two connections = %v", err)
	}
	if n := ops(acts)[opKillServer]; n != 0 {
		t.Errorf("%d kill actions for a daemon that also serves a live connection, want none", n)
	}
	if skip := actionOf(acts, opSkip); !strings.Contains(skip.Detail, "also serves") || skip.Path != "pid "+strconv.Itoa(many.Pid()) {
		t.Errorf("skip action %v; want pid %d left alone as it also serves another connection", skip, many.Pid())
	}
	<-blockedMany
	many.Release()
	if err := statfsErr(k.StagingPath(labDriver, "many-2"), failBound); err != nil || many.Exited() {
		t.Errorf("the daemon's other connection: statfs %v, daemon exited %t; want it serving", err, many.Exited())
	}
}

func actionOf(acts []Action, op Op) Action {
	for _, a := range acts {
		if a.Op == op {
			return a
		}
	}
	return Action{}
}

// TestStaleRcloneNeverUnmountsTheFreshMount: rclone (Debian's, a real
// third-party daemon) woken after its hung connection was aborted exits
// through an unmount of its mountpoint by path. Without the kill (the
// control, logged) that unmount takes the fresh mount staged there since;
// with AbortFUSE's kill the stale rclone never runs again and the fresh
// mount stays, polled every 10 ms for 3 s after the SIGCONT.
func TestStaleRcloneNeverUnmountsTheFreshMount(t *testing.T) {
	lab.RequireRoot(t)
	rclone := lab.RequireBinary(t, "rclone")
	k := newKubelet(t)
	src := t.TempDir()
	writeFile(t, filepath.Join(src, "f"), "rclone")
	staging := k.StagingPath(labDriver, "rclone-volume")
	mount := func() (int, probe.Dev) {
		t.Helper()
		before := rclonePids(t)
		cmd := exec.Command(rclone, "mount", src, staging, "--config", "/dev/null", "--daemon", "--daemon-wait", "5s")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("rclone mount: %v\n%s", err, out)
		}
		var pid int
		for p := range rclonePids(t) {
			if !before[p] {
				pid = p
			}
		}
		if pid == 0 {
			t.Fatalf("no new rclone process after mounting %s", staging)
		}
		t.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL) })
		return pid, devOf(t, staging)
	}
	isFresh := func(id int) func() bool {
		return func() bool {
			ms, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(staging))
			return err == nil && len(ms) > 0 && ms[len(ms)-1].ID == id
		}
	}

	for _, kill := range []bool{false, true} {
		pid, dev := mount()
		if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		waitStopped(t, pid)
		blocked := blockedStatfs(t, staging)
		at := &probe.Mount{Path: staging, ID: topID(t, k.Root(), staging), Dev: dev}
		u := &Unmounter{Root: k.Root()}
		if kill {
			acts, err := u.AbortFUSE(context.Background(), dev, at)
			t.Logf("actions: %v", acts)
			if err != nil || ops(acts)[opKillServer] != 1 {
				t.Fatalf("AbortFUSE = %v, %v; want the stopped rclone killed", acts, err)
			}
		} else {
			// The control: the abort alone, as before the kill existed.
			if err := os.WriteFile(filepath.Join(defaultFusectlDir, strconv.FormatUint(uint64(probe.FusectlConn(dev)), 10), "abort"), []byte("1"), 0); err != nil {
				t.Fatal(err)
			}
		}
		<-blocked
		if _, err := u.UnmountMounts(context.Background(), []*probe.Mount{at}); err != nil {
			t.Fatal(err)
		}
		mount() // the re-stage
		fresh := topID(t, k.Root(), staging)
		syscall.Kill(pid, syscall.SIGCONT)
		stayed := true
		for end := time.Now().Add(3 * time.Second); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
			if !isFresh(fresh)() {
				stayed = false
				break
			}
		}
		switch {
		case kill && !stayed:
			t.Errorf("the fresh mount %d at %s went away after the stale rclone %d was woken, though AbortFUSE killed it", fresh, staging, pid)
		case !kill:
			t.Logf("control (abort without the kill): fresh mount stayed %t", stayed)
		}
		// Each round ends with the path bare.
		for topID(t, k.Root(), staging) != 0 {
			if err := unix.Unmount(staging, unix.MNT_DETACH); err != nil {
				break
			}
		}
	}
}

// rclonePids lists the rclone processes.
func rclonePids(t *testing.T) map[int]bool {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	out := map[int]bool{}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if comm := readComm(filepath.Join("/proc", e.Name())); comm == "rclone" {
			out[pid] = true
		}
	}
	return out
}

// TestAbortSparesTheVolumesUsers: the hostile actor is a pod's user who
// holds a copy of the volume's /dev/fuse descriptor (handed over by the
// daemon, or inherited), plus a regular file named "fuse" and a fresh
// /dev/fuse attached to nothing, hoping the agent takes it for the
// daemon. The abort kills the daemon and leaves the user's process
// alone, saying why; the decoys are never looked at as servers.
func TestAbortSparesTheVolumesUsers(t *testing.T) {
	lab.RequireRoot(t)
	ctx := context.Background()
	k := newKubelet(t)
	v := newLabVolume(t, k, labHandle, labVolume)

	// The user's copy of the daemon's descriptor, taken as the test's
	// root can (a daemon handing it over does the same).
	pidfd, err := unix.PidfdOpen(v.fs.Pid(), 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(pidfd)
	var copyFD int = -1
	for _, f := range fuseFDs(filepath.Join("/proc", strconv.Itoa(v.fs.Pid()))) {
		if f.conn == v.fs.Conn() {
			if copyFD, err = unix.PidfdGetfd(pidfd, f.fd, 0); err != nil {
				t.Fatal(err)
			}
		}
	}
	if copyFD < 0 {
		t.Fatalf("the daemon %d holds no /dev/fuse of connection %d", v.fs.Pid(), v.fs.Conn())
	}
	decoyFile := filepath.Join(t.TempDir(), "fuse")
	writeFile(t, decoyFile, "fuse_connection:\t"+strconv.FormatUint(uint64(v.fs.Conn()), 10)+"\n")
	decoy, err := os.Open(decoyFile)
	if err != nil {
		t.Fatal(err)
	}
	defer decoy.Close()
	unattached, err := os.OpenFile("/dev/fuse", os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unattached.Close()
	user := exec.Command("sleep", "600")
	// The copy is closed through its *os.File: closed by number as well,
	// the File's finalizer would close that number again later, whatever
	// descriptor of another test has it by then.
	fuseCopy := os.NewFile(uintptr(copyFD), "fuse-copy")
	user.ExtraFiles = []*os.File{fuseCopy, decoy, unattached}
	if err := user.Start(); err != nil {
		t.Fatal(err)
	}
	fuseCopy.Close()
	lab.JoinPodCgroup(t, user.Process.Pid, labPod, "hostile0000000")
	t.Cleanup(func() { _ = user.Process.Kill(); _ = user.Wait() })

	if err := syscall.Kill(v.fs.Pid(), syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	waitStopped(t, v.fs.Pid())
	blocked := blockedStatfs(t, v.staging)
	at := &probe.Mount{Path: v.staging, ID: topID(t, k.Root(), v.staging), Dev: v.dev()}
	u := &Unmounter{Root: k.Root(), Users: []string{labPod}}
	acts, err := u.AbortFUSE(ctx, v.dev(), at)
	t.Logf("actions: %v", acts)
	if err != nil {
		t.Fatalf("AbortFUSE = %v", err)
	}
	<-blocked
	if kill := actionOf(acts, opKillServer); kill.Path != "pid "+strconv.Itoa(v.fs.Pid()) || ops(acts)[opKillServer] != 1 {
		t.Errorf("kill actions %v; want only the daemon %d killed", acts, v.fs.Pid())
	}
	skip := actionOf(acts, opSkip)
	if skip.Path != "pid "+strconv.Itoa(user.Process.Pid) || !strings.Contains(skip.Detail, "uses the volume") {
		t.Errorf("skip action %v; want the user's process %d left alone as a user of the volume", skip, user.Process.Pid)
	}
	if err := syscall.Kill(user.Process.Pid, 0); err != nil {
		t.Errorf("the volume user's process %d was killed: %v", user.Process.Pid, err)
	}
	waitGone(t, "the volume's daemon exited", v.fs.Exited)
}
