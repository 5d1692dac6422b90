package probe

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// TestStraysBelowGlobalmount: a mount one directory below globalmount that
// is not the volume ID a driver staging there would use (a pod with
// Bidirectional propagation can put one there) is a stray: reported, not a
// kubelet mount, and not linked to the volume whose staging directory it
// sits in, whose real staging mount stays the volume's.
func TestStraysBelowGlobalmount(t *testing.T) {
	inv := readTestdata(t, "hostile.mountinfo")
	want := []string{
		"/ru.yandex.s3.csi/5d41402abc4b2a76b9719d911017c592ae3bd5f1b6e3ab3ab4a5c9e3d4f0a1b2/globalmount/evil",
		"/globalmount/not-the-volume-id",
		"/globalmount/0001-0009-rook-ceph-0000000000000002-9e8d7c6b-9b1f-11ef-8f3a-0a580a810215",
		"/pv/pv-cr\r" + "x/globalmount/vol-9",
	}
	if len(inv.Strays) != len(want) {
		t.Fatalf("%d strays, want %d: %+v", len(inv.Strays), len(want), inv.Strays)
	}
	for i, s := range inv.Strays {
		if !strings.HasSuffix(s.Path, want[i]) || s.Why == "" {
			t.Errorf("stray %d = %q (%q), want a path ending in %q and a reason", i, s.Path, s.Why, want[i])
		}
	}
	for _, m := range inv.Mounts {
		if strings.Contains(m.Path, "/globalmount/") {
			t.Errorf("%s is a kubelet mount (%s), want it a stray", m.Path, m.Target.Kind)
		}
	}
}

// TestStraysOnLegacyPathsLive: below a legacy or block staging path, which
// names no volume handle, a live read takes a mount for the volume's
// staging mount only when vol_data.json names its directory as the volume
// handle and the driver stages below the staging path.
func TestStraysOnLegacyPathsLive(t *testing.T) {
	root := t.TempDir()
	csi := filepath.Join(root, "plugins", "kubernetes.io", "csi")
	volData := func(dir, driver, handle string) {
		t.Helper()
		if err := os.MkdirAll(dir, 0o750); err != nil {
			t.Fatal(err)
		}
		data := `{"driverName":"` + driver + `","volumeHandle":"` + handle + `"}`
		if err := os.WriteFile(filepath.Join(dir, kubelet.VolDataFile), []byte(data), 0o640); err != nil {
			t.Fatal(err)
		}
	}
	volData(filepath.Join(csi, "pv", "pv-1"), "rbd.csi.ceph.com", "vol-1")
	volData(filepath.Join(csi, "pv", "pv-2"), "rbd.csi.ceph.com", "vol-2")
	volData(filepath.Join(csi, "pv", "pv-3"), "ru.yandex.s3.csi", "vol-3")
	volData(filepath.Join(csi, "volumeDevices", "pv-4", "data"), "rbd.csi.ceph.com", "vol-4")
	table := "1 0 254:1 / / rw - ext4 /dev/vda1 rw\n" +
		"2 1 252:1 / " + csi + "/pv/pv-1/globalmount/vol-1 rw - ext4 /dev/rbd1 rw\n" +
		"3 1 252:2 / " + csi + "/pv/pv-2/globalmount/evil rw - ext4 /dev/rbd2 rw\n" +
		"4 1 0:50 / " + csi + "/pv/pv-3/globalmount/vol-3 rw - fuse.s3fs s3fs rw\n" +
		"5 1 0:5 /rbd4 " + csi + "/volumeDevices/staging/pv-4/vol-4 rw - devtmpfs udev rw\n" +
		"6 1 0:5 /rbd5 " + csi + "/volumeDevices/staging/pv-5/vol-5 rw - devtmpfs udev rw\n"
	inv, err := Parse([]byte(table), "test", Options{Root: root, Live: true, SysfsDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, m := range inv.Mounts {
		got[filepath.Base(m.Path)] = m.Target.Kind.String() + " " + m.Driver + " " + m.VolumeHandle
	}
	want := map[string]string{"vol-1": "staging rbd.csi.ceph.com vol-1", "vol-4": "block rbd.csi.ceph.com vol-4"}
	for k, w := range want {
		if got[k] != w {
			t.Errorf("mount %s = %q, want %q", k, got[k], w)
		}
	}
	if len(inv.Mounts) != len(want) {
		t.Errorf("kubelet mounts %v, want only %v", got, want)
	}
	strays := map[string]bool{}
	for _, s := range inv.Strays {
		strays[filepath.Base(s.Path)] = true
	}
	for _, s := range []string{"evil", "vol-3", "vol-5"} {
		if !strays[s] {
			t.Errorf("%s is not a stray (strays %v)", s, inv.Strays)
		}
	}
}
