package remount

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

func TestKernelAtLeast(t *testing.T) {
	for release, want := range map[string]bool{
		"6.16.0": true, "6.18.44-fc-v595": true, "7.0": true, "6.15.9": false,
		"6.1.0-28-amd64": false, "5.19": false, "6.16-rc1": true, "weird": true,
	} {
		if got := kernelAtLeast(release, 6, 16); got != want {
			t.Errorf("kernelAtLeast(%q, 6, 16) = %t, want %t", release, got, want)
		}
	}
}

// TestKillable: a holder of the aborted connection is killed only where
// the volume's daemon can live: never in a pod that uses the volume, never
// for a daemon the catalogue puts in the application pod, and never in a
// pod when the catalogue puts the daemon on the host.
func TestKillable(t *testing.T) {
	const user, plugin = "0b5f2c1e-8d44-4c1a-9f1e-2b7c7f0a9d11", "7c1d2e3f-0000-4c1a-9f1e-2b7c7f0a9d22"
	proc := func(cgroup string) string {
		dir := t.TempDir()
		if err := os.WriteFile(filepath.Join(dir, "cgroup"), []byte(cgroup), 0o644); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	inPod := func(uid string) string { return "0::/kubepods/besteffort/pod" + uid + "/0123456789abcdef\n" }
	host := proc("0::/system.slice/s3fs.service\n")
	for _, tc := range []struct {
		name string
		home kubelet.DaemonHome
		proc string
		want string // "" killable, else a part of why not
	}{
		{"plugin pod", kubelet.DaemonNodePlugin, proc(inPod(plugin)), ""},
		{"host process", kubelet.DaemonNodePlugin, host, ""},
		{"not catalogued", kubelet.DaemonUnknown, proc(inPod(plugin)), ""},
		{"the volume's user", kubelet.DaemonNodePlugin, proc(inPod(user)), "uses the volume"},
		{"user, not catalogued", kubelet.DaemonUnknown, proc(inPod(user)), "uses the volume"},
		{"app sidecar", kubelet.DaemonAppSidecar, host, "application pod"},
		{"host service in a pod", kubelet.DaemonHostService, proc(inPod(plugin)), "on the host"},
		{"host service on the host", kubelet.DaemonHostService, host, ""},
		{"unreadable cgroup", kubelet.DaemonNodePlugin, t.TempDir(), "cannot be read"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			u := &Unmounter{Users: []string{user}, Home: tc.home}
			got := u.killable(tc.proc)
			if tc.want == "" && got != "" || tc.want != "" && !strings.Contains(got, tc.want) {
				t.Errorf("killable = %q, want %q", got, tc.want)
			}
		})
	}
}

func TestFdinfoConn(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   string
		want uint32
		ok   bool
	}{
		{"dev fuse", "pos:\t0\nflags:\t02100002\nmnt_id:\t58\nino:\t90\nfuse_connection:\t40\n", 40, true},
		{"fuseblk", "pos:\t0\nfuse_connection:\t7340032\n", 7 << 20, true},
		{"not fuse", "pos:\t0\nflags:\t02\nmnt_id:\t26\nino:\t5\n", 0, false},
		{"garbled", "fuse_connection:\tforty\n", 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := fdinfoConn([]byte(tc.in))
			if got != tc.want || ok != tc.ok {
				t.Errorf("fdinfoConn(%q) = %d, %t; want %d, %t", tc.in, got, ok, tc.want, tc.ok)
			}
		})
	}
}

// BenchmarkFindServers measures one search of the host's processes for
// the servers of a connection no process serves: every descriptor link of
// every process is read once (the cost of each abort).
func BenchmarkFindServers(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("reads every process's descriptors: needs root")
	}
	u := &Unmounter{}
	procs, fds := 0, 0
	if ents, err := os.ReadDir("/proc"); err == nil {
		for _, e := range ents {
			if n, err := os.ReadDir("/proc/" + e.Name() + "/fd"); err == nil {
				procs++
				fds += len(n)
			}
		}
	}
	for b.Loop() {
		ss, _ := u.findServers(context.Background(), 1<<19)
		closeServers(ss)
	}
	b.ReportMetric(float64(procs), "procs")
	b.ReportMetric(float64(fds), "fds")
}
