package deploy_test

import (
	"context"
	"encoding/json"
	"fmt"
	"testing"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/mountmedic/mountmedic/agent/failover"
	"github.com/mountmedic/mountmedic/scripts/kubetest"
)

// TestControllerBlastRadius applies the base with the failover controller
// Component to a real kube-apiserver and uses the controller's
// ServiceAccount token as someone who stole it would: RBAC lets it patch
// any node and delete any pod; deploy/controller/admission-policy.yaml and
// no-force-detach-policy.yaml hold it to the controller's job. Every
// request the controller itself makes is allowed; every other is refused.
func TestControllerBlastRadius(t *testing.T) { controllerBlastRadius(t, baseNamespace, "") }

// TestControllerBlastRadiusRenamed is TestControllerBlastRadius for a Helm
// install under fullnameOverride in another namespace: the policies must
// hold the renamed controller's ServiceAccount as they hold
// mountmedic-controller, and let its own requests (its renamed leader
// Lease) pass.
func TestControllerBlastRadiusRenamed(t *testing.T) { controllerBlastRadius(t, "ops", "storage-medic") }

// controllerBlastRadius runs the cases on the base with the controller
// Component, or with fullname on the chart rendered into ns with
// fullnameOverride=fullname.
func controllerBlastRadius(t *testing.T, ns, fullname string) {
	kc := kubectl(t)
	c := kubetest.Start(t, kubetest.Options{})
	name := baseName
	if fullname == "" {
		run(t, ".", kc, "--kubeconfig="+c.Kubeconfig, "apply", "-k", overlayDir(t, "controller", controllerOverlay))
	} else {
		name = fullname
		applyChart(t, c, kc, ns, "fullnameOverride="+fullname, "namespace.create=true", "failover.enabled=true", "controller.enabled=true")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c.CreateNamespace(t, appsNS)
	admin := c.Client
	stolen := clientFor(t, c.ServiceAccountConfig(t, ns, name+"-controller"))

	ready := radiusNode(ctx, t, admin, "live-node", corev1.ConditionTrue)
	dead := radiusNode(ctx, t, admin, "dead-node", corev1.ConditionUnknown)
	// NotReady as its kubelet reports it (a network plugin down): alive.
	notReady := radiusNode(ctx, t, admin, "notready-node", corev1.ConditionFalse)
	ours := corev1.Taint{Key: failover.TaintOutOfService, Value: failover.TaintValue, Effect: corev1.TaintEffectNoExecute}
	patch := func(node string, p map[string]any) func() error {
		return func() error {
			b, _ := json.Marshal(p)
			_, err := stolen.CoreV1().Nodes().Patch(ctx, node, types.MergePatchType, b, metav1.PatchOptions{})
			return err
		}
	}
	taints := func(ts ...corev1.Taint) map[string]any { return map[string]any{"spec": map[string]any{"taints": ts}} }
	// The node's taints now (the API server's TaintNodesByCondition added
	// node.kubernetes.io/not-ready) plus one, as the controller patches
	// them; or minus the duty's.
	current := func(node string) []corev1.Taint {
		n, err := admin.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return n.Spec.Taints
	}
	withTaint := func(node string, tn corev1.Taint) map[string]any { return taints(append(current(node), tn)...) }
	withoutOurs := func(node string) map[string]any {
		keep := []corev1.Taint{}
		for _, tn := range current(node) {
			if tn.Value != failover.TaintValue {
				keep = append(keep, tn)
			}
		}
		return taints(keep...)
	}
	annotate := func(k string, v any) map[string]any {
		return map[string]any{"metadata": map[string]any{"annotations": map[string]any{k: v}}}
	}

	// The policies take effect once the API server has loaded them: a
	// label that changes at each try is refused from then on.
	try := 0
	waitRefused(ctx, t, "relabel a node", func() error {
		try++
		return patch(dead.Name, map[string]any{"metadata": map[string]any{"labels": map[string]any{"probe": fmt.Sprint(try)}}})()
	})
	refused := map[string]func() error{
		"taint a Ready node":              patch(ready.Name, withTaint(ready.Name, ours)),
		"mark a Ready node":               patch(ready.Name, annotate(failover.FailedOverAnnotation, "2026-01-01T00:00:00Z")),
		"taint a NotReady live node":      patch(notReady.Name, withTaint(notReady.Name, ours)),
		"mark a NotReady live node":       patch(notReady.Name, annotate(failover.FailedOverAnnotation, "2026-01-01T00:00:00Z")),
		"taint a dead node NoSchedule":    patch(dead.Name, withTaint(dead.Name, corev1.Taint{Key: ours.Key, Value: ours.Value, Effect: corev1.TaintEffectNoSchedule})),
		"another taint on a dead node":    patch(dead.Name, withTaint(dead.Name, corev1.Taint{Key: failover.TaintOutOfService, Value: "other", Effect: corev1.TaintEffectNoExecute})),
		"relabel a dead node":             patch(dead.Name, map[string]any{"metadata": map[string]any{"labels": map[string]any{"zone": "x"}}}),
		"another annotation":              patch(dead.Name, annotate("example.com/x", "y")),
		"cordon a dead node":              patch(dead.Name, map[string]any{"spec": map[string]any{"unschedulable": true}}),
		"drop a dead node's other taints": patch(dead.Name, taints(ours)),
		"taint and relabel a dead node":   patch(dead.Name, map[string]any{"spec": withTaint(dead.Name, ours)["spec"], "metadata": map[string]any{"labels": map[string]any{"zone": "x"}}}),
		"delete a node (no RBAC either)":  func() error { return stolen.CoreV1().Nodes().Delete(ctx, dead.Name, metav1.DeleteOptions{}) },
	}
	for what, do := range refused {
		if err := do(); !apierrors.IsForbidden(err) {
			t.Errorf("stolen controller token: %s: err = %v, want forbidden", what, err)
		}
	}
	// The controller's own node writes, in the order it makes them.
	for _, step := range []struct {
		what string
		node string
		body func() map[string]any
	}{
		{"taint a dead node", dead.Name, func() map[string]any { return withTaint(dead.Name, ours) }},
		{"remove the taint", dead.Name, func() map[string]any { return withoutOurs(dead.Name) }},
		{"mark a dead node", dead.Name, func() map[string]any { return annotate(failover.FailedOverAnnotation, "2026-01-01T00:00:00Z") }},
		{"unmark it", dead.Name, func() map[string]any { return annotate(failover.FailedOverAnnotation, nil) }},
		{"remove nothing from a Ready node", ready.Name, func() map[string]any { return withoutOurs(ready.Name) }},
	} {
		if err := patch(step.node, step.body())(); err != nil {
			t.Errorf("controller token: %s: %v, want allowed", step.what, err)
		}
	}

	// Pods.
	owner := metav1.OwnerReference{APIVersion: "apps/v1", Kind: "StatefulSet", Name: "db", UID: "0b2a5f8e-0000-4000-8000-000000000001", Controller: ptr.To(true)}
	dsOwner := owner
	dsOwner.Kind, dsOwner.Name = "DaemonSet", "ds"
	claim := corev1.Volume{Name: "data", VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: "data"}}}
	pods := map[string]struct {
		owners  []metav1.OwnerReference
		ann     map[string]string
		volumes []corev1.Volume
		node    string
		ready   corev1.ConditionStatus
		allowed bool
	}{
		"failover candidate":  {owners: []metav1.OwnerReference{owner}, volumes: []corev1.Volume{claim}, node: dead.Name, ready: corev1.ConditionFalse, allowed: true},
		"no controller":       {volumes: []corev1.Volume{claim}, node: dead.Name, ready: corev1.ConditionFalse},
		"a DaemonSet's":       {owners: []metav1.OwnerReference{dsOwner}, volumes: []corev1.Volume{claim}, node: dead.Name, ready: corev1.ConditionFalse},
		"opted out":           {owners: []metav1.OwnerReference{owner}, ann: map[string]string{failover.Annotation: "false"}, volumes: []corev1.Volume{claim}, node: dead.Name, ready: corev1.ConditionFalse},
		"static (mirror)":     {owners: []metav1.OwnerReference{owner}, ann: map[string]string{"kubernetes.io/config.mirror": "x"}, volumes: []corev1.Volume{claim}, node: dead.Name, ready: corev1.ConditionFalse},
		"no claim":            {owners: []metav1.OwnerReference{owner}, node: dead.Name, ready: corev1.ConditionFalse},
		"Ready (a live node)": {owners: []metav1.OwnerReference{owner}, volumes: []corev1.Volume{claim}, node: ready.Name, ready: corev1.ConditionTrue},
		"not scheduled":       {owners: []metav1.OwnerReference{owner}, volumes: []corev1.Volume{claim}},
	}
	i := 0
	for what, p := range pods {
		i++
		pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: appsNS, Name: fmt.Sprintf("pod-%d", i), OwnerReferences: p.owners, Annotations: p.ann},
			Spec: corev1.PodSpec{NodeName: p.node, Containers: []corev1.Container{{Name: "c", Image: "busybox"}}, Volumes: p.volumes}}
		pod, err := admin.CoreV1().Pods(appsNS).Create(ctx, pod, metav1.CreateOptions{})
		if err != nil {
			t.Fatalf("create pod %s: %v", what, err)
		}
		if p.ready != "" {
			pod.Status.Conditions = []corev1.PodCondition{{Type: corev1.PodReady, Status: p.ready}}
			if pod, err = admin.CoreV1().Pods(appsNS).UpdateStatus(ctx, pod, metav1.UpdateOptions{}); err != nil {
				t.Fatalf("pod %s status: %v", what, err)
			}
		}
		err = stolen.CoreV1().Pods(appsNS).Delete(ctx, pod.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64), Preconditions: &metav1.Preconditions{UID: &pod.UID}})
		switch {
		case p.allowed && err != nil:
			t.Errorf("controller token: force-delete the %s pod: %v, want allowed", what, err)
		case !p.allowed && !apierrors.IsForbidden(err):
			t.Errorf("stolen controller token: force-delete the %s pod: err = %v, want forbidden", what, err)
		}
	}

	// VolumeAttachments: no force detach unless an overlay opts in.
	va, err := admin.StorageV1().VolumeAttachments().Create(ctx, &storagev1.VolumeAttachment{
		ObjectMeta: metav1.ObjectMeta{Name: "csi-radius"},
		Spec: storagev1.VolumeAttachmentSpec{Attacher: "radius.csi", NodeName: ready.Name,
			Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: ptr.To("pv-x")}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := stolen.StorageV1().VolumeAttachments().Delete(ctx, va.Name, metav1.DeleteOptions{}); !apierrors.IsForbidden(err) {
		t.Errorf("stolen controller token: delete a VolumeAttachment: err = %v, want forbidden", err)
	}

	// Leases: its leader Lease yes; a heartbeat never.
	leases := stolen.CoordinationV1().Leases(ns)
	if _, err := leases.Create(ctx, &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: name + "-failover-leader"}}, metav1.CreateOptions{}); err != nil {
		t.Errorf("controller token: create the leader Lease: %v", err)
	}
	for what, l := range map[string]*coordinationv1.Lease{
		"heartbeat label": {ObjectMeta: metav1.ObjectMeta{Name: dead.Name, Labels: map[string]string{failover.HeartbeatLabel: failover.HeartbeatLabelValue}}},
		"fence plan":      {ObjectMeta: metav1.ObjectMeta{Name: "x", Annotations: map[string]string{failover.FencePlanAnnotation: `{"fenceAfterSeconds":1,"pods":[]}`}}},
	} {
		if _, err := leases.Create(ctx, l, metav1.CreateOptions{}); !apierrors.IsForbidden(err) {
			t.Errorf("stolen controller token: create a Lease with a %s: err = %v, want forbidden", what, err)
		}
	}

	// Events of the failover controller (failover-events-policy.yaml):
	// from its ServiceAccount only; a node's identity, which may write
	// any other event, is refused.
	failoverEvent := &eventsv1.Event{ObjectMeta: metav1.ObjectMeta{GenerateName: "radius-"}, EventTime: metav1.NowMicro(),
		ReportingController: failover.ReportingController, ReportingInstance: "mountmedic-controller-0",
		Action: "Taint", Reason: failover.ReasonFailedOver, Type: corev1.EventTypeWarning,
		Regarding: corev1.ObjectReference{Kind: "Node", Name: dead.Name}}
	asNode := clientFor(t, c.NodeConfig(t, ready.Name))
	refusal := waitRefused(ctx, t, "a node writes a failover controller event", func() error {
		_, err := asNode.EventsV1().Events("default").Create(ctx, failoverEvent, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return err
	})
	t.Logf("a node writing a failover controller event: %v", refusal)
	if _, err := stolen.EventsV1().Events("default").Create(ctx, failoverEvent, metav1.CreateOptions{}); err != nil {
		t.Errorf("controller token: create its own event: %v", err)
	}
}

// radiusNode creates a node whose Ready condition is status.
func radiusNode(ctx context.Context, t *testing.T, admin kubernetes.Interface, name string, status corev1.ConditionStatus) *corev1.Node {
	t.Helper()
	n, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"zone": "a"},
		Annotations: map[string]string{"example.com/keep": "1"}}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create node %s: %v", name, err)
	}
	now := metav1.Now()
	n.Status.Conditions = []corev1.NodeCondition{{Type: corev1.NodeReady, Status: status, LastHeartbeatTime: now, LastTransitionTime: now}}
	if n, err = admin.CoreV1().Nodes().UpdateStatus(ctx, n, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("node %s status: %v", name, err)
	}
	return n
}
