package guest

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

const (
	// EnvKernel names the directory of the guest kernel (boot/vmlinuz-<release>
	// and lib/modules/<release>/), as scripts/guest/kernel.sh prints it.
	EnvKernel = "MOUNTMEDIC_GUEST_KERNEL"
	// EnvAccel chooses qemu's accelerator: "tcg" (software emulation, the
	// default: KVM guests do not run on the nested machines here) or "kvm".
	EnvAccel = "MOUNTMEDIC_GUEST_ACCEL"

	// readyMarker is the console line stage two prints just before it starts
	// the command.
	readyMarker = "mountmedic-guest: ready"
)

// Kernel is a guest kernel unpacked from a Debian linux-image package.
type Kernel struct {
	// Dir holds boot/ and lib/modules/.
	Dir string
	// Release is the kernel release, 6.1.0-56-amd64.
	Release string
}

// Vmlinuz is the kernel image.
func (k Kernel) Vmlinuz() string { return filepath.Join(k.Dir, "boot", "vmlinuz-"+k.Release) }

// ModulesDir is lib/modules/<release>.
func (k Kernel) ModulesDir() string { return filepath.Join(k.Dir, "lib", "modules", k.Release) }

// FindKernel finds the guest kernel in $MOUNTMEDIC_GUEST_KERNEL, else in the
// tool cache's guest/current ($MOUNTMEDIC_CACHE, default /var/cache/mountmedic),
// where scripts/guest/kernel.sh puts it.
func FindKernel() (Kernel, error) {
	dir := os.Getenv(EnvKernel)
	if dir == "" {
		cache := os.Getenv("MOUNTMEDIC_CACHE")
		if cache == "" {
			cache = "/var/cache/mountmedic"
		}
		dir = filepath.Join(cache, "guest", "current")
	}
	dir, err := filepath.EvalSymlinks(dir)
	if err != nil {
		return Kernel{}, fmt.Errorf("no guest kernel (%v): run scripts/guest/kernel.sh, or set %s", err, EnvKernel)
	}
	imgs, _ := filepath.Glob(filepath.Join(dir, "boot", "vmlinuz-*"))
	if len(imgs) != 1 {
		return Kernel{}, fmt.Errorf("want one boot/vmlinuz-* in %s, found %d: run scripts/guest/kernel.sh", dir, len(imgs))
	}
	k := Kernel{Dir: dir, Release: strings.TrimPrefix(filepath.Base(imgs[0]), "vmlinuz-")}
	if _, err := os.Stat(filepath.Join(k.ModulesDir(), "modules.dep")); err != nil {
		return Kernel{}, fmt.Errorf("guest kernel %s has no modules.dep: run scripts/guest/kernel.sh", k.Release)
	}
	return k, nil
}

// Command is what runs in the guest, as root, in its initial mount
// namespace, with the guest's /tmp on a fresh ext4 scratch disk and /run and
// /var/tmp on fresh tmpfs.
type Command struct {
	// Args is the program and its arguments; the program is a host path
	// (the guest's root is the host's, read-only under a tmpfs overlay).
	Args []string
	// Env is the whole environment besides PATH and HOME.
	Env []string
	// Dir is the working directory (default /).
	Dir string
	// Modules are loaded with modprobe before the command (nbd, ext4...).
	Modules []string
	// Files are copied into the run directory, which the guest sees at the
	// same path read-write; Args may name them through RunDir.
	Files []string
}

// Config sizes the guest.
type Config struct {
	MemoryMiB int
	CPUs      int
	// Timeout bounds the whole run, boot included.
	Timeout time.Duration
	// Console, when set, receives the serial console as it comes.
	Console io.Writer
	// RunDir is the directory shared with the guest; a new one under
	// os.TempDir() when empty.
	RunDir string
	// Network gives the guest qemu's user-mode network: eth0 is 10.0.2.15
	// and 10.0.2.2 reaches the host's loopback (a Ceph cluster on
	// 127.0.0.1 for rbd-nbd in the guest).
	Network bool
	// ScratchMiB sizes the guest's /tmp, a sparse ext4 image in RunDir
	// (default 4096; only what the guest writes takes host disk).
	ScratchMiB int
}

// Result is what came back from the guest.
type Result struct {
	// Exit is the command's exit status (-1: it never finished).
	Exit int
	// Output is the command's stdout and stderr.
	Output []byte
	// Console is the serial console: the kernel's messages and stage two's.
	Console []byte
	// Boot is from the start of qemu to the command's start.
	Boot time.Duration
	// Took is from the start of qemu to its exit.
	Took time.Duration
	// GuestUptime is the guest's /proc/uptime at the command's start.
	GuestUptime float64
}

// Run boots the kernel under qemu and runs cmd in it. An error means the
// guest did not run the command to its end; a command that fails is a
// Result with a non-zero Exit.
func (k Kernel) Run(ctx context.Context, cfg Config, cmd Command) (*Result, error) {
	if len(cmd.Args) == 0 {
		return nil, errors.New("guest command has no program")
	}
	qemu, err := exec.LookPath("qemu-system-x86_64")
	if err != nil {
		return nil, fmt.Errorf("no qemu-system-x86_64 (Debian qemu-system-x86; scripts/deps.sh installs it): %w", err)
	}
	busybox, err := lookBusybox()
	if err != nil {
		return nil, err
	}
	if cfg.MemoryMiB == 0 {
		cfg.MemoryMiB = 1024
	}
	if cfg.CPUs == 0 {
		cfg.CPUs = 2
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = 10 * time.Minute
	}
	run := cfg.RunDir
	if run == "" {
		if run, err = os.MkdirTemp("", "mountmedic-guest-"); err != nil {
			return nil, err
		}
		defer os.RemoveAll(run)
	}
	if run, err = filepath.EvalSymlinks(run); err != nil {
		return nil, err
	}
	for _, f := range cmd.Files {
		if err := copyFile(f, filepath.Join(run, filepath.Base(f))); err != nil {
			return nil, err
		}
	}
	if cfg.ScratchMiB == 0 {
		cfg.ScratchMiB = 4096
	}
	scratch := filepath.Join(run, "scratch.img")
	if err := makeScratch(scratch, cfg.ScratchMiB); err != nil {
		return nil, err
	}
	initrd := filepath.Join(run, "initramfs.cpio")
	if err := writeInitramfs(initrd, busybox, k.ModulesDir()); err != nil {
		return nil, fmt.Errorf("build the guest initramfs: %w", err)
	}

	ctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	accel := os.Getenv(EnvAccel)
	if accel == "" {
		accel = "tcg"
	}
	args := []string{
		"-accel", accel, "-m", strconv.Itoa(cfg.MemoryMiB), "-smp", strconv.Itoa(cfg.CPUs),
		"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-serial", "stdio", "-monitor", "none",
		"-kernel", k.Vmlinuz(), "-initrd", initrd,
		"-append", "console=ttyS0 panic=-1 loglevel=4 mountmedic.run=" + run,
		"-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
		"-virtfs", "local,path=" + run + ",mount_tag=run,security_model=none,multidevs=remap",
		"-drive", "file=" + scratch + ",if=virtio,format=raw,cache=unsafe",
	}
	if cfg.Network {
		args = append(args, "-netdev", "user,id=n0", "-device", "virtio-net-pci,netdev=n0")
		cmd.Modules = append([]string{"virtio_net"}, cmd.Modules...)
	}
	if accel == "kvm" {
		args = append(args, "-cpu", "max")
	}
	if err := os.WriteFile(filepath.Join(run, "stage2"), []byte(k.stage2(run, cmd, cfg.Network)), 0o755); err != nil {
		return nil, err
	}
	q := exec.CommandContext(ctx, qemu, args...)
	q.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	q.WaitDelay = 5 * time.Second
	stdout, err := q.StdoutPipe()
	if err != nil {
		return nil, err
	}
	var qerr bytes.Buffer
	q.Stderr = &qerr
	res := &Result{Exit: -1}
	start := time.Now()
	if err := q.Start(); err != nil {
		return nil, fmt.Errorf("start qemu: %w", err)
	}
	var console bytes.Buffer
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		sc := bufio.NewScanner(stdout)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			if res.Boot == 0 && strings.HasPrefix(line, readyMarker) {
				res.Boot = time.Since(start)
				res.GuestUptime, _ = strconv.ParseFloat(strings.TrimSpace(strings.TrimPrefix(line, readyMarker+" uptime")), 64)
			}
			console.WriteString(line + "\n")
			if cfg.Console != nil {
				fmt.Fprintf(cfg.Console, "%6.2f %s\n", time.Since(start).Seconds(), line)
			}
		}
	}()
	wg.Wait()
	werr := q.Wait()
	res.Took = time.Since(start)
	res.Console = console.Bytes()
	res.Output, _ = os.ReadFile(filepath.Join(run, "output"))
	raw, rerr := os.ReadFile(filepath.Join(run, "exit"))
	if rerr == nil {
		res.Exit, rerr = strconv.Atoi(strings.TrimSpace(string(raw)))
	}
	switch {
	case ctx.Err() != nil:
		return res, fmt.Errorf("guest run passed its %v deadline (console tail: %s)", cfg.Timeout, tail(res.Console, 2000))
	case werr != nil:
		return res, fmt.Errorf("qemu: %w: %s (console tail: %s)", werr, qerr.Bytes(), tail(res.Console, 2000))
	case rerr != nil:
		return res, fmt.Errorf("the guest never wrote the command's exit status (console tail: %s)", tail(res.Console, 2000))
	}
	return res, nil
}

// stage2 is the script the guest runs in its new root: the mounts a test
// expects, the modules, then the command, its output and its status into the
// run directory, and power-off.
func (k Kernel) stage2(run string, cmd Command, network bool) string {
	var b strings.Builder
	b.WriteString("#!/bin/sh\n")
	b.WriteString("export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root\n")
	b.WriteString("off() { sync; echo o > /proc/sysrq-trigger; sleep 60; }\n")
	// A directory that holds the run directory stays on the overlay.
	fmt.Fprintf(&b, "for d in /run /var/tmp /dev/shm; do case %s/ in $d/*) continue;; esac; mkdir -p $d; mount -t tmpfs -o mode=1777 tmpfs $d; done\n", shq(run))
	b.WriteString("mkdir -p /dev/pts && mount -t devpts devpts /dev/pts\n")
	b.WriteString("mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null\n")
	// modprobe reads /lib/modules/<release> of the root: show it the
	// kernel's own tree.
	fmt.Fprintf(&b, "mkdir -p /lib/modules/%s && mount --bind %s /lib/modules/%s\n",
		k.Release, shq(k.ModulesDir()), k.Release)
	for _, m := range cmd.Modules {
		fmt.Fprintf(&b, "modprobe %s || echo 'guest: modprobe %s failed'\n", shq(m), m)
	}
	b.WriteString("busybox ip link set lo up\n")
	if network {
		b.WriteString("busybox ip addr add 10.0.2.15/24 dev eth0 && busybox ip link set eth0 up && busybox ip route add default via 10.0.2.2\n")
	}
	b.WriteString("hostname guest\n")
	fmt.Fprintf(&b, "echo \"%s uptime $(cut -d' ' -f1 /proc/uptime)\"\n", readyMarker)
	dir := cmd.Dir
	if dir == "" {
		dir = "/"
	}
	fmt.Fprintf(&b, "cd %s || off\n", shq(dir))
	b.WriteString("env -i PATH=\"$PATH\" HOME=/root")
	for _, e := range cmd.Env {
		b.WriteString(" " + shq(e))
	}
	for _, a := range cmd.Args {
		b.WriteString(" " + shq(a))
	}
	fmt.Fprintf(&b, " >%s/output 2>&1 </dev/null\n", shq(run))
	fmt.Fprintf(&b, "echo $? >%s/exit\n", shq(run))
	b.WriteString("off\n")
	return b.String()
}

// makeScratch makes the sparse ext4 image of the guest's /tmp.
func makeScratch(path string, mib int) error {
	mkfs, err := exec.LookPath("mkfs.ext4")
	if err != nil {
		return fmt.Errorf("no mkfs.ext4 for the guest's scratch disk (Debian e2fsprogs): %w", err)
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	err = f.Truncate(int64(mib) << 20)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("size the guest's scratch disk: %w", err)
	}
	if out, err := exec.Command(mkfs, "-q", "-F", "-E", "nodiscard", path).CombinedOutput(); err != nil {
		return fmt.Errorf("mkfs.ext4 the guest's scratch disk: %v: %s", err, out)
	}
	return nil
}

// shq quotes s for sh.
func shq(s string) string {
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

func lookBusybox() (string, error) {
	for _, p := range []string{"/bin/busybox", "/usr/bin/busybox"} {
		if fi, err := os.Stat(p); err == nil && fi.Mode().IsRegular() {
			return p, nil
		}
	}
	return "", errors.New("no static busybox for the guest initramfs (Debian busybox-static; scripts/deps.sh installs it)")
}

func copyFile(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	fi, err := in.Stat()
	if err != nil {
		return err
	}
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, fi.Mode().Perm())
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

func tail(b []byte, n int) string {
	if len(b) > n {
		b = b[len(b)-n:]
	}
	return string(b)
}
