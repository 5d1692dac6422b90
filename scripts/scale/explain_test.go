package scale

import (
	"bytes"
	"fmt"
	"os"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mountmedic/mountmedic/agent/failover"
)

// explainNotTainted says, for a failure message, why node may not have
// been tainted: what the API server has of it now (Ready condition, its
// kubelet and heartbeat Leases), what the controller's metrics say
// (leader, stand-down, dead and judged nodes) and the controller's log
// lines about it and about its leadership and sight. A liveness failure of
// the duty then names its cause in the CI log, without a rerun.
func (e *env) explainNotTainted(ctrl *controllerProc, node string) string {
	var b strings.Builder
	now := time.Now()
	if n, err := e.admin.CoreV1().Nodes().Get(e.ctx, node, metav1.GetOptions{}); err != nil {
		fmt.Fprintf(&b, "node: %v\n", err)
	} else {
		for _, c := range n.Status.Conditions {
			if c.Type == corev1.NodeReady {
				fmt.Fprintf(&b, "node Ready=%s (reason %q, heartbeat %s ago, transition %s ago)\n", c.Status, c.Reason,
					now.Sub(c.LastHeartbeatTime.Time).Round(time.Second), now.Sub(c.LastTransitionTime.Time).Round(time.Second))
			}
		}
		var taints []string
		for _, t := range n.Spec.Taints {
			taints = append(taints, t.Key+"="+t.Value+":"+string(t.Effect))
		}
		fmt.Fprintf(&b, "node taints: %v\n", taints)
	}
	for _, ns := range []string{failover.KubeletLeaseNamespace, agentNS} {
		l, err := e.admin.CoordinationV1().Leases(ns).Get(e.ctx, node, metav1.GetOptions{})
		switch {
		case err != nil:
			fmt.Fprintf(&b, "lease %s/%s: %v\n", ns, node, err)
		case l.Spec.RenewTime == nil:
			fmt.Fprintf(&b, "lease %s/%s: never renewed\n", ns, node)
		default:
			holder := ""
			if l.Spec.HolderIdentity != nil {
				holder = *l.Spec.HolderIdentity
			}
			fmt.Fprintf(&b, "lease %s/%s: holder %q, renewed %s ago\n", ns, node, holder, now.Sub(l.Spec.RenewTime.Time).Round(time.Second))
		}
	}
	if ctrl != nil {
		if m, err := scrape(ctrl.metrics); err != nil {
			fmt.Fprintf(&b, "controller metrics: %v\n", err)
		} else {
			fmt.Fprintf(&b, "controller: leader %v, stand-down %v, nodes dead %v of %v judged, in failover %v, sight regained %v times\n",
				m["mountmedic_failover_leader"], m["mountmedic_failover_stand_down"], m["mountmedic_failover_nodes_not_ready"],
				m["mountmedic_failover_nodes_judged"], m["mountmedic_failover_nodes_in_failover"], m["mountmedic_failover_watch_regained_total"])
		}
		fmt.Fprintf(&b, "controller log, its lines on %s and on its leadership, sight and stand-downs:\n%s", node,
			grepTail(ctrl.p.Log, 30, node, "leader", "Watching the API server", "Standing down", "Stand-down", "did not sync"))
	}
	return b.String()
}

// grepTail returns the last n lines of the file at path that contain any
// of words.
func grepTail(path string, n int, words ...string) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return fmt.Sprintf("read %s: %v", path, err)
	}
	var out [][]byte
	for line := range bytes.SplitSeq(data, []byte("\n")) {
		for _, w := range words {
			if bytes.Contains(line, []byte(w)) {
				out = append(out, line)
				break
			}
		}
	}
	if len(out) > n {
		out = out[len(out)-n:]
	}
	return string(bytes.Join(out, []byte("\n")))
}
