package probe

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/mountmedic/mountmedic/scripts/lab"
)

// superBase has an ext4 volume on an NBD device (staging and publish), an
// s3fs volume and the node's own ext4 root.
const superBase = `1 0 254:1 / / rw,relatime shared:1 - ext4 /dev/vda1 rw,errors=remount-ro
26 1 0:25 / /run rw,nosuid,nodev,noexec,relatime shared:5 - tmpfs tmpfs rw,size=2459104k,mode=755
401 1 43:0 / /var/lib/kubelet/plugins/kubernetes.io/csi/rbd.csi.ceph.com/ee46ee61e0e552f3ba5360dbf3e028b42c7cb6634bff5415f0c86282dedc9cfa/globalmount rw,relatime shared:300 - ext4 /dev/nbd0 rw
402 1 43:0 / /var/lib/kubelet/pods/0a1b2c3d-3333-4333-8333-333333333333/volumes/kubernetes.io~csi/pvc-2b2c3d4e-0000-4000-8000-000000000002/mount rw,relatime shared:300 - ext4 /dev/nbd0 rw
501 1 0:50 / /var/lib/kubelet/plugins/kubernetes.io/csi/ru.yandex.s3.csi/0c2f6b0a1d110c2f6b0a1d110c2f6b0a1d110c2f6b0a1d110c2f6b0a1d11aaaa/globalmount rw,nosuid,nodev,relatime shared:400 - fuse.s3fs s3fs rw,user_id=0,group_id=0
502 1 0:50 / /var/lib/kubelet/pods/0a1b2c3d-3333-4333-8333-333333333333/volumes/kubernetes.io~csi/pvc-5b2c3d4e-0000-4000-8000-000000000005/mount rw,nosuid,nodev,relatime shared:400 - fuse.s3fs s3fs rw,user_id=0,group_id=0
`

// withLines replaces the lines of superBase whose mount ID is a key.
func withLines(repl map[string]string) string {
	var out []string
	for _, l := range strings.Split(strings.TrimSuffix(superBase, "\n"), "\n") {
		id, _, _ := strings.Cut(l, " ")
		if r, ok := repl[id]; ok {
			if r != "" {
				out = append(out, r)
			}
			continue
		}
		out = append(out, l)
	}
	return strings.Join(out, "\n") + "\n"
}

func TestSuperOptionsChanged(t *testing.T) {
	base, err := Parse([]byte(superBase), "base", Options{})
	if err != nil {
		t.Fatal(err)
	}
	shut := map[string]string{
		"401": strings.Replace(strings.Split(superBase, "\n")[2], "/dev/nbd0 rw", "/dev/nbd0 rw,shutdown", 1),
		"402": strings.Replace(strings.Split(superBase, "\n")[3], "/dev/nbd0 rw", "/dev/nbd0 rw,shutdown", 1),
	}
	tests := map[string]struct {
		table string
		want  bool
	}{
		"same table":                 {superBase, false},
		"block volume shut down":     {withLines(shut), true},
		"only one line says so":      {withLines(map[string]string{"401": shut["401"]}), true},
		"journal aborted":            {strings.ReplaceAll(superBase, "/dev/nbd0 rw\n", "/dev/nbd0 rw,emergency_ro\n"), true},
		"fuse super options changed": {strings.ReplaceAll(superBase, "s3fs rw,user_id=0", "s3fs ro,user_id=0"), false},
		"node root changed":          {strings.Replace(superBase, "/dev/vda1 rw,errors", "/dev/vda1 ro,errors", 1), false},
		"block volume unmounted":     {withLines(map[string]string{"401": "", "402": ""}), false},
		"another block device mounted": {superBase +
			"600 1 43:32 / /mnt rw,relatime shared:9 - ext4 /dev/nbd1 rw,shutdown\n", false},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "mountinfo")
			if err := os.WriteFile(path, []byte(tc.table), 0o644); err != nil {
				t.Fatal(err)
			}
			got, err := SuperOptionsChanged(path, base)
			if err != nil {
				t.Fatalf("SuperOptionsChanged() error = %v", err)
			}
			if got != tc.want {
				t.Errorf("SuperOptionsChanged() = %v, want %v", got, tc.want)
			}
			// It never changes the inventory it compares with.
			for _, b := range base.Backends {
				if b.Dev == (Dev{43, 0}) && b.SuperOptions != "rw" {
					t.Errorf("backend %s super options = %q after the call, want %q kept", b.Dev, b.SuperOptions, "rw")
				}
			}
		})
	}
}

func TestSuperOptionsChangedErrors(t *testing.T) {
	base, err := Parse([]byte(superBase), "base", Options{})
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad")
	if err := os.WriteFile(bad, []byte("401 1 43:0 / /x rw shared:1 ext4\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := SuperOptionsChanged(filepath.Join(dir, "missing"), base); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("SuperOptionsChanged(missing file) error = %v, want one matching os.ErrNotExist", err)
	}
	var te *TableError
	if _, err := SuperOptionsChanged(bad, base); !errors.As(err, &te) || te.Source != bad {
		t.Errorf("SuperOptionsChanged(malformed table) error = %v, want a *TableError naming %s", err, bad)
	}
	// No block-backed filesystem: nothing to read, not even a missing file.
	fuseOnly, err := Parse([]byte(withLines(map[string]string{"401": "", "402": ""})), "fuse", Options{})
	if err != nil {
		t.Fatal(err)
	}
	if got, err := SuperOptionsChanged(filepath.Join(dir, "missing"), fuseOnly); got || err != nil {
		t.Errorf("SuperOptionsChanged(no block backend) = %v, %v; want false, nil without reading", got, err)
	}
}

// BenchmarkBlockRefresh is what a probe cycle pays to notice a shut-down
// block filesystem when nothing else changed, at 1k and 10k publish
// targets of an ext4 volume: a whole Live inventory read (what the agent
// did every cycle while a block volume was mounted), or SuperOptionsChanged.
func BenchmarkBlockRefresh(b *testing.B) {
	lab.RequireRoot(b)
	lab.RequireBinary(b, "mkfs.ext4")
	for _, n := range []int{1000, 10000} {
		k := lab.NewKubelet(b, filepath.Join(b.TempDir(), "kubelet"))
		staging := k.StagingPath(labDriver, "bench")
		lab.NewExt4(b, staging, 16)
		for i := 0; i < n; i++ {
			k.Publish("pod-"+strconv.Itoa(i), "pv-bench", labDriver, "bench", staging, false)
		}
		inv, err := ReadFile("/proc/self/mountinfo", Options{Root: k.Root(), Live: true})
		if err != nil {
			b.Fatal(err)
		}
		b.Run(fmt.Sprintf("mounts=%d/live-inventory", n), func(b *testing.B) {
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				if _, err := ReadFile("/proc/self/mountinfo", Options{Root: k.Root(), Live: true}); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(fmt.Sprintf("mounts=%d/super-options", n), func(b *testing.B) {
			b.ReportAllocs()
			for i := 0; i < b.N; i++ {
				changed, err := SuperOptionsChanged("/proc/self/mountinfo", inv)
				if err != nil || changed {
					b.Fatalf("SuperOptionsChanged() = %v, %v; want false, nil", changed, err)
				}
			}
		})
	}
}
