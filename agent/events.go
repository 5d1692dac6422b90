package agent

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

// Event reasons.
const (
	ReasonVolumeBroken    = "VolumeBroken"
	ReasonVolumeRepaired  = "VolumeRepaired"
	ReasonRepairEscalated = "RepairEscalated"
	ReasonEvicting        = "Evicting"
	ReasonEvictionBlocked = "EvictionBlocked"
	ReasonNotRepaired     = "NotRepaired"
	ReasonDriverDown      = "DriverDown"
)

// Event actions (events.k8s.io "action": what the agent did or tried).
const (
	actionProbe   = "Probe"
	actionRepair  = "Repair"
	actionEvict   = "Evict"
	actionDelete  = "Delete"
	actionUnmount = "Unmount"
)

// dryRunPrefix starts every event message of a dry run.
const dryRunPrefix = "[dry-run] "

// eventRecorder is what the agent needs of an events.k8s.io recorder
// (events.EventRecorder from client-go's tools/events satisfies it).
type eventRecorder interface {
	Eventf(regarding runtime.Object, related runtime.Object, eventtype, reason, action, note string, args ...interface{})
}

// reporter sends the agent's events on the pods and the PVC of a volume.
type reporter struct {
	rec    eventRecorder
	dryRun bool
}

// message formats an event note, with the dry-run prefix when due. The
// events API caps a note at 1 kB.
func (r reporter) message(format string, args ...any) string {
	msg := fmt.Sprintf(format, args...)
	if r.dryRun {
		msg = dryRunPrefix + msg
	}
	if len(msg) > 1000 {
		msg = msg[:997] + "..."
	}
	return msg
}

// volume sends one event on each pod (related: the PVC) and one on the PVC
// (related: the first pod).
func (r reporter) volume(pods []*corev1.Pod, pvc *corev1.PersistentVolumeClaim, eventtype, reason, action, note string) {
	if r.rec == nil {
		return
	}
	for _, pod := range pods {
		var related runtime.Object
		if pvc != nil {
			related = pvc
		}
		r.rec.Eventf(pod, related, eventtype, reason, action, "%s", note)
	}
	r.claim(pvc, pods, eventtype, reason, action, note)
}

// claim sends an event on the PVC only (related: the first pod).
func (r reporter) claim(pvc *corev1.PersistentVolumeClaim, pods []*corev1.Pod, eventtype, reason, action, note string) {
	if r.rec == nil || pvc == nil {
		return
	}
	var related runtime.Object
	if len(pods) > 0 {
		related = pods[0]
	}
	r.rec.Eventf(pvc, related, eventtype, reason, action, "%s", note)
}

// pod sends an event on one pod (related: the PVC) and on the PVC.
func (r reporter) pod(pod *corev1.Pod, pvc *corev1.PersistentVolumeClaim, eventtype, reason, action, note string) {
	r.volume([]*corev1.Pod{pod}, pvc, eventtype, reason, action, note)
}
