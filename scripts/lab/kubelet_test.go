package lab

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

const (
	testDriver = "s3.csi.example.com"
	testHandle = "bucket/prefix"
	testPodUID = "0b6f3c1e-5d2a-4f0e-9c61-7a0e2f4b9d11"
	testPV     = "pv-s3"
)

func readVolData(t *testing.T, dir string) map[string]string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(dir, "vol_data.json"))
	if err != nil {
		t.Fatalf("read vol_data.json: %v", err)
	}
	var m map[string]string
	if err := json.Unmarshal(data, &m); err != nil {
		t.Fatalf("decode vol_data.json %s: %v", data, err)
	}
	return m
}

// volumeTree is a CSI volume staged on a FaultFS, published for one pod,
// with a directory and a file subPath.
type volumeTree struct {
	k                *Kubelet
	fs               *FaultFS
	staging, publish string
	subDir, subFile  string
}

func newVolumeTree(t *testing.T) *volumeTree {
	t.Helper()
	k := NewKubelet(t, filepath.Join(t.TempDir(), "var", "lib", "kubelet"))
	v := &volumeTree{k: k, staging: k.StagingPath(testDriver, testHandle)}
	v.fs = StartFaultFS(t, v.staging)
	if err := os.MkdirAll(filepath.Join(v.staging, "sub", "dir"), 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(v.staging, "file"), "whole")
	writeFile(t, filepath.Join(v.staging, "sub", "dir", "x"), "subdir")
	writeFile(t, filepath.Join(v.staging, "config.txt"), "subfile")
	v.publish = k.Publish(testPodUID, testPV, testDriver, testHandle, v.staging, false)
	v.subDir = k.SubPath(testPodUID, testPV, "app", 0, filepath.Join(v.publish, "sub"))
	v.subFile = k.SubPath(testPodUID, testPV, "app", 1, filepath.Join(v.publish, "config.txt"))
	return v
}

func TestKubeletTree(t *testing.T) {
	RequireRoot(t)
	v := newVolumeTree(t)
	root := v.k.Root()

	sum := sha256.Sum256([]byte(testHandle))
	wantStaging := filepath.Join(root, "plugins/kubernetes.io/csi", testDriver, hex.EncodeToString(sum[:]), "globalmount")
	if v.staging != wantStaging {
		t.Errorf("StagingPath = %s, want %s", v.staging, wantStaging)
	}
	if got := readVolData(t, filepath.Dir(v.staging)); got["driverName"] != testDriver || got["volumeHandle"] != testHandle {
		t.Errorf("staging vol_data.json = %v, want driverName %s and volumeHandle %s", got, testDriver, testHandle)
	}
	wantPublish := filepath.Join(root, "pods", testPodUID, "volumes/kubernetes.io~csi", testPV, "mount")
	if v.publish != wantPublish {
		t.Errorf("Publish = %s, want %s", v.publish, wantPublish)
	}
	vd := readVolData(t, filepath.Dir(v.publish))
	for _, key := range []string{"specVolID", "volumeHandle", "driverName", "nodeName", "attachmentID", "volumeLifecycleMode"} {
		if vd[key] == "" {
			t.Errorf("publish vol_data.json has no %s: %v", key, vd)
		}
	}
	if vd["specVolID"] != testPV || vd["volumeLifecycleMode"] != "Persistent" || len(vd["attachmentID"]) != len("csi-")+64 {
		t.Errorf("publish vol_data.json = %v", vd)
	}
	wantSub := filepath.Join(root, "pods", testPodUID, "volume-subpaths", testPV, "app", "0")
	if v.subDir != wantSub {
		t.Errorf("SubPath = %s, want %s", v.subDir, wantSub)
	}
	if got, want := v.k.LegacyStagingPath("pv-old", testDriver, "old"), filepath.Join(root, "plugins/kubernetes.io/csi/pv/pv-old/globalmount"); got != want {
		t.Errorf("LegacyStagingPath = %s, want %s", got, want)
	}

	readFile(t, filepath.Join(v.publish, "file"), "whole")
	readFile(t, filepath.Join(v.subDir, "dir", "x"), "subdir")
	readFile(t, v.subFile, "subfile")
	for _, p := range []string{v.staging, v.publish, v.subDir, v.subFile} {
		m := mountAt(t, p)
		if m == nil || m.FSType != FaultFSType || uint32(m.Minor) != v.fs.Conn() {
			t.Errorf("mount at %s = %+v, want the faultfs connection %d", p, m, v.fs.Conn())
		}
	}
	if m := mountAt(t, v.publish); m != nil && m.Root != "/" {
		t.Errorf("publish mount root = %s, want /", m.Root)
	}
	if m := mountAt(t, v.subDir); m != nil && m.Root != "/sub" {
		t.Errorf("subPath mount root = %s, want /sub", m.Root)
	}
	if fi, err := os.Stat(v.subFile); err != nil || !fi.Mode().IsRegular() {
		t.Errorf("file subPath %s: %v, %v; want a regular file", v.subFile, fi, err)
	}

	ed := v.k.EmptyDir(testPodUID, "cache", true)
	if m := mountAt(t, ed); m == nil || m.FSType != "tmpfs" {
		t.Errorf("memory emptyDir mount = %+v, want tmpfs", m)
	}
	if plain := v.k.EmptyDir(testPodUID, "scratch", false); mountAt(t, plain) != nil {
		t.Errorf("disk emptyDir %s is a mount", plain)
	}

	v.fs.Kill()
	for _, p := range []string{v.publish, v.subDir} {
		if err := statfs(p); !errors.Is(err, unix.ENOTCONN) {
			t.Errorf("statfs %s after kill = %v, want ENOTCONN", p, err)
		}
	}
}

func TestKubeletBlockDevice(t *testing.T) {
	RequireRoot(t)
	b := NewExt4(t, filepath.Join(t.TempDir(), "ext4"), 16)
	k := NewKubelet(t, filepath.Join(t.TempDir(), "var", "lib", "kubelet"))
	p := k.BlockDevice(testPodUID, "pv-block", b.Device())
	if want := filepath.Join(k.Root(), "pods", testPodUID, "volumeDevices/kubernetes.io~csi/pv-block"); p != want {
		t.Errorf("BlockDevice = %s, want %s", p, want)
	}
	var st unix.Stat_t
	if err := unix.Stat(p, &st); err != nil {
		t.Fatalf("stat %s: %v", p, err)
	}
	major, minor := b.Dev()
	if st.Mode&unix.S_IFMT != unix.S_IFBLK || unix.Major(st.Rdev) != major || unix.Minor(st.Rdev) != minor {
		t.Errorf("%s: mode %o rdev %d:%d, want block device %d:%d", p, st.Mode, unix.Major(st.Rdev), unix.Minor(st.Rdev), major, minor)
	}
}

func TestContainer(t *testing.T) {
	for _, prop := range []string{PropagationPrivate, PropagationSlave} {
		t.Run(prop, func(t *testing.T) {
			RequireRoot(t)
			v := newVolumeTree(t)
			c := StartContainer(t, "app", prop, map[string]string{
				"/data":           v.publish,
				"/sub":            v.subDir,
				"/etc/config.txt": v.subFile,
			})
			readFile(t, c.Path("/data/file"), "whole")
			readFile(t, c.Path("/sub/dir/x"), "subdir")
			readFile(t, c.Path("/etc/config.txt"), "subfile")

			// The binds live only in the container's namespace: the host
			// sees empty mountpoints, so Path really walks that namespace.
			if ents, err := os.ReadDir(filepath.Join(c.Root(), "data")); err != nil || len(ents) != 0 {
				t.Errorf("host view of the container's /data: %v, %v; want an empty directory", ents, err)
			}

			// A mount made later on the host under the published volume
			// reaches a slave container only.
			inner := filepath.Join(v.publish, "inner")
			if err := os.Mkdir(inner, 0o755); err != nil {
				t.Fatal(err)
			}
			if err := unix.Mount("tmpfs", inner, "tmpfs", 0, ""); err != nil {
				t.Fatalf("mount tmpfs at %s: %v", inner, err)
			}
			t.Cleanup(func() { _ = unix.Unmount(inner, unix.MNT_DETACH) })
			writeFile(t, filepath.Join(inner, "marker"), "late")
			_, err := os.ReadFile(c.Path("/data/inner/marker"))
			switch {
			case prop == PropagationSlave && err != nil:
				t.Errorf("slave container does not see a later host mount: %v", err)
			case prop == PropagationPrivate && !errors.Is(err, os.ErrNotExist):
				t.Errorf("private container reading a later host mount = %v, want ENOENT", err)
			}

			v.fs.Kill()
			if err := statfs(c.Path("/data")); !errors.Is(err, unix.ENOTCONN) {
				t.Errorf("statfs of the container's /data after the daemon died = %v, want ENOTCONN", err)
			}
			if _, err := os.ReadFile(c.Path("/sub/dir/x")); !errors.Is(err, unix.ENOTCONN) {
				t.Errorf("read through the container's subPath after the daemon died = %v, want ENOTCONN", err)
			}
		})
	}
}
