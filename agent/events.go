package agent

import (
	"fmt"
	"sort"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

// Reason is the reason of an event the agent sends: one of the Reason
// constants, which alerts, docs and `mountmedic status` match by name.
type Reason string

// Event reasons.
const (
	ReasonVolumeBroken    Reason = "VolumeBroken"
	ReasonVolumeRepaired  Reason = "VolumeRepaired"
	ReasonRepairEscalated Reason = "RepairEscalated"
	ReasonEvicting        Reason = "Evicting"
	ReasonEvictionBlocked Reason = "EvictionBlocked"
	ReasonNotRepaired     Reason = "NotRepaired"
	ReasonDriverDown      Reason = "DriverDown"
	// ReasonBackendDown: the CSI driver answered and the volume's device
	// still does not (remount.ErrBackendUnavailable): the storage behind it
	// is down; the agent waits, nothing escalated.
	ReasonBackendDown   Reason = "BackendDown"
	ReasonVolumeGuarded Reason = "VolumeGuarded"
	// ReasonRepairOptedOut: the pod or claim opted out of repairs
	// (OptOutAnnotation); the volume is probed and reported only.
	ReasonRepairOptedOut Reason = "RepairOptedOut"
	// ReasonWouldRepair: with --dry-run, the repair the agent would make
	// now and the rungs after it.
	ReasonWouldRepair Reason = "WouldRepair"
)

// Event actions (events.k8s.io "action": what the agent did or tried).
const (
	actionProbe   = "Probe"
	actionRepair  = "Repair"
	actionEvict   = "Evict"
	actionDelete  = "Delete"
	actionUnmount = "Unmount"
	actionGuard   = "Guard"
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
func (r reporter) volume(pods []*corev1.Pod, pvc *corev1.PersistentVolumeClaim, eventtype string, reason Reason, action, note string) {
	if r.rec == nil {
		return
	}
	for _, pod := range pods {
		var related runtime.Object
		if pvc != nil {
			related = pvc
		}
		r.rec.Eventf(pod, related, eventtype, string(reason), action, "%s", note)
	}
	r.claim(pvc, pods, eventtype, reason, action, note)
}

// claim sends an event on the PVC only (related: the first pod).
func (r reporter) claim(pvc *corev1.PersistentVolumeClaim, pods []*corev1.Pod, eventtype string, reason Reason, action, note string) {
	if r.rec == nil || pvc == nil {
		return
	}
	var related runtime.Object
	if len(pods) > 0 {
		related = pods[0]
	}
	r.rec.Eventf(pvc, related, eventtype, string(reason), action, "%s", note)
}

// pod sends an event on one pod (related: the PVC) and on the PVC.
func (r reporter) pod(pod *corev1.Pod, pvc *corev1.PersistentVolumeClaim, eventtype string, reason Reason, action, note string) {
	r.volume([]*corev1.Pod{pod}, pvc, eventtype, reason, action, note)
}

// Event budget of a node: a storage outage breaks every volume of the node
// at once, and one event per pod and claim per step would be thousands of
// writes to the API server from one node (and would queue behind the
// client's own rate limit, ahead of the repairs' reads). Past the budget,
// events are counted per type and reason and summed up in one event on the
// Node per reason every eventSummaryEvery.
const (
	eventBurst        = 25
	eventRefill       = time.Second // one more event per second
	eventSummaryEvery = 10 * time.Second
	// eventSummaryNames is how many of the held events' objects a summary
	// names.
	eventSummaryNames = 10
)

// limitedRecorder passes events to rec within a token bucket (eventBurst,
// one token per eventRefill) and holds the rest for flush. Evictions pass
// always: the node's eviction budget bounds them already, and a pod's owner
// must see why it went. Workers and the loop share it.
type limitedRecorder struct {
	rec  eventRecorder
	node runtime.Object
	now  func() time.Time

	mu     sync.Mutex
	tokens float64
	last   time.Time
	held   map[heldKey]*heldEvents
	// sent and summarized count events passed on and held, for tests and
	// the log.
	sent, summarized int
}

type heldKey struct{ eventtype, reason, action string }

type heldEvents struct {
	count int
	names []string
}

func newLimitedRecorder(rec eventRecorder, nodeName string, now func() time.Time) *limitedRecorder {
	if now == nil {
		now = time.Now
	}
	return &limitedRecorder{rec: rec, now: now, tokens: eventBurst, last: now(),
		node: &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: nodeName}},
		held: make(map[heldKey]*heldEvents)}
}

// Eventf sends the event when the budget allows, else holds it for the next
// summary.
func (l *limitedRecorder) Eventf(regarding, related runtime.Object, eventtype, reason, action, note string, args ...interface{}) {
	l.mu.Lock()
	now := l.now()
	l.tokens = min(eventBurst, l.tokens+float64(now.Sub(l.last))/float64(eventRefill))
	l.last = now
	pass := Reason(reason) == ReasonEvicting || l.tokens >= 1
	if pass {
		if Reason(reason) != ReasonEvicting {
			l.tokens--
		}
		l.sent++
	} else {
		k := heldKey{eventtype, reason, action}
		h := l.held[k]
		if h == nil {
			h = &heldEvents{}
			l.held[k] = h
		}
		h.count++
		l.summarized++
		if len(h.names) < eventSummaryNames {
			h.names = append(h.names, objectName(regarding))
		}
	}
	l.mu.Unlock()
	if pass {
		l.rec.Eventf(regarding, related, eventtype, reason, action, note, args...)
	}
}

// flush sends one summary event on the Node per type and reason held since
// the last flush.
func (l *limitedRecorder) flush(dryRun bool) {
	l.mu.Lock()
	held := l.held
	l.held = make(map[heldKey]*heldEvents)
	l.mu.Unlock()
	keys := make([]heldKey, 0, len(held))
	for k := range held {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		a, b := keys[i], keys[j]
		return a.reason+a.action+a.eventtype < b.reason+b.action+b.eventtype
	})
	for _, k := range keys {
		h := held[k]
		names := strings.Join(h.names, ", ")
		if more := h.count - len(h.names); more > 0 {
			names += fmt.Sprintf(" and %d more", more)
		}
		note := fmt.Sprintf("%d %s events of this node were not sent one by one (more than %d at once, then one a second): about %s", h.count, k.reason, eventBurst, names)
		if dryRun {
			note = dryRunPrefix + note
		}
		if len(note) > 1000 {
			note = note[:997] + "..."
		}
		l.rec.Eventf(l.node, nil, k.eventtype, k.reason, k.action, "%s", note)
	}
}

// objectName is namespace/name of an API object, or its name.
func objectName(o runtime.Object) string {
	m, err := meta.Accessor(o)
	if err != nil {
		return "?"
	}
	if m.GetNamespace() == "" {
		return m.GetName()
	}
	return m.GetNamespace() + "/" + m.GetName()
}
