package main

import (
	"archive/tar"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// krewPlugin is the part of krew's Plugin manifest (index.krew.dev,
// krew.googlecontainertools.github.com/v1alpha2) that krew reads to
// install.
type krewPlugin struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
	Metadata   struct {
		Name string `json:"name"`
	} `json:"metadata"`
	Spec struct {
		Version          string `json:"version"`
		Homepage         string `json:"homepage"`
		ShortDescription string `json:"shortDescription"`
		Description      string `json:"description"`
		Platforms        []struct {
			Selector struct {
				MatchLabels map[string]string `json:"matchLabels"`
			} `json:"selector"`
			URI    string `json:"uri"`
			SHA256 string `json:"sha256"`
			Bin    string `json:"bin"`
			Files  []struct {
				From string `json:"from"`
				To   string `json:"to"`
			} `json:"files"`
		} `json:"platforms"`
	} `json:"spec"`
}

// TestKrewManifest builds the plugin for this machine's platform with
// scripts/plugin.sh and checks the krew manifest against the archive as
// krew would: the sha256, the binary the manifest names at the archive's
// root, and that binary running and printing the version.
func TestKrewManifest(t *testing.T) {
	out := t.TempDir()
	cmd := exec.Command("../../scripts/plugin.sh", "--version", "v0.0.1-test", "--out", out, "--platforms", "linux/"+goarch(t),
		"--url-base", "https://example.com/dl")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("scripts/plugin.sh: %v\n%s", err, b)
	}
	data, err := os.ReadFile(filepath.Join(out, "mountmedic.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var m krewPlugin
	if err := yaml.UnmarshalStrict(data, &m); err != nil {
		t.Fatalf("krew manifest: %v\n%s", err, data)
	}
	if m.APIVersion != "krew.googlecontainertools.github.com/v1alpha2" || m.Kind != "Plugin" || m.Metadata.Name != "mountmedic" ||
		m.Spec.Version != "v0.0.1-test" || m.Spec.ShortDescription == "" || len(m.Spec.Platforms) != 1 {
		t.Fatalf("krew manifest = %+v", m)
	}
	p := m.Spec.Platforms[0]
	archive := filepath.Join(out, filepath.Base(p.URI))
	if !strings.HasPrefix(p.URI, "https://example.com/dl/") || p.Selector.MatchLabels["os"] != "linux" || p.Bin != "kubectl-mountmedic" {
		t.Errorf("platform = %+v", p)
	}
	raw, err := os.ReadFile(archive)
	if err != nil {
		t.Fatal(err)
	}
	if sum := sha256.Sum256(raw); hex.EncodeToString(sum[:]) != p.SHA256 {
		t.Errorf("sha256 of %s = %x, manifest says %s", archive, sum, p.SHA256)
	}
	bin := filepath.Join(t.TempDir(), p.Bin)
	extract(t, archive, p.Bin, bin)
	got, err := exec.Command(bin, "version").Output()
	if err != nil || strings.TrimSpace(string(got)) != "v0.0.1-test" {
		t.Errorf("%s version = %q, %v; want v0.0.1-test", p.Bin, got, err)
	}
}

func goarch(t *testing.T) string {
	out, err := exec.Command("go", "env", "GOARCH").Output()
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(out))
}

// extract writes the archive's file name to dst.
func extract(t *testing.T, archive, name, dst string) {
	t.Helper()
	f, err := os.Open(archive)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	gz, err := gzip.NewReader(f)
	if err != nil {
		t.Fatal(err)
	}
	tr := tar.NewReader(gz)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			t.Fatalf("%s has no %s at its root", archive, name)
		}
		if err != nil {
			t.Fatal(err)
		}
		if h.Name != name {
			continue
		}
		w, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY, 0o755)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := io.Copy(w, tr); err != nil {
			t.Fatal(err)
		}
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		return
	}
}
