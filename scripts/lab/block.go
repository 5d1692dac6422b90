package lab

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

const (
	// ext4IocShutdown is EXT4_IOC_SHUTDOWN, _IOR('X', 125, __u32).
	ext4IocShutdown = 0x8004587d
	// ext4GoingFlagsNoLogFlush shuts down without flushing the journal.
	ext4GoingFlagsNoLogFlush = 2

	// loopDetachWait bounds the wait for an autoclear loop device to let go
	// of its backing file after the unmount.
	loopDetachWait = 10 * time.Second
)

// BlockFS is an ext4 filesystem on a loop device, mounted for one test. The
// loop device has LO_FLAGS_AUTOCLEAR: it detaches itself when the filesystem
// lets go of it, so none leaks even when the test binary dies.
type BlockFS struct {
	t            testing.TB
	mountpoint   string
	backing      string
	device       string
	major, minor uint32
}

// NewExt4 makes an ext4 filesystem of sizeMiB on a sparse file in t.TempDir(),
// attaches it to a loop device and mounts it at mountpoint (created if
// missing).
func NewExt4(t testing.TB, mountpoint string, sizeMiB int) *BlockFS {
	t.Helper()
	return NewExt4On(t, mountpoint, t.TempDir(), sizeMiB)
}

// NewExt4On is NewExt4 with the backing file in backingDir. With backingDir
// on a FaultFS this is the NBD-like case: a block device whose backend is a
// userspace daemon that can die or hang.
func NewExt4On(t testing.TB, mountpoint, backingDir string, sizeMiB int) *BlockFS {
	t.Helper()
	mkfs := RequireBinary(t, "mkfs.ext4")
	if sizeMiB < 8 {
		t.Fatalf("ext4 size %d MiB: want at least 8", sizeMiB)
	}
	if err := os.MkdirAll(mountpoint, 0o755); err != nil {
		t.Fatalf("create ext4 mountpoint: %v", err)
	}
	mp, err := filepath.EvalSymlinks(mountpoint)
	if err != nil {
		t.Fatalf("resolve ext4 mountpoint: %v", err)
	}
	dir, err := filepath.EvalSymlinks(backingDir)
	if err != nil {
		t.Fatalf("resolve ext4 backing dir: %v", err)
	}
	img, err := os.CreateTemp(dir, "ext4-*.img")
	if err != nil {
		t.Fatalf("create ext4 backing file: %v", err)
	}
	backing := img.Name()
	t.Cleanup(func() { _ = os.Remove(backing) })
	err = img.Truncate(int64(sizeMiB) << 20)
	if cerr := img.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		t.Fatalf("size ext4 backing file %s: %v", backing, err)
	}
	// Inode tables and journal are written now, not by a lazy-init thread
	// in the background after the mount.
	out, err := exec.Command(mkfs, "-q", "-F", "-E", "nodiscard,lazy_itable_init=0,lazy_journal_init=0", backing).CombinedOutput()
	if err != nil {
		t.Fatalf("mkfs.ext4 %s: %v: %s", backing, err, out)
	}

	b := &BlockFS{t: t, mountpoint: mp, backing: backing}
	loop, err := attachLoop(backing)
	if err != nil {
		t.Fatalf("attach %s to a loop device: %v", backing, err)
	}
	b.device = loop.Name()
	var st unix.Stat_t
	if err := unix.Fstat(int(loop.Fd()), &st); err != nil {
		loop.Close()
		t.Fatalf("stat %s: %v", b.device, err)
	}
	b.major, b.minor = unix.Major(st.Rdev), unix.Minor(st.Rdev)
	err = unix.Mount(b.device, mp, "ext4", 0, "")
	// The mount holds the device now; closing our descriptor leaves the
	// filesystem as its only user, or (mount failed) detaches it at once.
	loop.Close()
	if err != nil {
		t.Fatalf("mount %s at %s: %v", b.device, mp, err)
	}
	t.Cleanup(b.cleanup)
	return b
}

// attachLoop binds the file to a free loop device with autoclear and returns
// the open device.
func attachLoop(file string) (*os.File, error) {
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("open loop control: %w", err)
	}
	defer ctl.Close()
	backing, err := os.OpenFile(file, os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("open backing file: %w", err)
	}
	defer backing.Close()

	var lastErr error
	// Another process may take the free device between the two calls.
	for range 10 {
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			return nil, fmt.Errorf("find a free loop device: %w", err)
		}
		dev := "/dev/loop" + strconv.Itoa(n)
		loop, err := os.OpenFile(dev, os.O_RDWR, 0)
		if err != nil {
			return nil, fmt.Errorf("open %s: %w", dev, err)
		}
		cfg := unix.LoopConfig{Fd: uint32(backing.Fd())}
		cfg.Info.Flags = unix.LO_FLAGS_AUTOCLEAR
		copy(cfg.Info.File_name[:len(cfg.Info.File_name)-1], file)
		err = unix.IoctlLoopConfigure(int(loop.Fd()), &cfg)
		if err == nil {
			return loop, nil
		}
		loop.Close()
		if !errors.Is(err, unix.EBUSY) {
			return nil, fmt.Errorf("configure %s: %w", dev, err)
		}
		lastErr = err
	}
	return nil, fmt.Errorf("configure a loop device: %w", lastErr)
}

// Mountpoint is where the filesystem is mounted (symlinks resolved).
func (b *BlockFS) Mountpoint() string { return b.mountpoint }

// Device is the loop device, /dev/loopN.
func (b *BlockFS) Device() string { return b.device }

// Dev is the major and minor number of the loop device, as mountinfo shows.
func (b *BlockFS) Dev() (major, minor uint32) { return b.major, b.minor }

// BackingFile is the image file behind the loop device.
func (b *BlockFS) BackingFile() string { return b.backing }

// SysfsDir is /sys/fs/ext4/loopN, where ext4 keeps errors_count and friends.
func (b *BlockFS) SysfsDir() string {
	return filepath.Join("/sys/fs/ext4", filepath.Base(b.device))
}

// ErrorsCount reads errors_count from SysfsDir.
func (b *BlockFS) ErrorsCount() (int, error) {
	p := filepath.Join(b.SysfsDir(), "errors_count")
	data, err := os.ReadFile(p)
	if err != nil {
		return 0, fmt.Errorf("read %s: %w", p, err)
	}
	n, err := strconv.Atoi(strings.TrimSpace(string(data)))
	if err != nil {
		return 0, fmt.Errorf("parse %s: %w", p, err)
	}
	return n, nil
}

// SuperOptions are the filesystem's super options from mountinfo (the last
// field: rw/ro, errors=..., and shutdown or emergency_ro after a failure).
func (b *BlockFS) SuperOptions() ([]string, error) {
	mounts, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(b.mountpoint))
	if err != nil {
		return nil, fmt.Errorf("read mount table: %w", err)
	}
	for i := len(mounts) - 1; i >= 0; i-- {
		if m := mounts[i]; uint32(m.Major) == b.major && uint32(m.Minor) == b.minor {
			return strings.Split(m.VFSOptions, ","), nil
		}
	}
	return nil, fmt.Errorf("%s is not mounted at %s", b.device, b.mountpoint)
}

// Shutdown shuts the filesystem down with EXT4_IOC_SHUTDOWN, without flushing
// the journal: file reads and creates answer EIO afterwards, while stat,
// statfs and readdir go on working, and mountinfo shows the super option
// "shutdown".
func (b *BlockFS) Shutdown() {
	b.t.Helper()
	fd, err := unix.Open(b.mountpoint, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		b.t.Fatalf("open %s: %v", b.mountpoint, err)
	}
	defer unix.Close(fd)
	if err := unix.IoctlSetPointerInt(fd, ext4IocShutdown, ext4GoingFlagsNoLogFlush); err != nil {
		b.t.Fatalf("shut down ext4 at %s: %v", b.mountpoint, err)
	}
}

func (b *BlockFS) cleanup() {
	if err := unmountTop(b.mountpoint, func(m *mountinfo.Info) bool {
		return uint32(m.Major) == b.major && uint32(m.Minor) == b.minor
	}); err != nil {
		b.t.Errorf("ext4 cleanup: %v", err)
	}
	// Binds of the filesystem made elsewhere (a kubelet tree's publish and
	// subPath binds, cleaned up after this) would keep the device attached.
	if err := detachDevice(b.major, b.minor); err != nil {
		b.t.Errorf("ext4 cleanup: %v", err)
	}
	// Autoclear detaches the device once the filesystem is gone; a device
	// still bound to our file means something still holds the filesystem.
	attr := filepath.Join("/sys/block", filepath.Base(b.device), "loop", "backing_file")
	deadline := time.Now().Add(loopDetachWait)
	for {
		data, err := os.ReadFile(attr)
		if err != nil || strings.TrimSpace(string(data)) != b.backing {
			return
		}
		if time.Now().After(deadline) {
			b.t.Errorf("ext4 cleanup: %s is still attached to %s (a mount or open file still holds it)", b.device, b.backing)
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// detachDevice lazily unmounts every mount of the device major:minor in
// this (private) namespace, deepest first.
func detachDevice(major, minor uint32) error {
	mounts, err := mountinfo.GetMounts(func(m *mountinfo.Info) (bool, bool) {
		return uint32(m.Major) != major || uint32(m.Minor) != minor, false
	})
	if err != nil {
		return fmt.Errorf("read mount table: %w", err)
	}
	sort.Slice(mounts, func(i, j int) bool { return len(mounts[i].Mountpoint) > len(mounts[j].Mountpoint) })
	for _, m := range mounts {
		if err := unix.Unmount(m.Mountpoint, unix.MNT_DETACH); err != nil &&
			!errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("unmount %s: %w", m.Mountpoint, err)
		}
	}
	return nil
}
