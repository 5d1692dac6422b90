package remount

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
)

// BenchmarkDriverBackToData measures the repair against the real driver:
// from the moment the restarted s3driver accepts connections on its socket
// until the data reads back inside every container, for one volume and for
// fifty repaired at once (bounded by Config.Parallel: the default, 4, and
// 16). Each iteration kills
// the driver's whole process tree (every s3fs with it), marks the volumes
// dead as the agent's inventory would (not timed), restarts the driver,
// and then (timed) runs the agent's ladder as far as it goes: Restage, then
// LiveSwap for containers with private mounts, and reads a file inside each
// container.
//
//	go test -run '^$' -bench DriverBackToData -benchtime 5x ./remount
func BenchmarkDriverBackToData(b *testing.B) {
	hostToContainer := corev1.MountPropagationHostToContainer
	private := ctrDef{name: "app", mounts: []corev1.VolumeMount{{Name: testVolumeName, MountPath: "/data"}}}
	slave := ctrDef{name: "app", propagation: hostToContainer, mounts: []corev1.VolumeMount{
		{Name: testVolumeName, MountPath: "/data", MountPropagation: &hostToContainer}}}
	for _, bc := range []struct {
		name     string
		volumes  int
		ctr      ctrDef
		swap     bool
		parallel int
	}{
		{"volumes=1/None", 1, private, true, 0},
		{"volumes=1/HostToContainer", 1, slave, false, 0},
		{"volumes=50/None/parallel=4", 50, private, true, 4},
		{"volumes=50/None/parallel=16", 50, private, true, 16},
	} {
		b.Run(bc.name, func(b *testing.B) {
			benchBackToData(b, bc.volumes, bc.ctr, bc.swap, bc.parallel)
		})
	}
}

func benchBackToData(b *testing.B, n int, ctr ctrDef, swap bool, parallel int) {
	d := startDriverLab(b, Config{Parallel: parallel})
	vols := make([]*realVolume, n)
	for i := range vols {
		vols[i] = d.newVolume(b, fmt.Sprintf("bench%d", i), podDef{name: "p", ctrs: []ctrDef{ctr}})
	}
	ctx := context.Background()
	var total, worst time.Duration
	b.ResetTimer()
	b.StopTimer()
	for range b.N {
		d.drv.Kill()
		d.markDead(b, vols...)
		d.restartDriver(b)

		b.StartTimer()
		start := time.Now()
		var wg sync.WaitGroup
		errs := make([]error, n)
		for i, rv := range vols {
			wg.Go(func() {
				o := d.r.Restage(ctx, rv.vol)
				if o.Err == nil && swap {
					o = d.r.LiveSwap(ctx, rv.vol)
				}
				if o.Err != nil || !o.Healed {
					errs[i] = fmt.Errorf("%s: healed %t: %w", o.Tier, o.Healed, o.Err)
					return
				}
				c := rv.pods[0].ctrs["app"]
				if _, err := os.ReadFile(filepath.Join(c.Path("/data"), "data.txt")); err != nil {
					errs[i] = err
				}
			})
		}
		wg.Wait()
		took := time.Since(start)
		b.StopTimer()
		for i, err := range errs {
			if err != nil {
				b.Fatalf("volume %d: %v", i, err)
			}
		}
		total += took
		worst = max(worst, took)
	}
	b.ReportMetric(total.Seconds()/float64(b.N), "s/recovery")
	b.ReportMetric(worst.Seconds(), "s/worst")
	b.ReportMetric(0, "ns/op")
}
