package csilab

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/scripts/lab"
)

// Ceph is a throwaway single-node Ceph with a CephFS named "cephfs" on
// loopback ports, made by scripts/ceph-lab.sh: one mon, mgr, OSD and MDS,
// cephx off.
type Ceph struct {
	// parent holds dir (the lab's state) and the start trace.
	parent            string
	dir, conf, script string
	monAddr           string
	env               []string
}

// cephBinaries are the programs ceph-lab.sh and the CephFS driver run.
var cephBinaries = []string{"ceph-mon", "ceph-mgr", "ceph-osd", "ceph-mds", "ceph", "monmaptool", "ceph-fuse"}

// CephSessionTimeout is the session_timeout (seconds) of the lab's file
// system: the least Ceph takes (its default is 60).
const CephSessionTimeout = 30

// cephPorts is how many consecutive ports a lab takes: the mon's first,
// then the range the other daemons bind in.
const cephPorts = 40

var shared struct {
	mu   sync.Mutex
	once sync.Once
	ceph *Ceph
	err  error
}

// SharedCeph starts the test binary's Ceph on its first call and returns
// it to every caller after; a failed start fails every caller. It needs
// root and Debian's Ceph packages (scripts/deps.sh): without them the test
// skips, or fails under MOUNTMEDIC_REQUIRE_ROOT=1. TestMain stops it with
// StopSharedCeph.
func SharedCeph(t testing.TB) *Ceph {
	t.Helper()
	if os.Geteuid() != 0 {
		lab.SkipOrFail(t, "the Ceph lab needs root (uid %d)", os.Geteuid())
	}
	for _, b := range cephBinaries {
		lab.RequireBinary(t, b)
	}
	shared.once.Do(func() {
		start := time.Now()
		c, err := startCeph()
		shared.mu.Lock()
		shared.ceph, shared.err = c, err
		shared.mu.Unlock()
		if err == nil {
			t.Logf("ceph lab (mon, mgr, osd, mds, cephfs) on %s ready in %.1fs", c.monAddr, time.Since(start).Seconds())
		}
	})
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if shared.err != nil {
		t.Fatalf("start the Ceph lab: %v", shared.err)
	}
	return shared.ceph
}

// StopSharedCeph stops the Ceph of SharedCeph, if one was started, and
// removes its state. A start that failed leaves its trace and the
// daemons' logs (the error names them) and no daemon.
func StopSharedCeph() error {
	shared.mu.Lock()
	c := shared.ceph
	shared.ceph, shared.err = nil, errors.New("the Ceph lab was stopped")
	shared.mu.Unlock()
	if c == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, c.script, "stop")
	cmd.Env = c.env
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("%s stop: %w\n%s", c.script, err, out)
	}
	return os.RemoveAll(c.parent)
}

// repoRoot is the directory of go.mod above the working directory (a
// test's package directory).
func repoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("no go.mod above the working directory")
		}
		dir = parent
	}
}

func startCeph() (*Ceph, error) {
	root, err := repoRoot()
	if err != nil {
		return nil, err
	}
	base, err := lab.FreePortRange(cephPorts)
	if err != nil {
		return nil, err
	}
	parent, err := os.MkdirTemp("", "mountmedic-ceph-")
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(parent, "lab")
	c := &Ceph{
		parent: parent, dir: dir, conf: filepath.Join(dir, "ceph.conf"), script: filepath.Join(root, "scripts", "ceph-lab.sh"),
		monAddr: "127.0.0.1:" + strconv.Itoa(base),
	}
	c.env = append(os.Environ(), "CEPH_LAB_DIR="+dir, "CEPH_LAB_PORT="+strconv.Itoa(base),
		fmt.Sprintf("CEPH_LAB_PORTS=%d-%d", base+1, base+cephPorts-1), "CEPH_CONF="+c.conf)
	// ceph-lab.sh's own readiness wait ends at 60 s; a mon that never
	// answers would hold its first ceph command far longer.
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	// Output to a file: the daemons the script starts inherit it.
	outPath := filepath.Join(parent, "start.out")
	out, err := os.Create(outPath)
	if err != nil {
		return nil, err
	}
	defer out.Close()
	cmd := exec.CommandContext(ctx, "bash", "-x", c.script, "start")
	cmd.Env = c.env
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Run(); err != nil {
		// The script stopped its daemons; their logs stay for a look.
		return nil, fmt.Errorf("%s start: %w; its trace: %s, the daemons' logs: %s\n%s", c.script, err, outPath, dir, lab.Tail(outPath, 15))
	}
	// A client that dies holds its capabilities (the exclusive ones the
	// MDS gives a lone client on every inode it used: the volume's root
	// too) until the MDS finds its session stale, session_timeout after its
	// last renewal (60 s by default): a fresh client of the volume waits
	// that long for them. The tests' file system waits less.
	if _, err := c.Command(ctx, "fs", "set", "cephfs", "session_timeout", strconv.Itoa(CephSessionTimeout)); err != nil {
		return c, err
	}
	return c, nil
}

// Conf is the lab's ceph.conf, for clients.
func (c *Ceph) Conf() string { return c.conf }

// MonAddr is the mon's address (v1 protocol), as ceph-csi's "monitors".
func (c *Ceph) MonAddr() string { return c.monAddr }

// Command runs the ceph CLI against the lab and returns its output.
func (c *Ceph) Command(ctx context.Context, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	return cephCLI(ctx, c.env, append([]string{"-c", c.conf}, args...)...)
}

// cephDescriptionsRace is what the ceph CLI says when the mon refused the
// command it sends before any other (get_command_descriptions): a client
// can send it before the mon's map has reached it, with a zero fsid, which
// the mon refuses as "wrong fsid" (its log: "handle_command on fsid
// 00000000-... != ..."). The CLI then stops before sending the command it
// was given, so running it again is safe. Seen in about 1 of 20 calls
// while a lab starts, on an idle host too.
const cephDescriptionsRace = "problem getting command descriptions"

// cephCLIAttempts bounds the runs of one ceph CLI call that lost
// cephDescriptionsRace.
const cephCLIAttempts = 5

// cephBin is the ceph CLI (a test's own, in this package's tests).
var cephBin = "ceph"

// cephCLI runs the ceph CLI with args (and env, when not nil) and returns
// its output; a run that lost cephDescriptionsRace runs again, at most
// cephCLIAttempts times in all.
func cephCLI(ctx context.Context, env []string, args ...string) ([]byte, error) {
	for attempt := 1; ; attempt++ {
		cmd := exec.CommandContext(ctx, cephBin, args...)
		cmd.Env = env
		cmd.WaitDelay = 5 * time.Second
		var out, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &out, &stderr
		err := cmd.Run()
		if err == nil {
			return out.Bytes(), nil
		}
		msg := strings.TrimSpace(stderr.String())
		if !strings.Contains(msg, cephDescriptionsRace) || attempt == cephCLIAttempts || ctx.Err() != nil {
			return nil, fmt.Errorf("ceph %s: %w: %s (attempt %d)", strings.Join(args, " "), err, msg, attempt)
		}
		select {
		case <-ctx.Done():
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// Subvolume creates subvolume name in ceph-csi's group "csi" of the file
// system, through the mgr's volumes module as ceph-csi's controller does
// (internal/cephfs/core/volume.go), and returns its root path.
func (c *Ceph) Subvolume(t testing.TB, name string) string {
	t.Helper()
	ctx := context.Background()
	if _, err := c.Command(ctx, "fs", "subvolumegroup", "create", "cephfs", "csi"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Command(ctx, "fs", "subvolume", "create", "cephfs", name, "--group_name", "csi"); err != nil {
		t.Fatal(err)
	}
	out, err := c.Command(ctx, "fs", "subvolume", "getpath", "cephfs", name, "--group_name", "csi")
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(out))
}

// WriteFiles writes files (relative path -> content) below rootPath with
// a ceph-fuse client of its own, outside any kubelet root, which it then
// unmounts cleanly: its MDS session closes and holds no capability on
// them, as files another node wrote.
func (c *Ceph) WriteFiles(t testing.TB, rootPath string, files map[string]string) {
	t.Helper()
	mnt := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pid, err := runCephFuse(ctx, c, mnt, "admin", rootPath, "cephfs")
	if err != nil {
		t.Fatal(err)
	}
	for p, data := range files {
		p = filepath.Join(mnt, p)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := unix.Unmount(mnt, 0); err != nil {
		t.Fatalf("unmount the seeding ceph-fuse at %s: %v", mnt, err)
	}
	waitGone(pid, 30*time.Second)
}

// waitGone waits until process pid has exited (a zombie counts: the
// daemon's parent is init), at most d.
func waitGone(pid int, d time.Duration) bool {
	for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		if !alive(pid) {
			return true
		}
	}
	return false
}

// alive reports whether process pid exists and is not a zombie.
func alive(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return false
	}
	i := bytes.LastIndexByte(b, ')')
	return i > 0 && i+2 < len(b) && b[i+2] != 'Z'
}
