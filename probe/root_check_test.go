package probe

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestCheckKubeletRoot(t *testing.T) {
	dir := t.TempDir()
	real := filepath.Join(dir, "real", "kubelet")
	if err := os.MkdirAll(real, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(real, filepath.Join(dir, "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(dir, "real"), filepath.Join(dir, "parent")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join(dir, "gone"), filepath.Join(dir, "dangling")); err != nil {
		t.Fatal(err)
	}
	tests := map[string]struct {
		root   string
		onHost bool
		want   string // substring of the error; "" for none
	}{
		"real directory":             {real, true, ""},
		"trailing slash":             {real + "/", true, ""},
		"missing":                    {filepath.Join(dir, "nope", "kubelet"), true, ""},
		"relative":                   {"var/lib/kubelet", true, "not an absolute path"},
		"empty":                      {"", false, "not an absolute path"},
		"slash":                      {"/", false, "whole file system"},
		"slash in disguise":          {"/var/..", false, "whole file system"},
		"symlink":                    {filepath.Join(dir, "link"), true, "give the resolved path " + real},
		"symlink in a parent":        {filepath.Join(dir, "parent", "kubelet"), true, "give the resolved path " + real},
		"symlink of another system":  {filepath.Join(dir, "link"), false, ""},
		"symlink, root not made yet": {filepath.Join(dir, "parent", "nope", "kubelet"), true, "give the resolved path " + filepath.Join(dir, "real", "nope", "kubelet")},
		"dangling symlink":           {filepath.Join(dir, "dangling", "kubelet"), true, "does not resolve"},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			err := CheckKubeletRoot(tc.root, tc.onHost)
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("CheckKubeletRoot(%q, %v) = %v, want nil", tc.root, tc.onHost, err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Errorf("CheckKubeletRoot(%q, %v) = %v, want an error saying %q", tc.root, tc.onHost, err, tc.want)
			}
		})
	}
}
