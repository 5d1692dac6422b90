package probe

import (
	"bufio"
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/moby/sys/mountinfo"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

func readTestdata(t *testing.T, name string) *Inventory {
	t.Helper()
	inv, err := ReadFile(filepath.Join("testdata", name), Options{})
	if err != nil {
		t.Fatalf("ReadFile(%s) = %v", name, err)
	}
	return inv
}

func mountAt(t *testing.T, inv *Inventory, suffix string) *Mount {
	t.Helper()
	var found *Mount
	for _, m := range inv.Mounts {
		if strings.HasSuffix(m.Path, suffix) {
			if found != nil && !m.Covered {
				found = m
				continue
			}
			if found == nil {
				found = m
			}
		}
	}
	if found == nil {
		t.Fatalf("no mount ends in %q", suffix)
	}
	return found
}

func TestBuildLinksByDeviceAndRoot(t *testing.T) {
	inv := readTestdata(t, "s3fs-two-pods.mountinfo")
	if inv.Total != 12 || len(inv.Mounts) != 6 || len(inv.Backends) != 2 {
		t.Fatalf("inventory = %d total, %d kubelet mounts, %d backends; want 12, 6, 2", inv.Total, len(inv.Mounts), len(inv.Backends))
	}
	staging := mountAt(t, inv, "/globalmount")
	pub1 := mountAt(t, inv, "8d0e4c6a-5b7e-4a63-9f1e-0c2f6b0a1d11/volumes/kubernetes.io~csi/pvc-1b2c3d4e-0000-4000-8000-000000000001/mount")
	sub1 := mountAt(t, inv, "/app/1")
	sub2 := mountAt(t, inv, "/sidecar/0")
	if pub1.From != staging {
		t.Errorf("publish.From = %v, want the staging mount", pub1.From)
	}
	if sub1.From != pub1 {
		t.Errorf("subpath app/1 .From = %v, want its own pod's publish target", sub1.From)
	}
	if sub2.From == nil || sub2.From.Target.PodUID != sub2.Target.PodUID {
		t.Errorf("subpath sidecar/0 .From = %v, want the publish target of pod %s", sub2.From, sub2.Target.PodUID)
	}
	if sub2.Root != "/logs/my dir" {
		t.Errorf("escaped root = %q, want %q", sub2.Root, "/logs/my dir")
	}
	for _, m := range []*Mount{staging, pub1, sub1, sub2} {
		if m.Driver != "ru.yandex.s3.csi" {
			t.Errorf("%s: Driver = %q, want ru.yandex.s3.csi (from the staging path)", m.Path, m.Driver)
		}
		if m.Backend != staging.Backend {
			t.Errorf("%s: on another backend than the staging mount", m.Path)
		}
	}
	b := staging.Backend
	if b.Kind != BackendFUSE || b.Conn != 52 || b.ProbePath() != staging.Path {
		t.Errorf("backend = kind %v conn %d probe path %q; want fuse, 52, the staging path", b.Kind, b.Conn, b.ProbePath())
	}
}

func TestBuildCoveredAndLegacy(t *testing.T) {
	inv := readTestdata(t, "mixed-node.mountinfo")
	var covered, upper *Mount
	for _, m := range inv.Mounts {
		if m.Target.Kind == kubelet.KindStaging && m.Target.Driver == "juicefs.csi.io" {
			if m.Covered {
				covered = m
			} else {
				upper = m
			}
		}
	}
	if covered == nil || upper == nil || covered.Dev == upper.Dev {
		t.Fatalf("want a covered and an upper juicefs staging mount on two devices, got %v and %v", covered, upper)
	}
	pub := mountAt(t, inv, "/pvc-7/mount")
	if pub.From != covered {
		t.Errorf("publish pvc-7 .From = %v, want the covered staging mount it still shows (same device)", pub.From)
	}
	legacy := mountAt(t, inv, "/pv-legacy-5/mount")
	if legacy.From == nil || legacy.From.Target.PV != "pv-legacy-5" {
		t.Errorf("legacy publish .From = %v, want the pv/pv-legacy-5 staging mount", legacy.From)
	}
	for _, m := range inv.Mounts {
		if strings.HasPrefix(m.Path, "/srv") {
			t.Errorf("a lookalike path outside the kubelet root was classified: %s", m.Path)
		}
	}
}

func TestParseErrorsNameTheLine(t *testing.T) {
	tests := map[string]struct {
		data string
		line int
	}{
		"too few fields": {"1 0 8:1 / / rw - ext4 /dev/sda1 rw\n2 1 0:5 /x rw - tmpfs\n", 2},
		"no separator":   {"1 0 8:1 / / rw shared:1 ext4 /dev/sda1 rw extra\n", 1},
		"bad major":      {"1 0 8-1 / / rw - ext4 /dev/sda1 rw\n", 1},
		"bad id":         {"x 0 8:1 / / rw - ext4 /dev/sda1 rw\n", 1},
		"empty":          {"\n\n", 0},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			_, err := Parse([]byte(tc.data), "capture.txt", Options{})
			var te *TableError
			if !errors.As(err, &te) {
				t.Fatalf("Parse() error = %v, want a *TableError", err)
			}
			if te.Line != tc.line || te.Source != "capture.txt" {
				t.Errorf("Parse() error at %s line %d, want capture.txt line %d", te.Source, te.Line, tc.line)
			}
		})
	}
}

func TestReadFileMissing(t *testing.T) {
	_, err := ReadFile(filepath.Join(t.TempDir(), "nope"), Options{})
	if !errors.Is(err, os.ErrNotExist) {
		t.Errorf("ReadFile(missing) error = %v, want os.ErrNotExist", err)
	}
}

func TestAssessFromTheTableAlone(t *testing.T) {
	inv := readTestdata(t, "nbd-faults.mountinfo")
	rep := Assess(inv)
	want := map[string]State{
		"pvc-2b2c3d4e-0000-4000-8000-000000000002/mount":                Shutdown,
		"pvc-3b2c3d4e-0000-4000-8000-000000000003/mount":                ReadOnly,
		"pvc-4b2c3d4e-0000-4000-8000-000000000004/mount":                ReadOnly,
		"volume-subpaths/pvc-4b2c3d4e-0000-4000-8000-000000000004/db/0": Deleted,
	}
	for _, r := range rep.Mounts {
		for suffix, st := range want {
			if strings.HasSuffix(r.Mount.Path, suffix) && r.State != st {
				t.Errorf("%s: state %v, want %v", suffix, r.State, st)
			}
		}
	}
	if got := len(rep.Broken()); got != 7 {
		t.Errorf("broken = %d, want 7", got)
	}
	healthy := Assess(readTestdata(t, "s3fs-two-pods.mountinfo"))
	for _, r := range healthy.Mounts {
		if r.State != Unknown {
			t.Errorf("%s: offline state %v, want Unknown", r.Mount.Path, r.State)
		}
	}
}

// FuzzParse feeds the mount table parser arbitrary tables. Whatever it
// takes must read the same line by line in github.com/moby/sys/mountinfo's
// parser (ours is stricter: numbers, escapes and fields are checked, where
// mountinfo takes a bad number as 0), every kubelet mount kept must lie
// under the root and be linked only within its device, and the IDs must form
// a tree. Whatever it refuses must be a *TableError.
func FuzzParse(f *testing.F) {
	for _, name := range []string{"s3fs-two-pods.mountinfo", "nbd-faults.mountinfo", "mixed-node.mountinfo", "hostile.mountinfo"} {
		data, err := os.ReadFile(filepath.Join("testdata", name))
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data)
	}
	f.Add([]byte("1 0 0:1 /a\\040b//deleted /var/lib/kubelet/pods/u/volume-subpaths/v/c/0 rw - fuse.x x rw\n"))
	// The hostile tables of issue 13: a duplicate ID, a cycle of parents,
	// a device that is not a number, an escaped newline in a path.
	f.Add([]byte(rootLine + "301" + stageLine + "305 301" + pubLine + "301 1" + pubLine))
	f.Add([]byte(rootLine + "10 11" + pubLine + "11 10" + pubLine))
	f.Add([]byte(rootLine + "2 1 zz:yy / /var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/v/mount rw - tmpfs t rw\n"))
	f.Add([]byte(rootLine + "2 1 0:5 / /var/lib/kubelet/pods/u\\012x/volumes/kubernetes.io~csi/v\\033[2J/mount rw - fuse.x \x1b]0;t\a rw\r\n"))
	f.Add([]byte("7 7 254:1 / / rw - ext4 /dev/vda1 rw\r\n8 999 0:4 net:[1] /run/netns/a rw a:1 b:2 - nsfs nsfs rw\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		inv, err := Parse(data, "fuzz", Options{})
		if err != nil {
			var te *TableError
			if !errors.As(err, &te) {
				t.Fatalf("Parse() error %v is not a *TableError", err)
			}
			return
		}
		infos, merr := mountinfo.GetMountsFromReader(bytes.NewReader(data), nil)
		if errors.Is(merr, bufio.ErrTooLong) {
			return // a line over mountinfo's 64 KiB; ours takes up to 1 MiB
		}
		if merr != nil {
			t.Fatalf("Parse() took a table github.com/moby/sys/mountinfo refuses: %v", merr)
		}
		if len(infos) != inv.Total {
			t.Fatalf("Parse() counted %d mounts, mountinfo %d", inv.Total, len(infos))
		}
		lines := bytes.Split(bytes.TrimSuffix(data, []byte("\n")), []byte("\n"))
		for i, want := range infos {
			raw, err := parseLine(bytes.TrimSuffix(lines[i], []byte("\r")))
			if err != nil {
				t.Fatalf("line %d: parseLine() = %v after Parse() took the table", i+1, err)
			}
			got := raw.info("")
			if *got != *want {
				t.Fatalf("line %d: parsed %+v, mountinfo %+v", i+1, *got, *want)
			}
		}
		ids := make(map[int]int, len(infos))
		for _, in := range infos {
			if _, dup := ids[in.ID]; dup {
				t.Fatalf("Parse() took mount ID %d twice", in.ID)
			}
			ids[in.ID] = in.Parent
		}
		for _, in := range infos {
			id := in.ID
			for n := 0; n <= len(ids); n++ {
				p, ok := ids[id]
				if !ok || p == id {
					break
				}
				if n == len(ids) {
					t.Fatalf("Parse() took a cycle of parents through mount %d", in.ID)
				}
				id = p
			}
		}
		for _, m := range inv.Mounts {
			if !kubelet.Under(inv.Root, m.Path) {
				t.Fatalf("mount %q outside the root was kept", m.Path)
			}
			if m.Backend == nil || m.Backend.Dev != m.Dev {
				t.Fatalf("mount %q has backend %v, want one on its device", m.Path, m.Backend)
			}
			for f := m.From; f != nil; f = f.From {
				if f.Dev != m.Dev {
					t.Fatalf("mount %q linked to %q on another device", m.Path, f.Path)
				}
				if f == m {
					t.Fatalf("mount %q links to itself", m.Path)
				}
			}
		}
		_ = Assess(inv)
	})
}

// TestInTreeAndPluginSubPaths: subPath binds of non-CSI volumes are linked
// to their pod volume, an in-tree iSCSI pod volume to its device mount; a
// ConfigMap or Secret subPath whose file an update replaced is explained
// and not broken, while a deleted directory still is.
func TestInTreeAndPluginSubPaths(t *testing.T) {
	inv := readTestdata(t, "in-tree.mountinfo")
	from := map[string]string{}
	for _, m := range inv.Mounts {
		if m.From != nil {
			from[m.Path[strings.LastIndex(m.Path, "/volume"):]] = m.From.Target.Plugin + "/" + m.From.Target.Kind.String()
		}
	}
	want := map[string]string{
		"/volume-subpaths/shared/app/0":           "kubernetes.io~nfs/plugin",
		"/volume-subpaths/scratch/app/1":          "kubernetes.io~empty-dir/plugin",
		"/volume-subpaths/tls/app/2":              "kubernetes.io~secret/plugin",
		"/volume-subpaths/iscsi-data/db/0":        "kubernetes.io~iscsi/plugin",
		"/volumes/kubernetes.io~iscsi/iscsi-data": "kubernetes.io~iscsi/staging",
	}
	for p, w := range want {
		if from[p] != w {
			t.Errorf("%s linked from %q, want %q", p, from[p], w)
		}
	}
	rep := Assess(inv)
	if n := len(rep.Broken()); n != 0 {
		t.Errorf("broken = %d, want 0", n)
	}
	replaced := 0
	for _, r := range rep.Mounts {
		if r.Mount.ReplacedByUpdate() {
			replaced++
			if r.Err == nil || !strings.Contains(r.Err.Error(), "kubernetes#68211") {
				t.Errorf("%s: err %v, want the known cause named", r.Mount.Path, r.Err)
			}
		}
	}
	if replaced != 2 {
		t.Errorf("%d subPaths replaced by an update, want 2 (the ConfigMap's and the Secret's)", replaced)
	}
}

// TestReplacedByUpdateHostile: a pod names its emptyDir subPath like a
// ConfigMap's data directory and deletes it: that is a deleted directory,
// not a ConfigMap update.
func TestReplacedByUpdateHostile(t *testing.T) {
	const (
		root = "1 0 254:1 / / rw - ext4 /dev/vda1 rw\n"
		pod  = "/var/lib/kubelet/pods/u1"
	)
	for name, tc := range map[string]struct {
		line     string
		replaced bool
	}{
		"configmap update":                {"2 1 254:1 " + pod + "/volumes/kubernetes.io~configmap/cfg/..2026_11_27/a.yaml//deleted " + pod + "/volume-subpaths/cfg/app/0 rw - ext4 /dev/vda1 rw\n", true},
		"emptyDir named like a configmap": {"2 1 254:1 " + pod + "/volumes/kubernetes.io~empty-dir/x" + pod + "/volumes/kubernetes.io~configmap/x/..2026/a//deleted " + pod + "/volume-subpaths/x/app/0 rw - ext4 /dev/vda1 rw\n", false},
		"another pod's configmap":         {"2 1 254:1 /var/lib/kubelet/pods/u2/volumes/kubernetes.io~configmap/cfg/..2026/a//deleted " + pod + "/volume-subpaths/cfg/app/0 rw - ext4 /dev/vda1 rw\n", false},
	} {
		t.Run(name, func(t *testing.T) {
			inv, err := Parse([]byte(root+tc.line), name, Options{})
			if err != nil {
				t.Fatal(err)
			}
			if len(inv.Mounts) != 1 {
				t.Fatalf("%d mounts, want 1", len(inv.Mounts))
			}
			m := inv.Mounts[0]
			if got := m.ReplacedByUpdate(); got != tc.replaced {
				t.Errorf("ReplacedByUpdate() = %v, want %v", got, tc.replaced)
			}
			if st := Assess(inv).Mounts[0].State; (st == Deleted) == tc.replaced {
				t.Errorf("state %s, want Deleted %v", st, !tc.replaced)
			}
		})
	}
}

// TestCephCSIRealPaths: the staging and publish paths ceph-csi logged on a
// real node (ceph/ceph-csi#4762: NodePublishVolume binding
// <globalmount>/<volumeID> onto the target) link, and name the volume
// handle, whose sha256 is the staging path's directory.
func TestCephCSIRealPaths(t *testing.T) {
	const (
		id      = "0001-0024-aeb95e19-6505-44f5-9221-062605cda4ee-000000000000000a-dc93419b-7109-4c39-9a58-e87b9c6d3b8a"
		staging = "/var/lib/kubelet/plugins/kubernetes.io/csi/rbd.csi.ceph.com/3038ce5e41af71bc02c413b0a557fb52e71e372d4db7f600d4844ceb329780eb/globalmount/" + id
		target  = "/var/lib/kubelet/pods/bd49f109-cf95-4fce-9ea1-8bc71f04709b/volumes/kubernetes.io~csi/pvc-ed3aa009-edeb-4eaf-9f4e-761b717d7cf2/mount"
	)
	table := "1 0 254:1 / / rw - ext4 /dev/vda1 rw\n" +
		"2 1 252:0 / " + staging + " rw,relatime shared:2 - ext4 /dev/rbd0 rw,discard,stripe=16\n" +
		"3 1 252:0 / " + target + " rw,relatime shared:2 - ext4 /dev/rbd0 rw,discard,stripe=16\n"
	inv, err := Parse([]byte(table), "ceph-csi#4762", Options{})
	if err != nil {
		t.Fatal(err)
	}
	if len(inv.Mounts) != 2 {
		t.Fatalf("%d kubelet mounts, want 2", len(inv.Mounts))
	}
	st, pub := inv.Mounts[0], inv.Mounts[1]
	if st.Target.Kind != kubelet.KindStaging || st.VolumeHandle != id || st.Driver != "rbd.csi.ceph.com" {
		t.Errorf("staging mount = %s handle %q driver %q, want staging of %s by rbd.csi.ceph.com", st.Target.Kind, st.VolumeHandle, st.Driver, id)
	}
	if pub.From != st || pub.Driver != "rbd.csi.ceph.com" {
		t.Errorf("publish target from %v driver %q, want the staging mount and rbd.csi.ceph.com", pub.From, pub.Driver)
	}
	if d := pub.Daemon(); d != kubelet.DaemonKernel {
		t.Errorf("daemon of a krbd volume = %s, want kernel", d)
	}
}
