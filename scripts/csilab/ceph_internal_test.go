package csilab

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

// fakeCephCLI makes cephBin a program that fails its first
// `fails` runs with stderr msg and then prints "ok"; runs counts the runs.
func fakeCephCLI(t *testing.T, fails int, msg string) (runs func() int) {
	t.Helper()
	dir := t.TempDir()
	count := filepath.Join(dir, "runs")
	script := `#!/bin/sh
echo x >>"` + count + `"
if [ "$(wc -l <"` + count + `")" -le ` + strconv.Itoa(fails) + ` ]; then
	echo "` + msg + `" >&2
	exit 1
fi
echo ok
`
	if err := os.WriteFile(filepath.Join(dir, "ceph"), []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	old := cephBin
	cephBin = filepath.Join(dir, "ceph")
	t.Cleanup(func() { cephBin = old })
	return func() int {
		raw, _ := os.ReadFile(count)
		return strings.Count(string(raw), "\n")
	}
}

// TestCephCLIRunsAgainOnlyAfterTheDescriptionsRace: a run refused before
// the CLI sent its command runs again, up to cephCLIAttempts; any other
// failure (the command ran and failed) is returned at once.
func TestCephCLIRunsAgainOnlyAfterTheDescriptionsRace(t *testing.T) {
	race := "Error EPERM: problem getting command descriptions from mon."
	for _, tc := range []struct {
		name      string
		fails     int
		msg       string
		wantRuns  int
		wantError bool
	}{
		{"race once", 1, race, 2, false},
		{"race every time", 9, race, cephCLIAttempts, true},
		{"command failed", 1, "Error EEXIST: pool 'lab' exists", 1, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			runs := fakeCephCLI(t, tc.fails, tc.msg)
			out, err := cephCLI(context.Background(), nil, "osd", "ls")
			if got := runs(); got != tc.wantRuns {
				t.Errorf("ceph ran %d times, want %d", got, tc.wantRuns)
			}
			if tc.wantError {
				if err == nil || !strings.Contains(err.Error(), tc.msg) || !strings.Contains(err.Error(), "ceph osd ls") {
					t.Errorf("error %v, want one naming the command and %q", err, tc.msg)
				}
				return
			}
			if err != nil || strings.TrimSpace(string(out)) != "ok" {
				t.Errorf("cephCLI = %q, %v; want ok", out, err)
			}
		})
	}
}
