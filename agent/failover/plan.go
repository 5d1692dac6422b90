package failover

import (
	"encoding/json"
	"fmt"
	"slices"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
)

// FencePlanAnnotation on a heartbeat Lease is the node's fence plan: the
// UIDs of the pods its agent stops if it cannot renew the Lease for
// fenceAfterSeconds after the renewal that wrote it. The controller fails
// over only pods in the plan of the last renewal it saw, and only once that
// renewal is older than the fence window by its own clock. No annotation
// (an agent that never read its pods, or an older one): no pod of the node
// moves.
const FencePlanAnnotation = "failover.mountmedic.io/fence-plan"

// fencePlan is FencePlanAnnotation's value.
type fencePlan struct {
	// FenceAfterSeconds is the fence deadline, counted from the renewal
	// that carries the plan.
	FenceAfterSeconds int32 `json:"fenceAfterSeconds"`
	// Pods are the UIDs of the planned pods, sorted.
	Pods []string `json:"pods"`
}

// encodeFencePlan renders a plan for the annotation.
func encodeFencePlan(fenceAfter time.Duration, targets []fenceTarget) string {
	uids := make([]string, 0, len(targets))
	for _, t := range targets {
		uids = append(uids, t.UID)
	}
	return EncodeFencePlan(fenceAfter, uids)
}

// EncodeFencePlan renders FencePlanAnnotation's value for the pods with
// these UIDs and a fence deadline of fenceAfter (rounded up to a whole
// second): what an agent publishes, and what a test playing an agent
// publishes for its simulated node.
func EncodeFencePlan(fenceAfter time.Duration, uids []string) string {
	p := fencePlan{FenceAfterSeconds: int32((fenceAfter + time.Second - 1) / time.Second), Pods: slices.Clone(uids)}
	if p.Pods == nil {
		p.Pods = []string{}
	}
	slices.Sort(p.Pods)
	p.Pods = slices.Compact(p.Pods)
	b, _ := json.Marshal(p) // strings and an int: cannot fail
	return string(b)
}

// publishedPlan is what the controller read of a node's plan.
type publishedPlan struct {
	// Known: the Lease carries a well-formed plan.
	Known bool
	// Err says why a plan present could not be read.
	Err  error
	pods map[string]bool
	// FenceAfter is the plan's own deadline.
	FenceAfter time.Duration
}

// has reports whether the pod with uid is in the plan.
func (p publishedPlan) has(uid string) bool { return p.pods[uid] }

// planOf reads the fence plan of a heartbeat Lease (nil: none).
func planOf(l *coordinationv1.Lease) publishedPlan {
	if l == nil {
		return publishedPlan{}
	}
	v, ok := l.Annotations[FencePlanAnnotation]
	if !ok {
		return publishedPlan{}
	}
	var fp fencePlan
	if err := json.Unmarshal([]byte(v), &fp); err != nil {
		return publishedPlan{Err: fmt.Errorf("annotation %s of heartbeat lease %s/%s: %w", FencePlanAnnotation, l.Namespace, l.Name, err)}
	}
	if fp.FenceAfterSeconds <= 0 {
		return publishedPlan{Err: fmt.Errorf("annotation %s of heartbeat lease %s/%s: fenceAfterSeconds %d is not positive", FencePlanAnnotation, l.Namespace, l.Name, fp.FenceAfterSeconds)}
	}
	p := publishedPlan{Known: true, pods: make(map[string]bool, len(fp.Pods)), FenceAfter: time.Duration(fp.FenceAfterSeconds) * time.Second}
	for _, uid := range fp.Pods {
		p.pods[uid] = true
	}
	return p
}

// unionTargets is a and the targets of b that a lacks (by UID).
func unionTargets(a, b []fenceTarget) []fenceTarget {
	out := slices.Clone(a)
	for _, t := range b {
		if !slices.ContainsFunc(out, func(o fenceTarget) bool { return o.UID == t.UID }) {
			out = append(out, t)
		}
	}
	return out
}

// nodePod is a pod of a dead node as the controller sees it.
type nodePod struct {
	pod *corev1.Pod
	// d is the policy's decision for it now.
	d decision
	// rwo: it uses a ReadWriteOnce/ReadWriteOncePod claim, or a claim
	// that could not be read (which may be one).
	rwo bool
	// attachments of its eligible CSI volumes on the node.
	attachments []volumeAttachment
}

// Why a pod with a ReadWriteOnce volume stays on a failed-over node, as
// mountmedic_failover_pods_left_total labels it and events say.
const (
	// leftNotEligible: the policy does not fail it over (opted out,
	// excluded namespace or StorageClass, no controller...). It was not
	// fenced either, unless its claims could not be read.
	leftNotEligible = "not_eligible"
	// leftNotPlanned: eligible now, but not in the node's published fence
	// plan (made eligible, or created, after the node's last renewal): it
	// may still run there.
	leftNotPlanned = "not_planned"
)

var leftReasons = []string{leftNotEligible, leftNotPlanned}

// leftPod is a pod with a ReadWriteOnce volume that a fail-over leaves.
type leftPod struct {
	pod    *corev1.Pod
	reason string
	why    string
}

// failoverPlan is the controller's judgement of a dead node's pods.
type failoverPlan struct {
	// move: eligible now and in the node's published plan (fenced).
	move []eligiblePod
	// left: pods with ReadWriteOnce volumes that stay, and why.
	left []leftPod
	// taintBlockers: pods the out-of-service taint would evict (they do
	// not tolerate it) whose ReadWriteOnce volumes the node never fenced.
	// While there is one, the node must not be tainted.
	taintBlockers []*corev1.Pod
	// uncertain: eligibility unknown (a claim could not be read).
	uncertain int
}

// judgePods splits a dead node's pods by the node's published plan. Only
// what the node fenced moves: a pod is moved when the policy admits it now
// and the plan holds its UID. all is true when the plan does not limit
// (the cloud provider reports the instance shut down: nothing runs there).
func judgePods(pods []nodePod, plan publishedPlan, all bool) failoverPlan {
	var fp failoverPlan
	for _, p := range pods {
		uid := string(p.pod.UID)
		planned := all || plan.has(uid)
		if p.d.Uncertain && !p.d.Eligible {
			fp.uncertain++
		}
		switch {
		case p.d.Eligible && planned:
			fp.move = append(fp.move, eligiblePod{pod: p.pod, pvs: p.d.PVs, attachments: p.attachments})
			continue
		case p.d.Eligible:
			fp.left = append(fp.left, leftPod{pod: p.pod, reason: leftNotPlanned,
				why: "eligible, but not in the fence plan the node last published: it may still run unfenced"})
		case p.rwo && p.d.Reason != reasonTerminated:
			fp.left = append(fp.left, leftPod{pod: p.pod, reason: leftNotEligible, why: p.d.Reason})
		}
		if p.rwo && !planned && p.d.Reason != reasonTerminated && !toleratesOutOfService(p.pod) {
			fp.taintBlockers = append(fp.taintBlockers, p.pod)
		}
	}
	return fp
}

// toleratesOutOfService reports whether the pod stays on a node with the
// duty's out-of-service taint: a toleration for it without
// tolerationSeconds (with them the pod is evicted after the wait).
func toleratesOutOfService(pod *corev1.Pod) bool {
	return slices.ContainsFunc(pod.Spec.Tolerations, func(t corev1.Toleration) bool {
		if t.TolerationSeconds != nil || (t.Effect != "" && t.Effect != corev1.TaintEffectNoExecute) {
			return false
		}
		switch t.Operator {
		case corev1.TolerationOpExists:
			return t.Key == "" || t.Key == TaintOutOfService
		case corev1.TolerationOpEqual, "":
			return t.Key == TaintOutOfService && t.Value == TaintValue
		}
		return false
	})
}
