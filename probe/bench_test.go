package probe

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/scripts/lab"
)

// bindTree mounts a tmpfs staging mount and n publish binds of it under a
// lab kubelet root, so the mount table holds n+1 more mounts.
func bindTree(b *testing.B, n int) string {
	b.Helper()
	k := lab.NewKubelet(b, filepath.Join(b.TempDir(), "kubelet"))
	staging := k.StagingPath(labDriver, "bench")
	if err := unix.Mount("tmpfs", staging, "tmpfs", 0, "size=1m"); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = unix.Unmount(staging, unix.MNT_DETACH) })
	for i := 0; i < n; i++ {
		k.Publish("pod-"+strconv.Itoa(i), "pv-bench", labDriver, "bench", staging, false)
	}
	return k.Root()
}

// BenchmarkInventory reads and classifies the live table at 100, 1k and 10k
// kubelet mounts, beside the raw read of the same file.
func BenchmarkInventory(b *testing.B) {
	lab.RequireRoot(b)
	for _, n := range []int{100, 1000, 10000} {
		root := bindTree(b, n)
		b.Run(fmt.Sprintf("mounts=%d/raw", n), func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				if _, err := os.ReadFile("/proc/self/mountinfo"); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(fmt.Sprintf("mounts=%d/inventory", n), func(b *testing.B) {
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				inv, err := ReadFile("/proc/self/mountinfo", Options{Root: root})
				if err != nil {
					b.Fatal(err)
				}
				if len(inv.Mounts) < n {
					b.Fatalf("inventory has %d kubelet mounts, want at least %d", len(inv.Mounts), n)
				}
			}
		})
	}
}

func cpuTime() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkProbeCycle is one probe cycle over 1,000 healthy FUSE-backed
// binds, on 1, 20 and 200 backends (each its own FUSE daemon); cpu-ms/op is
// the process CPU time per cycle. The cost follows the backends: statfs and
// statx(FORCE_SYNC) are FUSE round trips of about 30 µs of CPU together.
func BenchmarkProbeCycle(b *testing.B) {
	lab.RequireRoot(b)
	for _, backends := range []int{1, 20, 200} {
		b.Run(fmt.Sprintf("binds=1000/backends=%d", backends), func(b *testing.B) {
			k := lab.NewKubelet(b, filepath.Join(b.TempDir(), "kubelet"))
			for j := 0; j < backends; j++ {
				handle := "vol" + strconv.Itoa(j)
				staging := k.StagingPath(labDriver, handle)
				lab.StartFaultFS(b, staging)
				for i := 0; i < 1000/backends; i++ {
					k.Publish("pod-"+strconv.Itoa(i), "pv-"+handle, labDriver, handle, staging, false)
				}
			}
			inv, err := ReadFile("/proc/self/mountinfo", Options{Root: k.Root(), Live: true})
			if err != nil {
				b.Fatal(err)
			}
			p := NewProber(DefaultConfig())
			b.ResetTimer()
			start := cpuTime()
			for i := 0; i < b.N; i++ {
				rep := p.Probe(context.Background(), inv)
				if len(rep.Broken()) != 0 {
					b.Fatalf("broken mounts in a healthy tree: %v", rep.Broken()[0].Err)
				}
			}
			b.ReportMetric(float64(cpuTime()-start)/float64(b.N)/1e6, "cpu-ms/op")
		})
	}
}

// BenchmarkHungThreads probes 100 hung FUSE mounts cycle after cycle and
// reports the process's threads: flat at about one per hung mount plus a
// constant, however long it runs (-benchtime=6000x: about a minute of 10 ms
// cycles).
func BenchmarkHungThreads(b *testing.B) {
	lab.RequireRoot(b)
	const n = 100
	k := lab.NewKubelet(b, filepath.Join(b.TempDir(), "kubelet"))
	var fss []*lab.FaultFS
	for j := 0; j < n; j++ {
		handle := "hung" + strconv.Itoa(j)
		staging := k.StagingPath(labDriver, handle)
		fs := lab.StartFaultFS(b, staging)
		k.Publish("pod", "pv-"+handle, labDriver, handle, staging, false)
		fs.Hang()
		fss = append(fss, fs)
	}
	b.Cleanup(func() {
		for _, fs := range fss {
			fs.Abort()
		}
	})
	inv, err := ReadFile("/proc/self/mountinfo", Options{Root: k.Root(), Live: true})
	if err != nil {
		b.Fatal(err)
	}
	before := threads(b)
	p := NewProber(Config{Timeout: 100 * time.Millisecond, Parallel: 4})
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		rep := p.Probe(context.Background(), inv)
		if rep.InFlight != n {
			b.Fatalf("in flight %d, want %d", rep.InFlight, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
	b.ReportMetric(float64(threads(b)), "threads")
	b.ReportMetric(float64(before), "threads-before")
}
