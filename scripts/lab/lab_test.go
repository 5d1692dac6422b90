package lab

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

func TestMain(m *testing.M) { Main(m) }

// blockedFor is how long a call must stay blocked for the test to call it
// hung. It is a bound on a wait, never an asserted duration.
const blockedFor = 2 * time.Second

// unblockWait bounds the wait for a blocked call to return after an abort.
const unblockWait = 30 * time.Second

func statfs(p string) error {
	var st unix.Statfs_t
	return unix.Statfs(p, &st)
}

func statxSync(p string) error {
	var st unix.Statx_t
	return unix.Statx(unix.AT_FDCWD, p, unix.AT_STATX_FORCE_SYNC, unix.STATX_BASIC_STATS, &st)
}

// statxBtime asks for the birth time of an open file, which makes the kernel
// send FUSE_STATX (not GETATTR) and no LOOKUP.
func statxBtime(fd int) error {
	var st unix.Statx_t
	return unix.Statx(fd, "", unix.AT_EMPTY_PATH|unix.AT_STATX_FORCE_SYNC, unix.STATX_BASIC_STATS|unix.STATX_BTIME, &st)
}

func writeFile(t *testing.T, p, content string) {
	t.Helper()
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatalf("write %s: %v", p, err)
	}
}

func readFile(t *testing.T, p, want string) {
	t.Helper()
	got, err := os.ReadFile(p)
	if err != nil {
		t.Fatalf("read %s: %v", p, err)
	}
	if string(got) != want {
		t.Fatalf("read %s = %q, want %q", p, got, want)
	}
}

func mountAt(t *testing.T, p string) *mountinfo.Info {
	t.Helper()
	mounts, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(p))
	if err != nil {
		t.Fatalf("read mount table: %v", err)
	}
	if len(mounts) == 0 {
		return nil
	}
	return mounts[len(mounts)-1]
}

func TestFaultFSHealthy(t *testing.T) {
	RequireRoot(t)
	f := StartFaultFS(t, filepath.Join(t.TempDir(), "mnt"))

	m := mountAt(t, f.Mountpoint())
	if m == nil {
		t.Fatalf("no mount at %s", f.Mountpoint())
	}
	if m.FSType != FaultFSType || m.Source != "faultfs" {
		t.Errorf("mountinfo fstype %q source %q, want %q and %q", m.FSType, m.Source, FaultFSType, "faultfs")
	}
	if m.Major != 0 || uint32(m.Minor) != f.Conn() {
		t.Errorf("mountinfo dev %d:%d, want 0:%d", m.Major, m.Minor, f.Conn())
	}
	if _, err := os.Stat(filepath.Join(fusectlDir, strconv.FormatUint(uint64(f.Conn()), 10), "abort")); err != nil {
		t.Errorf("fusectl abort file of connection %d: %v", f.Conn(), err)
	}
	p := filepath.Join(f.Mountpoint(), "hello")
	writeFile(t, p, "world")
	readFile(t, p, "world")
	readFile(t, filepath.Join(f.BackingDir(), "hello"), "world")
	if err := statxSync(p); err != nil {
		t.Errorf("statx(FORCE_SYNC) %s: %v", p, err)
	}
}

func TestFaultFSKill(t *testing.T) {
	RequireRoot(t)
	f := StartFaultFS(t, filepath.Join(t.TempDir(), "mnt"))
	p := filepath.Join(f.Mountpoint(), "file")
	writeFile(t, p, "data")

	f.Kill()

	if err := statfs(f.Mountpoint()); !errors.Is(err, unix.ENOTCONN) {
		t.Errorf("statfs after kill = %v, want ENOTCONN", err)
	}
	if err := statxSync(f.Mountpoint()); !errors.Is(err, unix.ENOTCONN) {
		t.Errorf("statx(FORCE_SYNC) of the root after kill = %v, want ENOTCONN", err)
	}
	if err := statxSync(p); !errors.Is(err, unix.ENOTCONN) {
		t.Errorf("statx(FORCE_SYNC) of a file after kill = %v, want ENOTCONN", err)
	}
	if m := mountAt(t, f.Mountpoint()); m == nil || m.FSType != FaultFSType {
		t.Errorf("mount at %s after kill = %+v, want the dead %s mount to stay", f.Mountpoint(), m, FaultFSType)
	}
}

func TestFaultFSErrno(t *testing.T) {
	RequireRoot(t)
	f := StartFaultFS(t, filepath.Join(t.TempDir(), "mnt"))
	p := filepath.Join(f.Mountpoint(), "file")
	writeFile(t, p, "data")
	fh, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer fh.Close()
	if err := statxBtime(int(fh.Fd())); err != nil {
		t.Fatalf("statx(BTIME) of an open file: %v", err)
	}

	for _, e := range []syscall.Errno{unix.EIO, unix.ESTALE, unix.EACCES} {
		f.SetErrno(e)
		if err := statfs(f.Mountpoint()); !errors.Is(err, e) {
			t.Errorf("statfs with errno %v = %v, want %v", e, err, e)
		}
		if err := statxSync(p); !errors.Is(err, e) {
			t.Errorf("statx(FORCE_SYNC) with errno %v = %v, want %v", e, err, e)
		}
		if err := statxBtime(int(fh.Fd())); !errors.Is(err, e) {
			t.Errorf("statx(FORCE_SYNC, BTIME) with errno %v = %v, want %v", e, err, e)
		}
		if _, err := os.ReadFile(p); !errors.Is(err, e) {
			t.Errorf("read with errno %v = %v, want %v", e, err, e)
		}
	}
	f.SetErrno(0)
	if err := statfs(f.Mountpoint()); err != nil {
		t.Errorf("statfs after clearing the errno: %v", err)
	}
	readFile(t, p, "data")
}

// startBlocked runs call in a goroutine and fails the test unless it is
// still blocked after blockedFor. The returned channel yields its result.
func startBlocked(t *testing.T, what string, call func() error) <-chan error {
	t.Helper()
	res := make(chan error, 1)
	go func() { res <- call() }()
	select {
	case err := <-res:
		t.Fatalf("%s returned %v on a hung mount, want it to block", what, err)
	case <-time.After(blockedFor):
	}
	return res
}

func TestFaultFSHangAbort(t *testing.T) {
	RequireRoot(t)
	f := StartFaultFS(t, filepath.Join(t.TempDir(), "mnt"))
	f.Hang()
	blockedStatfs := startBlocked(t, "statfs", func() error { return statfs(f.Mountpoint()) })
	blockedStatx := startBlocked(t, "statx(FORCE_SYNC)", func() error { return statxSync(f.Mountpoint()) })

	f.Abort()

	for what, res := range map[string]<-chan error{"statfs": blockedStatfs, "statx(FORCE_SYNC)": blockedStatx} {
		select {
		case err := <-res:
			if !errors.Is(err, unix.ECONNABORTED) && !errors.Is(err, unix.ENOTCONN) {
				t.Errorf("blocked %s after abort = %v, want ECONNABORTED or ENOTCONN", what, err)
			}
			t.Logf("blocked %s after abort: %v", what, err)
		case <-time.After(unblockWait):
			t.Fatalf("blocked %s did not return after abort", what)
		}
	}
	if err := statfs(f.Mountpoint()); !errors.Is(err, unix.ENOTCONN) {
		t.Errorf("statfs after abort = %v, want ENOTCONN", err)
	}
}

func TestFaultFSHangRelease(t *testing.T) {
	RequireRoot(t)
	f := StartFaultFS(t, filepath.Join(t.TempDir(), "mnt"))
	f.Hang()
	res := startBlocked(t, "statfs", func() error { return statfs(f.Mountpoint()) })

	f.Release()

	select {
	case err := <-res:
		if err != nil {
			t.Errorf("blocked statfs after release = %v, want success", err)
		}
	case <-time.After(unblockWait):
		t.Fatalf("blocked statfs did not return after release")
	}
}

// TestFaultFSCleanupWhileHung leaves the mount hung for the cleanup, which
// must abort it rather than wedge.
func TestFaultFSCleanupWhileHung(t *testing.T) {
	RequireRoot(t)
	f := StartFaultFS(t, filepath.Join(t.TempDir(), "mnt"))
	f.Hang()
	startBlocked(t, "statfs", func() error { return statfs(f.Mountpoint()) })
}

func TestExt4Shutdown(t *testing.T) {
	RequireRoot(t)
	b := NewExt4(t, filepath.Join(t.TempDir(), "ext4"), 32)
	if m := mountAt(t, b.Mountpoint()); m == nil || m.FSType != "ext4" {
		t.Fatalf("mount at %s = %+v, want ext4", b.Mountpoint(), m)
	}
	major, minor := b.Dev()
	if major != 7 {
		t.Errorf("Dev() = %d:%d, want a loop device (major 7)", major, minor)
	}
	p := filepath.Join(b.Mountpoint(), "file")
	writeFile(t, p, "data")
	unix.Sync()

	b.Shutdown()

	if _, err := os.ReadFile(p); !errors.Is(err, unix.EIO) {
		t.Errorf("read after shutdown = %v, want EIO", err)
	}
	if err := os.WriteFile(filepath.Join(b.Mountpoint(), "new"), nil, 0o644); !errors.Is(err, unix.EIO) {
		t.Errorf("create after shutdown = %v, want EIO", err)
	}
	opts, err := b.SuperOptions()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(opts, "shutdown") {
		t.Errorf("super options after shutdown = %v, want shutdown", opts)
	}
	n, err := b.ErrorsCount()
	t.Logf("after shutdown: stat %v, statfs %v, super options %v, errors_count %d (%v)", errOf(os.Stat(p)), statfs(b.Mountpoint()), opts, n, err)
}

// TestNBDLikeKill kills the FUSE daemon that serves the backing file of a
// loop device with ext4 on it.
func TestNBDLikeKill(t *testing.T) {
	RequireRoot(t)
	dir := t.TempDir()
	f := StartFaultFS(t, filepath.Join(dir, "fuse"))
	b := NewExt4On(t, filepath.Join(dir, "ext4"), f.Mountpoint(), 32)
	p := filepath.Join(b.Mountpoint(), "file")
	writeFile(t, p, "data")
	unix.Sync()
	readFile(t, p, "data")
	if n, err := b.ErrorsCount(); err != nil || n != 0 {
		t.Fatalf("errors_count before the kill = %d, %v; want 0", n, err)
	}

	f.Kill()

	// A write lands in the page cache; fsync is where the block layer
	// answers, and the journal aborts.
	if err := writeAndFsync(filepath.Join(b.Mountpoint(), "after-kill"), make([]byte, 64<<10)); !errors.Is(err, unix.EIO) {
		t.Errorf("write+fsync after the kill = %v, want EIO", err)
	}
	// The next journal start sees the aborted journal: ext4 turns
	// emergency read-only.
	if err := writeAndFsync(filepath.Join(b.Mountpoint(), "after-abort"), []byte("x")); !errors.Is(err, unix.EROFS) {
		t.Errorf("create after the journal aborted = %v, want EROFS", err)
	}
	opts, err := b.SuperOptions()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(opts, "emergency_ro") {
		t.Errorf("super options after the kill = %v, want emergency_ro", opts)
	}
	if n, err := b.ErrorsCount(); err != nil || n < 1 {
		t.Errorf("errors_count after the kill = %d, %v; want at least 1", n, err)
	}
	if err := statfs(b.Mountpoint()); err != nil {
		t.Errorf("statfs of the ext4 after the kill = %v, want success (statfs alone misses this failure)", err)
	}
	t.Logf("after kill: super options %v, stat %v, cached read %v", opts, errOf(os.Stat(p)), errOf(os.ReadFile(p)))
}

// TestNBDLikeHang hangs the FUSE daemon behind the loop device: fsync on the
// ext4 blocks while statfs still answers, until the FUSE connection is
// aborted.
func TestNBDLikeHang(t *testing.T) {
	RequireRoot(t)
	dir := t.TempDir()
	f := StartFaultFS(t, filepath.Join(dir, "fuse"))
	b := NewExt4On(t, filepath.Join(dir, "ext4"), f.Mountpoint(), 32)
	unix.Sync()

	f.Hang()
	res := startBlocked(t, "write+fsync", func() error {
		return writeAndFsync(filepath.Join(b.Mountpoint(), "during-hang"), make([]byte, 64<<10))
	})
	if err := statfs(b.Mountpoint()); err != nil {
		t.Errorf("statfs of the ext4 while its backend hangs = %v, want success", err)
	}

	f.Abort()

	select {
	case err := <-res:
		if !errors.Is(err, unix.EIO) {
			t.Errorf("blocked write+fsync after the abort = %v, want EIO", err)
		}
	case <-time.After(unblockWait):
		t.Fatalf("blocked write+fsync did not return after the abort")
	}
	opts, err := b.SuperOptions()
	if err != nil {
		t.Fatal(err)
	}
	n, err := b.ErrorsCount()
	t.Logf("after abort: super options %v, errors_count %d (%v)", opts, n, err)
}

func writeAndFsync(p string, data []byte) error {
	fh, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
	if err != nil {
		return err
	}
	defer fh.Close()
	if _, err := fh.Write(data); err != nil {
		return err
	}
	return fh.Sync()
}

func errOf[T any](_ T, err error) error { return err }
