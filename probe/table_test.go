package probe

import (
	"context"
	"errors"
	"math"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
)

// readGuarded runs ReadTable and fails the test if it does not return: a
// reader that blocks on a FIFO would otherwise hang the whole test binary.
// It asserts no duration; the guard only turns a hang into a failure.
func readGuarded(t *testing.T, ctx context.Context, path string, opts Options) (*Inventory, error) {
	t.Helper()
	type result struct {
		inv *Inventory
		err error
	}
	done := make(chan result, 1)
	go func() {
		inv, err := ReadTable(ctx, path, opts)
		done <- result{inv, err}
	}()
	select {
	case r := <-done:
		return r.inv, r.err
	case <-time.After(time.Minute):
		t.Fatalf("ReadTable(%s) never returned", path)
		return nil, nil
	}
}

// TestReadTableRefusesWhatIsNotAFile: a FIFO (an open blocks until a writer
// comes, then the reader waits for data for good), /dev/zero (endless), a
// directory and a socket each give an error naming the path, what it is and
// what to give instead, without blocking or reading.
func TestReadTableRefusesWhatIsNotAFile(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "table.fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "table.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	tests := map[string]struct {
		path string
		what string
	}{
		"fifo":      {fifo, "named pipe"},
		"dev zero":  {"/dev/zero", "character device"},
		"directory": {dir, "directory"},
		"socket":    {sock, "socket"},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			_, err := readGuarded(t, context.Background(), tc.path, Options{})
			if !errors.Is(err, ErrNotTable) {
				t.Fatalf("ReadTable(%s) error = %v, want ErrNotTable", tc.path, err)
			}
			for _, want := range []string{tc.path, tc.what, "regular file", "/proc/self/mountinfo"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("ReadTable(%s) error %q does not name %q", tc.path, err, want)
				}
			}
		})
	}
}

// TestReadTableSymlinkToFile: a capture reached through a symlink is a
// regular file and reads.
func TestReadTableSymlinkToFile(t *testing.T) {
	link := filepath.Join(t.TempDir(), "capture")
	abs, err := filepath.Abs(filepath.Join("testdata", "s3fs-two-pods.mountinfo"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(abs, link); err != nil {
		t.Fatal(err)
	}
	inv, err := ReadTable(context.Background(), link, Options{})
	if err != nil || inv.Total != 12 {
		t.Fatalf("ReadTable(symlink to a capture) = %v, %v; want 12 mounts", inv, err)
	}
}

// TestReadTableSizeCap: a file over the cap is refused before it is read
// (a sparse 200 MB file costs nothing to make), a procfs table (size 0 in
// stat) stops at the cap while streaming, and a table of exactly the cap
// reads.
func TestReadTableSizeCap(t *testing.T) {
	dir := t.TempDir()
	big := filepath.Join(dir, "big.mountinfo")
	f, err := os.Create(big)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(200 << 20); err != nil {
		t.Fatal(err)
	}
	f.Close()
	_, err = ReadTable(context.Background(), big, Options{})
	if !errors.Is(err, ErrTableTooLarge) || !strings.Contains(err.Error(), big) {
		t.Errorf("ReadTable(200 MB file) error = %v, want ErrTableTooLarge naming the file", err)
	}

	_, err = ReadTable(context.Background(), "/proc/self/mountinfo", Options{MaxSize: 64})
	if !errors.Is(err, ErrTableTooLarge) {
		t.Errorf("ReadTable(/proc/self/mountinfo, cap 64 bytes) error = %v, want ErrTableTooLarge", err)
	}
	if _, err := ReadTable(context.Background(), "/proc/self/mountinfo", Options{}); err != nil {
		t.Errorf("ReadTable(/proc/self/mountinfo) = %v, want it read under the default cap", err)
	}

	data, err := os.ReadFile(filepath.Join("testdata", "s3fs-two-pods.mountinfo"))
	if err != nil {
		t.Fatal(err)
	}
	exact := filepath.Join(dir, "exact.mountinfo")
	if err := os.WriteFile(exact, data, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadTable(context.Background(), exact, Options{MaxSize: int64(len(data))}); err != nil {
		t.Errorf("ReadTable(table of exactly the cap) = %v, want it read", err)
	}
	if _, err := ReadTable(context.Background(), exact, Options{MaxSize: int64(len(data)) - 1}); !errors.Is(err, ErrTableTooLarge) {
		t.Errorf("ReadTable(table one byte over the cap) = %v, want ErrTableTooLarge", err)
	}
}

// TestReadTableCancelled: a cancelled context stops the read.
func TestReadTableCancelled(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := ReadTable(ctx, filepath.Join("testdata", "mixed-node.mountinfo"), Options{})
	if !errors.Is(err, context.Canceled) {
		t.Errorf("ReadTable(cancelled) error = %v, want context.Canceled", err)
	}
}

const (
	rootLine  = "1 0 254:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw\n"
	stageLine = " 1 0:52 / /var/lib/kubelet/plugins/kubernetes.io/csi/s3.csi/3c1322b59623fa39fb5812635250c05175816f4d79b00c35196efc3f601eeeb9/globalmount rw shared:210 - fuse.s3fs s3fs rw\n"
	pubLine   = " 0:52 / /var/lib/kubelet/pods/8d0e4c6a/volumes/kubernetes.io~csi/pvc-1/mount rw shared:210 - fuse.s3fs s3fs rw\n"
)

// TestParseRefusesBrokenTables: each table error names the line and what is
// wrong with it. Before, a duplicate ID and a cycle of parents were taken
// (both mounts of a cycle on one path read "covered"), and a device that is
// not a number read as 0:0.
func TestParseRefusesBrokenTables(t *testing.T) {
	tests := map[string]struct {
		data string
		line int
		want string
	}{
		"duplicate ID": {rootLine + "301" + stageLine + "305 301" + pubLine + "301 1" + pubLine, 4, "mount ID 301 again (first on line 2)"},
		"cycle of two": {rootLine + "10 11" + pubLine + "11 10" + pubLine, 2, "cycle (10 -> 11 -> 10)"},
		"cycle of three, away from the first line": {rootLine + "20 1 0:5 / /a rw - tmpfs t rw\n" +
			"30 32 0:6 / /b rw - tmpfs t rw\n31 30 0:6 / /b/c rw - tmpfs t rw\n32 31 0:6 / /b/c/d rw - tmpfs t rw\n", 3, "cycle (30 -> 32 -> 31 -> 30)"},
		"device not numbers":     {rootLine + "2 1 zz:yy / /x rw - tmpfs t rw\n", 2, `device "zz:yy"`},
		"minor not a number":     {rootLine + "2 1 0:5x / /x rw - tmpfs t rw\n", 2, `device "0:5x"`},
		"device without a colon": {rootLine + "2 1 52 / /x rw - tmpfs t rw\n", 2, `device "52"`},
		"device overflows":       {rootLine + "2 1 0:99999999999 / /x rw - tmpfs t rw\n", 2, "device"},
		"negative parent":        {rootLine + "2 -1 0:5 / /x rw - tmpfs t rw\n", 2, `parent ID "-1"`},
		"zero ID":                {rootLine + "0 1 0:5 / /x rw - tmpfs t rw\n", 2, `mount ID "0"`},
		"ID overflows":           {rootLine + "4294967297 1 0:5 / /x rw - tmpfs t rw\n", 2, "mount ID"},
		"bad escape":             {rootLine + "2 1 0:5 / /x\\08 rw - tmpfs t rw\n", 2, "bad escape"},
		"escape out of range":    {rootLine + "2 1 0:5 / /x\\777 rw - tmpfs t rw\n", 2, "bad escape"},
		"escape cut short":       {rootLine + "2 1 0:5 / /x\\01 rw - tmpfs t rw\n", 2, "bad escape"},
		"two spaces":             {rootLine + "2 1 0:5 /  /x rw - tmpfs t rw\n", 2, "empty"},
		"relative mount point":   {rootLine + "2 1 0:5 / x rw - tmpfs t rw\n", 2, "absolute"},
		"field after super opts": {rootLine + "2 1 0:5 / /x rw - tmpfs t rw extra\n", 2, "more than three"},
		"empty line inside":      {rootLine + "\n2 1 0:5 / /x rw - tmpfs t rw\n", 2, "empty line"},
		"empty line at the end":  {rootLine + "\n\n", 2, "empty line"},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			_, err := Parse([]byte(tc.data), "capture.txt", Options{})
			var te *TableError
			if !errors.As(err, &te) {
				t.Fatalf("Parse() error = %v, want a *TableError", err)
			}
			if te.Line != tc.line || te.Source != "capture.txt" {
				t.Errorf("Parse() error at %s line %d, want capture.txt line %d (%v)", te.Source, te.Line, tc.line, err)
			}
			if !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "capture.txt line") {
				t.Errorf("Parse() error = %q, want it to name the file, the line and %q", err, tc.want)
			}
		})
	}
}

// TestParseAcceptsWhatTheKernelWrites: a mount that is its own parent (the
// root of a namespace), a parent outside the table (a container's view), a
// CRLF capture, a line longer than bufio's default 64 KiB token, and an
// nsfs root that is not a path.
func TestParseAcceptsWhatTheKernelWrites(t *testing.T) {
	long := "/var/lib/kubelet/pods/u/volumes/kubernetes.io~nfs/" + strings.Repeat("x", 70<<10)
	data := "7 7 254:1 / / rw - ext4 /dev/vda1 rw\r\n" +
		"8 999 0:4 net:[4026531993] /run/netns/a rw - nsfs nsfs rw\r\n" +
		"9 7 0:5 / " + long + " rw - nfs srv:/x rw\n"
	inv, err := Parse([]byte(data), "ok", Options{})
	if err != nil {
		t.Fatalf("Parse() = %v", err)
	}
	if inv.Total != 3 || len(inv.Mounts) != 1 || inv.Mounts[0].Path != long {
		t.Errorf("Parse() = %d mounts, %d kubelet; want 3 and the long nfs volume", inv.Total, len(inv.Mounts))
	}
}

func TestOtherRoots(t *testing.T) {
	const root = "1 0 254:1 / / rw - ext4 /dev/vda1 rw\n"
	tests := map[string]struct {
		table string
		want  []string
	}{
		"data dir": {root + "2 1 0:50 / /data/kubelet/pods/u1/volumes/kubernetes.io~csi/pv/mount rw - tmpfs t rw\n", []string{"/data/kubelet"}},
		"k0s and rke": {root + "2 1 0:50 / /var/lib/k0s/kubelet/pods/u1/volumes/kubernetes.io~empty-dir/x rw - tmpfs t rw\n" +
			"3 1 0:51 / /opt/rke/var/lib/kubelet/pods/u2/volume-subpaths/v/c/0 rw - tmpfs t rw\n", []string{"/var/lib/k0s/kubelet", "/opt/rke/var/lib/kubelet"}},
		"under the root":       {root + "2 1 0:50 / /var/lib/kubelet/pods/u1/volumes/kubernetes.io~csi/pv/mount rw - tmpfs t rw\n", nil},
		"pods without volumes": {root + "2 1 0:50 / /srv/pods/u1/logs rw - tmpfs t rw\n", nil},
		"pods at the top":      {root + "2 1 0:50 / /pods/u1/volumes/x rw - tmpfs t rw\n", nil},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			inv, err := Parse([]byte(tc.table), name, Options{})
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(inv.OtherRoots, tc.want) {
				t.Errorf("OtherRoots = %q, want %q", inv.OtherRoots, tc.want)
			}
		})
	}
}

// TestReadTableHugeCap: a cap at or near the largest int64 (scan
// --max-table-size 100Ei saturates there) reads a table as no cap would,
// with no overflow in the arithmetic of the bound, from a file and from
// procfs.
func TestReadTableHugeCap(t *testing.T) {
	for _, limit := range []int64{math.MaxInt64, math.MaxInt64 - 1, math.MaxInt64 / 2} {
		for _, path := range []string{filepath.Join("testdata", "s3fs-two-pods.mountinfo"), "/proc/self/mountinfo"} {
			inv, err := ReadTable(context.Background(), path, Options{MaxSize: limit})
			if err != nil || inv.Total == 0 {
				t.Errorf("ReadTable(%s, cap %d) = %v, want the table read", path, limit, err)
			}
		}
	}
}
