package remount

import (
	"slices"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// Volume is one broken CSI volume on this node, as the agent resolved it:
// the staging mount shared by its pods and, per pod, the publish request
// kubelet would send, the pod's dead binds and its running containers.
type Volume struct {
	Driver       string
	VolumeHandle string
	// Stage is the request for NodeStageVolume (any pod's VolumeRequest:
	// the stage part does not depend on the pod).
	Stage kubelet.VolumeRequest
	// Backend is the dead filesystem (its FUSE connection is aborted first
	// when Hung is set).
	Backend *probe.Backend
	// Hung: the Repairer's prober found Backend Hung. While that probe is
	// still blocked in the daemon (Prober.Stuck), it holds the hung
	// filesystem, so no other filesystem can have the backend's device
	// number. Once it has returned, the repair probes the volume's mount
	// again, as for a dead volume, before it aborts a connection or
	// unmounts: it may be another filesystem that was given the freed
	// number.
	Hung bool
	// Pods are the pods on this node that use the volume.
	Pods []PodVolume
}

// users are the UIDs of the pods that use the volume.
func (v *Volume) users() []string {
	var out []string
	for _, p := range v.Pods {
		uids := []types.UID{p.Publish.PodUID}
		for _, c := range p.Containers {
			uids = append(uids, c.PodUID)
		}
		for _, uid := range uids {
			if uid != "" && !slices.Contains(out, string(uid)) {
				out = append(out, string(uid))
			}
		}
	}
	return out
}

// daemonHome is where the driver catalogue puts the daemon of the volume's
// filesystem; kubelet.DaemonUnknown when the driver or its mounter is not
// catalogued.
func (v *Volume) daemonHome() kubelet.DaemonHome {
	d, ok := kubelet.LookupDriver(v.Driver)
	if !ok || v.Backend == nil {
		return kubelet.DaemonUnknown
	}
	mt, ok := d.Mounter(v.Backend.FSType, v.Backend.Source)
	if !ok {
		return kubelet.DaemonUnknown
	}
	return mt.Daemon
}

// PodVolume is one pod's use of a Volume.
type PodVolume struct {
	// Publish is the request for NodePublishVolume at this pod's target.
	Publish kubelet.VolumeRequest
	// Dead are this pod's kubelet mounts on the dead backend: its publish
	// target and subPath binds.
	Dead []*probe.Mount
	// Containers are the pod's running containers that mount the volume.
	Containers []ContainerMount
}

// ContainerMount is where a running container sees a volume.
type ContainerMount struct {
	PodUID      types.UID
	Container   string
	ContainerID string
	// MountPath is the volumeMount's mountPath inside the container.
	MountPath string
}

// Outcome is what a tier did for a volume.
type Outcome struct {
	Tier    Tier
	Actions []Action
	// Healed: probing after the tier found the volume healthy everywhere
	// the tier can reach (for a dry run: never).
	Healed bool
	// Err is why the tier failed; errors.Is(Err, ErrDriverUnavailable)
	// means retry later, not escalate (errors.Is(Err,
	// ErrBackendUnavailable): the driver answered, the volume's backend
	// did not).
	Err  error
	Took time.Duration
}
