package probe

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/scripts/lab"
)

// TestStackAtUniqueIDs: on a kernel with unique mount IDs, StackAt finds
// the three mounts stacked at a path, bottom first, as mountinfo lists
// them (its reused IDs, device, type, root); a mount made after one was
// freed gets a new unique ID although mountinfo may show the old ID again,
// and the freed one is gone for statmount. Listmount lists the root's
// children.
func TestStackAtUniqueIDs(t *testing.T) {
	lab.RequireRoot(t)
	if _, err := StackAt("/"); errors.Is(err, ErrNoUniqueMountID) {
		t.Skipf("kernel before 6.8: %v", err)
	}
	dir := filepath.Join(t.TempDir(), "stack")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("idtest", dir, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if err := unix.Mount(dir, dir, "", unix.MS_BIND, ""); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for range 3 {
			_ = unix.Unmount(dir, unix.MNT_DETACH)
		}
	})
	stack, err := StackAt(dir)
	if err != nil {
		t.Fatal(err)
	}
	dm, err := ReadDevMounts(context.Background(), "/proc/self/mountinfo", map[Dev]bool{stack[0].Dev: true}, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	var want []int
	for _, m := range dm.Mounts {
		if m.Mountpoint == dir {
			want = append(want, m.ID)
		}
	}
	var got []int
	for _, m := range stack {
		got = append(got, m.OldID)
		if m.Point != dir || m.FSType != "tmpfs" || m.Root != "/" || m.Dev != stack[0].Dev {
			t.Errorf("StackAt(%s): %+v, want a tmpfs at the path, root /, one device", dir, m)
		}
		if m.HasSource && m.Source != "idtest" {
			t.Errorf("StackAt(%s): source %q, want idtest", dir, m.Source)
		}
	}
	if len(got) != 3 || !slices.Equal(got, want) {
		t.Errorf("StackAt(%s) = mountinfo IDs %v, want %v (three, bottom first)", dir, got, want)
	}
	for i := 1; i < len(stack); i++ {
		if stack[i].ParentID != stack[i-1].ID {
			t.Errorf("mount %d's parent is %d, want %d below it", stack[i].ID, stack[i].ParentID, stack[i-1].ID)
		}
	}

	top := stack[len(stack)-1]
	if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(dir, dir, "", unix.MS_BIND, ""); err != nil {
		t.Fatal(err)
	}
	again, err := StackAt(dir)
	if err != nil || len(again) != 3 {
		t.Fatalf("StackAt after a new top = %v, %v", again, err)
	}
	newTop := again[2]
	t.Logf("top: unique %d (mountinfo %d, source %q %t), after unmount and bind again: unique %d (mountinfo %d)", top.ID, top.OldID, top.Source, top.HasSource, newTop.ID, newTop.OldID)
	if newTop.ID == top.ID {
		t.Errorf("a new mount got the freed mount's unique ID %d", top.ID)
	}
	if _, err := Statmount(top.ID); !errors.Is(err, unix.ENOENT) {
		t.Errorf("Statmount(freed mount %d) = %v, want ENOENT", top.ID, err)
	}
	ids := make([]uint64, 64)
	if n, err := Listmount(lsmtRoot, 0, ids); err != nil || n == 0 {
		t.Errorf("Listmount(root) = %d, %v; want its children", n, err)
	}
}
