package guest

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
)

// bootModules are the modules the initramfs loads to mount the host's root
// over 9p, lay a tmpfs overlay on it and mount the scratch disk (ext4 on
// virtio-blk); their dependencies come from modules.dep, and crc32c is
// ext4's soft dependency (modules.softdep), which insmod does not follow.
var bootModules = []string{"virtio_pci", "9pnet_virtio", "9p", "overlay", "virtio_blk", "crc32c_generic", "ext4"}

// moduleOrder returns the files (relative to lib/modules/<release>) of the
// named modules and of everything they depend on, each after its
// dependencies, as modules.dep lists them.
func moduleOrder(modDir string, names []string) ([]string, error) {
	f, err := os.Open(filepath.Join(modDir, "modules.dep"))
	if err != nil {
		return nil, fmt.Errorf("read the module dependencies (run depmod, or scripts/guest/kernel.sh): %w", err)
	}
	defer f.Close()
	deps := map[string][]string{}
	byName := map[string]string{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		file, rest, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		deps[file] = strings.Fields(rest)
		byName[moduleName(file)] = file
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read modules.dep: %w", err)
	}
	var order []string
	seen := map[string]bool{}
	var visit func(file string)
	visit = func(file string) {
		if seen[file] {
			return
		}
		seen[file] = true
		// modules.dep lists a module's dependencies nearest first; load the
		// farthest first.
		d := deps[file]
		for i := len(d) - 1; i >= 0; i-- {
			visit(d[i])
		}
		order = append(order, file)
	}
	for _, n := range names {
		file, ok := byName[strings.ReplaceAll(n, "-", "_")]
		if !ok {
			return nil, fmt.Errorf("module %s is not in %s/modules.dep (built in, or not built)", n, modDir)
		}
		visit(file)
	}
	return order, nil
}

// moduleName is the name of a module file: kernel/fs/9p/9p.ko -> 9p.
func moduleName(file string) string {
	base := filepath.Base(file)
	if i := strings.Index(base, ".ko"); i >= 0 {
		base = base[:i]
	}
	return strings.ReplaceAll(base, "-", "_")
}

// cpioWriter writes a cpio archive in the "newc" format the kernel unpacks
// as an initramfs.
type cpioWriter struct {
	w   io.Writer
	ino int
	err error
}

func (c *cpioWriter) header(name string, mode uint32, size int) {
	if c.err != nil {
		return
	}
	c.ino++
	hdr := fmt.Sprintf("070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X",
		c.ino, mode, 0, 0, 1, 0, size, 0, 0, 0, 0, len(name)+1, 0)
	c.write([]byte(hdr + name + "\x00"))
	c.pad(len(hdr) + len(name) + 1)
}

func (c *cpioWriter) write(b []byte) {
	if c.err == nil {
		_, c.err = c.w.Write(b)
	}
}

func (c *cpioWriter) pad(n int) {
	if r := n % 4; r != 0 {
		c.write(make([]byte, 4-r))
	}
}

func (c *cpioWriter) dir(name string) { c.header(name, 0o40755, 0) }

func (c *cpioWriter) file(name string, mode uint32, data []byte) {
	c.header(name, 0o100000|mode, len(data))
	c.write(data)
	c.pad(len(data))
}

func (c *cpioWriter) symlink(name, target string) {
	c.header(name, 0o120777, len(target))
	c.write([]byte(target))
	c.pad(len(target))
}

func (c *cpioWriter) close() error {
	c.header("TRAILER!!!", 0, 0)
	return c.err
}

// initScript is the initramfs's /init: it loads the boot modules, mounts the
// host's root read-only over 9p under a tmpfs overlay, the scratch disk at
// /tmp and the run directory read-write at its host path, and switches to the
// new root to run the stage-two script there. The scratch disk is ext4
// because tests need what tmpfs lacks on 6.1 (user xattrs: versitygw
// refuses a directory without them).
const initScript = `#!/bin/busybox sh
/bin/busybox --install -s /bin
mkdir -p /proc /sys /dev /host /rw /newroot
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
for m in $(cat /modules); do insmod /lib/modules/$m || echo "guest: insmod $m failed"; done
run=$(sed -n 's/.*mountmedic.run=\([^ ]*\).*/\1/p' /proc/cmdline)
fail() { echo "guest: $*"; echo o > /proc/sysrq-trigger; sleep 60; }
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=524288 hostroot /host || fail "mount the host root"
mount -t tmpfs -o mode=0755 tmpfs /rw
mkdir -p /rw/upper /rw/work
mount -t overlay overlay -o lowerdir=/host,upperdir=/rw/upper,workdir=/rw/work /newroot || fail "mount the overlay"
mount -t ext4 /dev/vda /newroot/tmp || fail "mount the scratch disk"
chmod 1777 /newroot/tmp
mkdir -p /newroot$run
mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288 run /newroot$run || fail "mount the run directory"
for d in proc sys dev; do mount --move /$d /newroot/$d; done
exec switch_root /newroot /bin/sh $run/stage2
`

// writeInitramfs writes the initramfs: busybox, the boot modules of the
// kernel in modDir, and /init.
func writeInitramfs(path, busybox, modDir string) error {
	order, err := moduleOrder(modDir, bootModules)
	if err != nil {
		return err
	}
	bb, err := os.ReadFile(busybox)
	if err != nil {
		return fmt.Errorf("read busybox (Debian busybox-static): %w", err)
	}
	var buf bytes.Buffer
	c := &cpioWriter{w: &buf}
	for _, d := range []string{"bin", "lib", "lib/modules"} {
		c.dir(d)
	}
	c.file("bin/busybox", 0o755, bb)
	c.symlink("bin/sh", "busybox")
	made := map[string]bool{}
	for _, m := range order {
		parts := strings.Split(filepath.Dir(m), "/")
		for i := range parts {
			d := "lib/modules/" + strings.Join(parts[:i+1], "/")
			if !made[d] {
				made[d] = true
				c.dir(d)
			}
		}
		data, err := os.ReadFile(filepath.Join(modDir, m))
		if err != nil {
			return fmt.Errorf("read module: %w", err)
		}
		c.file("lib/modules/"+m, 0o644, data)
	}
	c.file("modules", 0o644, []byte(strings.Join(order, "\n")+"\n"))
	c.file("init", 0o755, []byte(initScript))
	if err := c.close(); err != nil {
		return err
	}
	return os.WriteFile(path, buf.Bytes(), 0o644)
}
