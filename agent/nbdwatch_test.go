package agent

import (
	"errors"
	"fmt"
	"testing"

	"github.com/mountmedic/mountmedic/probe"
)

// TestNBDDaemonGoneIsCertain: a block volume whose nbd daemon is known
// gone waits no strikes; one that only hangs, or fails I/O, still does.
func TestNBDDaemonGoneIsCertain(t *testing.T) {
	nbd := &probe.Backend{Kind: probe.BackendBlock, Device: "nbd0", Dev: probe.Dev{Major: probe.NBDMajor}}
	tests := map[string]struct {
		v    *brokenVolume
		want bool
	}{
		"daemon gone": {&brokenVolume{backend: nbd, state: probe.Disconnected,
			err: fmt.Errorf("/dev/nbd0: its configuring process 7 is gone: %w", probe.ErrNBDDaemonGone)}, true},
		"hung device read": {&brokenVolume{backend: nbd, state: probe.Hung, err: probe.ErrHung}, false},
		"I/O error":        {&brokenVolume{backend: nbd, state: probe.IOError, err: errors.New("read /dev/nbd0: EIO")}, false},
		"no backend":       {&brokenVolume{state: probe.Disconnected, err: probe.ErrNBDDaemonGone}, false},
	}
	for name, tt := range tests {
		if got := tt.v.certain(); got != tt.want {
			t.Errorf("%s: certain() = %v, want %v", name, got, tt.want)
		}
	}
}
