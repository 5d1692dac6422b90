package remount

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/probe/kubelet"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

func csiErr(c codes.Code) error {
	e := &rpcError{Method: "NodeStageVolume", Endpoint: "/x/csi.sock", Code: c, err: status.Error(c, "driver says so")}
	e.unavailable = c == codes.Unavailable || c == codes.DeadlineExceeded
	return fmt.Errorf("stage volume %q: %w", "h", e)
}

func TestTransient(t *testing.T) {
	for _, tc := range []struct {
		name string
		err  error
		want bool
	}{
		{"nil", nil, false},
		{"csi aborted: an operation pending for the volume", csiErr(codes.Aborted), true},
		{"csi resource exhausted", csiErr(codes.ResourceExhausted), true},
		{"csi unavailable: the driver is down, waited for", csiErr(codes.Unavailable), false},
		{"csi deadline: the driver is down, waited for", csiErr(codes.DeadlineExceeded), false},
		{"csi internal", csiErr(codes.Internal), false},
		{"csi not found", csiErr(codes.NotFound), false},
		{"csi failed precondition", csiErr(codes.FailedPrecondition), false},
		{"cri unavailable", fmt.Errorf("stop container: %w", status.Error(codes.Unavailable, "runtime restarting")), false},
		{"cri aborted", fmt.Errorf("stop container: %w", status.Error(codes.Aborted, "busy")), true},
		{"mount changed under the tier", fmt.Errorf("unmount /x: %w", ErrMountChanged), true},
		{"unmount busy", fmt.Errorf("unmount /x: %w", unix.EBUSY), true},
		{"interrupted", &fs.PathError{Op: "open", Path: "/x", Err: unix.EINTR}, true},
		{"out of descriptors", fmt.Errorf("open: %w", unix.EMFILE), true},
		{"permission", fmt.Errorf("unmount /x: %w", unix.EPERM), false},
		{"not connected", fmt.Errorf("verify: %w", unix.ENOTCONN), false},
		{"unsafe path", &unsafePathError{Path: "/x", Root: "/r", Reason: "a symlink"}, false},
		{"driver unavailable", fmt.Errorf("x: %w", ErrDriverUnavailable), false},
		{"backend unavailable: waited for", &backendError{err: fmt.Errorf("/dev/nbd0: %w", probe.ErrHung)}, false},
		{"cancelled", fmt.Errorf("wait: %w", context.Canceled), false},
		{"joined, all transient", errors.Join(fmt.Errorf("a: %w", unix.EBUSY), fmt.Errorf("b: %w", ErrMountChanged)), true},
		{"joined, one says the tier cannot work", errors.Join(fmt.Errorf("a: %w", unix.EBUSY), errors.New("pod p: no publish target")), false},
		{"plain", errors.New("publish target not healthy"), false},
	} {
		if got := Transient(tc.err); got != tc.want {
			t.Errorf("%s: Transient(%v) = %t, want %t", tc.name, tc.err, got, tc.want)
		}
	}
}

// TestBackendErrorIsWaitedOut: a backend that is down matches both
// ErrBackendUnavailable (the agent names it) and ErrDriverUnavailable
// (every caller waits it out), keeps its cause and says both.
func TestBackendErrorIsWaitedOut(t *testing.T) {
	err := fmt.Errorf("reattach: %w", &backendError{err: fmt.Errorf("/dev/nbd0 after the re-attach: %w", probe.ErrHung)})
	for _, target := range []error{ErrBackendUnavailable, ErrDriverUnavailable, probe.ErrHung} {
		if !errors.Is(err, target) {
			t.Errorf("errors.Is(%v, %v) = false", err, target)
		}
	}
	if errors.Is(fmt.Errorf("x: %w", ErrDriverUnavailable), ErrBackendUnavailable) {
		t.Error("a driver that is down reads as a backend that is down")
	}
	if msg := err.Error(); !strings.Contains(msg, "/dev/nbd0") || !strings.Contains(msg, "its backend does not") {
		t.Errorf("message %q names neither the device nor the backend", msg)
	}
}

// TestTierRetriesTransientFailure: the tier's body runs again after a
// transient failure, at most TransientRetries times, and never after a
// failure that says the tier cannot work, a heal, a dry run, or a restart
// that stopped a container.
func TestTierRetriesTransientFailure(t *testing.T) {
	busy := fmt.Errorf("unmount: %w", unix.EBUSY)
	for _, tc := range []struct {
		name    string
		cfg     Config
		tier    Tier
		results []error // per run; nil heals
		stopped bool    // each run stops a container
		runs    int
		healed  bool
	}{
		{"transient then healed", Config{}, TierRestage, []error{busy, nil}, false, 2, true},
		{"transient every time: bounded", Config{}, TierRestage, []error{busy, busy, busy, busy}, false, 3, false},
		{"transient, more retries", Config{TransientRetries: 3}, TierRestage, []error{busy, busy, busy, nil}, false, 4, true},
		{"retries off", Config{TransientRetries: -1}, TierRestage, []error{busy, nil}, false, 1, false},
		{"cannot work: no retry", Config{}, TierRestage, []error{errors.New("publish target not healthy"), nil}, false, 1, false},
		{"driver down: no retry", Config{}, TierRestage, []error{csiErr(codes.Unavailable), nil}, false, 1, false},
		{"dry run: no retry", Config{DryRun: true}, TierRestage, []error{busy, nil}, false, 1, false},
		{"restart that stopped a container: no retry", Config{}, TierRestart, []error{busy, nil}, true, 1, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.cfg.KubeletRoot = t.TempDir()
			tc.cfg.TransientBackoff = time.Millisecond
			r, err := New(tc.cfg)
			if err != nil {
				t.Fatal(err)
			}
			defer r.Close()
			runs := 0
			o := r.run(context.Background(), tc.tier, &Volume{Driver: "d"}, func(_ context.Context, o *Outcome) {
				err := tc.results[runs]
				runs++
				if tc.stopped {
					o.Actions = append(o.Actions, Action{Op: opStopContainer, Path: "c"})
				}
				o.Actions = append(o.Actions, Action{Op: opUnmount, Path: "/x", Err: err})
				o.Err, o.Healed = err, err == nil
			})
			if runs != tc.runs || o.Healed != tc.healed {
				t.Errorf("runs = %d, healed %t; want %d, %t (err %v)", runs, o.Healed, tc.runs, tc.healed, o.Err)
			}
			retries := 0
			for _, a := range o.Actions {
				if a.Op == opRetry {
					retries++
				}
			}
			if retries != tc.runs-1 || len(o.Actions) < tc.runs {
				t.Errorf("actions %v: want every run's and %d retries", o.Actions, tc.runs-1)
			}
		})
	}
}

// TestUnmountTierRetriesBusyUnmount: a real dead mount whose first lazy
// unmount answers EBUSY (a seam for the fault): the unmount tier runs
// again and heals, instead of leaving the pod to the next tier.
func TestUnmountTierRetriesBusyUnmount(t *testing.T) {
	lab.RequireRoot(t)
	k := newKubelet(t)
	root := k.Root()
	const uid = "bbbbbbbb-2222-3333-4444-555555555555"
	target := k.PublishPath(uid, "pv-busy")
	if err := unix.Mount("busy", target, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	top := table(t, root).top(target)
	var calls atomic.Int32
	r, err := New(Config{KubeletRoot: root, TransientBackoff: time.Millisecond, Sys: Syscalls{
		Unmount: func(p string, flags int) error {
			if calls.Add(1) == 1 {
				return unix.EBUSY
			}
			return unix.Unmount(p, flags)
		},
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	v := &Volume{Driver: "d", VolumeHandle: "h", Pods: []PodVolume{{Dead: []*probe.Mount{
		{ID: top.ID, Path: target, Dev: top.Dev, Target: kubelet.Target{Kind: kubelet.KindPublish, PodUID: uid}},
	}}}}
	o := r.Unmount(context.Background(), v)
	if !o.Healed || o.Err != nil || calls.Load() != 2 {
		t.Fatalf("Unmount: healed %t, err %v, %d unmount calls; want healed after a retry: %v", o.Healed, o.Err, calls.Load(), o.Actions)
	}
	if m := table(t, root).top(target); m != nil {
		t.Errorf("mount %d still at %s", m.ID, target)
	}
	if _, err := os.Stat(target); err != nil {
		t.Errorf("publish target gone: %v", err)
	}
}
