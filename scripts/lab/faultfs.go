package lab

import (
	"bufio"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// FUSEMagic is the f_type statfs reports for a FUSE filesystem.
const FUSEMagic = 0x65735546

// FaultFSType is the file system type of a FaultFS in the mount table.
const FaultFSType = "fuse.faultfs"

// controlTimeout bounds one exchange on the control socket.
const controlTimeout = 30 * time.Second

// FaultFS is a go-fuse loopback filesystem served by a separate process, with
// faults injected over a control socket: an errno for every request, a hang
// inside every handler, or the death of the daemon.
type FaultFS struct {
	t          testing.TB
	mountpoint string
	backing    string
	control    string
	d          *daemon
	conn       uint32
	// more are the further mounts of a StartFaultFSMany daemon.
	more []faultMount
}

type faultMount struct {
	path string
	conn uint32
}

// FaultFSOption changes how StartFaultFS sets up the filesystem.
type FaultFSOption func(*faultFSConfig)

// WithBackingDir serves dir instead of a fresh directory in t.TempDir().
func WithBackingDir(dir string) FaultFSOption {
	return func(c *faultFSConfig) { c.Backing = dir }
}

type faultFSConfig struct {
	Mountpoint string
	// More are further mountpoints the same daemon serves, each its own
	// FUSE connection over the same backing directory and faults; MoreFile
	// holds them one a line when they are too many for the environment.
	More     []string `json:",omitempty"`
	MoreFile string   `json:",omitempty"`
	Backing  string
	Control  string
}

// StartFaultFS mounts a FaultFS at mountpoint (created if missing) and
// returns once the mount answers statfs with the FUSE magic. The mount shows
// fstype fuse.faultfs and source faultfs in mountinfo. Cleanup aborts the
// connection (so a hung mount never wedges it), detaches the mount and kills
// and reaps the daemon.
func StartFaultFS(t testing.TB, mountpoint string, opts ...FaultFSOption) *FaultFS {
	t.Helper()
	cfg := faultFSConfig{Mountpoint: mountpoint}
	for _, o := range opts {
		o(&cfg)
	}
	if cfg.Backing == "" {
		cfg.Backing = t.TempDir()
	}
	if err := os.MkdirAll(mountpoint, 0o755); err != nil {
		t.Fatalf("create faultfs mountpoint: %v", err)
	}
	mp, err := filepath.EvalSymlinks(mountpoint)
	if err != nil {
		t.Fatalf("resolve faultfs mountpoint: %v", err)
	}
	cfg.Mountpoint = mp
	var nonce [8]byte
	if _, err := rand.Read(nonce[:]); err != nil {
		t.Fatalf("make control socket name: %v", err)
	}
	// An abstract socket: no path length limit, nothing to remove.
	cfg.Control = "@mountmedic-lab-faultfs-" + hex.EncodeToString(nonce[:])

	d, err := startDaemon(roleFaultFS, cfg, 0)
	if err != nil {
		t.Fatalf("start faultfs at %s: %v", mp, err)
	}
	f := &FaultFS{t: t, mountpoint: mp, backing: cfg.Backing, control: cfg.Control, d: d}
	t.Cleanup(f.cleanup)

	var st unix.Statfs_t
	if err := unix.Statfs(mp, &st); err != nil {
		t.Fatalf("statfs new faultfs at %s: %v", mp, err)
	}
	if st.Type != FUSEMagic {
		t.Fatalf("statfs new faultfs at %s: f_type %#x, want the fuse magic %#x", mp, st.Type, FUSEMagic)
	}
	var sb unix.Stat_t
	if err := unix.Stat(mp, &sb); err != nil {
		t.Fatalf("stat new faultfs at %s: %v", mp, err)
	}
	f.conn = unix.Minor(sb.Dev)
	return f
}

// StartFaultFSMany mounts one FaultFS daemon at every one of mountpoints:
// one process, one FUSE connection per mountpoint, all over the same backing
// directory and under the same faults, so that Hang, Release and Kill reach
// every mount at once (a storage backend outage under many volumes). It
// returns once every mount answers statfs. Mountpoint and Conn are the
// first mount's; Conns lists them all.
func StartFaultFSMany(t testing.TB, mountpoints []string, opts ...FaultFSOption) *FaultFS {
	t.Helper()
	if len(mountpoints) == 0 {
		t.Fatal("StartFaultFSMany: no mountpoint")
	}
	var more []string
	for _, mp := range mountpoints[1:] {
		if err := os.MkdirAll(mp, 0o755); err != nil {
			t.Fatalf("create faultfs mountpoint: %v", err)
		}
		r, err := filepath.EvalSymlinks(mp)
		if err != nil {
			t.Fatalf("resolve faultfs mountpoint: %v", err)
		}
		more = append(more, r)
	}
	// The list goes through a file: a thousand paths exceed the size of
	// one environment variable.
	list := filepath.Join(t.TempDir(), "mountpoints")
	if err := os.WriteFile(list, []byte(strings.Join(more, "\n")), 0o600); err != nil {
		t.Fatal(err)
	}
	f := StartFaultFS(t, mountpoints[0], append(opts, func(c *faultFSConfig) { c.MoreFile = list })...)
	for _, mp := range more {
		var sb unix.Stat_t
		if err := unix.Stat(mp, &sb); err != nil {
			t.Fatalf("stat new faultfs at %s: %v", mp, err)
		}
		f.more = append(f.more, faultMount{path: mp, conn: unix.Minor(sb.Dev)})
	}
	return f
}

// Conns lists the FUSE connection numbers of every mount of the daemon.
func (f *FaultFS) Conns() []uint32 {
	out := []uint32{f.conn}
	for _, m := range f.more {
		out = append(out, m.conn)
	}
	return out
}

// Mountpoint is where the filesystem is mounted (symlinks resolved).
func (f *FaultFS) Mountpoint() string { return f.mountpoint }

// BackingDir is the directory the filesystem serves.
func (f *FaultFS) BackingDir() string { return f.backing }

// Pid is the process id of the FUSE daemon.
func (f *FaultFS) Pid() int { return f.d.pid() }

// Conn is the FUSE connection number: the minor of the mount's st_dev and
// the name of its directory under /sys/fs/fuse/connections.
func (f *FaultFS) Conn() uint32 { return f.conn }

// SetErrno makes every request answer e; 0 clears the fault.
func (f *FaultFS) SetErrno(e syscall.Errno) {
	f.t.Helper()
	f.command("errno " + strconv.Itoa(int(e)))
}

// Delay makes every request answer d late (0 clears it): a slow daemon
// that still answers, as opposed to a hung one.
func (f *FaultFS) Delay(d time.Duration) {
	f.t.Helper()
	f.command("delay " + d.String())
}

// Hang makes every request block inside its handler until Release or an
// abort of the connection.
func (f *FaultFS) Hang() {
	f.t.Helper()
	f.command("hang")
}

// Release ends a Hang: blocked requests go on and new ones are served.
func (f *FaultFS) Release() {
	f.t.Helper()
	f.command("release")
}

// Exited reports whether the daemon process has exited (and been reaped).
func (f *FaultFS) Exited() bool { return f.d.exited() }

// Kill sends SIGKILL to the daemon and waits until it is reaped. The mount
// stays; its requests answer ENOTCONN afterwards.
func (f *FaultFS) Kill() {
	f.d.kill()
}

// Abort writes 1 to /sys/fs/fuse/connections/<Conn>/abort: requests in flight
// fail with ECONNABORTED, later ones with ENOTCONN.
func (f *FaultFS) Abort() {
	f.t.Helper()
	if err := f.abort(); err != nil {
		f.t.Fatalf("abort faultfs connection: %v", err)
	}
}

func (f *FaultFS) abort() error {
	// Connection numbers are global and reused once a connection ends: only
	// abort while this namespace still has a mount on our connection, or a
	// test running beside us could lose its mount.
	conns := make(map[uint32]bool)
	for _, c := range f.Conns() {
		conns[c] = true
	}
	mounts, err := mountinfo.GetMounts(func(m *mountinfo.Info) (bool, bool) {
		return m.FSType != FaultFSType || m.Major != 0 || !conns[uint32(m.Minor)], false
	})
	if err != nil {
		return fmt.Errorf("read mount table: %w", err)
	}
	live := make(map[uint32]bool)
	for _, m := range mounts {
		live[uint32(m.Minor)] = true
	}
	if !live[f.conn] && len(f.more) == 0 {
		return fmt.Errorf("connection %d: no faultfs mount on it any more", f.conn)
	}
	var errs []error
	for c := range live {
		p := filepath.Join(fusectlDir, strconv.FormatUint(uint64(c), 10), "abort")
		if err := os.WriteFile(p, []byte("1"), 0); err != nil {
			errs = append(errs, fmt.Errorf("write %s: %w", p, err))
		}
	}
	return errors.Join(errs...)
}

func (f *FaultFS) command(cmd string) {
	f.t.Helper()
	if err := f.exchange(cmd); err != nil {
		f.t.Fatalf("faultfs control %q: %v", cmd, err)
	}
}

func (f *FaultFS) exchange(cmd string) error {
	c, err := net.DialTimeout("unix", f.control, controlTimeout)
	if err != nil {
		return fmt.Errorf("dial control socket: %w", err)
	}
	defer c.Close()
	if err := c.SetDeadline(time.Now().Add(controlTimeout)); err != nil {
		return fmt.Errorf("set control deadline: %w", err)
	}
	if _, err := c.Write([]byte(cmd + "\n")); err != nil {
		return fmt.Errorf("send: %w", err)
	}
	reply, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return fmt.Errorf("read reply: %w", err)
	}
	if reply != "ok\n" {
		return fmt.Errorf("daemon answered %q", strings.TrimSpace(reply))
	}
	return nil
}

func (f *FaultFS) cleanup() {
	// Abort first: it fails every blocked request, so neither the unmount
	// nor anything the test left hanging can wedge the cleanup. The
	// connection may be gone already.
	_ = f.abort()
	for _, m := range append([]faultMount{{f.mountpoint, f.conn}}, f.more...) {
		if err := unmountTop(m.path, func(in *mountinfo.Info) bool {
			return in.FSType == FaultFSType && in.Major == 0 && uint32(in.Minor) == m.conn
		}); err != nil {
			f.t.Errorf("faultfs cleanup: %v", err)
		}
	}
	f.d.kill()
	if f.t.Failed() {
		if out := f.d.output.String(); out != "" {
			f.t.Logf("faultfs daemon output:\n%s", out)
		}
	}
}

// unmountTop lazily unmounts the mounts stacked at path while the top one
// matches ours. A mount someone else stacked on top stays.
func unmountTop(path string, ours func(*mountinfo.Info) bool) error {
	for range 16 {
		mounts, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(path))
		if err != nil {
			return fmt.Errorf("read mount table: %w", err)
		}
		if len(mounts) == 0 || !ours(mounts[len(mounts)-1]) {
			return nil
		}
		if err := unix.Unmount(path, unix.MNT_DETACH); err != nil {
			if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT) {
				return nil
			}
			return fmt.Errorf("unmount %s: %w", path, err)
		}
	}
	return fmt.Errorf("unmount %s: still mounted after 16 lazy unmounts", path)
}

// runFaultFSDaemon serves the loopback filesystem and the control socket
// until the connection ends or the process is killed.
func runFaultFSDaemon(cfg faultFSConfig, ready *readiness) error {
	root, err := fs.NewLoopbackRoot(cfg.Backing)
	if err != nil {
		return fmt.Errorf("loopback root %s: %w", cfg.Backing, err)
	}
	// No attribute, entry or negative caching: each stat and lookup reaches
	// the daemon, so an injected fault shows at once. Data still goes through
	// the page cache, so ordinary reads and writes work.
	var zero time.Duration
	opts := &fs.Options{
		EntryTimeout:    &zero,
		AttrTimeout:     &zero,
		NegativeTimeout: &zero,
		MountOptions: fuse.MountOptions{
			FsName:            "faultfs",
			Name:              "faultfs",
			AllowOther:        true,
			DirectMount:       true,
			DirectMountStrict: true,
		},
	}
	flt := &faults{}
	raw := &faultRaw{RawFileSystem: fs.NewNodeFS(root, opts), f: flt}
	srv, err := fuse.NewServer(raw, cfg.Mountpoint, &opts.MountOptions)
	if err != nil {
		return fmt.Errorf("mount fuse at %s: %w", cfg.Mountpoint, err)
	}
	go srv.Serve()
	if err := srv.WaitMount(); err != nil {
		return fmt.Errorf("wait for fuse mount at %s: %w", cfg.Mountpoint, err)
	}
	// The daemon lives until every connection ended: one aborted mount
	// must not end the others (its exit would abort them all).
	var served sync.WaitGroup
	served.Go(srv.Wait)
	if cfg.MoreFile != "" {
		raw, err := os.ReadFile(cfg.MoreFile)
		if err != nil {
			return fmt.Errorf("read mountpoint list: %w", err)
		}
		if len(raw) > 0 {
			cfg.More = append(cfg.More, strings.Split(string(raw), "\n")...)
		}
	}
	for _, mp := range cfg.More {
		// Each mount its own node tree: go-fuse binds a tree to one server.
		root, err := fs.NewLoopbackRoot(cfg.Backing)
		if err != nil {
			return fmt.Errorf("loopback root %s: %w", cfg.Backing, err)
		}
		o := *opts
		s, err := fuse.NewServer(&faultRaw{RawFileSystem: fs.NewNodeFS(root, &o), f: flt}, mp, &o.MountOptions)
		if err != nil {
			return fmt.Errorf("mount fuse at %s: %w", mp, err)
		}
		go s.Serve()
		if err := s.WaitMount(); err != nil {
			return fmt.Errorf("wait for fuse mount at %s: %w", mp, err)
		}
		served.Go(s.Wait)
	}
	ln, err := net.Listen("unix", cfg.Control)
	if err != nil {
		return fmt.Errorf("listen on control socket: %w", err)
	}
	go serveControl(ln, flt)
	ready.ok()
	served.Wait()
	return nil
}

func serveControl(ln net.Listener, flt *faults) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go handleControl(c, flt)
	}
}

func handleControl(c net.Conn, flt *faults) {
	defer c.Close()
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return
	}
	verb, arg, _ := strings.Cut(strings.TrimSpace(line), " ")
	reply := "ok\n"
	switch verb {
	case "errno":
		n, err := strconv.Atoi(arg)
		if err != nil || n < 0 {
			reply = fmt.Sprintf("error: bad errno %q\n", arg)
			break
		}
		flt.setErrno(syscall.Errno(n))
	case "delay":
		d, err := time.ParseDuration(arg)
		if err != nil || d < 0 {
			reply = fmt.Sprintf("error: bad delay %q\n", arg)
			break
		}
		flt.setDelay(d)
	case "hang":
		flt.startHang()
	case "release":
		flt.release()
	default:
		reply = fmt.Sprintf("error: unknown command %q\n", verb)
	}
	_, _ = c.Write([]byte(reply))
}
