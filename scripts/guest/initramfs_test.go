package guest

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
)

func TestModuleOrder(t *testing.T) {
	dir := t.TempDir()
	dep := "kernel/fs/9p/9p.ko: kernel/net/9p/9pnet.ko kernel/fs/fscache/fscache.ko kernel/fs/netfs/netfs.ko\n" +
		"kernel/net/9p/9pnet.ko:\n" +
		"kernel/fs/fscache/fscache.ko: kernel/fs/netfs/netfs.ko\n" +
		"kernel/fs/netfs/netfs.ko:\n" +
		"kernel/drivers/block/nbd.ko:\n"
	if err := os.WriteFile(filepath.Join(dir, "modules.dep"), []byte(dep), 0o644); err != nil {
		t.Fatal(err)
	}
	got, err := moduleOrder(dir, []string{"9p", "nbd", "netfs"})
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"kernel/fs/netfs/netfs.ko", "kernel/fs/fscache/fscache.ko", "kernel/net/9p/9pnet.ko",
		"kernel/fs/9p/9p.ko", "kernel/drivers/block/nbd.ko"}
	if !slices.Equal(got, want) {
		t.Errorf("moduleOrder = %q, want %q", got, want)
	}
	if _, err := moduleOrder(dir, []string{"overlay"}); err == nil {
		t.Error("moduleOrder of a module modules.dep lacks: no error")
	}
}

func TestShellQuote(t *testing.T) {
	for in, want := range map[string]string{
		"plain":     "'plain'",
		"it's":      `'it'\''s'`,
		"$(reboot)": "'$(reboot)'",
	} {
		if got := shq(in); got != want {
			t.Errorf("shq(%q) = %s, want %s", in, got, want)
		}
	}
}
