package deploy_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/client-go/util/retry"

	"github.com/mountmedic/mountmedic/scripts/kubetest"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// The lab node's name and the labels Prometheus gives its scrape target,
// as the PodMonitor's relabelling does in a cluster.
const (
	labNode   = lab.DefaultNodeName
	labJob    = "mountmedic"
	appsNS    = "apps"
	fuseCSI   = "s3.csi.lab.mountmedic.io"
	blockCSI  = "rbd.csi.lab.mountmedic.io"
	nfsPlugin = "kubernetes.io~nfs" // the driver label of in-tree nfs volumes
	rateRange = "5m"                // $__rate_interval: long enough to hold the whole scenario
)

// labVolume is one volume of one pod: a CSI PersistentVolume with its
// claim, or an inline volume of an in-tree plugin (nfs).
type labVolume struct {
	name  string // pod name suffix; PV and PVC names for CSI volumes
	csi   string // CSI driver; empty: an inline nfs volume
	fault string // kill, hang, eio or shutdown (ext4)
	// owned: a ReplicaSet controls the pod (evictable); ready: the pod is
	// Running and Ready, so a PodDisruptionBudget applies to its eviction.
	owned, ready, pdb bool
}

// labVolumes are the scenario. The in-tree volumes are never re-staged, so
// their pods reach the eviction tier; the CSI volumes' drivers are not
// registered on the lab node, so the agent's repairer finds them down and
// leaves their pods be.
var labVolumes = []labVolume{
	{name: "dead", csi: fuseCSI, fault: "kill", owned: true},           // Disconnected (publish, staging, subPath)
	{name: "ext4", csi: blockCSI, fault: "shutdown", owned: true},      // Shutdown
	{name: "gone", fault: "kill", owned: true},                         // Disconnected, evicted
	{name: "hung", fault: "hang", owned: true, ready: true, pdb: true}, // Hung, eviction blocked by a PDB (429)
	{name: "eio", fault: "eio"},                                        // IOError, no controller: never evicted
}

// TestLiveDashboardAndAlerts runs the real `mountmedic agent` under the
// RBAC of deploy/ against a real kube-apiserver, on a lab kubelet tree with
// a dead, a hung and an EIO FUSE volume and a shut-down ext4 volume; a real
// Prometheus scrapes it and loads rules.yaml. Every dashboard query and
// every alert expression must then return data (not NaN), every rule must
// evaluate without error, `promtool check metrics` must pass on the
// agent's /metrics, and testdata/metrics.txt must have its shape.
//
// Queries that need something to have happened, and how the scenario makes
// it happen:
//   - repairs, repair duration, evictions: the agent evicts the ReplicaSet
//     pod of the killed nfs volume (evict tier: in-tree volumes are never
//     re-staged), a PodDisruptionBudget answers 429 for the hung volume's
//     pod, and the EIO pod has no controller. The CSI volumes (dead, shut
//     down) stay broken: their drivers are not registered on the lab node,
//     so the agent's repairer finds them down (mountmedic_driver_up 0).
//   - MountmedicRepairsFailing: the blocked and the refused evictions count
//     as failed evict repairs while mounts stay broken.
//   - MountmedicAgentDown: evaluated after the agent is stopped (and checked
//     empty while it runs).
//   - MountmedicScanStalled: needs two minutes without a finished probe
//     cycle; it is evaluated 125 s after the last scrape (Prometheus's
//     query time parameter) instead of waiting, and checked empty now.
//   - failover (every agent runs with --failover, liveFailoverFlags): a
//     second, simulated node (failover_live_test.go) with a StatefulSet pod
//     on a ReadWriteOnce CSI volume and its own real agent dies with the
//     faults: its kubelet Lease stops and its agent loses the API server.
//     That agent fences (MountmedicNodeFenced; its publish mount is
//     unmounted), the controller (`mountmedic controller` on the lab node,
//     under its own ServiceAccount, elected leader) taints the node
//     out-of-service and force-deletes the pod once the taint eviction
//     controller has marked it terminating (MountmedicFailoverActed, the
//     death-to-action histogram, pod deletions). At the end the node comes
//     back: the fence is lifted and the leader removes its taint.
//     MountmedicHeartbeatFailing: the cut-off agent's failed renewals.
func TestLiveDashboardAndAlerts(t *testing.T) {
	lab.RequireRoot(t)
	promBin := lab.RequireBinary(t, "prometheus")
	pt := promtool(t)
	kc := kubectl(t)
	bin := buildMountmedic(t)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	// The control plane, with deploy/ applied: the agent runs with its
	// node's credentials (Node authorizer, NodeRestriction) and its pod's
	// ServiceAccount token, as the DaemonSet gives them. The controllers:
	// liveControllers.
	c := kubetest.Start(t, kubetest.Options{Controllers: liveControllers, ControllerManagerArgs: liveKCMArgs})
	run(t, ".", kc, "--kubeconfig="+c.Kubeconfig, "apply", "-k", ".")
	run(t, ".", kc, "--kubeconfig="+c.Kubeconfig, "apply", "-f", "controller/serviceaccount.yaml", "-f", "controller/rbac.yaml")
	c.CreateNamespace(t, appsNS)
	// The lab node's Node object, as a real node has (the agent writes its
	// PodVolumeMountsBroken condition there), Ready, its kubelet Lease
	// renewed by the test as the simulated node's is: the failover
	// controller judges it alive.
	if _, err := c.Client.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: labNode}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create node %s: %v", labNode, err)
	}
	err := retry.RetryOnConflict(retry.DefaultRetry, func() error {
		node, err := c.Client.CoreV1().Nodes().Get(ctx, labNode, metav1.GetOptions{})
		if err != nil {
			return err
		}
		now := metav1.Now()
		node.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: corev1.ConditionTrue, Reason: "KubeletReady",
			LastHeartbeatTime: now, LastTransitionTime: now}}
		_, err = c.Client.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		t.Fatalf("set node %s Ready: %v", labNode, err)
	}
	go (&simNode{name: labNode, cs: c.Client, kubeletOn: true}).kubelet(ctx)
	credentials := agentCredentials(ctx, t, c, labNode, "")

	// Pods in the API and their volumes in a lab kubelet tree.
	kl := lab.NewKubelet(t, filepath.Join(t.TempDir(), "var", "lib", "kubelet"))
	faults, unhang := createWorkload(ctx, t, c.Client, kl)

	// The agent: the DaemonSet's own arguments and environment, the
	// failover duty turned on, then what differs in the lab (later flags
	// win).
	ds, _ := daemonSet(t)
	metricsAddr := freeAddr(t)
	dsArgs := append(slices.Clone(ds.Spec.Template.Spec.Containers[0].Args), liveFailoverFlags...)
	// The peer key the DaemonSet mounts from the Secret mountmedic-peer-key:
	// both agents check their peers as shipped.
	peerKey := filepath.Join(t.TempDir(), "peer-key")
	if err := os.WriteFile(peerKey, []byte("live-test-peer-key-0123456789abcdef0123456789"), 0o400); err != nil {
		t.Fatal(err)
	}
	dsArgs = append(dsArgs, "--failover-peer-key-file="+peerKey, "--failover-peer-listen=127.0.0.1:0")
	args := append(append(slices.Clone(dsArgs), credentials...), "--node-name="+labNode, "--kubelet-root="+kl.Root(),
		"--host-table=/proc/self/mountinfo", "--metrics-addr="+metricsAddr, "-v=2")
	agent := startProcess(t, "agent", []string{"POD_NAMESPACE=mountmedic", "POD_NAME=mountmedic-" + labNode}, bin, args...)
	started := time.Now()
	// A thread blocked in a FUSE request the daemon has read cannot be
	// killed: the agent process cannot exit until the hung connection is
	// aborted. Cleanups run last-in first-out: this one before the agent's.
	t.Cleanup(unhang)

	// The failover controller, on the lab node, under its own
	// ServiceAccount, with the Deployment's arguments.
	ctlArgs := append(slices.Clone(decodeController(t, renderOverlay(t, "controller", controllerOverlay)).Spec.Template.Spec.Containers[0].Args), liveControllerFlags...)
	ctlAddr := freeAddr(t)
	ctlArgs = append(ctlArgs, "--kubeconfig="+writeKubeconfig(t, c.ServiceAccountConfig(t, "mountmedic", "mountmedic-controller"), ""), "--metrics-addr="+ctlAddr, "-v=2")
	ctl := startProcess(t, "controller", []string{"POD_NAMESPACE=mountmedic", "POD_NAME=" + controllerPod}, bin, ctlArgs...)

	// The simulated node that is going to die, and its agent.
	sim := startSimNode(ctx, t, c, bin, dsArgs)

	// Prometheus scrapes both agents and the controller every second and
	// evaluates the rules.
	prom := startPrometheus(t, promBin, scrapeTarget{addr: metricsAddr, node: labNode}, scrapeTarget{addr: sim.metricsAddr, node: simNodeName},
		scrapeTarget{addr: ctlAddr, node: labNode, pod: controllerPod})

	// The faults, once the agent has seen the volumes healthy, the
	// controller leads the failover duty and both heartbeats are renewed.
	waitQuery(ctx, t, prom, fmt.Sprintf(`sum(mountmedic_kubelet_mounts{node=%q, kind=~"publish|plugin"}) >= %d`, labNode, len(labVolumes)))
	waitQuery(ctx, t, prom, fmt.Sprintf(`mountmedic_failover_leader{node=%q} == 1`, labNode))
	for _, n := range []string{labNode, simNodeName} {
		waitQuery(ctx, t, prom, fmt.Sprintf(`mountmedic_failover_heartbeat_renewals_total{node=%q, result="success"} > 0`, n))
	}
	if mounted, _ := sim.publishMounted(t); !mounted {
		t.Fatalf("%s: the simulated node's publish target is not mounted before the partition", sim.publish)
	}
	for _, f := range faults {
		f()
	}
	sim.partition()
	faulted := time.Now()

	// Every query returns data.
	queries := liveQueries(t)
	deadline := time.Now().Add(3 * time.Minute)
	for {
		failing := 0
		for i := range queries {
			q := &queries[i]
			if q.ok {
				continue
			}
			q.result, q.err = prom.query(q.expr, time.Now().Add(q.shift))
			q.ok = q.err == nil && q.want == hasData(q.result)
			if !q.ok {
				failing++
			}
		}
		if failing == 0 {
			break
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			for _, q := range queries {
				if !q.ok {
					t.Errorf("%s: %s\n  want data: %v, got %v (err %v)", q.name, q.expr, q.want, q.result, q.err)
				}
			}
			t.Fatalf("%d of %d queries never gave what they should; agent log:\n%s", failing, len(queries), agent.Tail(40))
		}
		time.Sleep(2 * time.Second)
	}
	t.Logf("%d queries evaluated against the live agents, all as expected %.0f s after the faults", len(queries), time.Since(faulted).Seconds())
	checkFailover(ctx, t, prom, sim)

	// With -update, the dashboard picture (docs/alerts.md), from this Prometheus
	// after a little more history.
	if *update {
		time.Sleep(20 * time.Second)
		writePreview(t, prom, started, time.Now())
	}

	// The rule engine evaluated every rule without error, and the alerts
	// the scenario raises are pending (their "for" has not passed) or firing.
	checkRules(t, prom, "MountmedicStaleMounts", "MountmedicHungMounts", "MountmedicRepairsFailing",
		"MountmedicFailoverActed", "MountmedicNodeFenced", "MountmedicHeartbeatFailing")

	// The agent's own /metrics: promtool's lint, and the capture's shape.
	body := httpGet(t, "http://"+metricsAddr+"/metrics")
	cmd := exec.Command(pt, "check", "metrics")
	cmd.Stdin = bytes.NewReader(body)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("promtool check metrics on the agent's /metrics: %v\n%s", err, out)
	}
	compareCapture(t, body, metricsCapture)
	ctlBody := httpGet(t, "http://"+ctlAddr+"/metrics")
	cmd = exec.Command(pt, "check", "metrics")
	cmd.Stdin = bytes.NewReader(ctlBody)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("promtool check metrics on the controller's /metrics: %v\n%s", err, out)
	}
	compareCapture(t, ctlBody, controllerCapture)
	logUsage(t, prom)
	_ = ctl

	// The simulated node comes back: its agent lifts the fence, the leader
	// removes its taint.
	healFailover(ctx, t, prom, sim)

	// Agent down: stop it; up turns 0 and the alert expression has data.
	// The hung FUSE connection is aborted first, as a re-stage would:
	// otherwise the thread probing it keeps the process from exiting.
	unhang()
	agent.stop(t)
	waitQuery(ctx, t, prom, `up{job="mountmedic"} == 0`)
	for _, a := range alerts(t) {
		if a.Alert != "MountmedicAgentDown" {
			continue
		}
		res, err := prom.query(a.Expr, time.Now())
		if err != nil || !hasData(res) {
			t.Errorf("MountmedicAgentDown after the agent stopped: %s = %v (err %v), want data", a.Expr, res, err)
		}
	}
}

// liveQuery is one expression to evaluate against the live Prometheus.
type liveQuery struct {
	name, expr string
	// shift moves the evaluation time; want is whether data is expected.
	shift  time.Duration
	want   bool
	ok     bool
	result model.Vector
	err    error
}

// liveQueries lists every dashboard query (variables substituted), the
// variables' own queries and every alert expression, with the exceptions
// described on TestLiveDashboardAndAlerts.
func liveQueries(t *testing.T) []liveQuery {
	t.Helper()
	subst := strings.NewReplacer(`$__rate_interval`, rateRange, `$__range`, "1h", `$node`, labNode, `$driver`, ".*", `$job`, labJob)
	var qs []liveQuery
	// The scenario itself: each fault seen in its state, each eviction
	// outcome counted. (A shut-down ext4 shows only in the mount table's
	// super options, which the agent re-reads at its resync, 30 s by
	// default: nothing wakes it when a filesystem shuts down.)
	for _, s := range []struct{ driver, kind, state string }{
		{fuseCSI, "publish", "Disconnected"}, {fuseCSI, "subpath", "Disconnected"}, {blockCSI, "publish", "Shutdown"},
		{nfsPlugin, "plugin", "Disconnected"}, {nfsPlugin, "plugin", "Hung"}, {nfsPlugin, "plugin", "IOError"},
	} {
		qs = append(qs, liveQuery{name: "scenario: " + s.state + " " + s.kind + " mounts of " + s.driver, want: true,
			expr: fmt.Sprintf(`mountmedic_stale_mounts{node=%q, driver=%q, kind=%q, state=%q} > 0`, labNode, s.driver, s.kind, s.state)})
	}
	for _, r := range []string{`result="evicted"} > 0`, `result="blocked_by_pdb"} > 0`, `result="no_controller"} > 0`} {
		qs = append(qs, liveQuery{name: "scenario: evictions " + r, want: true, expr: `mountmedic_evictions_total{` + r})
	}
	// The failover: the simulated node fenced itself, the controller leads
	// and failed the node over, its pod was force-deleted.
	for name, expr := range map[string]string{
		"controller leads":        fmt.Sprintf(`mountmedic_failover_leader{node=%q} == 1`, labNode),
		"simulated node fenced":   fmt.Sprintf(`mountmedic_failover_node_fenced{node=%q} == 1`, simNodeName),
		"node failed over":        fmt.Sprintf(`mountmedic_failover_failovers_total{node=%q, result="success"} > 0`, labNode),
		"failed-over node named":  fmt.Sprintf(`mountmedic_failover_last_failover_timestamp_seconds{node=%q, failed_node=%q} > 0`, labNode, simNodeName),
		"its pod force-deleted":   fmt.Sprintf(`mountmedic_failover_pod_deletions_total{node=%q, result="success"} > 0`, labNode),
		"death to action timed":   fmt.Sprintf(`mountmedic_failover_death_to_action_seconds_count{node=%q} > 0`, labNode),
		"lab node never fenced":   fmt.Sprintf(`mountmedic_failover_fences_total{node=%q} == 0`, labNode),
		"no failed fail-over":     fmt.Sprintf(`mountmedic_failover_failovers_total{node=%q, result="failure"} == 0`, labNode),
		"no failed pod deletion":  fmt.Sprintf(`mountmedic_failover_pod_deletions_total{node=%q, result="failure"} == 0`, labNode),
		"heartbeat renewals fail": fmt.Sprintf(`mountmedic_failover_heartbeat_renewals_total{node=%q, result="failure"} > 0`, simNodeName),
	} {
		qs = append(qs, liveQuery{name: "scenario: failover: " + name, want: true, expr: expr})
	}
	// The node condition: the lab's broken mounts set it True on the
	// agent's own Node.
	for name, expr := range map[string]string{
		"condition True":    fmt.Sprintf(`mountmedic_node_condition_broken{node=%q} == 1`, labNode),
		"condition written": fmt.Sprintf(`mountmedic_node_condition_writes_total{node=%q, result="success"} > 0`, labNode),
	} {
		qs = append(qs, liveQuery{name: "scenario: node condition: " + name, want: true, expr: expr})
	}
	add := func(q liveQuery) { qs = append(qs, q) }
	for _, tg := range dashboardTargets(t) {
		add(liveQuery{name: fmt.Sprintf("panel %q query %s", tg.panel, tg.ref), expr: subst.Replace(tg.expr), want: true})
	}
	// Variables: label_values(M, L) has data when M has series with L.
	add(liveQuery{name: "variable node", expr: fmt.Sprintf(`mountmedic_build_info{node=%q}`, labNode), want: true})
	for _, d := range []string{fuseCSI, blockCSI, nfsPlugin} {
		add(liveQuery{name: "variable driver " + d, expr: fmt.Sprintf(`mountmedic_stale_mounts{node=~%q, driver=%q}`, labNode, d), want: true})
	}
	for _, a := range alerts(t) {
		switch a.Alert {
		case "MountmedicAgentDown":
			add(liveQuery{name: "alert " + a.Alert + " while the agent runs", expr: a.Expr, want: false})
		case "MountmedicAgentsUnavailable":
			// The lab runs no kube-state-metrics, whose series it reads:
			// no data; rules_test.yaml gives it data with promtool.
			add(liveQuery{name: "alert " + a.Alert + " without kube-state-metrics", expr: a.Expr, want: false})
		case "MountmedicNodeConditionFailing":
			// The lab agent writes its Node with the node's identity, as
			// shipped: its writes succeed.
			add(liveQuery{name: "alert " + a.Alert + " while the agent writes its node", expr: a.Expr, want: false})
		case "MountmedicScanStalled":
			add(liveQuery{name: "alert " + a.Alert + " now", expr: a.Expr, want: false})
			add(liveQuery{name: "alert " + a.Alert + " 125 s after the last scrape", expr: a.Expr, shift: 125 * time.Second, want: true})
		default:
			add(liveQuery{name: "alert " + a.Alert, expr: a.Expr, want: true})
		}
	}
	return qs
}

// hasData reports a vector with at least one sample that is a number.
func hasData(v model.Vector) bool {
	for _, s := range v {
		if !math.IsNaN(float64(s.Value)) {
			return true
		}
	}
	return false
}

// createWorkload creates in the API the pods, claims and volumes of
// labVolumes, lays out their mounts in the kubelet tree, and returns the
// functions that inject each volume's fault.
func createWorkload(ctx context.Context, t *testing.T, cs kubernetes.Interface, kl *lab.Kubelet) (faults []func(), unhang func()) {
	t.Helper()
	rs, err := cs.AppsV1().ReplicaSets(appsNS).Create(ctx, &appsv1.ReplicaSet{
		ObjectMeta: metav1.ObjectMeta{Name: "web"},
		Spec: appsv1.ReplicaSetSpec{
			Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"app": "web"}},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: map[string]string{"app": "web"}},
				Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "app", Image: "busybox"}}},
			},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create ReplicaSet: %v", err)
	}
	for _, v := range labVolumes {
		volume := corev1.Volume{Name: "data", VolumeSource: corev1.VolumeSource{NFS: &corev1.NFSVolumeSource{Server: "nfs.lab", Path: "/export/" + v.name}}}
		handle := "vol-" + v.name
		if v.csi != "" {
			createClaim(ctx, t, cs, v.name, v.csi, handle)
			volume.VolumeSource = corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: "data-" + v.name}}
		}
		pod := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: "web-" + v.name, Labels: map[string]string{"app": "web", "volume": v.name}},
			Spec: corev1.PodSpec{
				NodeName:   labNode,
				Containers: []corev1.Container{{Name: "app", Image: "busybox", VolumeMounts: []corev1.VolumeMount{{Name: "data", MountPath: "/data"}}}},
				Volumes:    []corev1.Volume{volume},
			},
		}
		if v.owned {
			yes := true
			pod.OwnerReferences = []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: rs.Name, UID: rs.UID, Controller: &yes}}
		}
		pod, err = cs.CoreV1().Pods(appsNS).Create(ctx, pod, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("create pod: %v", err)
		}
		if v.ready {
			// A Pending pod ignores its PodDisruptionBudget on eviction.
			pod.Status.Phase = corev1.PodRunning
			pod.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}
			if _, err := cs.CoreV1().Pods(appsNS).UpdateStatus(ctx, pod, metav1.UpdateOptions{}); err != nil {
				t.Fatalf("set pod %s running: %v", pod.Name, err)
			}
		}
		if v.pdb {
			one := intstr.FromInt32(1)
			_, err := cs.PolicyV1().PodDisruptionBudgets(appsNS).Create(ctx, &policyv1.PodDisruptionBudget{
				ObjectMeta: metav1.ObjectMeta{Name: "web-" + v.name},
				Spec:       policyv1.PodDisruptionBudgetSpec{MinAvailable: &one, Selector: &metav1.LabelSelector{MatchLabels: map[string]string{"volume": v.name}}},
			}, metav1.CreateOptions{})
			if err != nil {
				t.Fatalf("create PDB: %v", err)
			}
		}

		// The mounts, where kubelet and the driver would make them.
		uid := string(pod.UID)
		var fs *lab.FaultFS
		switch {
		case v.fault == "shutdown":
			staging := kl.StagingPath(v.csi, handle)
			ext4 := lab.NewExt4(t, staging, 16)
			kl.Publish(uid, "pv-"+v.name, v.csi, handle, staging, false)
			faults = append(faults, ext4.Shutdown)
			continue
		case v.csi != "":
			staging := kl.StagingPath(v.csi, handle)
			fs = lab.StartFaultFS(t, staging)
			if err := os.Mkdir(filepath.Join(staging, "sub"), 0o755); err != nil {
				t.Fatal(err)
			}
			kl.Publish(uid, "pv-"+v.name, v.csi, handle, staging, false)
			kl.SubPath(uid, "data", "app", 0, filepath.Join(staging, "sub"))
		default:
			fs = lab.StartFaultFS(t, filepath.Join(kl.Root(), "pods", uid, "volumes", "kubernetes.io~nfs", "data"))
		}
		switch v.fault {
		case "kill":
			faults = append(faults, fs.Kill)
		case "hang":
			faults = append(faults, fs.Hang)
			unhang = fs.Abort
		case "eio":
			faults = append(faults, func() { fs.SetErrno(syscall.EIO) })
		default:
			t.Fatalf("volume %s: unknown fault %q", v.name, v.fault)
		}
	}
	return faults, unhang
}

// createClaim creates a CSI PersistentVolume and the claim bound to it.
func createClaim(ctx context.Context, t *testing.T, cs kubernetes.Interface, name, driver, handle string) {
	t.Helper()
	_, err := cs.CoreV1().PersistentVolumes().Create(ctx, &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: "pv-" + name},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
			AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
			PersistentVolumeSource:        corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: driver, VolumeHandle: handle}},
			ClaimRef:                      &corev1.ObjectReference{Namespace: appsNS, Name: "data-" + name},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create PV: %v", err)
	}
	empty := ""
	_, err = cs.CoreV1().PersistentVolumeClaims(appsNS).Create(ctx, &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "data-" + name},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
			VolumeName:       "pv-" + name,
			StorageClassName: &empty,
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create PVC: %v", err)
	}
}

// writeKubeconfig writes a kubeconfig that authenticates with rc's bearer
// token, reaching the API server at server (empty: rc's).
func writeKubeconfig(t *testing.T, rc *rest.Config, server string) string {
	t.Helper()
	if server == "" {
		server = rc.Host
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["lab"] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: rc.CAData}
	cfg.AuthInfos["token"] = &clientcmdapi.AuthInfo{Token: rc.BearerToken}
	cfg.Contexts["lab"] = &clientcmdapi.Context{Cluster: "lab", AuthInfo: "token"}
	cfg.CurrentContext = "lab"
	path := filepath.Join(t.TempDir(), "kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatal(err)
	}
	return path
}

// agentCredentials lays out what the DaemonSet gives node's agent and
// returns the agent's flags for them: the kubelet's kubeconfig (node's own
// identity, its certificate in a file, as kubeadm writes it) and the token
// kubelet projects into the agent's pod (a pod mountmedic-<node> bound to
// node, which this creates), both reaching the API server at server
// (empty: directly).
func agentCredentials(ctx context.Context, t *testing.T, c *kubetest.Cluster, node, server string) []string {
	t.Helper()
	dir := t.TempDir()
	nodeKubeconfig := filepath.Join(dir, "etc", "kubernetes", "kubelet.conf")
	c.WriteNodeKubeconfig(t, nodeKubeconfig, filepath.Join(dir, "var", "lib", "kubelet"), node, server)
	pod, err := c.Client.CoreV1().Pods("mountmedic").Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "mountmedic-" + node, Labels: map[string]string{"app.kubernetes.io/name": "mountmedic"}},
		Spec: corev1.PodSpec{NodeName: node, ServiceAccountName: "mountmedic",
			Containers: []corev1.Container{{Name: "agent", Image: "mountmedic"}},
			// The DaemonSet's: the taint eviction controller must leave it
			// (and so its token) on an out-of-service node.
			Tolerations: []corev1.Toleration{{Operator: corev1.TolerationOpExists}}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create the agent's pod on %s: %v", node, err)
	}
	return []string{"--node-kubeconfig=" + nodeKubeconfig, "--kubeconfig=" + writeKubeconfig(t, c.PodTokenConfig(t, pod), server)}
}

// freeAddr returns a loopback address with a port free right now.
func freeAddr(t *testing.T) string {
	t.Helper()
	ports, err := lab.FreePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[0]))
}

// process is a program the live test runs, killed with the test binary.
type process struct{ *lab.Process }

// startProcess starts bin with args and the test's environment plus env.
func startProcess(t *testing.T, name string, env []string, bin string, args ...string) *process {
	t.Helper()
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), env...)
	lp, err := lab.RunProcess(name, cmd, filepath.Join(t.TempDir(), name+".log"))
	if err != nil {
		t.Fatal(err)
	}
	p := &process{lp}
	t.Cleanup(func() {
		p.stop(t)
		if t.Failed() {
			t.Logf("last lines of %s:\n%s", name, p.Tail(30))
		}
	})
	return p
}

// stop sends SIGTERM, and SIGKILL when the process has not exited 10 s
// later, which fails the test: the agent must stop on SIGTERM.
func (p *process) stop(t *testing.T) {
	if p.Stop(10 * time.Second) {
		t.Errorf("%s did not stop within 10 s of SIGTERM; killed it", p.Name)
	}
}

// promServer is a running Prometheus.
type promServer struct {
	url string
	p   *process
}

// scrapeTarget is an agent's (or the controller's) metrics address, its
// node and its pod ("": mountmedic-<node>, an agent's).
type scrapeTarget struct{ addr, node, pod string }

// controllerPod is the lab controller's pod name.
const controllerPod = "mountmedic-controller-0"

// startPrometheus starts Prometheus on a free loopback port with a fresh
// data directory, scraping the agents every second as job mountmedic with
// the node and pod labels the PodMonitor gives, and evaluating rules.yaml
// every second.
func startPrometheus(t *testing.T, bin string, targets ...scrapeTarget) *promServer {
	t.Helper()
	dir := t.TempDir()
	rules, err := filepath.Abs(rulesFile)
	if err != nil {
		t.Fatal(err)
	}
	cfg := fmt.Sprintf(`global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files:
  - %q
scrape_configs:
  - job_name: %s
    static_configs:
`, rules, labJob)
	for _, tg := range targets {
		pod := tg.pod
		if pod == "" {
			pod = "mountmedic-" + tg.node
		}
		cfg += fmt.Sprintf(`      - targets: [%q]
        labels:
          node: %q
          pod: %q
          namespace: mountmedic
`, tg.addr, tg.node, pod)
	}
	cfgPath := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	addr := freeAddr(t)
	p := startProcess(t, "prometheus", nil, bin, "--config.file="+cfgPath, "--storage.tsdb.path="+filepath.Join(dir, "data"),
		"--web.listen-address="+addr, "--log.level=warn")
	s := &promServer{url: "http://" + addr, p: p}
	deadline := time.Now().Add(time.Minute)
	for {
		resp, err := http.Get(s.url + "/-/ready")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return s
			}
		}
		if p.Exited() {
			t.Fatalf("prometheus exited:\n%s", p.Tail(20))
		}
		if time.Now().After(deadline) {
			t.Fatalf("prometheus not ready after a minute:\n%s", p.Tail(20))
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// query evaluates an instant query at time at.
func (s *promServer) query(expr string, at time.Time) (model.Vector, error) {
	v := url.Values{"query": {expr}, "time": {strconv.FormatFloat(float64(at.UnixNano())/1e9, 'f', 3, 64)}}
	resp, err := http.Get(s.url + "/api/v1/query?" + v.Encode())
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var r struct {
		Status string `json:"status"`
		Error  string `json:"error"`
		Data   struct {
			ResultType string          `json:"resultType"`
			Result     json.RawMessage `json:"result"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil {
		return nil, fmt.Errorf("decode answer: %w", err)
	}
	if r.Status != "success" {
		return nil, fmt.Errorf("query %s: %s", expr, r.Error)
	}
	switch r.Data.ResultType {
	case "vector":
		var vec model.Vector
		if err := json.Unmarshal(r.Data.Result, &vec); err != nil {
			return nil, err
		}
		return vec, nil
	case "scalar":
		var sc model.Scalar
		if err := json.Unmarshal(r.Data.Result, &sc); err != nil {
			return nil, err
		}
		return model.Vector{{Value: sc.Value, Timestamp: sc.Timestamp}}, nil
	}
	return nil, fmt.Errorf("query %s: result type %s, want a vector", expr, r.Data.ResultType)
}

// waitQuery waits until expr has data.
func waitQuery(ctx context.Context, t *testing.T, s *promServer, expr string) {
	t.Helper()
	for {
		res, err := s.query(expr, time.Now())
		if err == nil && hasData(res) {
			return
		}
		select {
		case <-ctx.Done():
			t.Fatalf("waiting for %s: %v (last: %v, err %v)", expr, ctx.Err(), res, err)
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// checkRules reads the rule engine's state: every rule healthy, and the
// named alerts active (pending or firing).
func checkRules(t *testing.T, s *promServer, active ...string) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		errs := ruleErrors(t, s, active)
		if len(errs) == 0 {
			return
		}
		if time.Now().After(deadline) {
			for _, e := range errs {
				t.Error(e)
			}
			return
		}
		time.Sleep(time.Second)
	}
}

// ruleErrors says what is wrong with the rule engine's state now.
func ruleErrors(t *testing.T, s *promServer, active []string) []string {
	t.Helper()
	var errs []string
	var r struct {
		Data struct {
			Groups []struct {
				Rules []struct {
					Name      string `json:"name"`
					Health    string `json:"health"`
					LastError string `json:"lastError"`
					State     string `json:"state"`
				} `json:"rules"`
			} `json:"groups"`
		} `json:"data"`
	}
	if err := json.Unmarshal(httpGet(t, s.url+"/api/v1/rules"), &r); err != nil {
		t.Fatal(err)
	}
	seen := 0
	for _, g := range r.Data.Groups {
		for _, rule := range g.Rules {
			seen++
			if rule.Health != "ok" {
				errs = append(errs, fmt.Sprintf("rule %s: health %q, last error %q", rule.Name, rule.Health, rule.LastError))
			}
			if slices.Contains(active, rule.Name) && rule.State != "pending" && rule.State != "firing" {
				errs = append(errs, fmt.Sprintf("alert %s is %q, want pending or firing", rule.Name, rule.State))
			}
		}
	}
	if want := len(alerts(t)); seen != want {
		errs = append(errs, fmt.Sprintf("Prometheus loaded %d rules, want %d", seen, want))
	}
	return errs
}

func httpGet(t *testing.T, u string) []byte {
	t.Helper()
	resp, err := http.Get(u)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s %v\n%s", u, resp.Status, err, b)
	}
	return b
}

// captureHeaders open testdata/metrics.txt and
// testdata/controller-metrics.txt.
var captureHeaders = map[string]string{
	metricsCapture: `# CAPTURED from a real mountmedic agent in the fault lab (a dead, a hung and
# an EIO FUSE volume, a shut-down ext4 volume, evictions; with --failover) by
#   go test ./deploy/ -run TestLiveDashboardAndAlerts -update
# The live test fails when the agent's metric families (names, types, label
# names) differ from this file's; TestQueriesUseExportedMetrics checks the
# dashboard's and the alerts' metric names against it and
# controller-metrics.txt without root.
`,
	controllerCapture: `# CAPTURED from a real mountmedic controller in the fault lab (leading,
# after it failed a simulated dead node over) by
#   go test ./deploy/ -run TestLiveDashboardAndAlerts -update
# The live test fails when the controller's metric families (names, types,
# label names) differ from this file's.
`,
}

// shape is a metric family's type and label names.
func shape(t *testing.T, text []byte) map[string]string {
	t.Helper()
	parser := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := parser.TextToMetricFamilies(bytes.NewReader(text))
	if err != nil {
		t.Fatalf("parse metrics: %v", err)
	}
	out := make(map[string]string)
	for name, f := range fams {
		labels := map[string]bool{}
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = true
			}
		}
		var names []string
		for l := range labels {
			names = append(names, l)
		}
		sort.Strings(names)
		out[name] = f.GetType().String() + " {" + strings.Join(names, ",") + "}"
	}
	return out
}

func compareCapture(t *testing.T, live []byte, capture string) {
	t.Helper()
	if *update {
		if err := os.WriteFile(capture, append([]byte(captureHeaders[capture]), live...), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, want := shape(t, live), shape(t, readFile(t, capture))
	for name, s := range want {
		if got[name] != s {
			t.Errorf("metric %s: live %q, %s has %q (rerun with -update if the change is intended)", name, got[name], capture, s)
		}
	}
	for name, s := range got {
		if _, ok := want[name]; !ok {
			t.Errorf("metric %s (%s) is not in %s (rerun with -update)", name, s, capture)
		}
	}
}

// logUsage logs the lab agent's and the controller's CPU and memory in the
// scenario (with the failover duty on), for the requests of the DaemonSet
// and the Deployment.
func logUsage(t *testing.T, s *promServer) {
	t.Helper()
	for _, pod := range []string{"mountmedic-" + labNode, controllerPod} {
		sel := `{job="mountmedic", pod="` + pod + `"}`
		for _, q := range []string{
			`rate(process_cpu_seconds_total` + sel + `[1m])`,
			`max_over_time(process_resident_memory_bytes` + sel + `[5m])`,
			`max_over_time(go_memstats_heap_inuse_bytes` + sel + `[5m])`,
			`max_over_time(go_threads` + sel + `[5m])`,
		} {
			if res, err := s.query(q, time.Now()); err == nil && len(res) > 0 {
				t.Logf("%s = %g", q, float64(res[0].Value))
			}
		}
	}
}
