package lab

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// Propagation modes of a lab container's mount tree.
const (
	// PropagationPrivate is the default of a container runtime (a volume
	// mount with mountPropagation None): nothing mounted on the host later
	// reaches the container.
	PropagationPrivate = "private"
	// PropagationSlave is mountPropagation HostToContainer: mounts made
	// later under a shared host mount (the kubelet root) reach the
	// container.
	PropagationSlave = "slave"
)

// Container is a stand-in for a running container: a process in its own
// mount namespace that bind-mounted host paths into a root directory at its
// start, as a runtime does, and then sleeps until killed.
type Container struct {
	t      testing.TB
	name   string
	root   string
	chroot bool
	d      *daemon
}

// ContainerOption changes how StartContainer sets up a container.
type ContainerOption func(*containerConfig)

// WithContainerDir puts the container root directory under dir instead of
// t.TempDir().
func WithContainerDir(dir string) ContainerOption {
	return func(c *containerConfig) { c.Root = filepath.Join(dir, c.Name) }
}

// WithChroot makes the container chroot into its root directory once its
// binds are made, as a runtime pivots into the rootfs: /proc/<pid>/root is
// then the container root and its mountinfo shows container paths ("/data"),
// only the mounts below its root.
func WithChroot() ContainerOption {
	return func(c *containerConfig) { c.Chroot = true }
}

// WithReadOnly makes the container's binds at these container paths
// read-only, as a runtime does for a volumeMount with readOnly: true.
func WithReadOnly(containerPaths ...string) ContainerOption {
	return func(c *containerConfig) {
		for _, p := range containerPaths {
			c.ReadOnly = append(c.ReadOnly, filepath.Clean(p))
		}
	}
}

// WithPodCgroup puts the container's process into a cgroup named the way
// kubelet's cgroupfs driver names a pod container's cgroup,
// .../kubepods/besteffort/pod<podUID>/<containerID>, below a directory of
// its own in the cgroup v2 hierarchy (v1 where there is none). Cleanup
// removes the directories.
func WithPodCgroup(podUID, containerID string) ContainerOption {
	return func(c *containerConfig) { c.podUID, c.containerID = podUID, containerID }
}

type containerConfig struct {
	Name        string
	Root        string
	Propagation string
	Binds       []containerBind
	Chroot      bool
	ReadOnly    []string

	// Not sent to the daemon: the parent moves it into the cgroup.
	podUID, containerID string
}

type containerBind struct {
	ContainerPath string
	HostPath      string
}

// StartContainer starts a container called name. Its process gets a new mount
// namespace, applies propagation ("private" or "slave") to its whole tree,
// then bind-mounts (recursively) each host path of binds at root+container
// path, creating a directory or a file as the host path is one. Cleanup kills
// it.
func StartContainer(t testing.TB, name, propagation string, binds map[string]string, opts ...ContainerOption) *Container {
	t.Helper()
	if propagation != PropagationPrivate && propagation != PropagationSlave {
		t.Fatalf("container %s: propagation %q: want %q or %q", name, propagation, PropagationPrivate, PropagationSlave)
	}
	cfg := containerConfig{Name: name, Propagation: propagation}
	cfg.Root = filepath.Join(t.TempDir(), name)
	for _, o := range opts {
		o(&cfg)
	}
	for ctr, host := range binds {
		if !filepath.IsAbs(ctr) {
			t.Fatalf("container %s: path %q must be absolute", name, ctr)
		}
		cfg.Binds = append(cfg.Binds, containerBind{ContainerPath: filepath.Clean(ctr), HostPath: host})
	}
	// Parents before children, as a runtime orders mounts.
	sort.Slice(cfg.Binds, func(i, j int) bool { return cfg.Binds[i].ContainerPath < cfg.Binds[j].ContainerPath })
	if err := os.MkdirAll(cfg.Root, 0o755); err != nil {
		t.Fatalf("create container root: %v", err)
	}
	root, err := filepath.EvalSymlinks(cfg.Root)
	if err != nil {
		t.Fatalf("resolve container root: %v", err)
	}
	cfg.Root = root

	// CLONE_NEWNS at clone, not Unshareflags: Go would make the child's tree
	// private before exec, and slave propagation would then have no master.
	d, err := startDaemon(roleContainer, cfg, syscall.CLONE_NEWNS)
	if err != nil {
		t.Fatalf("start container %s: %v", name, err)
	}
	c := &Container{t: t, name: name, root: root, chroot: cfg.Chroot, d: d}
	var cg *podCgroup
	if cfg.podUID != "" {
		if cg, err = joinPodCgroup(d.pid(), cfg.podUID, cfg.containerID); err != nil {
			d.kill()
			t.Fatalf("container %s: %v", name, err)
		}
	}
	t.Cleanup(func() {
		c.d.kill()
		if cg != nil {
			if err := cg.remove(); err != nil {
				t.Errorf("container %s: %v", name, err)
			}
		}
		if t.Failed() {
			if out := c.d.output.String(); out != "" {
				t.Logf("container %s output:\n%s", name, out)
			}
		}
	})
	return c
}

// Pid is the process id of the container.
func (c *Container) Pid() int { return c.d.pid() }

// Root is the container's root directory, a host path.
func (c *Container) Root() string { return c.root }

// Path is containerPath as the container sees it:
// /proc/<pid>/root/<root>/<containerPath>, or /proc/<pid>/root/<containerPath>
// for a container made WithChroot. The walk through /proc/<pid>/root
// resolves mounts in the container's mount namespace.
func (c *Container) Path(containerPath string) string {
	if c.chroot {
		return filepath.Join("/proc", strconv.Itoa(c.Pid()), "root", containerPath)
	}
	return filepath.Join("/proc", strconv.Itoa(c.Pid()), "root", c.root, containerPath)
}

// MountNS is the path of the container's mount namespace file, for setns.
func (c *Container) MountNS() string {
	return filepath.Join("/proc", strconv.Itoa(c.Pid()), "ns", "mnt")
}

// Kill sends SIGKILL to the container and waits until it is reaped; its
// mount namespace goes with it.
func (c *Container) Kill() { c.d.kill() }

// runContainerDaemon sets up the container's mounts in the mount namespace
// it was cloned into and sleeps until it is killed.
func runContainerDaemon(cfg containerConfig, ready *readiness) error {
	var flags uintptr = unix.MS_REC | unix.MS_PRIVATE
	if cfg.Propagation == PropagationSlave {
		flags = unix.MS_REC | unix.MS_SLAVE
	}
	if err := unix.Mount("", "/", "", flags, ""); err != nil {
		return fmt.Errorf("make mount tree %s: %w", cfg.Propagation, err)
	}
	for _, b := range cfg.Binds {
		target := filepath.Join(cfg.Root, b.ContainerPath)
		if err := makeMountTarget(b.HostPath, target); err != nil {
			return fmt.Errorf("bind %s: %w", b.ContainerPath, err)
		}
		if err := unix.Mount(b.HostPath, target, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("bind %s at %s: %w", b.HostPath, b.ContainerPath, err)
		}
		if slices.Contains(cfg.ReadOnly, b.ContainerPath) {
			if err := unix.Mount("", target, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
				return fmt.Errorf("make %s read-only: %w", b.ContainerPath, err)
			}
		}
	}
	if cfg.Chroot {
		if err := unix.Chroot(cfg.Root); err != nil {
			return fmt.Errorf("chroot into %s: %w", cfg.Root, err)
		}
		if err := unix.Chdir("/"); err != nil {
			return fmt.Errorf("chdir into the new root: %w", err)
		}
	}
	ready.ok()
	for {
		time.Sleep(time.Hour)
	}
}
