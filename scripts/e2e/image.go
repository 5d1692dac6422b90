package e2e

import (
	"archive/tar"
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"time"
)

// Images the node runs, by the reference a pod names them with. They are
// packed on this machine (no registry is reachable) and imported into
// containerd's k8s.io namespace before kubelet starts.
const (
	// PauseImage is the sandbox image: the static pause program of ./pause.
	PauseImage = "registry.k8s.io/pause:e2e"
	// BusyboxImage holds Debian's busybox-static with a link per applet.
	BusyboxImage = "docker.io/library/busybox:e2e"
)

// imageFile is one entry of an image layer: a regular file (Data), a
// symbolic link (Link) or a directory (Dir).
type imageFile struct {
	Name string
	Mode int64
	Data []byte
	Link string
	Dir  bool
}

// epoch is the time stamped on image layers and configs, so that the same
// inputs give the same digests.
var epoch = time.Unix(0, 0).UTC()

// writeOCIArchive writes a single-layer, single-platform OCI image archive
// named ref to path, as `ctr images import` reads it.
func writeOCIArchive(path, ref string, files []imageFile, entrypoint []string) error {
	var layer bytes.Buffer
	tw := tar.NewWriter(&layer)
	sort.Slice(files, func(i, j int) bool { return files[i].Name < files[j].Name })
	dirs := map[string]bool{}
	for _, f := range files {
		for d := filepath.Dir(f.Name); d != "." && d != "/" && !dirs[d]; d = filepath.Dir(d) {
			dirs[d] = true
		}
	}
	dirList := make([]string, 0, len(dirs))
	for d := range dirs {
		dirList = append(dirList, d)
	}
	sort.Strings(dirList)
	for _, d := range dirList {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: d + "/", Mode: 0o755, ModTime: epoch}); err != nil {
			return fmt.Errorf("image %s: layer directory %s: %w", ref, d, err)
		}
	}
	for _, f := range files {
		h := &tar.Header{Name: f.Name, Mode: f.Mode, ModTime: epoch}
		switch {
		case f.Dir:
			h.Typeflag, h.Name = tar.TypeDir, f.Name+"/"
		case f.Link != "":
			h.Typeflag, h.Linkname = tar.TypeSymlink, f.Link
		default:
			h.Typeflag, h.Size = tar.TypeReg, int64(len(f.Data))
		}
		if err := tw.WriteHeader(h); err != nil {
			return fmt.Errorf("image %s: layer entry %s: %w", ref, f.Name, err)
		}
		if _, err := tw.Write(f.Data); err != nil {
			return fmt.Errorf("image %s: layer entry %s: %w", ref, f.Name, err)
		}
	}
	if err := tw.Close(); err != nil {
		return fmt.Errorf("image %s: close layer: %w", ref, err)
	}
	layerDigest := digest(layer.Bytes())

	config, err := json.Marshal(map[string]any{
		"created":      epoch.Format(time.RFC3339),
		"architecture": runtime.GOARCH,
		"os":           "linux",
		"config": map[string]any{
			"Entrypoint": entrypoint,
			"Env":        []string{"PATH=/bin"},
		},
		"rootfs": map[string]any{"type": "layers", "diff_ids": []string{layerDigest}},
	})
	if err != nil {
		return fmt.Errorf("image %s: config: %w", ref, err)
	}
	manifest, err := json.Marshal(map[string]any{
		"schemaVersion": 2,
		"mediaType":     "application/vnd.oci.image.manifest.v1+json",
		"config":        descriptor("application/vnd.oci.image.config.v1+json", config),
		"layers":        []any{descriptor("application/vnd.oci.image.layer.v1.tar", layer.Bytes())},
	})
	if err != nil {
		return fmt.Errorf("image %s: manifest: %w", ref, err)
	}
	md := descriptor("application/vnd.oci.image.manifest.v1+json", manifest)
	md["platform"] = map[string]string{"architecture": runtime.GOARCH, "os": "linux"}
	md["annotations"] = map[string]string{
		"io.containerd.image.name":          ref,
		"org.opencontainers.image.ref.name": ref[strings.LastIndex(ref, ":")+1:],
	}
	index, err := json.Marshal(map[string]any{
		"schemaVersion": 2,
		"mediaType":     "application/vnd.oci.image.index.v1+json",
		"manifests":     []any{md},
	})
	if err != nil {
		return fmt.Errorf("image %s: index: %w", ref, err)
	}

	out, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("image %s: %w", ref, err)
	}
	defer out.Close()
	aw := tar.NewWriter(out)
	entries := []struct {
		name string
		data []byte
	}{
		{"oci-layout", []byte(`{"imageLayoutVersion":"1.0.0"}`)},
		{"index.json", index},
		{blobPath(config), config},
		{blobPath(manifest), manifest},
		{blobPath(layer.Bytes()), layer.Bytes()},
	}
	for _, e := range entries {
		if err := aw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: e.name, Mode: 0o644, Size: int64(len(e.data)), ModTime: epoch}); err != nil {
			return fmt.Errorf("image %s: archive entry %s: %w", ref, e.name, err)
		}
		if _, err := aw.Write(e.data); err != nil {
			return fmt.Errorf("image %s: archive entry %s: %w", ref, e.name, err)
		}
	}
	if err := aw.Close(); err != nil {
		return fmt.Errorf("image %s: close archive: %w", ref, err)
	}
	if err := out.Close(); err != nil {
		return fmt.Errorf("image %s: %w", ref, err)
	}
	return nil
}

func digest(data []byte) string {
	sum := sha256.Sum256(data)
	return "sha256:" + hex.EncodeToString(sum[:])
}

func blobPath(data []byte) string {
	return "blobs/sha256/" + strings.TrimPrefix(digest(data), "sha256:")
}

func descriptor(mediaType string, data []byte) map[string]any {
	return map[string]any{"mediaType": mediaType, "digest": digest(data), "size": len(data)}
}

// buildPauseImage compiles ./pause statically and packs it as PauseImage.
func buildPauseImage(dir, archive string) error {
	bin := filepath.Join(dir, "pause")
	// go test runs in the package directory.
	cmd := exec.Command("go", "build", "-trimpath", "-ldflags=-s -w", "-o", bin, "./pause")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("build the pause program (go build ./scripts/e2e/pause): %w\n%s", err, out)
	}
	data, err := os.ReadFile(bin)
	if err != nil {
		return fmt.Errorf("read the pause program: %w", err)
	}
	return writeOCIArchive(archive, PauseImage, []imageFile{{Name: "pause", Mode: 0o755, Data: data}}, []string{"/pause"})
}

// buildBusyboxImage packs Debian's static busybox with a link per applet as
// BusyboxImage.
func buildBusyboxImage(busybox, archive string) error {
	data, err := os.ReadFile(busybox)
	if err != nil {
		return fmt.Errorf("read %s (install the Debian package busybox-static): %w", busybox, err)
	}
	out, err := exec.Command(busybox, "--list").Output()
	if err != nil {
		return fmt.Errorf("list the applets of %s: %w", busybox, err)
	}
	files := []imageFile{{Name: "bin/busybox", Mode: 0o755, Data: data}, {Name: "tmp", Mode: 0o1777, Dir: true}}
	for _, applet := range strings.Fields(string(out)) {
		if applet == "busybox" || strings.Contains(applet, "/") {
			continue
		}
		files = append(files, imageFile{Name: "bin/" + applet, Mode: 0o777, Link: "busybox"})
	}
	return writeOCIArchive(archive, BusyboxImage, files, []string{"/bin/sh"})
}
