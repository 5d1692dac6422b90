package main

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/probe/kubelet"
)

var (
	captureOut    = flag.String("capture-out", "", "TestWriteCapture: write a generated mountinfo capture to this file")
	captureMounts = flag.Int("capture-mounts", 10000, "TestWriteCapture: mounts in the generated capture")
)

// writeCapture writes the mountinfo of a busy node with n mounts: a few
// system mounts, one s3fs staging mount per 9 pods' volume, and per pod a
// CSI publish target, a subPath bind, a projected service-account token,
// and its container's overlay root (with containerd's long lowerdir
// options) and sandbox shm. About two thirds of the lines are kubelet
// mounts. It returns the file's size.
func writeCapture(tb testing.TB, path string, n int) int64 {
	return writeCaptureOf(tb, path, n, false)
}

// writeCaptureOf is writeCapture; with mixed, the volumes rotate through
// four drivers' layouts: k8s-csi-s3 (s3fs on globalmount), ceph-csi RBD
// (ext4 on /dev/rbdN at globalmount/<volumeID>), ceph-csi CephFS (kernel
// client on globalmount) and csi-driver-nfs (no staging; every export of
// one NFSv4 superblock).
func writeCaptureOf(tb testing.TB, path string, n int, mixed bool) int64 {
	tb.Helper()
	f, err := os.Create(path)
	if err != nil {
		tb.Fatal(err)
	}
	w := bufio.NewWriterSize(f, 1<<20)
	id := 1
	line := func(format string, args ...any) {
		fmt.Fprintf(w, "%d ", id)
		fmt.Fprintf(w, format, args...)
		w.WriteByte('\n')
		id++
	}
	system := []string{
		"0 254:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw,errors=remount-ro",
		"1 0:21 / /proc rw,nosuid,nodev,noexec,relatime shared:12 - proc proc rw",
		"1 0:22 / /sys rw,nosuid,nodev,noexec,relatime shared:2 - sysfs sysfs rw",
		"1 0:5 / /dev rw,nosuid,relatime shared:8 - devtmpfs udev rw,size=12263164k,nr_inodes=3065791,mode=755",
		"1 0:25 / /run rw,nosuid,nodev,noexec,relatime shared:5 - tmpfs tmpfs rw,size=2459104k,mode=755",
		"3 0:40 / /sys/fs/fuse/connections rw,nosuid,nodev,noexec,relatime shared:14 - fusectl fusectl rw",
		"3 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 rw,nsdelegate,memory_recursiveprot",
		"1 254:2 / /var/lib/containerd rw,relatime shared:20 - ext4 /dev/vda2 rw",
	}
	for _, s := range system {
		line("%s", s)
	}
	rest := n - len(system)
	pods := rest * 9 / 46 // 5 mounts per pod, one staging mount per 9 pods
	pvs := (pods + 8) / 9
	// vol says how volume p is mounted: its device, the root of its
	// publish target, the filesystem type, source and super options.
	type vol struct{ dev, root, fsType, source, super string }
	volOf := func(p int) vol {
		if !mixed {
			return vol{fmt.Sprintf("0:%d", 100+p), "", "fuse.s3fs", "s3fs", "rw,user_id=0,group_id=0,allow_other"}
		}
		switch p % 4 {
		case 1:
			return vol{fmt.Sprintf("252:%d", p), "", "ext4", fmt.Sprintf("/dev/rbd%d", p), "rw,stripe=16"}
		case 2:
			return vol{fmt.Sprintf("0:%d", 100+p), "", "ceph", fmt.Sprintf("10.96.0.1:6789:/volumes/csi/csi-vol-%d", p), "rw,name=csi-cephfs-node,secret=<hidden>,acl"}
		case 3:
			return vol{"0:99", fmt.Sprintf("/srv/nfs/%d", p), "nfs4", fmt.Sprintf("nfs.example:/srv/nfs/%d", p), "rw,vers=4.2,hard,proto=tcp,timeo=600,sec=sys,addr=10.0.0.5"}
		}
		return vol{fmt.Sprintf("0:%d", 100+p), "", "fuse.s3fs", "s3fs", "rw,user_id=0,group_id=0,allow_other"}
	}
	for p := 0; p < pvs && id <= n; p++ {
		v := volOf(p)
		switch {
		case !mixed || p%4 == 0:
			line("1 %s / /var/lib/kubelet/plugins/kubernetes.io/csi/ru.yandex.s3.csi/%x/globalmount rw,nosuid,nodev,relatime shared:%d - %s %s %s",
				v.dev, sha256.Sum256([]byte("bucket-"+strconv.Itoa(p))), 200+p, v.fsType, v.source, v.super)
		case p%4 == 1:
			h := fmt.Sprintf("0001-0009-rook-ceph-0000000000000002-%08d", p)
			line("1 %s / /var/lib/kubelet/plugins/kubernetes.io/csi/rook-ceph.rbd.csi.ceph.com/%x/globalmount/%s rw,relatime shared:%d - %s %s %s",
				v.dev, sha256.Sum256([]byte(h)), h, 200+p, v.fsType, v.source, v.super)
		case p%4 == 2:
			line("1 %s / /var/lib/kubelet/plugins/kubernetes.io/csi/rook-ceph.cephfs.csi.ceph.com/%x/globalmount rw,relatime shared:%d - %s %s %s",
				v.dev, sha256.Sum256([]byte("fs-"+strconv.Itoa(p))), 200+p, v.fsType, v.source, v.super)
		}
	}
	for q := 0; id <= n; q++ {
		uid := fmt.Sprintf("%08x-%04x-4%03x-8%03x-%012x", q, q&0xffff, q&0xfff, (q>>12)&0xfff, q*7919)
		p := q % pvs
		v := volOf(p)
		root := v.root
		if root == "" {
			root = "/"
		}
		ctr := sha256.Sum256([]byte("ctr-" + uid))
		kube := []string{
			fmt.Sprintf("1 0:%d / /var/lib/kubelet/pods/%s/volumes/kubernetes.io~projected/kube-api-access-%05d rw,relatime shared:%d - tmpfs tmpfs rw,size=245760k,inode64", 20000+q, uid, q%100000, 30000+q),
			fmt.Sprintf("1 %s %s /var/lib/kubelet/pods/%s/volumes/kubernetes.io~csi/pvc-%08d-0000-4000-8000-000000000000/mount rw,nosuid,nodev,relatime shared:%d - %s %s %s", v.dev, root, uid, p, 200+p, v.fsType, v.source, v.super),
			fmt.Sprintf("1 %s %s/data/%d /var/lib/kubelet/pods/%s/volume-subpaths/pvc-%08d-0000-4000-8000-000000000000/app/0 rw,nosuid,nodev,relatime shared:%d - %s %s %s", v.dev, v.root, q, uid, p, 200+p, v.fsType, v.source, v.super),
			fmt.Sprintf("5 0:%d / /run/containerd/io.containerd.grpc.v1.cri/sandboxes/%x/shm rw,nosuid,nodev,noexec,relatime shared:%d - tmpfs shm rw,size=65536k,inode64", 60000+q, ctr, 70000+q),
			fmt.Sprintf("5 0:%d / /run/containerd/io.containerd.runtime.v2.task/k8s.io/%x/rootfs rw,relatime shared:%d - overlay overlay rw,lowerdir=/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs/snapshots/%d/fs:/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs/snapshots/%d/fs,upperdir=/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs/snapshots/%d/fs,workdir=/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs/snapshots/%d/work,uuid=on",
				90000+q, ctr, 100000+q, 3*q+1, 3*q+2, 3*q+3, 3*q+3),
		}
		for _, k := range kube {
			if id > n {
				break
			}
			line("%s", k)
		}
	}
	if err := w.Flush(); err != nil {
		tb.Fatal(err)
	}
	fi, err := f.Stat()
	if err != nil {
		tb.Fatal(err)
	}
	if err := f.Close(); err != nil {
		tb.Fatal(err)
	}
	return fi.Size()
}

// TestWriteCapture writes a generated capture for measurements outside Go
// (time, /usr/bin/time -v) when -capture-out is given:
//
//	go test -run TestWriteCapture ./cmd/mountmedic -capture-out /tmp/10k.mountinfo -capture-mounts 10000
//
// Without the flag it checks that the generator writes a table scan reads,
// with the number of mounts asked for.
func TestWriteCapture(t *testing.T) {
	path, n := *captureOut, *captureMounts
	if path == "" {
		path, n = filepath.Join(t.TempDir(), "capture"), 1000
	}
	size := writeCapture(t, path, n)
	var out, errb discardCounter
	code := execute(context.Background(), []string{"scan", "--mountinfo", path, "--max-table-size", strconv.FormatInt(size, 10)}, &out, &errb)
	if code != exitOK {
		t.Fatalf("scan of the generated capture: exit status %d", code)
	}
	t.Logf("%s: %d mounts, %d bytes", path, n, size)

	// The mixed-driver capture reads as healthy too: every publish target
	// of a staged volume linked to its staging mount (ceph-csi RBD's below
	// globalmount included), none Missing.
	mixed := filepath.Join(t.TempDir(), "mixed")
	writeCaptureOf(t, mixed, 1000, true)
	var stdout bytes.Buffer
	if code := execute(context.Background(), []string{"scan", "--mountinfo", mixed, "-o", "json"}, &stdout, &errb); code != exitOK {
		t.Fatalf("scan of the mixed-driver capture: exit status %d", code)
	}
	var doc scanDoc
	if err := json.Unmarshal(stdout.Bytes(), &doc); err != nil {
		t.Fatal(err)
	}
	daemons := map[string]int{}
	for _, r := range doc.Mounts {
		daemons[r.Daemon]++
		if r.Target.Kind == kubelet.KindPublish && r.FSType != "nfs4" && r.From == "" {
			t.Errorf("mixed capture: publish target %s (%s) not linked to a staging mount", r.Path, r.FSType)
		}
	}
	if daemons["kernel"] == 0 || daemons["node-plugin"] == 0 {
		t.Errorf("mixed capture: daemons %v, want kernel and node-plugin mounts", daemons)
	}
}

type discardCounter struct{ n int }

func (d *discardCounter) Write(p []byte) (int, error) { d.n += len(p); return len(p), nil }

// BenchmarkScanCapture is the issue's "scan --mountinfo of a 10k-mount
// capture" measured inside one process: the raw read of the file (from the
// page cache), moby/sys/mountinfo's parse of it (the library scan builds
// on: the floor of reading a mount table in Go), scan's own read and
// classification of it (probe.ReadFile, which links the volume graph too),
// then scan itself (read, classify, assess, format) in each
// output format.
func BenchmarkScanCapture(b *testing.B) {
	for _, tc := range []struct {
		n     int
		mixed bool
	}{{10000, false}, {10000, true}} {
		n := tc.n
		path := filepath.Join(b.TempDir(), "capture")
		size := writeCaptureOf(b, path, n, tc.mixed)
		name := fmt.Sprintf("mounts=%d", n)
		if tc.mixed {
			name = fmt.Sprintf("mixed-drivers/mounts=%d", n)
		}
		b.Run(name+"/raw-read", func(b *testing.B) {
			b.SetBytes(size)
			for b.Loop() {
				if _, err := os.ReadFile(path); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(name+"/mountinfo-parse", func(b *testing.B) {
			b.SetBytes(size)
			b.ReportAllocs()
			for b.Loop() {
				f, err := os.Open(path)
				if err != nil {
					b.Fatal(err)
				}
				_, err = mountinfo.GetMountsFromReader(f, nil)
				f.Close()
				if err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(name+"/read-classify", func(b *testing.B) {
			b.SetBytes(size)
			b.ReportAllocs()
			for b.Loop() {
				if _, err := probe.ReadFile(path, probe.Options{}); err != nil {
					b.Fatal(err)
				}
			}
		})
		for _, format := range []string{"table", "json"} {
			b.Run(name+"/scan-"+format, func(b *testing.B) {
				b.SetBytes(size)
				b.ReportAllocs()
				for b.Loop() {
					if code := execute(context.Background(), []string{"scan", "--mountinfo", path, "-o", format}, io.Discard, io.Discard); code != exitOK {
						b.Fatalf("scan: exit status %d", code)
					}
				}
			})
		}
	}
}

// envPeakRSS names a file where a command run by BenchmarkScanProcess
// writes its peak RSS (VmHWM, in KiB) as it exits. getrusage cannot say it:
// a child's ru_maxrss includes the parent's memory it shared until exec.
const envPeakRSS = "MOUNTMEDIC_TEST_PEAK_RSS"

// envParseMountinfo makes the test binary parse the mount table it names
// with moby/sys/mountinfo, and do nothing else, as BenchmarkScanProcess's
// baseline of a Go program that reads a mount table: the same runtime,
// the same file, the library's parse.
const envParseMountinfo = "MOUNTMEDIC_TEST_PARSE_MOUNTINFO"

func parseMountinfoOnly(path string) int {
	f, err := os.Open(path)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer f.Close()
	infos, err := mountinfo.GetMountsFromReader(f, nil)
	if err != nil || len(infos) == 0 {
		fmt.Fprintln(os.Stderr, "parse", path, err)
		return 1
	}
	if p := os.Getenv(envPeakRSS); p != "" {
		writePeakRSS(p)
	}
	return 0
}

func writePeakRSS(path string) {
	status, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return
	}
	for _, l := range strings.Split(string(status), "\n") {
		if v, ok := strings.CutPrefix(l, "VmHWM:"); ok {
			_ = os.WriteFile(path, []byte(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB"))), 0o600)
		}
	}
}

// BenchmarkScanProcess runs scan --mountinfo as its own process (this test
// binary as the command) on the 10k-mount capture and on a table without a
// kubelet mount (the binary's own footprint), and reports the peak RSS of
// each beside the capture's size, and the CPU time (user and system) each
// took; cat(1) of the capture is the raw read.
func BenchmarkScanProcess(b *testing.B) {
	path := filepath.Join(b.TempDir(), "capture")
	size := writeCapture(b, path, 10000)
	hwm := filepath.Join(b.TempDir(), "hwm")
	empty := filepath.Join("..", "..", "probe", "testdata", "no-kubelet.mountinfo")
	run := func(b *testing.B, size int64, name string, args ...string) {
		var (
			peak int64
			cpu  time.Duration
			runs int
		)
		for b.Loop() {
			cmd := exec.Command(name, args...)
			self := name == os.Args[0]
			switch {
			case self && args[0] == "parse":
				cmd = exec.Command(name)
				cmd.Env = append(os.Environ(), envParseMountinfo+"="+args[1], envPeakRSS+"="+hwm)
			case self:
				cmd.Env = append(os.Environ(), envRunMain+"=1", envPeakRSS+"="+hwm)
			}
			cmd.Stdout = io.Discard
			if err := cmd.Run(); err != nil {
				b.Fatalf("%s %v: %v", name, args, err)
			}
			cpu += cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
			runs++
			if !self {
				continue
			}
			data, err := os.ReadFile(hwm)
			if err != nil {
				b.Fatal(err)
			}
			kib, err := strconv.ParseInt(string(data), 10, 64)
			if err != nil {
				b.Fatal(err)
			}
			peak = max(peak, kib)
		}
		if peak > 0 {
			b.ReportMetric(float64(peak)/1024, "peak-RSS-MiB")
		}
		// CPU time is the fairer figure on a shared machine: wall time
		// counts the waits for a core.
		b.ReportMetric(float64(cpu.Microseconds())/1000/float64(runs), "cpu-ms/op")
		if size > 0 {
			b.ReportMetric(float64(size)/(1<<20), "capture-MiB")
		}
	}
	mixed := filepath.Join(b.TempDir(), "mixed")
	mixedSize := writeCaptureOf(b, mixed, 10000, true)
	b.Run("mounts=10000/cat", func(b *testing.B) { run(b, size, "cat", path) })
	b.Run("mounts=10000/mountinfo-parse", func(b *testing.B) { run(b, size, os.Args[0], "parse", path) })
	b.Run("mounts=10000/scan", func(b *testing.B) { run(b, size, os.Args[0], "scan", "--mountinfo", path) })
	b.Run("mixed-drivers/cat", func(b *testing.B) { run(b, mixedSize, "cat", mixed) })
	b.Run("mixed-drivers/mountinfo-parse", func(b *testing.B) { run(b, mixedSize, os.Args[0], "parse", mixed) })
	b.Run("mixed-drivers/scan", func(b *testing.B) { run(b, mixedSize, os.Args[0], "scan", "--mountinfo", mixed) })
	b.Run("no-kubelet/scan", func(b *testing.B) { run(b, 0, os.Args[0], "scan", "--mountinfo", empty) })
}
