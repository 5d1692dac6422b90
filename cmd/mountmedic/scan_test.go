package main

import (
	"bytes"
	"context"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite the golden files")

// tables are the captured mount tables the golden files cover.
var tables = []string{"s3fs-two-pods", "nbd-faults", "mixed-node", "no-kubelet"}

func TestScanGolden(t *testing.T) {
	for _, name := range tables {
		for _, format := range []string{"table", "wide", "json"} {
			t.Run(name+"/"+format, func(t *testing.T) {
				table := filepath.Join("..", "..", "probe", "testdata", name+".mountinfo")
				var stdout, stderr bytes.Buffer
				code := execute(context.Background(), []string{"scan", "--mountinfo", table, "-o", format}, &stdout, &stderr)
				wantCode := exitOK
				if name == "nbd-faults" {
					wantCode = exitBroken
				}
				if code != wantCode {
					t.Errorf("scan exit status = %d, want %d (stderr %q)", code, wantCode, stderr.String())
				}
				golden := filepath.Join("testdata", name+"."+format+".golden")
				if *update {
					if err := os.WriteFile(golden, stdout.Bytes(), 0o644); err != nil {
						t.Fatal(err)
					}
					return
				}
				want, err := os.ReadFile(golden)
				if err != nil {
					t.Fatalf("read golden (run go test ./cmd/mountmedic -update to write it): %v", err)
				}
				if got := stdout.String(); got != string(want) {
					t.Errorf("scan %s -o %s output differs from %s:\n--- got\n%s\n--- want\n%s", name, format, golden, got, want)
				}
			})
		}
	}
}

func TestScanBadInput(t *testing.T) {
	dir := t.TempDir()
	malformed := filepath.Join("..", "..", "probe", "testdata", "malformed.mountinfo")
	tests := map[string]struct {
		args []string
		want []string // substrings of stderr
	}{
		"missing file":    {[]string{"scan", "--mountinfo", filepath.Join(dir, "nope")}, []string{"nope", "no such file"}},
		"malformed line":  {[]string{"scan", "--mountinfo", malformed}, []string{"malformed.mountinfo line 7", "not enough fields"}},
		"bad output":      {[]string{"scan", "--mountinfo", malformed, "-o", "yaml"}, []string{`--output "yaml"`, "table, wide or json"}},
		"bad timeout":     {[]string{"scan", "--timeout", "0s"}, []string{"--timeout 0s"}},
		"both sources":    {[]string{"scan", "--mountinfo", malformed, "--host-table", "/proc/1/mountinfo"}, []string{"use one"}},
		"unknown command": {[]string{"scna"}, []string{"unknown command"}},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			if code := execute(context.Background(), tc.args, &stdout, &stderr); code != exitError {
				t.Errorf("execute(%v) = %d, want %d", tc.args, code, exitError)
			}
			for _, w := range tc.want {
				if !strings.Contains(stderr.String(), w) {
					t.Errorf("execute(%v) stderr = %q, want it to name %q", tc.args, stderr.String(), w)
				}
			}
		})
	}
}

func TestScanLiveTableOfThisMachine(t *testing.T) {
	var stdout, stderr bytes.Buffer
	code := execute(context.Background(), []string{"scan", "-o", "json"}, &stdout, &stderr)
	if code == exitError {
		t.Fatalf("scan of this machine failed: %s", stderr.String())
	}
	if !strings.Contains(stdout.String(), `"source": "/proc/self/mountinfo"`) {
		t.Errorf("scan -o json = %s, want the live source named", stdout.String())
	}
}
