package probe

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestReadDevMounts: only the mounts of the asked devices are kept, with
// which of them another mount covers (whatever the order of the lines);
// a table past the byte cap or with more such mounts than the count cap is
// refused. The hostile actor is a pod's root stacking binds of its volume
// in its own mount namespace.
func TestReadDevMounts(t *testing.T) {
	dead := Dev{Major: 0, Minor: 99}
	lines := []string{
		"1 1 8:1 / / rw - ext4 /dev/sda1 rw",
		// the container's volume, covered by mount 30 listed before it
		"30 20 0:50 / /data rw - tmpfs tmpfs rw",
		"20 1 0:99 / /data rw - fuse.s3fs s3fs rw",
		"21 1 0:99 /sub /sub rw master:3 - fuse.s3fs s3fs rw",
		"22 21 0:7 / /sub/x rw - tmpfs tmpfs rw",
	}
	dir := t.TempDir()
	path := filepath.Join(dir, "mountinfo")
	if err := os.WriteFile(path, []byte(strings.Join(lines, "\n")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	dm, err := ReadDevMounts(context.Background(), path, map[Dev]bool{dead: true}, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, m := range dm.Mounts {
		got = append(got, fmt.Sprintf("%d %s %s covered=%t", m.ID, m.Mountpoint, m.Root, dm.Covered[m.ID]))
	}
	want := []string{"20 /data / covered=true", "21 /sub /sub covered=false"}
	if strings.Join(got, "; ") != strings.Join(want, "; ") {
		t.Errorf("ReadDevMounts = %q, want %q", got, want)
	}

	// A stack of binds of the dead device: refused past the count cap.
	var stack []string
	stack = append(stack, "1 1 8:1 / / rw - ext4 /dev/sda1 rw")
	for i := 0; i < 50; i++ {
		stack = append(stack, fmt.Sprintf("%d %d 0:99 / /data rw - fuse.s3fs s3fs rw", 100+i, 99+i))
	}
	big := filepath.Join(dir, "stack")
	if err := os.WriteFile(big, []byte(strings.Join(stack, "\n")+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := ReadDevMounts(context.Background(), big, map[Dev]bool{dead: true}, 0, 10); !errors.Is(err, ErrTooManyMounts) {
		t.Errorf("ReadDevMounts(50 mounts of the device, cap 10) = %v, want ErrTooManyMounts", err)
	}
	if _, err := ReadDevMounts(context.Background(), big, map[Dev]bool{dead: true}, 100, 0); !errors.Is(err, ErrTableTooLarge) {
		t.Errorf("ReadDevMounts(cap 100 bytes) = %v, want ErrTableTooLarge", err)
	}
	if dm, err := ReadDevMounts(context.Background(), big, map[Dev]bool{{Major: 9, Minor: 9}: true}, 0, 10); err != nil || len(dm.Mounts) != 0 {
		t.Errorf("ReadDevMounts(another device) = %v, %v; want nothing kept", dm, err)
	}
	if _, err := ReadDevMounts(context.Background(), "/proc/self/mountinfo", map[Dev]bool{dead: true}, 0, 0); err != nil {
		t.Errorf("ReadDevMounts(/proc/self/mountinfo) = %v", err)
	}
}
