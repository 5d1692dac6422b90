package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	"github.com/mountmedic/mountmedic/probe"
)

func TestPrintable(t *testing.T) {
	tests := map[string]struct{ in, want string }{
		"plain":             {"/var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/pv/mount", "/var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/pv/mount"},
		"space stays":       {"my dir", "my dir"},
		"newline":           {"a\nb", `a\012b`},
		"tab":               {"a\tb", `a\011b`},
		"carriage return":   {"a\rb", `a\015b`},
		"escape sequence":   {"\x1b[2J\x1b]0;t\a", `\033[2J\033]0;t\007`},
		"backslash":         {`a\b`, `a\134b`},
		"delete":            {"a\x7fb", `a\177b`},
		"c1 csi":            {"a\u009b31m", `a\u009b31m`},
		"bidi override":     {"a\u202eb", `a\u202eb`},
		"zero width joiner": {"a\u200db", `a\u200db`},
		"tag character":     {"a\U000e0041b", `a\U000e0041b`},
		"not utf-8":         {"a\xffb", `a\377b`},
		"utf-8 stays":       {"données ✓", "données ✓"},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			if got := printable(tc.in); got != tc.want {
				t.Errorf("printable(%q) = %q, want %q", tc.in, got, tc.want)
			}
		})
	}
	if got := printableText("line one\nline \x1b two"); got != "line one\nline \\033 two" {
		t.Errorf("printableText kept or escaped the wrong bytes: %q", got)
	}
}

// safeForTerminal reports the first byte or character of out that a
// terminal could act on, other than the newlines that end rows.
func safeForTerminal(out []byte) (string, bool) {
	for i := 0; i < len(out); {
		r, n := utf8.DecodeRune(out[i:])
		switch {
		case r == utf8.RuneError && n == 1:
			return string(out[i : i+1]), false
		case r == '\n':
		case r < 0x20, r == 0x7f, r >= 0x80 && r <= 0x9f, unicode.Is(unicode.Cf, r):
			return string(r), false
		}
		i += n
	}
	return "", true
}

// TestScanHostileTable: a table whose paths hold an escaped newline
// followed by a forged row, raw ESC sequences (clear screen, set the window
// title), a tab, DEL, a C1 CSI, a bidi override and a byte that is not UTF-8.
// In every format the output must hold one row per mount and nothing a
// terminal acts on; JSON must still decode to the paths as the table has
// them.
func TestScanHostileTable(t *testing.T) {
	table := filepath.Join("..", "..", "probe", "testdata", "hostile.mountinfo")
	inv, err := probe.ReadFile(table, probe.Options{})
	if err != nil {
		t.Fatal(err)
	}
	for _, format := range []string{"table", "wide", "json"} {
		t.Run(format, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			if code := execute(context.Background(), []string{"scan", "--mountinfo", table, "-o", format}, &stdout, &stderr); code != exitBroken {
				t.Fatalf("scan exit status = %d, want %d (stderr %q)", code, exitBroken, stderr.String())
			}
			if c, ok := safeForTerminal(stdout.Bytes()); !ok {
				t.Errorf("scan -o %s wrote %q raw:\n%s", format, c, stdout.String())
			}
			if format == "json" {
				var doc scanDoc
				if err := json.Unmarshal(stdout.Bytes(), &doc); err != nil {
					t.Fatalf("scan -o json: %v", err)
				}
				want := map[string]bool{}
				for _, m := range inv.Mounts {
					if utf8.ValidString(m.Path) {
						want[m.Path] = true
					}
				}
				for _, r := range doc.Mounts {
					delete(want, r.Path)
				}
				if len(want) > 0 {
					t.Errorf("scan -o json lost the exact paths %v", want)
				}
				return
			}
			// A header, one row per mount, a blank line, the summary;
			// then a heading and one line per stray, if any.
			lines := strings.Split(strings.TrimSuffix(stdout.String(), "\n"), "\n")
			want := len(inv.Mounts) + 3
			if len(inv.Strays) > 0 {
				want += 1 + len(inv.Strays)
			}
			for _, l := range lines {
				if strings.HasPrefix(l, "not known whether a staging mount is gone: ") {
					want++
				}
			}
			if len(lines) != want {
				t.Errorf("scan -o %s wrote %d lines for %d mounts, want %d:\n%s", format, len(lines), len(inv.Mounts), want, stdout.String())
			}
		})
	}
}

// TestScanErrorsEscaped: an error on stderr names a file or quotes a line
// with the bytes escaped too.
func TestScanErrorsEscaped(t *testing.T) {
	dir := t.TempDir()
	hostile := filepath.Join(dir, "capture\x1b[2J\x1b]0;x\a")
	if err := os.WriteFile(hostile, []byte("1 0 8:1 / / rw - ext4 /dev/sda rw\n2 1 zz:yy / /x\x1b[31m rw - tmpfs t rw\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{
		{"scan", "--mountinfo", hostile},
		{"scan", "--mountinfo", hostile + "-missing"},
	} {
		var stdout, stderr bytes.Buffer
		if code := execute(context.Background(), args, &stdout, &stderr); code != exitError {
			t.Errorf("execute(%q) = %d, want %d", args, code, exitError)
		}
		if c, ok := safeForTerminal(stderr.Bytes()); !ok || !strings.Contains(stderr.String(), `capture\033[2J`) {
			t.Errorf("execute(%q) stderr wrote %q raw or lost the file name: %q", args, c, stderr.String())
		}
	}
}
