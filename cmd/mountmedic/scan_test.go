package main

import (
	"bytes"
	"context"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the golden files")

// tables are the captured mount tables the golden files cover.
var tables = []string{"s3fs-two-pods", "nbd-faults", "mixed-node", "no-kubelet", "hostile",
	"ceph-rbd", "cephfs", "juicefs", "gcsfuse", "blob", "seaweedfs", "k8s-csi-s3", "nfs", "smb", "longhorn", "ebs", "in-tree"}

func TestScanGolden(t *testing.T) {
	for _, name := range tables {
		for _, format := range []string{"table", "wide", "json"} {
			t.Run(name+"/"+format, func(t *testing.T) {
				table := filepath.Join("..", "..", "probe", "testdata", name+".mountinfo")
				var stdout, stderr bytes.Buffer
				code := execute(context.Background(), []string{"scan", "--mountinfo", table, "-o", format}, &stdout, &stderr)
				wantCode := exitOK
				if name == "nbd-faults" || name == "hostile" {
					wantCode = exitBroken
				}
				if code != wantCode {
					t.Errorf("scan exit status = %d, want %d (stderr %q)", code, wantCode, stderr.String())
				}
				golden := filepath.Join("testdata", name+"."+format+".golden")
				if *update {
					if err := os.WriteFile(golden, stdout.Bytes(), 0o644); err != nil {
						t.Fatal(err)
					}
					return
				}
				want, err := os.ReadFile(golden)
				if err != nil {
					t.Fatalf("read golden (run go test ./cmd/mountmedic -update to write it): %v", err)
				}
				if got := stdout.String(); got != string(want) {
					t.Errorf("scan %s -o %s output differs from %s:\n--- got\n%s\n--- want\n%s", name, format, golden, got, want)
				}
			})
		}
	}
}

func TestScanBadInput(t *testing.T) {
	dir := t.TempDir()
	malformed := filepath.Join("..", "..", "probe", "testdata", "malformed.mountinfo")
	good := filepath.Join("..", "..", "probe", "testdata", "s3fs-two-pods.mountinfo")
	link := filepath.Join(dir, "kubelet-link")
	if err := os.Symlink(dir, link); err != nil {
		t.Fatal(err)
	}
	const root = "1 0 254:1 / / rw - ext4 /dev/vda1 rw\n"
	table := func(name, data string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	dup := table("dup", root+"2 1 0:5 / /a rw - tmpfs t rw\n2 1 0:6 / /b rw - tmpfs t rw\n")
	cycle := table("cycle", root+"2 3 0:5 / /var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/v/mount rw - tmpfs t rw\n"+
		"3 2 0:5 / /var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/v/mount rw - tmpfs t rw\n")
	elsewhere := table("elsewhere", root+"2 1 0:50 / /data/kubelet/pods/u1/volumes/kubernetes.io~csi/pv-1/mount rw - fuse.s3fs s3fs rw\n")
	microk8s := table("microk8s", root+"2 1 0:51 /d /var/snap/microk8s/common/var/lib/kubelet/pods/u1/volume-subpaths/v/c/0 rw - nfs4 s:/d rw\n")
	dev := table("dev", root+"2 1 zz:yy / /var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/v/mount rw - tmpfs t rw\n")
	tests := map[string]struct {
		args []string
		want []string // substrings of stderr
	}{
		"relative kubelet root":  {[]string{"scan", "--kubelet-root", "var/lib/kubelet"}, []string{"--kubelet-root", "not an absolute path", "/var/lib/kubelet"}},
		"kubelet root is /":      {[]string{"scan", "--mountinfo", good, "--kubelet-root", "/"}, []string{"--kubelet-root", "whole file system"}},
		"symlinked kubelet root": {[]string{"scan", "--kubelet-root", link}, []string{"--kubelet-root", "symlink", "give the resolved path " + dir}},
		"duplicate mount ID":     {[]string{"scan", "--mountinfo", dup}, []string{dup + " line 3", "mount ID 2 again (first on line 2)"}},
		"cycle of parents":       {[]string{"scan", "--mountinfo", cycle}, []string{cycle + " line 2", "cycle (2 -> 3 -> 2)"}},
		"device not a number":    {[]string{"scan", "--mountinfo", dev}, []string{dev + " line 2", `device "zz:yy"`}},
		"table over the cap":     {[]string{"scan", "--mountinfo", good, "--max-table-size", "1Ki"}, []string{good, "size cap", "--max-table-size"}},
		"bad size cap":           {[]string{"scan", "--mountinfo", good, "--max-table-size", "lots"}, []string{`--max-table-size "lots"`, "32Mi"}},
		"directory":              {[]string{"scan", "--mountinfo", dir}, []string{dir, "a directory", "regular file"}},
		"missing file":           {[]string{"scan", "--mountinfo", filepath.Join(dir, "nope")}, []string{"nope", "no such file"}},
		"malformed line":         {[]string{"scan", "--mountinfo", malformed}, []string{"malformed.mountinfo line 7", "not enough fields"}},
		"bad output":             {[]string{"scan", "--mountinfo", malformed, "-o", "yaml"}, []string{`--output "yaml"`, "table, wide or json"}},
		"bad timeout":            {[]string{"scan", "--timeout", "0s"}, []string{"--timeout 0s"}},
		"live root missing":      {[]string{"scan", "--kubelet-root", filepath.Join(dir, "nope")}, []string{"--kubelet-root " + filepath.Join(dir, "nope") + " does not exist", "--root-dir"}},
		"root elsewhere":         {[]string{"scan", "--mountinfo", elsewhere}, []string{"no kubelet volume mounts under --kubelet-root /var/lib/kubelet", "under /data/kubelet", "give --kubelet-root /data/kubelet"}},
		"microk8s root":          {[]string{"scan", "--mountinfo", microk8s}, []string{"give --kubelet-root /var/snap/microk8s/common/var/lib/kubelet"}},
		"both sources":           {[]string{"scan", "--mountinfo", malformed, "--host-table", "/proc/1/mountinfo"}, []string{"use one"}},
		"unknown command":        {[]string{"scna"}, []string{"unknown command"}},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			if code := execute(context.Background(), tc.args, &stdout, &stderr); code != exitError {
				t.Errorf("execute(%v) = %d, want %d", tc.args, code, exitError)
			}
			for _, w := range tc.want {
				if !strings.Contains(stderr.String(), w) {
					t.Errorf("execute(%v) stderr = %q, want it to name %q", tc.args, stderr.String(), w)
				}
			}
		})
	}
}

func TestScanLiveTableOfThisMachine(t *testing.T) {
	var stdout, stderr bytes.Buffer
	code := execute(context.Background(), []string{"scan", "--kubelet-root", t.TempDir(), "-o", "json"}, &stdout, &stderr)
	if code == exitError {
		t.Fatalf("scan of this machine failed: %s", stderr.String())
	}
	if !strings.Contains(stdout.String(), `"source": "/proc/self/mountinfo"`) {
		t.Errorf("scan -o json = %s, want the live source named", stdout.String())
	}
}

// TestScanSignalExitStatus: a scan that a signal cut short exits with the
// shell's status for it (128+n), says so, and prints no report.
func TestScanSignalExitStatus(t *testing.T) {
	table := filepath.Join("..", "..", "probe", "testdata", "nbd-faults.mountinfo")
	for sig, want := range map[syscall.Signal]int{syscall.SIGINT: 130, syscall.SIGTERM: 143} {
		ctx, cancel := context.WithCancelCause(context.Background())
		cancel(signalled{sig})
		var stdout, stderr bytes.Buffer
		if code := execute(ctx, []string{"scan", "--mountinfo", table}, &stdout, &stderr); code != want {
			t.Errorf("scan stopped by %v: exit status %d, want %d", sig, code, want)
		}
		if stdout.Len() != 0 || !strings.Contains(stderr.String(), "stopped by SIG") {
			t.Errorf("scan stopped by %v: stdout %q, stderr %q; want no report and the signal named", sig, stdout.String(), stderr.String())
		}
	}
}
