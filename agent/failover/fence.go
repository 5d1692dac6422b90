package failover

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/remount"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// ContainerStopper stops the running containers of pods on this node.
// NodeFence implements it through the CRI.
type ContainerStopper interface {
	// StopPodContainers stops every running container of the pods with
	// UIDs podUIDs, each with grace after SIGTERM. Result i says how many
	// containers of pod podUIDs[i] it stopped and what failed.
	StopPodContainers(ctx context.Context, podUIDs []string, grace time.Duration) []PodResult
}

// VolumeUnmounter lazily unmounts pods' volume mounts on this node.
// NodeFence implements it with the host mount table and remount.Unmounter.
type VolumeUnmounter interface {
	// UnmountPodVolumes lazily unmounts the CSI publish targets of the pods
	// with UIDs podUIDs, their subPath binds of them and their raw block
	// paths. Result i says how many mounts of pod podUIDs[i] it took off
	// and what failed.
	UnmountPodVolumes(ctx context.Context, podUIDs []string) []PodResult
	// MountedPods lists the UIDs of the pods with CSI volume mounts on this
	// node: the fence's targets when the API server was never reached.
	MountedPods(ctx context.Context) ([]string, error)
}

// PodResult is what one step of a fence did to one pod: how many
// containers it stopped or mounts it took off, and what failed.
type PodResult struct {
	N   int
	Err error
}

// allFailed is the result of a step that failed for every pod.
func allFailed(podUIDs []string, err error) []PodResult {
	out := make([]PodResult, len(podUIDs))
	for i := range out {
		out[i].Err = err
	}
	return out
}

// NodeFence is the real fence: containers stopped through the container
// runtime's CRI socket, volumes unmounted lazily (umount2 MNT_DETACH on
// safe paths beneath the kubelet root, never a stat of a dead mount) in the
// agent's mount namespace, whatever namespace HostTable describes.
type NodeFence struct {
	// CRIEndpoint is the runtime's socket (unix:///run/containerd/containerd.sock).
	CRIEndpoint string
	// KubeletRoot is kubelet's --root-dir.
	KubeletRoot string
	// HostTable is the mount table to read (/proc/1/mountinfo with hostPID):
	// which pods have which mounts. It may be another mount namespace's
	// than ours; the unmounts must reach it by propagation.
	HostTable string
	// DryRun plans and reports without stopping or unmounting.
	DryRun bool
	// Guard mounts mountmedic's guard (remount.Guarder) over each publish
	// target the fence unmounted: kubelet starts the stopped containers
	// again, and they must fail on the guard rather than write to the
	// node's disk. The pod's teardown (the driver's NodeUnpublishVolume)
	// takes it away.
	Guard bool
	// CRITimeout bounds each CRI call; remount.DefaultCRITimeout when zero.
	CRITimeout time.Duration
}

// StopPodContainers dials the CRI socket once (a fence is rare; the
// runtime may have restarted since the last one) and stops the pods'
// running containers. A container that is gone by then counts as stopped.
func (f *NodeFence) StopPodContainers(ctx context.Context, podUIDs []string, grace time.Duration) []PodResult {
	if len(podUIDs) == 0 {
		return nil
	}
	cri, err := remount.DialCRI(ctx, f.CRIEndpoint, remount.CRIOptions{Timeout: f.CRITimeout})
	if err != nil {
		return allFailed(podUIDs, fmt.Errorf("fence pods: %w", err))
	}
	defer cri.Close()
	// All at once: each stop may take the whole grace period, and the
	// fence must end within the controller's margin.
	out := make([]PodResult, len(podUIDs))
	var wg sync.WaitGroup
	for i, uid := range podUIDs {
		wg.Go(func() { out[i] = f.stopPod(ctx, cri, uid, grace) })
	}
	wg.Wait()
	return out
}

// stopPod stops the pod's running containers (remount.Restarter, which
// stops them all at once and counts one gone already as stopped).
func (f *NodeFence) stopPod(ctx context.Context, cri *remount.CRIClient, podUID string, grace time.Duration) PodResult {
	r := &remount.Restarter{CRI: cri, Grace: grace, DryRun: f.DryRun}
	stopped, _, err := r.Restart(ctx, podUID)
	if err != nil {
		err = fmt.Errorf("fence pod %s: %w", podUID, err)
	}
	return PodResult{N: len(stopped), Err: err}
}

// podMounts picks from inv the mounts a fence unmounts for each pod of
// podUIDs: CSI publish targets, subPath binds on one of their filesystems,
// raw block paths.
func podMounts(inv *probe.Inventory, podUIDs []string) map[string][]*probe.Mount {
	out := make(map[string][]*probe.Mount, len(podUIDs))
	for _, uid := range podUIDs {
		out[uid] = nil
	}
	type podDev struct {
		uid string
		dev probe.Dev
	}
	published := make(map[podDev]bool)
	for _, m := range inv.Mounts {
		mounts, ok := out[m.Target.PodUID]
		if !ok {
			continue
		}
		switch {
		case m.Guard:
			// The guard a fence left: never unmounted by a fence.
		case m.Target.Kind == kubelet.KindPublish && m.Target.Plugin == kubelet.CSIPluginDir:
			out[m.Target.PodUID] = append(mounts, m)
			published[podDev{m.Target.PodUID, m.Dev}] = true
		case m.Target.Kind == kubelet.KindBlock:
			out[m.Target.PodUID] = append(mounts, m)
		}
	}
	for _, m := range inv.Mounts {
		if m.Target.Kind == kubelet.KindSubPath && published[podDev{m.Target.PodUID, m.Dev}] {
			out[m.Target.PodUID] = append(out[m.Target.PodUID], m)
		}
	}
	return out
}

// inventory reads the volume mounts of the pods podUIDs (of every pod when
// nil): per path in our mount namespace where the kernel allows it
// (remount.Unmounter.PodMounts, whose cost is the pods' paths and never
// the node's mount count), else from HostTable.
func (f *NodeFence) inventory(podUIDs []string) (*probe.Inventory, error) {
	if u := f.unmounter(); f.hostRoot() != "" && u.PerPath() {
		ms, err := u.PodMounts(podUIDs)
		if err != nil {
			return nil, fmt.Errorf("read the pods' volume mounts below %s: %w", f.KubeletRoot, err)
		}
		return &probe.Inventory{Mounts: ms}, nil
	}
	inv, err := probe.ReadFile(f.HostTable, probe.Options{Root: f.KubeletRoot})
	if err != nil {
		return nil, fmt.Errorf("read mount table %s: %w", f.HostTable, err)
	}
	return inv, nil
}

// UnmountPodVolumes finds each pod's CSI mounts (inventory: per path, or
// from the mount table once) and lazily unmounts them, deepest first, each
// only while it is still the mount found. The table may be another mount
// namespace's (the DaemonSet's /proc/1/mountinfo): its mounts are matched
// in our own namespace by path, device and root, never by mount ID
// (remount.Unmounter.UnmountFromTable); per path, a path where that
// namespace shows another mount than ours is left alone (agreeing). That
// namespace is looked at again afterwards: a pod's mount still there is an
// error (our unmounts do not reach that namespace), not a fence done. The
// staging mount stays: other pods on the node may share it, and no process
// of a fenced pod reaches it any more.
func (f *NodeFence) UnmountPodVolumes(ctx context.Context, podUIDs []string) []PodResult {
	if len(podUIDs) == 0 {
		return nil
	}
	inv, err := f.inventory(podUIDs)
	if err != nil {
		return allFailed(podUIDs, err)
	}
	byPod := podMounts(inv, podUIDs)
	u := f.unmounter()
	out := make([]PodResult, len(podUIDs))
	for i, uid := range podUIDs {
		mounts, err := f.agreeing(u, uid, byPod[uid])
		if err != nil {
			out[i].Err = fmt.Errorf("unmount volumes of pod %s: %w", uid, err)
		}
		if len(mounts) == 0 {
			continue
		}
		actions, err := u.UnmountFromTable(ctx, mounts)
		out[i].N = remount.Unmounted(actions)
		if err != nil {
			out[i].Err = errors.Join(out[i].Err, fmt.Errorf("unmount volumes of pod %s: %w", uid, err))
			continue
		}
		f.guard(ctx, uid, mounts)
	}
	if f.DryRun {
		return out
	}
	f.checkGone(byPod, podUIDs, out)
	return out
}

// guard mounts the guard over the pod's CSI publish targets the fence
// unmounted. A target that is a mount point again (another mount was below
// the one unmounted) is left as it is; a failure is logged: the fence
// stands without it.
func (f *NodeFence) guard(ctx context.Context, uid string, unmounted []*probe.Mount) {
	if !f.Guard {
		return
	}
	g := &remount.Guarder{Root: f.KubeletRoot, DryRun: f.DryRun}
	for _, m := range unmounted {
		if m.Target.Kind != kubelet.KindPublish || m.Target.Plugin != kubelet.CSIPluginDir {
			continue
		}
		if a := g.Guard(ctx, m.Path); a.Err != nil && !errors.Is(a.Err, remount.ErrMountChanged) {
			klog.FromContext(ctx).Error(a.Err, "Fence: guarding an unmounted publish target failed: a container kubelet starts again may write to the node's disk", "podUID", uid, "path", m.Path)
		}
	}
}

// checkGone looks at HostTable's namespace again (per path: checkGoneAt;
// else its whole table) and fails each pod whose unmounts went through but
// whose mounts it still shows (same path, device and root).
func (f *NodeFence) checkGone(byPod map[string][]*probe.Mount, podUIDs []string, out []PodResult) {
	if f.unmounter().PerPath() && f.hostRoot() != "" {
		f.checkGoneAt(byPod, podUIDs, out)
		return
	}
	after, err := f.inventory(nil)
	if err != nil {
		for i, uid := range podUIDs {
			if out[i].Err == nil && len(byPod[uid]) > 0 {
				out[i].Err = fmt.Errorf("check the unmounts of pod %s: %w", uid, err)
			}
		}
		return
	}
	type place struct {
		path string
		dev  probe.Dev
		root string
	}
	left := make(map[place]bool, len(after.Mounts))
	for _, m := range after.Mounts {
		left[place{m.Path, m.Dev, m.Root}] = true
	}
	for i, uid := range podUIDs {
		if out[i].Err != nil {
			continue
		}
		for _, m := range byPod[uid] {
			if left[place{m.Path, m.Dev, m.Root}] {
				out[i].Err = fmt.Errorf("pod %s: %s is still mounted in %s after its unmount: our unmounts do not reach that mount namespace (is the kubelet root mounted with Bidirectional propagation?)", uid, m.Path, f.HostTable)
				break
			}
		}
	}
}

// MountedPods lists the pods with CSI publish targets or raw block paths
// mounted.
func (f *NodeFence) MountedPods(context.Context) ([]string, error) {
	inv, err := f.inventory(nil)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, m := range inv.Mounts {
		csi := m.Target.Kind == kubelet.KindPublish && m.Target.Plugin == kubelet.CSIPluginDir && !m.Guard
		if (csi || m.Target.Kind == kubelet.KindBlock) && m.Target.PodUID != "" && !slices.Contains(out, m.Target.PodUID) {
			out = append(out, m.Target.PodUID)
		}
	}
	return out, nil
}
