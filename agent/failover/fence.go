package failover

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/remount"
)

// ContainerStopper stops the running containers of a pod on this node.
// NodeFence implements it through the CRI.
type ContainerStopper interface {
	// StopPodContainers stops every running container of the pod with UID
	// podUID, each with grace after SIGTERM, and says how many it stopped.
	StopPodContainers(ctx context.Context, podUID string, grace time.Duration) (int, error)
}

// VolumeUnmounter lazily unmounts a pod's volume mounts on this node.
// NodeFence implements it with the host mount table and remount.Unmounter.
type VolumeUnmounter interface {
	// UnmountPodVolumes lazily unmounts the pod's CSI publish targets, its
	// subPath binds of them and its raw block paths, and says how many.
	UnmountPodVolumes(ctx context.Context, podUID string) (int, error)
	// MountedPods lists the UIDs of the pods with CSI volume mounts on this
	// node: the fence's targets when the API server was never reached.
	MountedPods(ctx context.Context) ([]string, error)
}

// NodeFence is the real fence: containers stopped through the container
// runtime's CRI socket, volumes unmounted lazily (umount2 MNT_DETACH on
// safe paths beneath the kubelet root, never a stat of a dead mount).
type NodeFence struct {
	// CRIEndpoint is the runtime's socket (unix:///run/containerd/containerd.sock).
	CRIEndpoint string
	// KubeletRoot is kubelet's --root-dir.
	KubeletRoot string
	// HostTable is the mount table to read (/proc/1/mountinfo with hostPID).
	HostTable string
	// DryRun plans and reports without stopping or unmounting.
	DryRun bool
	// CRITimeout bounds each CRI call; remount.DefaultCRITimeout when zero.
	CRITimeout time.Duration
}

// StopPodContainers dials the CRI socket (a fence is rare; the runtime may
// have restarted since the last one) and stops the pod's running
// containers. A container that is gone by then counts as stopped.
func (f *NodeFence) StopPodContainers(ctx context.Context, podUID string, grace time.Duration) (int, error) {
	cri, err := remount.DialCRI(ctx, f.CRIEndpoint, remount.CRIOptions{Timeout: f.CRITimeout})
	if err != nil {
		return 0, fmt.Errorf("fence pod %s: %w", podUID, err)
	}
	defer cri.Close()
	ctrs, err := cri.PodContainers(ctx, podUID)
	if err != nil {
		return 0, fmt.Errorf("fence pod %s: %w", podUID, err)
	}
	if f.DryRun {
		return len(ctrs), nil
	}
	// All at once: each stop may take the whole grace period, and the
	// fence must end within the controller's margin.
	var mu sync.Mutex
	var wg sync.WaitGroup
	var errs []error
	n := 0
	for _, ct := range ctrs {
		wg.Go(func() {
			err := cri.StopContainer(ctx, ct.ID, grace)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case err == nil || status.Code(err) == codes.NotFound:
				n++
			default:
				errs = append(errs, fmt.Errorf("stop container %s (%s) of pod %s: %w", ct.Name, ct.ID, podUID, err))
			}
		})
	}
	wg.Wait()
	return n, errors.Join(errs...)
}

// podMounts picks from inv the mounts a fence unmounts for pod podUID: CSI
// publish targets, subPath binds on one of their filesystems, raw block
// paths.
func podMounts(inv *probe.Inventory, podUID string) []*probe.Mount {
	var devs []probe.Dev
	var out []*probe.Mount
	for _, m := range inv.Mounts {
		if m.Target.PodUID != podUID {
			continue
		}
		switch {
		case m.Target.Kind == probe.KindPublish && m.Target.Plugin == probe.CSIPluginDir:
			out = append(out, m)
			devs = append(devs, m.Dev)
		case m.Target.Kind == probe.KindBlock:
			out = append(out, m)
		}
	}
	for _, m := range inv.Mounts {
		if m.Target.PodUID == podUID && m.Target.Kind == probe.KindSubPath && slices.Contains(devs, m.Dev) {
			out = append(out, m)
		}
	}
	return out
}

func (f *NodeFence) inventory() (*probe.Inventory, error) {
	inv, err := probe.ReadFile(f.HostTable, probe.Options{Root: f.KubeletRoot})
	if err != nil {
		return nil, fmt.Errorf("read mount table %s: %w", f.HostTable, err)
	}
	return inv, nil
}

// UnmountPodVolumes lazily unmounts the pod's CSI mounts, deepest first,
// each only while it is still the mount the table named. The staging mount
// stays: other pods on the node may share it, and no process of a fenced
// pod reaches it any more.
func (f *NodeFence) UnmountPodVolumes(ctx context.Context, podUID string) (int, error) {
	inv, err := f.inventory()
	if err != nil {
		return 0, err
	}
	mounts := podMounts(inv, podUID)
	if len(mounts) == 0 {
		return 0, nil
	}
	u := &remount.Unmounter{Root: f.KubeletRoot, DryRun: f.DryRun}
	actions, err := u.UnmountMounts(ctx, mounts)
	n := 0
	for _, a := range actions {
		// Detail is "mount <id>" for a mount taken off (or, in a dry
		// run, that would be), with a suffix when it was gone already.
		if a.Err == nil && a.Op == remount.OpUnmount && strings.HasPrefix(a.Detail, "mount ") && !strings.HasSuffix(a.Detail, "not mounted") {
			n++
		}
	}
	if err != nil {
		return n, fmt.Errorf("unmount volumes of pod %s: %w", podUID, err)
	}
	return n, nil
}

// MountedPods lists the pods with CSI publish targets or raw block paths
// mounted.
func (f *NodeFence) MountedPods(context.Context) ([]string, error) {
	inv, err := f.inventory()
	if err != nil {
		return nil, err
	}
	var out []string
	for _, m := range inv.Mounts {
		csi := m.Target.Kind == probe.KindPublish && m.Target.Plugin == probe.CSIPluginDir
		if (csi || m.Target.Kind == probe.KindBlock) && m.Target.PodUID != "" && !slices.Contains(out, m.Target.PodUID) {
			out = append(out, m.Target.PodUID)
		}
	}
	return out, nil
}
