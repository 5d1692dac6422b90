//go:build guest

package remount

import (
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/scripts/csilab"
)

// The NBD faults with the real rbd-nbd on a real Ceph: the lab NBD
// driver's rbd mode (ceph-csi RBD's node contract and rbd-nbd options) in
// the guest of scripts/guest, mapping images of the host's Ceph lab
// through scripts/guest/fwd (go test ./scripts/guest -run TestRBDInGuest
// starts the Ceph lab and the guest). The lab, the container-side reader
// and the checks are the nbdkit matrix's (nbd_guest_root_test.go): the
// reader reads the data fsync'd before the fault, uncached, and writes;
// the device and the mounts are the ones from before.

// startRBDLab is startNBDLab with the driver in rbd mode on the host's
// Ceph, with ceph-csi's map options (reattach-timeout 300 s, no I/O
// timeout).
func startRBDLab(t testing.TB, opts ...csilab.NBDDriverOption) (*nbdLab, csilab.RBDConfig) {
	t.Helper()
	cfg := csilab.GuestCeph(t)
	l := startNBDLab(t, append([]csilab.NBDDriverOption{csilab.WithRBD(cfg)}, opts...)...)
	return l, cfg
}

// newRBDVolume makes the volume's image (ceph-csi's controller does at
// CreateVolume) and stages and publishes it as newVolume does.
func (l *nbdLab) newRBDVolume(t testing.TB, cfg csilab.RBDConfig, id string) *nbdVol {
	t.Helper()
	cfg.CreateImage(t, csilab.RBDPool, id, 64)
	return l.newVolume(t, id)
}

// healUntil runs the re-attach tier as the agent does until it heals the
// volume: a driver out of time (ErrDriverUnavailable) or busy with the
// volume (Aborted) is asked again a second later.
func healUntil(t testing.TB, r *Repairer, v *nbdVol, d time.Duration) Outcome {
	t.Helper()
	for deadline := time.Now().Add(d); ; time.Sleep(time.Second) {
		o := r.Reattach(context.Background(), v.vol)
		logOutcome(t, "reattach "+v.id, o)
		if o.Healed || !(errors.Is(o.Err, ErrDriverUnavailable) || Transient(o.Err)) || time.Now().After(deadline) {
			return o
		}
	}
}

// agentRepairer is a Repairer at the agent's defaults (a 90 s re-attach
// deadline, which covers ceph-csi's wait for the dead daemon's watch on
// the image to expire).
func agentRepairer(t testing.TB, l *nbdLab) *Repairer {
	t.Helper()
	r, err := New(Config{KubeletRoot: l.root, Probe: probe.Config{Timeout: 2 * time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

// TestRBDDaemonKilled kills a volume's rbd-nbd with the plugin up (ceph-csi
// heals this never: its healer runs at plugin start only). The re-attach
// tier asks the driver, whose `rbd-nbd attach --device` gives the same
// /dev/nbdN a fresh daemon; nothing is staged, mapped or unmounted.
// MOUNTMEDIC_RBD_KILLS kills it that many times (1 by default; the
// benchmark's p50 and max).
func TestRBDDaemonKilled(t *testing.T) {
	kills := 1
	if s := os.Getenv("MOUNTMEDIC_RBD_KILLS"); s != "" {
		kills, _ = strconv.Atoi(s)
	}
	l, cfg := startRBDLab(t)
	v := l.newRBDVolume(t, cfg, "0001-rbd-killed")
	devices, stages := connectedNBD(t), l.drv.Stages
	r := agentRepairer(t, l)
	var times []time.Duration
	for i := range kills {
		dm := l.drv.Daemon(v.id)
		if dm == nil {
			t.Fatal("no rbd-nbd daemon serves the volume")
		}
		killed := time.Now()
		dm.Kill()
		l.markBroken(t, v)
		detected := time.Since(killed)
		o := healUntil(t, r, v, 3*time.Minute)
		if !o.Healed {
			t.Fatalf("kill %d: reattach healed %v, err %v; want healed by the re-attach alone", i, o.Healed, o.Err)
		}
		if err := v.readerOK(); err != nil {
			t.Fatalf("kill %d: %v", i, err)
		}
		took := time.Since(killed)
		times = append(times, took)
		l.wantKept(t, v)
		if n := connectedNBD(t); n != devices {
			t.Errorf("%d nbd devices mapped after the heal, want %d as before", n, devices)
		}
		if l.drv.Stages != stages {
			t.Errorf("the driver staged %d times during the heal, want 0 (a re-attach only)", l.drv.Stages-stages)
		}
		if d := l.drv.Daemon(v.id); d == nil || d.Pid() == dm.Pid() {
			t.Errorf("after the heal the volume's rbd-nbd is %v, want a fresh daemon", d)
		}
		t.Logf("kill %d: detected %v, reader reads and writes %v after the kill", i,
			detected.Round(time.Millisecond), took.Round(time.Millisecond))
	}
	slices.Sort(times)
	t.Logf("rbd figures: rbd-nbd killed %d times, plugin up: kill -> reader reads and writes p50 %v, max %v; device, mount and container kept",
		kills, times[len(times)/2].Round(time.Millisecond), times[len(times)-1].Round(time.Millisecond))
}

// TestRBDPluginRestart restarts the node plugin with several volumes
// staged (every rbd-nbd dies with it) and heals each by re-attaching;
// with MOUNTMEDIC_RBD_VOLUMES set (the benchmark) it also measures
// ceph-csi's own healer at plugin start alone, on the same images.
func TestRBDPluginRestart(t *testing.T) {
	n := 3
	if s := os.Getenv("MOUNTMEDIC_RBD_VOLUMES"); s != "" {
		n, _ = strconv.Atoi(s)
	}
	for _, mode := range []string{"mountmedic", "healer-at-start"} {
		if mode == "healer-at-start" && os.Getenv("MOUNTMEDIC_RBD_VOLUMES") == "" {
			continue // the comparison is the benchmark's
		}
		t.Run(mode, func(t *testing.T) {
			var opts []csilab.NBDDriverOption
			if mode == "healer-at-start" {
				opts = append(opts, csilab.WithHealAtStart())
			}
			l, cfg := startRBDLab(t, opts...)
			var vs []*nbdVol
			for i := range n {
				vs = append(vs, l.newRBDVolume(t, cfg, fmt.Sprintf("0001-rbd-%s-%02d", mode, i)))
			}
			devices := connectedNBD(t)
			restarted := time.Now()
			if err := l.drv.Restart(); err != nil {
				t.Fatal(err)
			}
			if mode == "mountmedic" {
				r := agentRepairer(t, l)
				l.markBroken(t, vs...)
				var wg sync.WaitGroup
				for _, v := range vs {
					wg.Go(func() {
						if o := healUntil(t, r, v, 4*time.Minute); !o.Healed {
							t.Errorf("%s: reattach healed %v, err %v", v.id, o.Healed, o.Err)
						}
					})
				}
				wg.Wait()
			}
			var times []time.Duration
			for _, v := range vs {
				if err := v.readerOK(); err != nil {
					t.Errorf("%s: %v", v.id, err)
				}
				times = append(times, time.Since(restarted))
				l.wantKept(t, v)
			}
			if got := connectedNBD(t); got != devices {
				t.Errorf("%d nbd devices mapped after the heal, want %d", got, devices)
			}
			slices.Sort(times)
			t.Logf("rbd figures: plugin restart, %d volumes, %s: all readers read and write %v after the restart",
				n, mode, times[len(times)-1].Round(time.Millisecond))
		})
	}
}

// TestRBDBackendDown stops the OSD serving clients (`ceph osd pause`, as
// an OSD down is for its clients): rbd-nbd lives, the device does not
// answer. The re-attach tier asks the driver, which finds the image still
// mapped by its live rbd-nbd and answers OK (ceph-csi's attachRBDImage),
// while the device still does not answer: the tier must say the backend
// is down (ErrBackendUnavailable, which is waited out as
// ErrDriverUnavailable), never escalate, and nothing is staged, mapped or
// unmounted. Once the OSD serves again, the volume answers by itself.
func TestRBDBackendDown(t *testing.T) {
	l, cfg := startRBDLab(t)
	v := l.newRBDVolume(t, cfg, "0001-rbd-backend")
	devices, stages := connectedNBD(t), l.drv.Stages
	cfg.Ceph(t, "osd", "pause")
	paused := true
	t.Cleanup(func() {
		if paused {
			cfg.Ceph(t, "osd", "unpause")
		}
	})
	down := time.Now()
	go func() { _, _ = readUncached(v.ctr.Path("/data/acked")) }()
	l.markBroken(t, v)
	o := l.r.Reattach(context.Background(), v.vol)
	logOutcome(t, "reattach while the OSD is paused", o)
	if o.Healed || !errors.Is(o.Err, ErrBackendUnavailable) || !errors.Is(o.Err, ErrDriverUnavailable) {
		t.Errorf("reattach with the OSD paused: healed %v, err %v; want ErrBackendUnavailable (wait)", o.Healed, o.Err)
	}
	if l.drv.Stages != stages || connectedNBD(t) != devices {
		t.Errorf("with the OSD paused: %d stages, %d devices; want none new", l.drv.Stages-stages, connectedNBD(t)-devices)
	}
	cfg.Ceph(t, "osd", "unpause")
	paused = false
	up := time.Now()
	for deadline := time.Now().Add(2 * time.Minute); l.brokenNow(t, v); time.Sleep(2 * time.Second) {
		if time.Now().After(deadline) {
			t.Fatal("the volume never answered after the OSD served again")
		}
	}
	if err := v.readerOK(); err != nil {
		t.Fatal(err)
	}
	l.wantKept(t, v)
	t.Logf("rbd figures: OSD paused %v: reader reads and writes %v after it served again, nothing re-staged",
		up.Sub(down).Round(time.Millisecond), time.Since(up).Round(time.Millisecond))
}
