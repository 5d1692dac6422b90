// Package guest boots Debian's own kernel (linux-image-amd64, 6.1 on
// bookworm) under qemu and runs a command, typically a Go test binary built
// on the host with `go test -c`, inside it: the lab for what the host kernel
// cannot show (NBD: the host kernel has no nbd driver) and for the root
// tests on an LTS kernel that nodes run.
//
// The guest's root is the host's /, shared read-only over 9p (virtio) under
// a tmpfs overlay, so every host program and test binary is there at its own
// path and every write stays in the guest's memory. A run directory is shared
// read-write at its host path: the command's output and exit status come
// back through it, the kernel's messages through the serial console. The
// initramfs (busybox-static and the 9p, virtio and overlay modules in
// modules.dep order) is written for each run; modprobe in the guest sees the
// kernel's own lib/modules.
//
// The kernel comes from the tool cache, where scripts/guest/kernel.sh unpacks
// the Debian package (keyed by package and version). qemu runs with software
// emulation (TCG) unless MOUNTMEDIC_GUEST_ACCEL says kvm: /dev/kvm exists on
// the machines here but a KVM guest hangs in its firmware. The guest's CPU is
// then several times slower than the host's: keep what runs inside small.
//
// This package is test support; its tests build the guest-only tests
// (build tag guest) and run them inside.
package guest
