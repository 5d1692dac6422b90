package failover

import (
	"fmt"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
)

// Taints the duty reads and writes.
const (
	// TaintOutOfService is KEP-2268's taint: with it (and the node not
	// Ready) the pod garbage collector force-deletes the node's terminating
	// pods and the attach/detach controller detaches their volumes at once.
	TaintOutOfService = corev1.TaintNodeOutOfService
	// TaintValue marks the out-of-service taint this duty applied; it
	// removes only a taint with this value, never an operator's.
	TaintValue = "mountmedic"
	// TaintShutdown is the cloud provider's taint on a node whose instance
	// is shut down.
	TaintShutdown = "node.cloudprovider.kubernetes.io/shutdown"
)

// Heartbeat Leases: one per node, named after the node, in the duty's
// namespace, with this label so that the controller watches only them.
const (
	HeartbeatLabel      = "failover.mountmedic.io/heartbeat"
	HeartbeatLabelValue = "node"
)

// KubeletLeaseNamespace holds kubelet's node Leases.
const KubeletLeaseNamespace = corev1.NamespaceNodeLease

// FailedOverAnnotation marks a node failed over in force-delete mode (the
// taint marks it in taint mode); its value is when.
const FailedOverAnnotation = "failover.mountmedic.io/failed-over-at"

// observer remembers, by its own clock, when each signal last changed. A
// Lease's renewTime is the writer's clock and a node's clock may be wrong:
// like kubelet's node lifecycle controller, the duty only asks "has it
// changed, and when did I see that", so clock skew between nodes does not
// matter. A signal seen for the first time counts as changed then: a leader
// that just started waits a full window before it trusts any silence, and
// so does one that regains sight of the API server (restartAll). Only the
// leader's worker uses it, from one goroutine.
type observer struct {
	seen map[string]sighting
}

type sighting struct {
	version string
	at      time.Time
}

func newObserver() *observer { return &observer{seen: make(map[string]sighting)} }

// observe records version of signal key at now and returns when the value
// was first seen.
func (o *observer) observe(key, version string, now time.Time) time.Time {
	s, ok := o.seen[key]
	if !ok || s.version != version {
		s = sighting{version: version, at: now}
		o.seen[key] = s
	}
	return s.at
}

func (o *observer) forget(key string) { delete(o.seen, key) }

// restartAll restarts every silence clock at now, keeping the versions:
// after a time the controller could not watch (an API server outage, a
// broken watch), it cannot know what changed meanwhile, so no silence
// before now counts. A node must then stay silent a full window again.
func (o *observer) restartAll(now time.Time) {
	for k, s := range o.seen {
		s.at = now
		o.seen[k] = s
	}
}

// forgetNode drops every signal of a node that left the scope or the
// cluster.
func (o *observer) forgetNode(node string) {
	for _, k := range []string{kubeletKey(node), readyKey(node), heartbeatKey(node)} {
		o.forget(k)
	}
}

func kubeletKey(node string) string   { return "kubelet/" + node }
func readyKey(node string) string     { return "ready/" + node }
func heartbeatKey(node string) string { return "heartbeat/" + node }

// leaseVersion is what changes when a Lease is renewed or changes hands.
func leaseVersion(l *coordinationv1.Lease) string {
	v := ""
	if l.Spec.RenewTime != nil {
		v = l.Spec.RenewTime.UTC().Format(time.RFC3339Nano)
	}
	if l.Spec.HolderIdentity != nil {
		v += "/" + *l.Spec.HolderIdentity
	}
	return v
}

// readyHeartbeat is the Ready condition's heartbeat, which kubelet
// refreshes when it posts node status.
func readyHeartbeat(node *corev1.Node) string {
	for _, c := range node.Status.Conditions {
		if c.Type == corev1.NodeReady {
			return c.LastHeartbeatTime.UTC().Format(time.RFC3339Nano)
		}
	}
	return ""
}

// heartbeatState is what a node's heartbeat Lease says.
type heartbeatState string

const (
	heartbeatMissing  heartbeatState = "missing"
	heartbeatReleased heartbeatState = "released"
	heartbeatHeld     heartbeatState = "held"
)

// oosState is who applied the out-of-service taint.
type oosState string

const (
	oosNone  oosState = ""
	oosOurs  oosState = "ours"
	oosOther oosState = "other"
)

// evidence is everything the duty knows about a node, as a log line and
// an event print it.
type evidence struct {
	Ready corev1.ConditionStatus
	// KubeletSilent is how long neither the kubelet Lease nor the Ready
	// heartbeat has changed, by the observer's clock.
	KubeletSilent time.Duration
	Heartbeat     heartbeatState
	// HeartbeatSilent is how long the heartbeat Lease has not changed.
	HeartbeatSilent time.Duration
	// FenceWindow is the wait for this node's heartbeat (its advertised
	// fence time, at least FenceAfter, plus the margin).
	FenceWindow  time.Duration
	Shutdown     bool
	OutOfService oosState
	// ForceMarked: the node carries FailedOverAnnotation.
	ForceMarked bool
}

// keysAndValues renders the evidence for a structured log line.
func (e evidence) keysAndValues() []any {
	return []any{"ready", string(e.Ready), "kubeletSilent", e.KubeletSilent.Round(time.Second).String(),
		"heartbeat", string(e.Heartbeat), "heartbeatSilent", e.HeartbeatSilent.Round(time.Second).String(),
		"fenceWindow", e.FenceWindow.String(), "shutdownTaint", e.Shutdown, "outOfService", string(e.OutOfService)}
}

// readyOrMissing names a Ready condition's status for a message.
func readyOrMissing(s corev1.ConditionStatus) string {
	if s == "" {
		return "missing"
	}
	return string(s)
}

// String renders the evidence for an event note.
func (e evidence) String() string {
	ready := readyOrMissing(e.Ready)
	s := fmt.Sprintf("Ready=%s, kubelet silent %s, mountmedic heartbeat %s", ready, e.KubeletSilent.Round(time.Second), e.Heartbeat)
	if e.Heartbeat == heartbeatHeld {
		s += fmt.Sprintf(" and silent %s (fence window %s)", e.HeartbeatSilent.Round(time.Second), e.FenceWindow)
	}
	if e.Shutdown {
		s += ", cloud shutdown taint"
	}
	return s
}

// gather builds a node's evidence at now from the node, its kubelet Lease
// and its heartbeat Lease (nil when absent), recording what changed.
func (c *ControllerConfig) gather(o *observer, node *corev1.Node, kubelet, heartbeat *coordinationv1.Lease, now time.Time) evidence {
	return c.gatherAt(o, node, kubelet, heartbeat, now, now)
}

// gatherAt is gather for objects read from the API server between now and
// seen: a signal that changed counts as first seen at seen (the end of the
// reads), and silences are measured at now (their start). A slow read then
// shortens a silence, never lengthens it.
func (c *ControllerConfig) gatherAt(o *observer, node *corev1.Node, kubelet, heartbeat *coordinationv1.Lease, now, seen time.Time) evidence {
	since := func(at time.Time) time.Duration { return max(now.Sub(at), 0) }
	e := evidence{Ready: ""}
	for _, cond := range node.Status.Conditions {
		if cond.Type == corev1.NodeReady {
			e.Ready = cond.Status
		}
	}
	for _, t := range node.Spec.Taints {
		switch {
		case t.Key == TaintOutOfService && t.Value == TaintValue:
			if e.OutOfService == oosNone {
				e.OutOfService = oosOurs
			}
		case t.Key == TaintOutOfService:
			e.OutOfService = oosOther
		case t.Key == TaintShutdown:
			e.Shutdown = true
		}
	}
	_, e.ForceMarked = node.Annotations[FailedOverAnnotation]

	// The kubelet's last sign of life: a change of its Lease or of the
	// Ready heartbeat, whichever came later.
	last := o.observe(readyKey(node.Name), readyHeartbeat(node), seen)
	if kubelet != nil {
		if at := o.observe(kubeletKey(node.Name), leaseVersion(kubelet), seen); at.After(last) {
			last = at
		}
	}
	e.KubeletSilent = since(last)

	e.FenceWindow = c.FenceWindow(0)
	switch {
	case heartbeat == nil:
		e.Heartbeat = heartbeatMissing
		o.forget(heartbeatKey(node.Name))
	case heartbeat.Spec.HolderIdentity == nil || *heartbeat.Spec.HolderIdentity == "":
		e.Heartbeat = heartbeatReleased
		o.observe(heartbeatKey(node.Name), leaseVersion(heartbeat), seen)
	default:
		e.Heartbeat = heartbeatHeld
		var secs int32
		if heartbeat.Spec.LeaseDurationSeconds != nil {
			secs = *heartbeat.Spec.LeaseDurationSeconds
		}
		// A fresh read carries the fence plan: its own deadline counts
		// too (the informers keep no annotations).
		if p := planOf(heartbeat); p.Known {
			secs = max(secs, int32(p.FenceAfter/time.Second))
		}
		e.FenceWindow = c.FenceWindow(secs)
		e.HeartbeatSilent = since(o.observe(heartbeatKey(node.Name), leaseVersion(heartbeat), seen))
	}
	return e
}

// verdict is the duty's judgement of a node.
type verdict int

const (
	// verdictAlive: kubelet's Ready condition is True.
	verdictAlive verdict = iota
	// verdictSuspect: not Ready, but not confirmed dead (see the reason).
	verdictSuspect
	// verdictDead: not Ready, kubelet silent, and the node has fenced (its
	// heartbeat was silent past the fence window) or is shut down.
	verdictDead
	// verdictOperator: someone else applied the out-of-service taint;
	// Kubernetes fails the node over, the duty stays out of it.
	verdictOperator
)

var verdictNames = [...]string{"alive", "suspect", "dead", "operator"}

func (v verdict) String() string { return verdictNames[v] }

// judgement is the duty's verdict on a node: what, a short code that
// changes only when the kind of reason changes, and why in words.
type judgement struct {
	verdict verdict
	code    string
	why     string
}

// judge says what the evidence proves, and why.
func (c *ControllerConfig) judge(e evidence) judgement {
	switch {
	case e.OutOfService == oosOther:
		return judgement{verdictOperator, "operator", "someone else applied the out-of-service taint: Kubernetes fails the node over"}
	case e.Ready == corev1.ConditionTrue:
		return judgement{verdictAlive, "ready", "node is Ready"}
	case e.Ready != corev1.ConditionUnknown:
		return judgement{verdictSuspect, "kubelet-reports", fmt.Sprintf("node is not Ready but its Ready condition is %s, not Unknown: its kubelet reported it (it is running)", readyOrMissing(e.Ready))}
	case e.KubeletSilent < c.KubeletGrace:
		return judgement{verdictSuspect, "kubelet-alive", fmt.Sprintf("node is not Ready but kubelet showed life %s ago (< %s): it is running",
			e.KubeletSilent.Round(time.Second), c.KubeletGrace)}
	case e.Heartbeat == heartbeatHeld && e.HeartbeatSilent >= e.FenceWindow:
		return judgement{verdictDead, "fenced", fmt.Sprintf("kubelet silent %s and the mountmedic heartbeat silent %s (>= fence window %s): the node is down or has fenced itself",
			e.KubeletSilent.Round(time.Second), e.HeartbeatSilent.Round(time.Second), e.FenceWindow)}
	case e.Shutdown && c.TrustShutdownTaint:
		return judgement{verdictDead, codeShutdown, fmt.Sprintf("kubelet silent %s and the cloud provider reports the instance shut down", e.KubeletSilent.Round(time.Second))}
	case e.Heartbeat == heartbeatHeld:
		return judgement{verdictSuspect, "not-fenced-yet", fmt.Sprintf("the mountmedic heartbeat is silent only %s (< fence window %s): the node may be partitioned and not fenced yet",
			e.HeartbeatSilent.Round(time.Second), e.FenceWindow)}
	case e.Heartbeat == heartbeatReleased:
		return judgement{verdictSuspect, "released", "the node's mountmedic agent released its heartbeat (it stopped): nothing confirms the node fenced; apply the out-of-service taint by hand if it is down"}
	default:
		return judgement{verdictSuspect, "no-heartbeat", "no mountmedic heartbeat for this node: nothing confirms it fenced; run the agent with --failover there, or apply the out-of-service taint by hand if it is down"}
	}
}

// codeShutdown is the judgement code of a node the cloud provider reports
// shut down (TrustShutdownTaint).
const codeShutdown = "shutdown"
