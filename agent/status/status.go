// Package status builds the cluster view of `mountmedic status` (and the
// kubectl plugin `kubectl mountmedic`): per node, its pod volume mounts'
// health, the last repair and its outcome, and its failover state, from
// what the API server already has: the PodVolumeMountsBroken condition the
// agents keep on their Nodes, the agents' events, the failover heartbeat
// Leases and the out-of-service taint. It reads only; it never writes.
//
// status imports agent and agent/failover for their names (condition type,
// event reasons, labels, taint); neither imports it.
package status

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/kubernetes"

	"github.com/mountmedic/mountmedic/agent"
	"github.com/mountmedic/mountmedic/agent/failover"
)

// Options select what Read reads.
type Options struct {
	// Namespace is mountmedic's (the agents' pods and heartbeat Leases).
	Namespace string
	// Name is the install's name, which its objects' names start with
	// (the chart's fullnameOverride); empty: DefaultName.
	Name string
	// Nodes, when not empty, limits the view to these nodes.
	Nodes []string
	// FenceAfter is the heartbeat's fence window: a heartbeat silent for
	// longer (or its Lease's duration, if longer) reads "fenced".
	FenceAfter time.Duration
	// HeartbeatInterval: a heartbeat older than 1.5 intervals reads
	// "silent".
	HeartbeatInterval time.Duration
	// StaleAfter: a condition whose heartbeat is older reads "stale" (the
	// agent writes it at least every 5 minutes).
	StaleAfter time.Duration
	// Now is the time ages are counted to.
	Now time.Time
}

// Volumes is a node's pod volume mounts as its condition says.
type Volumes struct {
	// State: "healthy", "broken", "stale" (the agent stopped writing) or
	// "unknown" (no condition: no agent, or --node-condition=false).
	State string `json:"state"`
	agent.ConditionSummary
	Since   *time.Time `json:"since,omitempty"`
	Message string     `json:"message,omitempty"`
}

// Repair is the last repair event an agent wrote about a node's pods.
type Repair struct {
	Reason  string    `json:"reason"`
	Outcome string    `json:"outcome"`
	Object  string    `json:"object"`
	Note    string    `json:"note"`
	At      time.Time `json:"at"`
}

// Failover is a node's failover state.
type Failover struct {
	// State: "off" (no heartbeat), "ok", "silent" (heartbeat late),
	// "fenced" (silent past the fence window: the agent stopped its RWO
	// pods, or the node is down), "released" (the agent stopped cleanly),
	// "failed-over" (mountmedic's out-of-service taint is on the node).
	State        string     `json:"state"`
	HeartbeatAge *string    `json:"heartbeatAge,omitempty"`
	TaintedAt    *time.Time `json:"taintedAt,omitempty"`
}

// Node is one row of the view.
type Node struct {
	Name       string   `json:"name"`
	Ready      string   `json:"ready"`
	Volumes    Volumes  `json:"volumes"`
	LastRepair *Repair  `json:"lastRepair,omitempty"`
	Failover   Failover `json:"failover"`
}

// View is the whole cluster's.
type View struct {
	Nodes []Node `json:"nodes"`
	// Warnings are what could not be read (permissions, a bad message):
	// the view is still what could be.
	Warnings []string `json:"warnings,omitempty"`
}

// repairOutcome maps the agent's event reasons to an outcome word.
var repairOutcome = map[agent.Reason]string{
	agent.ReasonVolumeRepaired:  "repaired",
	agent.ReasonNotRepaired:     "not repaired",
	agent.ReasonRepairEscalated: "escalated",
	agent.ReasonEvicting:        "evicting",
	agent.ReasonEvictionBlocked: "eviction blocked",
	agent.ReasonDriverDown:      "driver down",
	agent.ReasonBackendDown:     "backend down",
	agent.ReasonVolumeBroken:    "broken",
	agent.ReasonRepairOptedOut:  "opted out",
	agent.ReasonWouldRepair:     "dry run",
}

// pageSize bounds each list (nodes and events): a 5,000-node cluster is
// read in pages, not one response.
const pageSize = 500

// Read builds the view.
func Read(ctx context.Context, cs kubernetes.Interface, opts Options) (*View, error) {
	return read(ctx, cs, opts, true)
}

// read builds the view, with each node's last repair when repairs.
func read(ctx context.Context, cs kubernetes.Interface, opts Options, repairs bool) (*View, error) {
	if opts.Now.IsZero() {
		opts.Now = time.Now()
	}
	nodes, err := listNodes(ctx, cs, opts.Nodes)
	if err != nil {
		return nil, err
	}
	v := &View{}
	rows := make(map[string]*Node, len(nodes))
	for i := range nodes {
		row := nodeRow(&nodes[i], opts, v)
		rows[row.Name] = row
	}
	readHeartbeats(ctx, cs, opts, rows, v)
	if repairs {
		readRepairs(ctx, cs, readTrust(ctx, cs, opts.Name, EventsPolicy), rows, v)
	}
	for _, r := range rows {
		v.Nodes = append(v.Nodes, *r)
	}
	slices.SortFunc(v.Nodes, func(a, b Node) int { return cmp.Compare(a.Name, b.Name) })
	return v, nil
}

func listNodes(ctx context.Context, cs kubernetes.Interface, names []string) ([]corev1.Node, error) {
	if len(names) > 0 {
		var out []corev1.Node
		for _, n := range names {
			node, err := cs.CoreV1().Nodes().Get(ctx, n, metav1.GetOptions{})
			if err != nil {
				return nil, fmt.Errorf("get node %s: %w%s", n, err, rbacHint(err))
			}
			out = append(out, *node)
		}
		return out, nil
	}
	var out []corev1.Node
	opts := metav1.ListOptions{Limit: pageSize}
	for {
		l, err := cs.CoreV1().Nodes().List(ctx, opts)
		if err != nil {
			return nil, fmt.Errorf("list nodes: %w%s", err, rbacHint(err))
		}
		out = append(out, l.Items...)
		if l.Continue == "" {
			return out, nil
		}
		opts.Continue = l.Continue
	}
}

func nodeRow(n *corev1.Node, opts Options, v *View) *Node {
	row := &Node{Name: n.Name, Ready: "Unknown", Volumes: Volumes{State: "unknown"}, Failover: Failover{State: "off"}}
	for _, c := range n.Status.Conditions {
		switch c.Type {
		case corev1.NodeReady:
			row.Ready = string(c.Status)
		case agent.ConditionType:
			since := c.LastTransitionTime.Time
			row.Volumes.Since, row.Volumes.Message = &since, c.Message
			sum, err := agent.ParseConditionMessage(c.Message)
			if err != nil {
				v.Warnings = append(v.Warnings, fmt.Sprintf("node %s: %v", n.Name, err))
			}
			row.Volumes.ConditionSummary = sum
			switch {
			case opts.StaleAfter > 0 && opts.Now.Sub(c.LastHeartbeatTime.Time) > opts.StaleAfter:
				row.Volumes.State = "stale"
			case c.Status == corev1.ConditionTrue:
				row.Volumes.State = "broken"
			case c.Status == corev1.ConditionFalse:
				row.Volumes.State = "healthy"
			}
		}
	}
	for _, t := range n.Spec.Taints {
		if t.Key == failover.TaintOutOfService && t.Value == failover.TaintValue {
			row.Failover.State = "failed-over"
			if t.TimeAdded != nil {
				at := t.TimeAdded.Time
				row.Failover.TaintedAt = &at
			}
		}
	}
	return row
}

// readHeartbeats reads the failover heartbeat Leases (one list of the
// namespace, by their label).
func readHeartbeats(ctx context.Context, cs kubernetes.Interface, opts Options, rows map[string]*Node, v *View) {
	sel := labels.SelectorFromSet(labels.Set{failover.HeartbeatLabel: failover.HeartbeatLabelValue}).String()
	lo := metav1.ListOptions{LabelSelector: sel, Limit: pageSize}
	for {
		l, err := cs.CoordinationV1().Leases(opts.Namespace).List(ctx, lo)
		if err != nil {
			v.Warnings = append(v.Warnings, fmt.Sprintf("heartbeat leases in %s: %v", opts.Namespace, err))
			return
		}
		for i := range l.Items {
			if row := rows[l.Items[i].Name]; row != nil {
				heartbeat(row, &l.Items[i], opts)
			}
		}
		if l.Continue == "" {
			return
		}
		lo.Continue = l.Continue
	}
}

func heartbeat(row *Node, l *coordinationv1.Lease, opts Options) {
	if row.Failover.State == "failed-over" {
		return
	}
	if l.Spec.HolderIdentity == nil || *l.Spec.HolderIdentity == "" {
		row.Failover.State = "released"
		return
	}
	if l.Spec.RenewTime == nil {
		return
	}
	age := opts.Now.Sub(l.Spec.RenewTime.Time).Round(time.Second)
	s := age.String()
	row.Failover.HeartbeatAge = &s
	window := opts.FenceAfter
	if l.Spec.LeaseDurationSeconds != nil {
		window = max(window, time.Duration(*l.Spec.LeaseDurationSeconds)*time.Second)
	}
	switch {
	case window > 0 && age > window:
		row.Failover.State = "fenced"
	case opts.HeartbeatInterval > 0 && age > opts.HeartbeatInterval+opts.HeartbeatInterval/2:
		row.Failover.State = "silent"
	default:
		row.Failover.State = "ok"
	}
}

// readRepairs finds each node's latest repair event: an event of the
// agent (reportingController) naming the node as its reportingInstance,
// which the trust says its node's agent wrote (readTrust). Events the
// trust cannot vouch for are counted in a warning and left out.
func readRepairs(ctx context.Context, cs kubernetes.Interface, tr trust, rows map[string]*Node, v *View) {
	var untrusted int
	err := listAgentEvents(ctx, cs, func(e *corev1.Event) {
		outcome, ok := repairOutcome[agent.Reason(e.Reason)]
		if !ok {
			return
		}
		row := rows[e.ReportingInstance]
		if row == nil {
			return
		}
		if !tr.vouches(e) {
			untrusted++
			return
		}
		at := eventTime(e)
		if row.LastRepair == nil || at.After(row.LastRepair.At) {
			row.LastRepair = &Repair{Reason: e.Reason, Outcome: outcome, Object: objectName(e.InvolvedObject), Note: e.Message, At: at}
		}
	})
	if err != nil {
		v.Warnings = append(v.Warnings, fmt.Sprintf("mountmedic events: %v", err))
	}
	if untrusted > 0 {
		v.Warnings = append(v.Warnings, tr.ignored(untrusted))
	}
}

// listAgentEvents calls each with every event whose reporting controller
// is the agent's, in pages.
func listAgentEvents(ctx context.Context, cs kubernetes.Interface, each func(*corev1.Event)) error {
	return listEvents(ctx, cs, agent.ReportingController, each)
}

// listEvents calls each with every event whose reporting controller is
// controller, in pages.
func listEvents(ctx context.Context, cs kubernetes.Interface, controller string, each func(*corev1.Event)) error {
	lo := metav1.ListOptions{FieldSelector: fields.OneTermEqualSelector("reportingComponent", controller).String(), Limit: pageSize}
	for {
		l, err := cs.CoreV1().Events("").List(ctx, lo)
		if err != nil {
			return err
		}
		for i := range l.Items {
			each(&l.Items[i])
		}
		if l.Continue == "" {
			return nil
		}
		lo.Continue = l.Continue
	}
}

func objectName(o corev1.ObjectReference) string {
	if o.Namespace == "" {
		return strings.ToLower(o.Kind) + "/" + o.Name
	}
	return strings.ToLower(o.Kind) + "/" + o.Namespace + "/" + o.Name
}

// eventTime is when an event last happened.
func eventTime(e *corev1.Event) time.Time {
	switch {
	case e.Series != nil && !e.Series.LastObservedTime.IsZero():
		return e.Series.LastObservedTime.Time
	case !e.EventTime.IsZero():
		return e.EventTime.Time
	case !e.LastTimestamp.IsZero():
		return e.LastTimestamp.Time
	}
	return e.CreationTimestamp.Time
}

// Table writes the view as the default output of mountmedic status; wide
// adds when the volumes' state began, the heartbeat's age and the last
// repair's note.
func (v *View) Table(w io.Writer, now time.Time, wide bool) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	header := "NODE\tREADY\tVOLUMES\tBROKEN MOUNTS\tLAST REPAIR\tFAILOVER"
	if wide {
		header += "\tVOLUMES SINCE\tHEARTBEAT\tREPAIR NOTE"
	}
	fmt.Fprintln(tw, header)
	for _, n := range v.Nodes {
		vol := n.Volumes.State
		if n.Volumes.State == "broken" || n.Volumes.State == "healthy" {
			vol = fmt.Sprintf("%s %d/%d", n.Volumes.State, n.Volumes.Broken, n.Volumes.Total)
		}
		var broken []string
		for _, c := range n.Volumes.Counts {
			broken = append(broken, fmt.Sprintf("%s %s %d", c.Driver, c.State, c.Count))
		}
		if n.Volumes.Truncated {
			broken = append(broken, "...")
		}
		repair := "-"
		if r := n.LastRepair; r != nil {
			repair = fmt.Sprintf("%s %s ago (%s)", r.Outcome, ago(now.Sub(r.At)), r.Object)
		}
		fo := n.Failover.State
		switch {
		case n.Failover.HeartbeatAge != nil && fo != "ok":
			fo += " (heartbeat " + *n.Failover.HeartbeatAge + " ago)"
		case n.Failover.TaintedAt != nil:
			fo += " (" + ago(now.Sub(*n.Failover.TaintedAt)) + " ago)"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s", safe(n.Name), n.Ready, vol, safe(orDash(strings.Join(broken, ", "))), safe(repair), fo)
		if wide {
			since, hb, note := "-", "-", "-"
			if n.Volumes.Since != nil {
				since = ago(now.Sub(*n.Volumes.Since))
			}
			if n.Failover.HeartbeatAge != nil {
				hb = *n.Failover.HeartbeatAge
			}
			if n.LastRepair != nil {
				note = orDash(strings.ReplaceAll(n.LastRepair.Note, "\n", " "))
			}
			fmt.Fprintf(tw, "\t%s\t%s\t%s", since, hb, safe(note))
		}
		fmt.Fprintln(tw)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, warn := range v.Warnings {
		if _, err := fmt.Fprintf(w, "warning: %s\n", safe(warn)); err != nil {
			return err
		}
	}
	return nil
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// ago rounds a duration the way kubectl's AGE column does.
func ago(d time.Duration) string {
	switch {
	case d < 0:
		return "0s"
	case d < 2*time.Minute:
		return fmt.Sprintf("%ds", int(d.Seconds()))
	case d < 2*time.Hour:
		return fmt.Sprintf("%dm", int(d.Minutes()))
	case d < 48*time.Hour:
		return fmt.Sprintf("%dh", int(d.Hours()))
	}
	return fmt.Sprintf("%dd", int(d.Hours()/24))
}

// safe keeps names and notes (which pods' users choose) from writing
// control characters to the terminal: they are shown escaped.
func safe(s string) string {
	if !strings.ContainsFunc(s, func(r rune) bool { return r < 0x20 || r == 0x7f }) {
		return s
	}
	q := strconv.Quote(s)
	return q[1 : len(q)-1]
}

// Unhealthy is the view of the nodes that need a look: volumes not healthy
// (broken, stale, unknown) or a failover state other than ok or off.
func (v *View) Unhealthy() *View {
	out := &View{Warnings: v.Warnings}
	for _, n := range v.Nodes {
		if n.Volumes.State != "healthy" || (n.Failover.State != "ok" && n.Failover.State != "off") {
			out.Nodes = append(out.Nodes, n)
		}
	}
	return out
}
