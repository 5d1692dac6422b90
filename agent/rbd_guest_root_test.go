//go:build guest

package agent_test

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mountmedic/mountmedic/agent"
	"github.com/mountmedic/mountmedic/remount"
	"github.com/mountmedic/mountmedic/scripts/csilab"
)

// TestAgentRBD runs the agent at its defaults over rbd-nbd volumes of a
// real Ceph: the lab NBD driver in rbd mode (ceph-csi RBD's node contract,
// the real rbd-nbd with ceph-csi's map options) mapping images of the
// host's Ceph lab through scripts/guest/fwd. scripts/guest's
// TestRBDInGuest starts the lab and runs this in the guest, with the API
// server on the host. In turn:
//
//   - backend down: `ceph osd pause` stops the OSD serving clients, as an
//     OSD that is down does for them. Each volume's rbd-nbd lives and its
//     device answers nothing; ceph-csi's re-attach answers OK. The agent
//     must say BackendDown and never DriverDown, keep mountmedic_driver_up
//     at 1 through a resync (which used to take the driver for one that
//     came back and run the volume again at once), run no tier past the
//     re-attach and stage nothing. Once the OSD serves again the
//     containers read their acknowledged data and write, same processes,
//     devices and mounts.
//   - daemon killed: a volume's rbd-nbd is killed with the plugin up. The
//     agent heals it through ceph-csi's re-attach, which waits for the
//     dead daemon's watch on the image to expire (30 s) before it answers:
//     within the re-attach's own deadline, so no DriverDown either.
func TestAgentRBD(t *testing.T) {
	ceph := csilab.GuestCeph(t)
	e := newNBDEnv(t, csilab.WithRBD(ceph))
	for _, name := range []string{"down", "killed"} {
		ceph.CreateImage(t, csilab.RBDPool, "csi-vol-"+name, 64)
	}
	down, killed := e.newVolume("down"), e.newVolume("killed")
	vols := []*nbdVolume{down, killed}
	pids := map[string]int{}
	for _, s := range vols {
		if err := s.readerOK(); err != nil {
			t.Fatalf("before the fault: %v", err)
		}
		pids[s.id] = s.app.Pid()
	}
	cfg := e.defaultConfig()
	a := e.startAgent(cfg, e.withRepairer(cfg, remount.Config{}, agent.Deps{}))
	stages, devices := e.drv.Stages, connectedNBD()
	driverUp := func() float64 {
		v, _ := metricSum(a, "mountmedic_driver_up", `driver="`+csilab.NBDDriverName+`"`)
		return v
	}
	// wantNoOtherTier: only the re-attach ran, and nothing was staged.
	wantNoOtherTier := func() {
		t.Helper()
		for _, tier := range []string{"restage", "liveswap", "restart", "evict", "unmount"} {
			if n, _ := metricSum(a, "mountmedic_repairs_total", `tier="`+tier+`"`); n != 0 {
				t.Errorf("repairs_total{tier=%s} = %v, want 0: the re-attach alone may run", tier, n)
			}
		}
		if e.drv.Stages != stages {
			t.Errorf("the driver staged %d times, want 0 (re-attaches only)", e.drv.Stages-stages)
		}
		if n := connectedNBD(); n != devices {
			t.Errorf("%d nbd devices connected, want %d as before", n, devices)
		}
	}
	count := func(s *nbdVolume, reason agent.Reason) int {
		n := 0
		for _, ev := range e.eventsOf(s.pod.UID) {
			if ev.Reason == string(reason) {
				n++
			}
		}
		return n
	}

	// The backend down.
	{
		ceph.Ceph(t, "osd", "pause")
		paused := true
		t.Cleanup(func() {
			if paused {
				ceph.Ceph(t, "osd", "unpause")
			}
		})
		start := time.Now()
		ev := e.waitEvent(down.pod.UID, string(agent.ReasonBackendDown), csilab.NBDDriverName, "storage behind it is down")
		said := time.Since(start)
		// Through a resync, which re-checks the drivers: the driver
		// answers, so nothing about it changes.
		time.Sleep(cfg.Resync + 10*time.Second)
		if v := driverUp(); v != 1 {
			t.Errorf("mountmedic_driver_up = %v with the backend down, want 1: the driver answers", v)
		}
		for _, s := range vols {
			if n := count(s, agent.ReasonDriverDown); n != 0 {
				t.Errorf("%s: %d DriverDown events with the backend down, want none (events %v)", s.id, n, e.reasons(s.pod.UID))
			}
		}
		if n := count(down, agent.ReasonBackendDown); n != 1 {
			t.Errorf("%s: %d BackendDown events in one episode, want 1 (events %v)", down.id, n, e.reasons(down.pod.UID))
		}
		if n, _ := metricSum(a, "mountmedic_repairs_total", `result="backend_unavailable"`, `tier="reattach"`); n < 1 {
			t.Errorf("repairs_total{reattach,backend_unavailable} = %v, want at least 1", n)
		}
		held := time.Since(start)
		ceph.Ceph(t, "osd", "unpause")
		paused = false
		back := time.Now()
		for _, s := range vols {
			took, err := s.readerBack(back, 3*time.Minute)
			if err != nil {
				t.Fatalf("OSD serving again: %v", err)
			}
			e.wantKept(s, pids[s.id])
			t.Logf("rbd figures: agent, OSD paused %v: BackendDown %v after the pause (%q); %s reads and writes %v after it serves again",
				held.Round(time.Second), said.Round(time.Millisecond), ev.Note, s.id, took.Round(time.Millisecond))
		}
		wantNoOtherTier()
	}

	// The daemon killed.
	{
		old := e.drv.Daemon(killed.id)
		if old == nil {
			t.Fatal("no rbd-nbd serves the volume")
		}
		driverDowns := count(killed, agent.ReasonDriverDown)
		start := time.Now()
		old.Kill()
		took, err := killed.readerBack(start, 4*time.Minute)
		if err != nil {
			t.Fatalf("rbd-nbd killed: %v", err)
		}
		e.wantKept(killed, pids[killed.id])
		ev := e.waitEvent(killed.pod.UID, string(agent.ReasonVolumeRepaired), "reattach")
		if d := e.drv.Daemon(killed.id); d == nil || d.Pid() == old.Pid() {
			t.Errorf("after the heal the volume's rbd-nbd is %v, want a fresh daemon", d)
		}
		if n := count(killed, agent.ReasonDriverDown) - driverDowns; n != 0 {
			t.Errorf("%d DriverDown events while ceph-csi waited for the dead watch, want none (events %v)", n, e.reasons(killed.pod.UID))
		}
		if v := driverUp(); v != 1 {
			t.Errorf("mountmedic_driver_up = %v after the heal, want 1", v)
		}
		wantNoOtherTier()
		t.Logf("rbd figures: agent, rbd-nbd killed: the container reads and writes again %v after the kill; %s %q",
			took.Round(time.Millisecond), ev.Reason, ev.Note)
	}
}

// metricSum adds up the samples of the agent's metric name whose labels
// hold every one of labels (`key="value"`), and says whether any did.
func metricSum(a *runningAgent, name string, labels ...string) (float64, bool) {
	var sum float64
	found := false
	for _, line := range strings.Split(a.get("/metrics").body, "\n") {
		rest, ok := strings.CutPrefix(line, name+"{")
		if !ok {
			continue
		}
		set, value, ok := strings.Cut(rest, "} ")
		if !ok {
			continue
		}
		match := true
		for _, l := range labels {
			match = match && strings.Contains(","+set+",", ","+l+",")
		}
		v, err := strconv.ParseFloat(strings.TrimSpace(value), 64)
		if match && err == nil {
			sum += v
			found = true
		}
	}
	return sum, found
}
