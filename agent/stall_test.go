package agent_test

import (
	"errors"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/agent"
	"github.com/mountmedic/mountmedic/remount"
)

// TestAgentFindsAHangBetweenCycles: the agent probes once an hour, and the
// real s3fs of a volume stops answering while a container reads it. Only
// the stall watch (the connection's waiting requests, read between
// cycles) can start the probe that finds the hang: the agent aborts the
// connection, the container's read returns, and the volume heals, all
// before any cycle was due. Before that, the same daemon pausing for less
// than the probe deadline at a time, while the container reads, is never
// taken for hung.
func TestAgentFindsAHangBetweenCycles(t *testing.T) {
	d := newDriverEnv(t)
	s := d.newVolume("stall")
	if err := s.reads("stall"); err != nil {
		t.Fatalf("volume not readable before the hang: %v", err)
	}
	cfg := d.config()
	cfg.ProbeInterval, cfg.Resync = time.Hour, time.Hour
	a := d.startAgent(cfg, d.withRepairer(cfg, remount.Config{}, agent.Deps{}))
	inContainer := s.private.Path("/data/data.txt")
	pid := s3fsPid(t, "stall")
	t.Cleanup(func() { _ = unix.Kill(pid, unix.SIGKILL) })

	// A slow daemon: paused for 1.5 s at a time (under the 2 s deadline,
	// the slowest answer the agent must not take for a hang) while the
	// container reads, five times.
	for i := 0; i < 5; i++ {
		if err := unix.Kill(pid, unix.SIGSTOP); err != nil {
			t.Fatal(err)
		}
		read := make(chan error, 1)
		go func() { _, err := os.ReadFile(inContainer); read <- err }()
		time.Sleep(1500 * time.Millisecond)
		if err := unix.Kill(pid, unix.SIGCONT); err != nil {
			t.Fatal(err)
		}
		if err := <-read; err != nil {
			t.Fatalf("pause %d: the container's read failed: %v (the agent took a slow daemon for hung)", i+1, err)
		}
	}
	if evs := d.eventsOf(s.pod.UID); len(evs) > 0 {
		t.Fatalf("events after pauses under the deadline: %s %q, want none", evs[0].Reason, evs[0].Note)
	}

	hangAndHeal(t, d, a, s, "stall", pid)
}

// TestAgentFindsAHangOnANewMount: the agent probes once
// an hour and has done its first cycle when a pod's volume is staged and
// published; its real s3fs then stops answering while the container
// reads. The stall watch knows only the backends of the inventory it was
// given: the mount table's change must reach it before the next cycle,
// or the container's read waits for that cycle (here an hour).
func TestAgentFindsAHangOnANewMount(t *testing.T) {
	d := newDriverEnv(t)
	cfg := d.config()
	cfg.ProbeInterval, cfg.Resync = time.Hour, time.Hour
	a := d.startAgent(cfg, d.withRepairer(cfg, remount.Config{}, agent.Deps{}))
	s := d.newVolume("late")
	if err := s.reads("late"); err != nil {
		t.Fatalf("volume not readable before the hang: %v", err)
	}
	pid := s3fsPid(t, "late")
	t.Cleanup(func() { _ = unix.Kill(pid, unix.SIGKILL) })
	hangAndHeal(t, d, a, s, "late", pid)
}

// hangAndHeal stops the s3fs (pid) of volume s, named name, while its
// private container reads, and checks that the agent, which runs no probe
// cycle for an hour, aborts the connection (the read returns), repairs
// the volume through a probe the stall watch started, and the volume
// reads again everywhere.
func hangAndHeal(t *testing.T, d *driverEnv, a *runningAgent, s *s3Volume, name string, pid int) {
	t.Helper()
	if err := unix.Kill(pid, unix.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	read := make(chan error, 1)
	go func() { _, err := os.ReadFile(s.private.Path("/data/data.txt")); read <- err }()
	select {
	case err := <-read:
		if err == nil || !(errors.Is(err, unix.ECONNABORTED) || errors.Is(err, unix.ENOTCONN)) {
			t.Fatalf("the container's read on the hung daemon returned %v, want ECONNABORTED or ENOTCONN (the agent's abort)", err)
		}
	case <-time.After(2 * time.Minute):
		t.Fatal("the container's read still blocks 2 minutes after the hang: nothing found it between the hourly cycles")
	}
	d.waitEvent(s.pod.UID, string(agent.ReasonVolumeRepaired), "repaired by")
	d.waitFor("the volume to read again everywhere", func() (bool, error) {
		err := s.reads(name)
		return err == nil, err
	})
	if n, _ := a.metric(`mountmedic_stall_probes_total`); n < 1 {
		t.Errorf("stall_probes_total = %v, want at least 1 (the probe that found the hang)", n)
	}
	if n, _ := a.metric(`mountmedic_repairs_total{result="success",tier="restage"}`); n < 1 {
		t.Errorf(`repairs_total{restage,success} = %v, want at least 1`, n)
	}
}
