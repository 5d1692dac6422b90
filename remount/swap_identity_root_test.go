package remount

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// swapIdentityLab is a container with a tmpfs of its own at /data (the
// "dead" mount: the swap never asks it anything) and a fresh tmpfs on the
// host at a publish target, the swap's source.
type swapIdentityLab struct {
	k      *lab.Kubelet
	c      *lab.Container
	source string
	data   string // /data as the container's namespace names it from its root mount
}

func newSwapIdentityLab(t *testing.T, name string) *swapIdentityLab {
	t.Helper()
	k := newKubelet(t)
	source := k.PublishPath("dddddddd-2222-3333-4444-555555555555", "pv-"+name)
	if err := unix.Mount("fresh", source, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(source, "f"), "fresh")
	c := lab.StartContainer(t, name, lab.PropagationPrivate, map[string]string{"/data": t.TempDir()}, lab.WithChroot())
	return &swapIdentityLab{k: k, c: c, source: source, data: filepath.Join(c.Root(), "data")}
}

// mountInContainer mounts a tmpfs called name at /data in the container
// and writes a file of that name into it.
func (l *swapIdentityLab) mountInContainer(t *testing.T, name string) {
	t.Helper()
	err := inContainerNamespace(t, l.c.Pid(), func() error {
		if err := unix.Mount(name, l.data, "tmpfs", 0, "size=1m"); err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(l.data, name), []byte(name), 0o644)
	})
	if err != nil {
		t.Fatalf("mount %s in the container: %v", name, err)
	}
}

func (l *swapIdentityLab) unmountInContainer(t *testing.T) {
	t.Helper()
	if err := inContainerNamespace(t, l.c.Pid(), func() error { return unix.Unmount(l.data, unix.MNT_DETACH) }); err != nil {
		t.Fatalf("unmount /data in the container: %v", err)
	}
}

// top is the mountinfo ID and unique ID of the mount on top at /data in
// the container.
func (l *swapIdentityLab) top(t *testing.T) (int, uint64) {
	t.Helper()
	fd, err := unix.Open(l.c.Path("/data"), unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	id, unique, err := fdMountIDs(fd)
	if err != nil {
		t.Fatal(err)
	}
	return id, unique
}

func (l *swapIdentityLab) plan(t *testing.T) swapTarget {
	t.Helper()
	targets, err := planSwap("", []int{l.c.Pid()}, []probe.Dev{devOf(t, l.c.Path("/data"))}, "/", l.source)
	if err != nil || len(targets) != 1 {
		t.Fatalf("planSwap = %+v, %v; want the container's /data", targets, err)
	}
	return targets[0]
}

// TestSwapRefusesReusedMountID: the hostile actor is the container's root
// (or any mount in the node's other namespaces, which share the ID space):
// after the swap was planned, the dead mount goes and a fresh mount comes at
// the same container path, and the kernel gives it the freed mount's ID
// (and device number). The swap names the dead mount by its unique ID and
// leaves the fresh one alone; by the mountinfo ID alone it would detach it.
func TestSwapRefusesReusedMountID(t *testing.T) {
	lab.RequireRoot(t)
	l := newSwapIdentityLab(t, "reuse")
	const tries = 20
	for range tries {
		l.mountInContainer(t, "dead")
		target := l.plan(t)
		if _, unique := l.top(t); unique == 0 {
			t.Skipf("kernel %s: no unique mount IDs (Linux 6.8): the swap checks the mountinfo ID only", kernelRelease())
		}
		if target.UniqueID == 0 {
			t.Fatalf("planSwap = %+v: want the dead mount's unique ID pinned", target)
		}
		l.unmountInContainer(t)
		l.mountInContainer(t, "mine")
		if id, _ := l.top(t); id != target.MountID {
			// Another mount on the node took the freed ID: try again.
			l.unmountInContainer(t)
			continue
		}
		acts, err := (&swapper{Root: l.k.Root()}).Swap(context.Background(), []swapTarget{target})
		if !errors.Is(err, ErrMountChanged) {
			t.Errorf("Swap over a fresh mount with the freed mount's ID %d = %v, %v; want ErrMountChanged", target.MountID, acts, err)
		}
		wantFile(t, l.c.Path("/data/mine"), "mine")
		return
	}
	t.Fatalf("no fresh mount got the freed mount's ID in %d tries: nothing reused to refuse", tries)
}

// TestSwapRechecksBeforeDetach: between the swap's check and its detach
// of the dead mount (after the clone went beneath it), a mount comes on top
// at the container path. The swap looks again before the detach and
// leaves that mount in place.
func TestSwapRechecksBeforeDetach(t *testing.T) {
	lab.RequireRoot(t)
	l := newSwapIdentityLab(t, "recheck")
	l.mountInContainer(t, "dead")
	target := l.plan(t)
	h := hostSyscalls()
	var beneath bool
	sys := Syscalls{MoveMount: func(fromDirfd int, fromPath string, toDirfd int, toPath string, flags int) error {
		if err := h.MoveMount(fromDirfd, fromPath, toDirfd, toPath, flags); err != nil || flags&moveMountBeneath == 0 {
			return err
		}
		// On the swap's thread, in the container's namespace.
		beneath = true
		if err := unix.Mount("late", l.data, "tmpfs", 0, "size=1m"); err != nil {
			return err
		}
		return os.WriteFile(filepath.Join(l.data, "late"), []byte("late"), 0o644)
	}}
	acts, err := (&swapper{Root: l.k.Root(), Sys: sys}).Swap(context.Background(), []swapTarget{target})
	if !beneath {
		t.Fatalf("Swap = %v, %v: the kernel did not mount beneath, the step this test checks", acts, err)
	}
	if !errors.Is(err, ErrMountChanged) {
		t.Errorf("Swap with a mount come on top before the detach = %v, %v; want ErrMountChanged", acts, err)
	}
	wantFile(t, l.c.Path("/data/late"), "late")
}
