package remount

import (
	"testing"

	"github.com/mountmedic/mountmedic/probe"
)

// TestRepairerSharesOwnNamespaceTable: the Repairer takes the agent's
// table reader only when it reads our own mount namespace under the same
// kubelet root; a hostPID table (/proc/1/mountinfo) has other mount IDs.
func TestRepairerSharesOwnNamespaceTable(t *testing.T) {
	root := t.TempDir()
	for _, tc := range []struct {
		path, root string
		shared     bool
	}{
		{"/proc/self/mountinfo", root, true},
		{"/proc/thread-self/mountinfo", root, true},
		{"/proc/1/mountinfo", root, false},
		{"/proc/self/mountinfo", "/var/lib/kubelet", false},
	} {
		tr := probe.NewTableReader(tc.path, probe.Options{Root: tc.root})
		r, err := New(Config{KubeletRoot: root, Table: tr})
		if err != nil {
			t.Fatal(err)
		}
		if got := r.table == tr; got != tc.shared {
			t.Errorf("table %s under %s: shared %t, want %t", tc.path, tc.root, got, tc.shared)
		}
		if r.table.Path() != tc.path && r.table.Path() != "/proc/thread-self/mountinfo" {
			t.Errorf("own reader reads %s, want /proc/thread-self/mountinfo", r.table.Path())
		}
		r.Close()
	}
}
