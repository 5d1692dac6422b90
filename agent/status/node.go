package status

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/client-go/kubernetes"

	"github.com/mountmedic/mountmedic/agent"
	"github.com/mountmedic/mountmedic/agent/failover"
)

// NodeDetail is the drill-down of one node: its row of the view, its
// agent's pod, its pods' volumes and what its agent reported.
type NodeDetail struct {
	Node
	Agent *AgentPod `json:"agent,omitempty"`
	// Pods are the node's pods with persistent or CSI volumes.
	Pods []PodVolumes `json:"pods"`
	// Events are the agent's events written by this node's agent (see
	// trust), newest first.
	Events []AgentEvent `json:"events"`
	// Verified says how the events are known to be the agent's own.
	Verified string `json:"verified"`
	// FailoverEvents are the failover controller's events about the node
	// or its pods (regarding or related to the Node), those it is known to
	// have written (see trust), newest first.
	FailoverEvents []AgentEvent `json:"failoverEvents"`
	// FailoverVerified says how the failover events are known to be the
	// controller's.
	FailoverVerified string   `json:"failoverVerified"`
	Warnings         []string `json:"warnings,omitempty"`
}

// AgentPod is the mountmedic agent pod on the node.
type AgentPod struct {
	Name     string `json:"name"`
	Phase    string `json:"phase"`
	Ready    bool   `json:"ready"`
	Restarts int32  `json:"restarts"`
}

// PodVolumes is a pod and its volumes backed by claims or CSI drivers.
type PodVolumes struct {
	Namespace string      `json:"namespace"`
	Name      string      `json:"name"`
	Volumes   []PodVolume `json:"volumes"`
}

// PodVolume is one volume of a pod: its name and what backs it (a claim,
// or a CSI driver for an inline or ephemeral volume).
type PodVolume struct {
	Name   string `json:"name"`
	Claim  string `json:"claim,omitempty"`
	Driver string `json:"driver,omitempty"`
}

// AgentEvent is one event of the node's agent.
type AgentEvent struct {
	At      time.Time `json:"at"`
	Type    string    `json:"type"`
	Reason  string    `json:"reason"`
	Outcome string    `json:"outcome,omitempty"`
	Object  string    `json:"object"`
	Note    string    `json:"note"`
	Count   int32     `json:"count,omitempty"`
}

// maxEvents bounds the events a drill-down keeps (the newest).
const maxEvents = 50

// AgentSelector finds the agents' pods in their namespace by labels no
// rename changes: app.kubernetes.io/name follows the chart's nameOverride,
// app.kubernetes.io/part-of stays mountmedic (deploy/kustomization.yaml).
const AgentSelector = "app.kubernetes.io/part-of=mountmedic,app.kubernetes.io/component=agent"

// ReadNode builds the drill-down of node.
func ReadNode(ctx context.Context, cs kubernetes.Interface, opts Options, node string) (*NodeDetail, error) {
	opts.Nodes = []string{node}
	v, err := read(ctx, cs, opts, false)
	if err != nil {
		return nil, err
	}
	d := &NodeDetail{Node: v.Nodes[0], Pods: []PodVolumes{}, Events: []AgentEvent{}, FailoverEvents: []AgentEvent{}, Warnings: v.Warnings}
	onNode := metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("spec.nodeName", node).String()}
	agents, err := cs.CoreV1().Pods(opts.Namespace).List(ctx, metav1.ListOptions{FieldSelector: onNode.FieldSelector, LabelSelector: AgentSelector})
	if err != nil {
		d.Warnings = append(d.Warnings, fmt.Sprintf("agent pod in %s: %v%s", opts.Namespace, err, rbacHint(err)))
	} else if len(agents.Items) > 0 {
		p := agents.Items[0]
		a := &AgentPod{Name: p.Name, Phase: string(p.Status.Phase)}
		for _, c := range p.Status.Conditions {
			if c.Type == corev1.PodReady {
				a.Ready = c.Status == corev1.ConditionTrue
			}
		}
		for _, c := range p.Status.ContainerStatuses {
			a.Restarts += c.RestartCount
		}
		d.Agent = a
	}
	pods, err := cs.CoreV1().Pods("").List(ctx, onNode)
	if err != nil {
		d.Warnings = append(d.Warnings, fmt.Sprintf("pods on %s: %v%s", node, err, rbacHint(err)))
	} else {
		for _, p := range pods.Items {
			if pv := podVolumes(&p); len(pv.Volumes) > 0 {
				d.Pods = append(d.Pods, pv)
			}
		}
		slices.SortFunc(d.Pods, func(a, b PodVolumes) int {
			return cmp.Or(cmp.Compare(a.Namespace, b.Namespace), cmp.Compare(a.Name, b.Name))
		})
	}
	tr := readTrust(ctx, cs, opts.Name, EventsPolicy)
	var untrusted int
	err = listAgentEvents(ctx, cs, func(e *corev1.Event) {
		if e.ReportingInstance != node {
			return
		}
		if !tr.vouches(e) {
			untrusted++
			return
		}
		if e.Reason != "" && (d.LastRepair == nil || eventTime(e).After(d.LastRepair.At)) && outcomeOf(e.Reason) != "" {
			d.LastRepair = &Repair{Reason: e.Reason, Outcome: outcomeOf(e.Reason), Object: objectName(e.InvolvedObject), Note: e.Message, At: eventTime(e)}
		}
		d.Events = append(d.Events, AgentEvent{At: eventTime(e), Type: e.Type, Reason: e.Reason,
			Outcome: outcomeOf(e.Reason), Object: objectName(e.InvolvedObject), Note: e.Message, Count: eventCount(e)})
	})
	if err != nil {
		d.Warnings = append(d.Warnings, fmt.Sprintf("mountmedic events: %v%s", err, rbacHint(err)))
	}
	if untrusted > 0 {
		d.Warnings = append(d.Warnings, tr.ignored(untrusted))
	}
	slices.SortFunc(d.Events, func(a, b AgentEvent) int { return b.At.Compare(a.At) })
	if len(d.Events) > maxEvents {
		d.Events = d.Events[:maxEvents]
	}
	if tr.since.IsZero() {
		d.Verified = "no: " + tr.why
	} else {
		d.Verified = fmt.Sprintf("events with reportingController %s and reportingInstance %s created since %s, when the admission policy %s (which admits them only from node %s's own identity) was in force",
			agent.ReportingController, node, tr.since.UTC().Format(time.RFC3339), tr.policy, node)
	}
	readFailoverEvents(ctx, cs, opts.Name, node, d)
	return d, nil
}

// readFailoverEvents adds the failover controller's events about node (on
// the Node, or on a pod with the Node related) that FailoverEventsPolicy
// vouches for.
func readFailoverEvents(ctx context.Context, cs kubernetes.Interface, name, node string, d *NodeDetail) {
	tr := readTrust(ctx, cs, name, FailoverEventsPolicy)
	isNode := func(o *corev1.ObjectReference) bool { return o != nil && o.Kind == "Node" && o.Name == node }
	var untrusted int
	err := listEvents(ctx, cs, failover.ReportingController, func(e *corev1.Event) {
		if !isNode(&e.InvolvedObject) && !isNode(e.Related) {
			return
		}
		if !tr.vouches(e) {
			untrusted++
			return
		}
		d.FailoverEvents = append(d.FailoverEvents, AgentEvent{At: eventTime(e), Type: e.Type, Reason: e.Reason,
			Object: objectName(e.InvolvedObject), Note: e.Message, Count: eventCount(e)})
	})
	if err != nil {
		d.Warnings = append(d.Warnings, fmt.Sprintf("failover controller events: %v%s", err, rbacHint(err)))
	}
	if untrusted > 0 {
		d.Warnings = append(d.Warnings, tr.ignored(untrusted))
	}
	slices.SortFunc(d.FailoverEvents, func(a, b AgentEvent) int { return b.At.Compare(a.At) })
	if len(d.FailoverEvents) > maxEvents {
		d.FailoverEvents = d.FailoverEvents[:maxEvents]
	}
	if tr.since.IsZero() {
		d.FailoverVerified = "no: " + tr.why
	} else {
		d.FailoverVerified = fmt.Sprintf("events with reportingController %s created since %s, when the admission policy %s (which admits them only from the controller's ServiceAccount) was in force",
			failover.ReportingController, tr.since.UTC().Format(time.RFC3339), tr.policy)
	}
}

// podVolumes lists pod's volumes that a claim or a CSI driver backs.
func podVolumes(p *corev1.Pod) PodVolumes {
	out := PodVolumes{Namespace: p.Namespace, Name: p.Name}
	for _, v := range p.Spec.Volumes {
		switch {
		case v.PersistentVolumeClaim != nil:
			out.Volumes = append(out.Volumes, PodVolume{Name: v.Name, Claim: v.PersistentVolumeClaim.ClaimName})
		case v.Ephemeral != nil:
			out.Volumes = append(out.Volumes, PodVolume{Name: v.Name, Claim: p.Name + "-" + v.Name})
		case v.CSI != nil:
			out.Volumes = append(out.Volumes, PodVolume{Name: v.Name, Driver: v.CSI.Driver})
		}
	}
	return out
}

func outcomeOf(reason string) string { return repairOutcome[agent.Reason(reason)] }

func eventCount(e *corev1.Event) int32 {
	if e.Series != nil {
		return e.Series.Count
	}
	return e.Count
}

// Table writes the drill-down; wide keeps whole notes.
func (d *NodeDetail) Table(w io.Writer, now time.Time, wide bool) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	vol := d.Volumes.State
	if d.Volumes.State == "broken" || d.Volumes.State == "healthy" {
		vol = fmt.Sprintf("%s %d/%d", d.Volumes.State, d.Volumes.Broken, d.Volumes.Total)
	}
	if d.Volumes.Since != nil {
		vol += " for " + ago(now.Sub(*d.Volumes.Since))
	}
	fmt.Fprintf(tw, "Node:\t%s\n", safe(d.Name))
	fmt.Fprintf(tw, "Ready:\t%s\n", d.Ready)
	fmt.Fprintf(tw, "Volumes:\t%s\n", vol)
	if d.Volumes.Message != "" {
		fmt.Fprintf(tw, "Condition:\t%s\n", safe(d.Volumes.Message))
	}
	agentLine := "none found (no agent pod on this node in the namespace)"
	if a := d.Agent; a != nil {
		agentLine = fmt.Sprintf("%s %s, ready %v, %d restarts", safe(a.Name), a.Phase, a.Ready, a.Restarts)
	}
	fmt.Fprintf(tw, "Agent:\t%s\n", agentLine)
	fmt.Fprintf(tw, "Failover:\t%s\n", d.Failover.State)
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(w, "\nPods with claims or CSI volumes (%d):\n", len(d.Pods))
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NAMESPACE\tPOD\tVOLUME\tCLAIM/DRIVER")
	for _, p := range d.Pods {
		for _, v := range p.Volumes {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", safe(p.Namespace), safe(p.Name), safe(v.Name), safe(orDash(v.Claim+v.Driver)))
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(w, "\nWhat the agent reported (%d events; verified: %s):\n", len(d.Events), safe(d.Verified))
	if err := eventTable(w, now, wide, d.Events); err != nil {
		return err
	}
	if len(d.FailoverEvents) > 0 {
		fmt.Fprintf(w, "\nWhat the failover controller reported (%d events; verified: %s):\n", len(d.FailoverEvents), safe(d.FailoverVerified))
		if err := eventTable(w, now, wide, d.FailoverEvents); err != nil {
			return err
		}
	}
	for _, warn := range d.Warnings {
		if _, err := fmt.Fprintf(w, "warning: %s\n", safe(warn)); err != nil {
			return err
		}
	}
	return nil
}

// eventTable writes events as a table; wide keeps whole notes.
func eventTable(w io.Writer, now time.Time, wide bool, evs []AgentEvent) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "AGE\tTYPE\tREASON\tOBJECT\tCOUNT\tNOTE")
	for _, e := range evs {
		note := e.Note
		if !wide && len(note) > 80 {
			note = note[:77] + "..."
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\n", ago(now.Sub(e.At)), e.Type, safe(e.Reason), safe(e.Object), max(e.Count, 1), safe(strings.ReplaceAll(note, "\n", " ")))
	}
	return tw.Flush()
}
