package remount

import (
	"context"
	"fmt"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	corev1 "k8s.io/api/core/v1"

	"github.com/mountmedic/mountmedic/probe"
)

// BenchmarkWakeAfterRepair measures what a hung daemon does to the staging
// path when it wakes after its repair, with the real k8s-csi-s3 driver and
// each of its mounters: per iteration a volume's daemon is stopped
// (SIGSTOP), the volume re-staged (Restage: abort, kill, stage), the
// stopped daemon continued (SIGCONT), and the staging path read every
// 10 ms for 10 s. It reports the milliseconds the path was anything but a
// FUSE mount (or the guard): bare-ms is their sum over the iterations,
// killed the daemons the abort killed. Run with -benchtime=10x.
func BenchmarkWakeAfterRepair(b *testing.B) {
	d := startDriverLab(b, Config{})
	for _, mounter := range []string{"s3fs", "rclone"} {
		b.Run(mounter, func(b *testing.B) {
			var bare time.Duration
			killed, n := 0, 0
			for b.Loop() {
				n++
				k, bad := wakeOnce(b, d, mounter, fmt.Sprintf("wake-%s-%d", mounter, n))
				killed += k
				bare += bad
			}
			b.ReportMetric(float64(bare.Milliseconds()), "bare-ms")
			b.ReportMetric(float64(killed), "killed")
		})
	}
}

func wakeOnce(b *testing.B, d *driverLab, mounter, prefix string) (int, time.Duration) {
	b.Helper()
	var attrs map[string]string
	if mounter == "rclone" {
		// k8s-csi-s3's rclone mounter; Debian's rclone needs path-style
		// addressing, and uploads at once with no write-back delay.
		attrs = map[string]string{"mounter": "rclone", "options": "--s3-provider=Other --vfs-write-back=0s"}
	}
	rv := d.newVolumeWith(b, prefix, attrs, podDef{name: "a", ctrs: []ctrDef{{name: "app",
		mounts: []corev1.VolumeMount{{Name: testVolumeName, MountPath: "/data"}}}}})
	pids := daemonsOf(b, mounter, rv.staging)
	for _, pid := range pids {
		if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL) })
	}
	for _, pid := range pids {
		waitStopped(b, pid)
	}
	d.markDead(b, rv)
	if !rv.vol.Hung {
		b.Fatalf("the stopped %s did not make the volume hang", mounter)
	}
	re := d.r.Restage(context.Background(), rv.vol)
	if !re.Healed {
		b.Fatalf("Restage: %v (%v)", re.Err, re.Actions)
	}
	killed := ops(re.Actions)[opKillServer]
	start := time.Now()
	for _, pid := range pids {
		syscall.Kill(pid, syscall.SIGCONT)
	}
	var bad time.Duration
	var since time.Time
	for now := start; now.Before(start.Add(10 * time.Second)); now = time.Now() {
		ok := fuseOrGuard(rv.staging)
		switch {
		case !ok && since.IsZero():
			since = now
		case ok && !since.IsZero():
			bad += now.Sub(since)
			since = time.Time{}
		}
		time.Sleep(10 * time.Millisecond)
	}
	if !since.IsZero() {
		bad += time.Since(since)
	}
	return killed, bad
}

// fuseOrGuard reports whether the top mount at path is a FUSE mount or
// mountmedic's guard.
func fuseOrGuard(path string) bool {
	infos, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(path))
	if err != nil || len(infos) == 0 {
		return false
	}
	top := infos[len(infos)-1]
	return strings.HasPrefix(top.FSType, "fuse") || top.Source == probe.GuardSource
}
