package deploy_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	eventsv1 "k8s.io/api/events/v1"
	policyv1 "k8s.io/api/policy/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/utils/ptr"

	"github.com/mountmedic/mountmedic/agent"
	"github.com/mountmedic/mountmedic/agent/failover"
	"github.com/mountmedic/mountmedic/scripts/kubetest"
	"github.com/mountmedic/mountmedic/scripts/lab"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// The two nodes of the blast-radius test and the CSI driver of their
// volumes.
const (
	nodeA, nodeB = "node-a", "node-b"
	radiusCSI    = "radius.csi.lab.mountmedic.io"
)

// TestNodeBlastRadius applies deploy/ to a real kube-apiserver
// (--authorization-mode=Node,RBAC, NodeRestriction on) and checks, with real
// requests, what the credentials the shipped DaemonSet gives node A's agent
// reach: its node's identity, read from a kubeconfig laid out as kubeadm
// does (agent.NewNodeClient, as the command does), and its pod's
// ServiceAccount token bound to the pod on node A (as kubelet projects it).
// Node B has the same objects: a pod with a CSI volume whose PV names a
// node-stage and a node-publish Secret, a VolumeAttachment, its Node. From
// node A's credentials every object of node B is refused and node A's own
// are allowed; the ServiceAccount writes only node A's heartbeat Lease.
func TestNodeBlastRadius(t *testing.T) { blastRadius(t, agent.IdentityNode, "", "") }

// TestServiceAccountBlastRadius is TestNodeBlastRadius for
// --identity=serviceaccount (deploy/ with deploy/identity/serviceaccount):
// node A's agent acts with its pod's token alone. Every write that reaches
// node B is refused as with the node identity (the admission policies);
// reads of node B's pods, claims, PVs and attachments are allowed (RBAC
// cannot confine reads to a node), Secrets are refused.
func TestServiceAccountBlastRadius(t *testing.T) {
	blastRadius(t, agent.IdentityServiceAccount, "", "")
}

// TestBlastRadiusOtherNamespace is the blast-radius test of both modes for
// an install that a kustomize overlay moves to another namespace
// (`namespace: ops`): the admission policies must hold a stolen token of
// the moved ServiceAccount to its node as they do in mountmedic, and the
// agent's own writes (its events, its heartbeat) must still pass.
func TestBlastRadiusOtherNamespace(t *testing.T) {
	for _, mode := range []string{agent.IdentityServiceAccount, agent.IdentityNode} {
		t.Run(mode, func(t *testing.T) { blastRadius(t, mode, "ops", "") })
	}
}

// TestBlastRadiusRenamed is the blast-radius test of both modes for a Helm
// install under fullnameOverride in another namespace: every object and
// the agent's ServiceAccount are renamed, and the admission policies must
// hold a stolen token of the renamed ServiceAccount to its node as they
// hold mountmedic's (a policy left matching the name mountmedic would let
// it write anywhere RBAC lets it), while the agent's own writes pass.
func TestBlastRadiusRenamed(t *testing.T) {
	for _, mode := range []string{agent.IdentityServiceAccount, agent.IdentityNode} {
		t.Run(mode, func(t *testing.T) { blastRadius(t, mode, "ops", "storage-medic") })
	}
}

// radiusCase is one request of node A's agent and whether each identity
// mode may make it.
type radiusCase struct {
	name     string
	node, sa bool
	// only: the mode the case applies to (empty: both).
	only string
	do   func() error
}

// blastRadius runs the cases for mode on an install into namespace ns
// (empty: the base's, mountmedic, unchanged; else an overlay setting it).
// With fullname, the install is the Helm chart's, rendered with
// fullnameOverride=fullname into ns.
func blastRadius(t *testing.T, mode, ns, fullname string) {
	kc := kubectl(t)
	c := kubetest.Start(t, kubetest.Options{})
	dir, agentNS, agentSA := ".", baseNamespace, baseName
	overlay := ""
	if mode == agent.IdentityServiceAccount {
		overlay = componentOverlay("identity/serviceaccount")
	}
	if ns != "" {
		agentNS = ns
		if overlay == "" {
			overlay = "resources: [../../deploy]\n"
		}
		overlay = "namespace: " + ns + "\n" + overlay
	}
	if overlay != "" {
		dir = overlayDir(t, "radius-"+mode, overlay)
	}
	if fullname == "" {
		run(t, ".", kc, "--kubeconfig="+c.Kubeconfig, "apply", "-k", dir)
	} else {
		agentSA = fullname
		applyChart(t, c, kc, agentNS, "fullnameOverride="+fullname, "namespace.create=true", "identity="+mode)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	c.CreateNamespace(t, appsNS)
	admin := c.Client

	type nodeObjects struct {
		pod, pod2, agentPod *corev1.Pod
		stage, publish      string // the Secrets the node's PV names
		pv, pvc, va         string
	}
	objs := map[string]*nodeObjects{}
	for _, node := range []string{nodeA, nodeB} {
		o := &nodeObjects{stage: "stage-" + node, publish: "publish-" + node, pv: "pv-" + node, pvc: "data-" + node}
		objs[node] = o
		if _, err := admin.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create node %s: %v", node, err)
		}
		for _, s := range []string{o.stage, o.publish} {
			if _, err := admin.CoreV1().Secrets(appsNS).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: s},
				StringData: map[string]string{"key": s}}, metav1.CreateOptions{}); err != nil {
				t.Fatalf("create secret %s: %v", s, err)
			}
		}
		handle := "vol-" + node
		empty := ""
		if _, err := admin.CoreV1().PersistentVolumes().Create(ctx, &corev1.PersistentVolume{
			ObjectMeta: metav1.ObjectMeta{Name: o.pv},
			Spec: corev1.PersistentVolumeSpec{
				Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
				AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
				PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
					Driver: radiusCSI, VolumeHandle: handle,
					NodeStageSecretRef:   &corev1.SecretReference{Namespace: appsNS, Name: o.stage},
					NodePublishSecretRef: &corev1.SecretReference{Namespace: appsNS, Name: o.publish},
				}},
				ClaimRef: &corev1.ObjectReference{Namespace: appsNS, Name: o.pvc},
			},
		}, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create PV: %v", err)
		}
		if _, err := admin.CoreV1().PersistentVolumeClaims(appsNS).Create(ctx, &corev1.PersistentVolumeClaim{
			ObjectMeta: metav1.ObjectMeta{Name: o.pvc},
			Spec: corev1.PersistentVolumeClaimSpec{
				AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
				Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
				VolumeName:       o.pv,
				StorageClassName: &empty,
			},
		}, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create PVC: %v", err)
		}
		o.va = kubelet.AttachmentName(handle, radiusCSI, node)
		if _, err := admin.StorageV1().VolumeAttachments().Create(ctx, &storagev1.VolumeAttachment{
			ObjectMeta: metav1.ObjectMeta{Name: o.va},
			Spec: storagev1.VolumeAttachmentSpec{Attacher: radiusCSI, NodeName: node,
				Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: ptr.To(o.pv)}},
		}, metav1.CreateOptions{}); err != nil {
			t.Fatalf("create VolumeAttachment: %v", err)
		}
		o.pod = createRadiusPod(ctx, t, admin, appsNS, "app-"+node, node, "", o.pvc)
		o.pod2 = createRadiusPod(ctx, t, admin, appsNS, "app2-"+node, node, "", o.pvc)
		o.agentPod = createRadiusPod(ctx, t, admin, agentNS, agentSA+"-"+node, node, agentSA, "")
	}
	// A Secret no PV and no pod names.
	if _, err := admin.CoreV1().Secrets(appsNS).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "unreferenced"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	a, b := objs[nodeA], objs[nodeB]

	// Node A's agent: its pod's token, and (node mode) its node's
	// identity as the DaemonSet finds it (a kubeconfig naming kubelet's
	// certificate file). ag is the client the agent acts with.
	asSA := clientFor(t, c.PodTokenConfig(t, a.agentPod))
	unbound := clientFor(t, c.ServiceAccountConfig(t, agentNS, agentSA))
	ag := asSA
	if mode == agent.IdentityNode {
		dir := t.TempDir()
		nodeKubeconfig := filepath.Join(dir, "etc", "kubernetes", "kubelet.conf")
		c.WriteNodeKubeconfig(t, nodeKubeconfig, filepath.Join(dir, "var", "lib", "kubelet"), nodeA, "")
		asNode, err := agent.NewNodeClient(agent.Config{NodeKubeconfig: nodeKubeconfig, NodeName: nodeA, Version: "test"})
		if err != nil {
			t.Fatal(err)
		}
		if err := agent.CheckNodeIdentity(ctx, asNode, nodeA); err != nil {
			t.Fatalf("CheckNodeIdentity(node A's credentials, %s) = %v, want nil", nodeA, err)
		}
		if err := agent.CheckNodeIdentity(ctx, asNode, nodeB); !errors.Is(err, agent.ErrNotNodeIdentity) {
			t.Errorf("CheckNodeIdentity(node A's credentials, %s) = %v, want ErrNotNodeIdentity", nodeB, err)
		}
		if err := agent.CheckNodeIdentity(ctx, admin, nodeA); !errors.Is(err, agent.ErrNotNodeIdentity) {
			t.Errorf("CheckNodeIdentity(the admin's credentials, %s) = %v, want ErrNotNodeIdentity", nodeA, err)
		}
		ag = asNode
		// The Node authorizer learns the pods, claims and volumes from
		// its own informers: wait until node A reads its own Secret.
		waitAllowed(ctx, t, "node A gets the node-stage Secret of its pod's PV", func() error {
			_, err := ag.CoreV1().Secrets(appsNS).Get(ctx, a.stage, metav1.GetOptions{})
			return err
		})
		waitAllowed(ctx, t, "node A gets the VolumeAttachment of its node", func() error {
			_, err := ag.StorageV1().VolumeAttachments().Get(ctx, a.va, metav1.GetOptions{})
			return err
		})
	} else {
		saClient, err := agent.NewServiceAccountClient(agent.Config{NodeName: nodeA, Version: "test"}, c.PodTokenConfig(t, a.agentPod))
		if err != nil {
			t.Fatal(err)
		}
		if err := agent.CheckServiceAccountIdentity(ctx, saClient, nodeA); err != nil {
			t.Fatalf("CheckServiceAccountIdentity(node A's pod token, %s) = %v, want nil", nodeA, err)
		}
		if err := agent.CheckServiceAccountIdentity(ctx, saClient, nodeB); !errors.Is(err, agent.ErrNotNodeBound) {
			t.Errorf("CheckServiceAccountIdentity(node A's pod token, %s) = %v, want ErrNotNodeBound", nodeB, err)
		}
		if err := agent.CheckServiceAccountIdentity(ctx, unbound, nodeA); !errors.Is(err, agent.ErrNotNodeBound) {
			t.Errorf("CheckServiceAccountIdentity(a token bound to no pod, %s) = %v, want ErrNotNodeBound", nodeA, err)
		}
		if err := agent.CheckServiceAccountIdentity(ctx, admin, nodeA); !errors.Is(err, agent.ErrNotNodeBound) {
			t.Errorf("CheckServiceAccountIdentity(the admin's credentials, %s) = %v, want ErrNotNodeBound", nodeA, err)
		}
		ag = saClient
		// The eviction policy reads the pods through a parameter
		// informer: wait for its first refusal.
		refusal := waitRefused(ctx, t, "node A's ServiceAccount evicts node B's pod (dry run)", func() error {
			return evictDry(ctx, ag, b.pod)
		})
		t.Logf("node A's ServiceAccount evicting node B's pod: %v", refusal)
	}

	ownNode := func(node string) metav1.ListOptions {
		return metav1.ListOptions{FieldSelector: "spec.nodeName=" + node}
	}
	annotate := []byte(`{"metadata":{"annotations":{"mountmedic.io/test":"x"}}}`)
	condition := func(typ string) []byte {
		now := time.Now().UTC().Format(time.RFC3339)
		return []byte(`{"status":{"conditions":[{"type":"` + typ + `","status":"False","reason":"Test","message":"test",` +
			`"lastHeartbeatTime":"` + now + `","lastTransitionTime":"` + now + `"}]}}`)
	}
	lease := func(name string) *coordinationv1.Lease {
		return &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: agentNS},
			Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To("mountmedic-" + nodeA)}}
	}
	event := func(controller, instance string) *eventsv1.Event {
		return &eventsv1.Event{
			ObjectMeta: metav1.ObjectMeta{GenerateName: "radius-"}, EventTime: metav1.NowMicro(),
			ReportingController: controller, ReportingInstance: instance,
			Action: "Test", Reason: "Test", Type: corev1.EventTypeNormal,
			Regarding: corev1.ObjectReference{Kind: "Pod", Namespace: appsNS, Name: a.pod.Name, UID: a.pod.UID},
		}
	}
	// The ValidatingAdmissionPolicies are enforced once the API server
	// has loaded them: wait for their first refusals.
	refusal := waitRefused(ctx, t, "the ServiceAccount creates node B's heartbeat Lease", func() error {
		_, err := asSA.CoordinationV1().Leases(agentNS).Create(ctx, lease(nodeB), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return err
	})
	t.Logf("node A's ServiceAccount writing node B's Lease: %v", refusal)
	refusal = waitRefused(ctx, t, "node A's agent writes an agent event naming node B", func() error {
		_, err := ag.EventsV1().Events(appsNS).Create(ctx, event(agent.ReportingController, nodeB), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
		return err
	})
	t.Logf("node A's agent writing an event as node B's agent: %v", refusal)
	if _, err := admin.CoordinationV1().Leases(agentNS).Create(ctx, lease(nodeB), metav1.CreateOptions{}); err != nil {
		t.Fatalf("create node B's Lease as admin: %v", err)
	}

	for _, tc := range []radiusCase{
		// Secrets: only those a PV of a pod on node A names, and none
		// with the ServiceAccount.
		{"get the node-stage Secret of node A's PV", true, false, "", func() error {
			_, err := ag.CoreV1().Secrets(appsNS).Get(ctx, a.stage, metav1.GetOptions{})
			return err
		}},
		{"get the node-publish Secret of node A's PV", true, false, "", func() error {
			_, err := ag.CoreV1().Secrets(appsNS).Get(ctx, a.publish, metav1.GetOptions{})
			return err
		}},
		{"get the node-stage Secret of node B's PV", false, false, "", func() error {
			_, err := ag.CoreV1().Secrets(appsNS).Get(ctx, b.stage, metav1.GetOptions{})
			return err
		}},
		{"get the node-publish Secret of node B's PV", false, false, "", func() error {
			_, err := ag.CoreV1().Secrets(appsNS).Get(ctx, b.publish, metav1.GetOptions{})
			return err
		}},
		{"get a Secret nothing names", false, false, "", func() error {
			_, err := ag.CoreV1().Secrets(appsNS).Get(ctx, "unreferenced", metav1.GetOptions{})
			return err
		}},
		{"list Secrets", false, false, "", func() error {
			_, err := ag.CoreV1().Secrets(appsNS).List(ctx, metav1.ListOptions{})
			return err
		}},
		// Claims, volumes, attachments: reads, which RBAC cannot hold to
		// a node.
		{"get node A's PVC and PV", true, true, "", func() error {
			if _, err := ag.CoreV1().PersistentVolumeClaims(appsNS).Get(ctx, a.pvc, metav1.GetOptions{}); err != nil {
				return err
			}
			_, err := ag.CoreV1().PersistentVolumes().Get(ctx, a.pv, metav1.GetOptions{})
			return err
		}},
		{"get node B's PVC", false, true, "", func() error {
			_, err := ag.CoreV1().PersistentVolumeClaims(appsNS).Get(ctx, b.pvc, metav1.GetOptions{})
			return err
		}},
		{"get node B's PV", false, true, "", func() error {
			_, err := ag.CoreV1().PersistentVolumes().Get(ctx, b.pv, metav1.GetOptions{})
			return err
		}},
		{"get node A's VolumeAttachment", true, true, "", func() error {
			_, err := ag.StorageV1().VolumeAttachments().Get(ctx, a.va, metav1.GetOptions{})
			return err
		}},
		{"get node B's VolumeAttachment", false, true, "", func() error {
			_, err := ag.StorageV1().VolumeAttachments().Get(ctx, b.va, metav1.GetOptions{})
			return err
		}},
		{"list VolumeAttachments", false, false, "", func() error {
			_, err := ag.StorageV1().VolumeAttachments().List(ctx, metav1.ListOptions{})
			return err
		}},
		{"delete node A's VolumeAttachment", false, false, "", func() error {
			return ag.StorageV1().VolumeAttachments().Delete(ctx, a.va, metav1.DeleteOptions{DryRun: []string{metav1.DryRunAll}})
		}},
		{"get a CSIDriver", true, true, "", func() error {
			_, err := ag.StorageV1().CSIDrivers().Get(ctx, radiusCSI, metav1.GetOptions{})
			if apierrors.IsNotFound(err) {
				return nil // allowed to ask; there is none
			}
			return err
		}},
		// Pods: the agent's informer, its GETs, evictions and deletions.
		{"list and watch node A's pods", true, true, "", func() error {
			if _, err := ag.CoreV1().Pods("").List(ctx, ownNode(nodeA)); err != nil {
				return err
			}
			w, err := ag.CoreV1().Pods("").Watch(ctx, ownNode(nodeA))
			if err == nil {
				w.Stop()
			}
			return err
		}},
		{"list node B's pods", false, true, "", func() error {
			_, err := ag.CoreV1().Pods("").List(ctx, ownNode(nodeB))
			return err
		}},
		{"list every pod", false, true, "", func() error {
			_, err := ag.CoreV1().Pods("").List(ctx, metav1.ListOptions{})
			return err
		}},
		{"get node A's pod", true, true, "", func() error {
			_, err := ag.CoreV1().Pods(appsNS).Get(ctx, a.pod.Name, metav1.GetOptions{})
			return err
		}},
		{"get node B's pod", false, true, "", func() error {
			_, err := ag.CoreV1().Pods(appsNS).Get(ctx, b.pod.Name, metav1.GetOptions{})
			return err
		}},
		{"evict node B's pod", false, false, "", func() error { return evict(ctx, ag, b.pod) }},
		{"delete node B's pod", false, false, "", func() error { return deleteUID(ctx, ag, b.pod2) }},
		{"create a pod", false, false, "", func() error {
			_, err := ag.CoreV1().Pods(appsNS).Create(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "intruder"},
				Spec: corev1.PodSpec{NodeName: nodeA, Containers: []corev1.Container{{Name: "c", Image: "busybox"}}}}, metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
			return err
		}},
		// Nodes: the agent writes its PodVolumeMountsBroken condition.
		{"set node A's PodVolumeMountsBroken condition", true, true, "", func() error {
			_, err := ag.CoreV1().Nodes().PatchStatus(ctx, nodeA, condition(string(agent.ConditionType)))
			return err
		}},
		{"set node B's PodVolumeMountsBroken condition", false, false, "", func() error {
			_, err := ag.CoreV1().Nodes().PatchStatus(ctx, nodeB, condition(string(agent.ConditionType)))
			return err
		}},
		{"set node A's Ready condition", true, false, "", func() error {
			_, err := ag.CoreV1().Nodes().PatchStatus(ctx, nodeA, condition(string(corev1.NodeReady)))
			return err
		}},
		{"label node A through its status", true, false, "", func() error {
			n, err := ag.CoreV1().Nodes().Patch(ctx, nodeA, types.MergePatchType,
				[]byte(`{"metadata":{"labels":{"mountmedic.io/radius":"steered"}}}`), metav1.PatchOptions{}, "status")
			if err == nil && n.Labels["mountmedic.io/radius"] != "steered" {
				err = fmt.Errorf("the status patch was admitted but did not set the label")
			}
			return err
		}},
		{"set node A's address through its status", true, false, "", func() error {
			_, err := ag.CoreV1().Nodes().Patch(ctx, nodeA, types.MergePatchType,
				[]byte(`{"status":{"addresses":[{"type":"InternalIP","address":"192.0.2.66"}]}}`), metav1.PatchOptions{}, "status")
			return err
		}},
		{"patch node A", true, false, "", func() error {
			_, err := ag.CoreV1().Nodes().Patch(ctx, nodeA, types.MergePatchType, annotate, metav1.PatchOptions{})
			return err
		}},
		{"patch node B", false, false, "", func() error {
			_, err := ag.CoreV1().Nodes().Patch(ctx, nodeB, types.MergePatchType, annotate, metav1.PatchOptions{})
			return err
		}},
		{"taint node A", false, false, "", func() error {
			_, err := ag.CoreV1().Nodes().Patch(ctx, nodeA, types.MergePatchType,
				[]byte(`{"spec":{"taints":[{"key":"mountmedic.io/test","effect":"NoSchedule"}]}}`), metav1.PatchOptions{})
			return err
		}},
		{"get node B", false, true, "", func() error {
			_, err := ag.CoreV1().Nodes().Get(ctx, nodeB, metav1.GetOptions{})
			return err
		}},
		// Events: the agent's own only as its node's agent.
		{"create an agent event as node A's agent", true, true, "", func() error {
			_, err := ag.EventsV1().Events(appsNS).Create(ctx, event(agent.ReportingController, nodeA), metav1.CreateOptions{})
			return err
		}},
		{"create an agent event as node B's agent", false, false, "", func() error {
			_, err := ag.EventsV1().Events(appsNS).Create(ctx, event(agent.ReportingController, nodeB), metav1.CreateOptions{})
			return err
		}},
		{"create a core/v1 agent event as node B's agent", false, false, "", func() error {
			_, err := ag.CoreV1().Events(appsNS).Create(ctx, coreAgentEvent(a.pod, nodeB), metav1.CreateOptions{})
			return err
		}},
		// The failover controller's events: in the serviceaccount mode the
		// agent writes only the agent's; a node's identity, as kubelet's,
		// writes any event unless the controller Component's policy is
		// installed (TestControllerBlastRadius). The heartbeat's events
		// about its node are the agent's.
		{"create a failover controller event", true, false, "", func() error {
			_, err := ag.EventsV1().Events(appsNS).Create(ctx, event(failover.ReportingController, "mountmedic-controller-x"), metav1.CreateOptions{})
			return err
		}},
		{"create a failover heartbeat event as its node's agent", true, true, "", func() error {
			_, err := ag.EventsV1().Events(appsNS).Create(ctx, event(failover.NodeReportingController, nodeA), metav1.CreateOptions{})
			return err
		}},
		{"create an event of another controller", true, false, "", func() error {
			_, err := ag.EventsV1().Events(appsNS).Create(ctx, event("example.com/other", "x"), metav1.CreateOptions{})
			return err
		}},
		// Tokens: only bound to its own pods (the agent mints none).
		{"mint a token bound to node B's pod", false, false, "", func() error {
			_, err := ag.CoreV1().ServiceAccounts(appsNS).CreateToken(ctx, "default", &authenticationv1.TokenRequest{
				Spec: authenticationv1.TokenRequestSpec{BoundObjectRef: &authenticationv1.BoundObjectReference{
					APIVersion: "v1", Kind: "Pod", Name: b.pod.Name, UID: b.pod.UID}},
			}, metav1.CreateOptions{})
			return err
		}},
		{"mint an unbound token of the agent's ServiceAccount", false, false, "", func() error {
			_, err := ag.CoreV1().ServiceAccounts(agentNS).CreateToken(ctx, agentSA, &authenticationv1.TokenRequest{}, metav1.CreateOptions{})
			return err
		}},
		// Leases: a node writes only its own in kube-node-lease, the
		// ServiceAccount only its node's heartbeat.
		{"node identity: create a heartbeat Lease", false, false, agent.IdentityNode, func() error {
			_, err := ag.CoordinationV1().Leases(agentNS).Create(ctx, lease(nodeA), metav1.CreateOptions{DryRun: []string{metav1.DryRunAll}})
			return err
		}},
		{"ServiceAccount: create node A's heartbeat Lease", true, true, "", func() error {
			_, err := asSA.CoordinationV1().Leases(agentNS).Create(ctx, lease(nodeA), metav1.CreateOptions{})
			return err
		}},
		{"ServiceAccount: renew node A's heartbeat Lease", true, true, "", func() error {
			l, err := asSA.CoordinationV1().Leases(agentNS).Get(ctx, nodeA, metav1.GetOptions{})
			if err != nil {
				return err
			}
			l.Spec.RenewTime = &metav1.MicroTime{Time: time.Now()}
			_, err = asSA.CoordinationV1().Leases(agentNS).Update(ctx, l, metav1.UpdateOptions{})
			return err
		}},
		{"ServiceAccount: list the heartbeat Leases", true, true, "", func() error {
			_, err := asSA.CoordinationV1().Leases(agentNS).List(ctx, metav1.ListOptions{})
			return err
		}},
		{"ServiceAccount: create node B's heartbeat Lease", false, false, "", func() error {
			_, err := asSA.CoordinationV1().Leases(agentNS).Create(ctx, lease(nodeB), metav1.CreateOptions{})
			return err
		}},
		{"ServiceAccount: renew node B's heartbeat Lease", false, false, "", func() error {
			l, err := asSA.CoordinationV1().Leases(agentNS).Get(ctx, nodeB, metav1.GetOptions{})
			if err != nil {
				return fmt.Errorf("get: %w (a get is allowed: the write is what must be refused)", err)
			}
			l.Spec.HolderIdentity = ptr.To("mountmedic-" + nodeA)
			_, err = asSA.CoordinationV1().Leases(agentNS).Update(ctx, l, metav1.UpdateOptions{})
			return err
		}},
		{"ServiceAccount: delete node B's heartbeat Lease", false, false, "", func() error {
			return asSA.CoordinationV1().Leases(agentNS).Delete(ctx, nodeB, metav1.DeleteOptions{})
		}},
		{"ServiceAccount: a Lease in kube-node-lease", false, false, "", func() error {
			_, err := asSA.CoordinationV1().Leases(corev1.NamespaceNodeLease).Create(ctx, lease(nodeA), metav1.CreateOptions{})
			return err
		}},
		// Both modes: the ServiceAccount lists events (the eviction
		// budget's rebuild), and writes none.
		{"ServiceAccount: list events", true, true, "", func() error {
			_, err := asSA.CoreV1().Events("").List(ctx, metav1.ListOptions{Limit: 1})
			return err
		}},
		// Node mode: the ServiceAccount does nothing else but the Lease.
		{"ServiceAccount: get a Secret", false, false, agent.IdentityNode, func() error {
			_, err := asSA.CoreV1().Secrets(appsNS).Get(ctx, a.stage, metav1.GetOptions{})
			return err
		}},
		{"ServiceAccount: evict node A's pod", false, false, agent.IdentityNode, func() error { return evictDry(ctx, asSA, a.pod) }},
		{"ServiceAccount: get a PV", false, false, agent.IdentityNode, func() error {
			_, err := asSA.CoreV1().PersistentVolumes().Get(ctx, a.pv, metav1.GetOptions{})
			return err
		}},
		{"ServiceAccount: list pods", false, false, agent.IdentityNode, func() error {
			_, err := asSA.CoreV1().Pods("").List(ctx, ownNode(nodeA))
			return err
		}},
		// A token of the agent's ServiceAccount that names no node (minted
		// without a pod binding) writes nothing.
		{"unbound token: create a Lease", false, false, "", func() error {
			_, err := unbound.CoordinationV1().Leases(agentNS).Create(ctx, lease(nodeA+"-unbound"), metav1.CreateOptions{})
			return err
		}},
		{"unbound token: evict node A's pod", false, false, "", func() error { return evictDry(ctx, unbound, a.pod) }},
		{"unbound token: delete node A's pod", false, false, "", func() error {
			return unbound.CoreV1().Pods(appsNS).Delete(ctx, a.pod.Name, metav1.DeleteOptions{DryRun: []string{metav1.DryRunAll}})
		}},
		{"unbound token: create an agent event", false, false, "", func() error {
			_, err := unbound.EventsV1().Events(appsNS).Create(ctx, event(agent.ReportingController, nodeA), metav1.CreateOptions{})
			return err
		}},
		// Last: they remove node A's pods.
		{"evict node A's pod", true, true, "", func() error { return evict(ctx, ag, a.pod) }},
		{"delete node A's pod", true, true, "", func() error { return deleteUID(ctx, ag, a.pod2) }},
	} {
		if tc.only != "" && tc.only != mode {
			continue
		}
		allow := tc.node
		if mode == agent.IdentityServiceAccount {
			allow = tc.sa
		}
		err := tc.do()
		switch {
		case allow && err != nil:
			t.Errorf("node A's agent (%s): %s: %v, want it allowed", mode, tc.name, err)
		case !allow && err == nil:
			t.Errorf("node A's agent (%s): %s: allowed, want it refused", mode, tc.name)
		case !allow && !apierrors.IsForbidden(err):
			t.Errorf("node A's agent (%s): %s: %v, want 403 Forbidden", mode, tc.name, err)
		}
	}

	// A user who may create events (here the cluster admin) cannot pass
	// one off as an agent's.
	for _, forge := range []func() error{
		func() error {
			_, err := admin.EventsV1().Events(appsNS).Create(ctx, event(agent.ReportingController, nodeA), metav1.CreateOptions{})
			return err
		},
		func() error {
			_, err := admin.CoreV1().Events(appsNS).Create(ctx, coreAgentEvent(a.pod, nodeA), metav1.CreateOptions{})
			return err
		},
	} {
		if err := forge(); !apierrors.IsForbidden(err) {
			t.Errorf("the admin creates an event as node A's agent: %v, want 403 Forbidden", err)
		}
	}
}

// coreAgentEvent is a core/v1 Event that claims to come from node's
// mountmedic agent, about pod.
func coreAgentEvent(pod *corev1.Pod, node string) *corev1.Event {
	return &corev1.Event{
		ObjectMeta:          metav1.ObjectMeta{GenerateName: "forged-"},
		InvolvedObject:      corev1.ObjectReference{Kind: "Pod", Namespace: pod.Namespace, Name: pod.Name, UID: pod.UID},
		Reason:              "VolumeRepaired",
		Message:             "forged",
		Type:                corev1.EventTypeNormal,
		EventTime:           metav1.NowMicro(),
		Action:              "Repair",
		ReportingController: agent.ReportingController,
		ReportingInstance:   node,
	}
}

// evictDry is evict as a server-side dry run.
func evictDry(ctx context.Context, cs kubernetes.Interface, pod *corev1.Pod) error {
	return cs.PolicyV1().Evictions(pod.Namespace).Evict(ctx, &policyv1.Eviction{
		ObjectMeta: metav1.ObjectMeta{Namespace: pod.Namespace, Name: pod.Name},
		DeleteOptions: &metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &pod.UID},
			DryRun: []string{metav1.DryRunAll}},
	})
}

// applyChart renders the chart into ns with set and applies it with
// kubectl, as `helm template | kubectl apply -f -` does.
func applyChart(t *testing.T, c *kubetest.Cluster, kc, ns string, set ...string) {
	t.Helper()
	args := []string{"template", "mountmedic", chartDir, "--namespace", ns, "--kube-version", kubeVersion}
	for _, s := range set {
		args = append(args, "--set", s)
	}
	file := filepath.Join(t.TempDir(), "chart.yaml")
	if err := os.WriteFile(file, run(t, ".", lab.RequireTool(t, "helm"), args...), 0o644); err != nil {
		t.Fatal(err)
	}
	run(t, ".", kc, "--kubeconfig="+c.Kubeconfig, "apply", "-f", file)
}

// createRadiusPod creates a pod bound to node (claim: a PVC volume, when
// not empty) with serviceAccount (empty: default).
func createRadiusPod(ctx context.Context, t *testing.T, cs kubernetes.Interface, ns, name, node, serviceAccount, claim string) *corev1.Pod {
	t.Helper()
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: corev1.PodSpec{
			NodeName:           node,
			ServiceAccountName: serviceAccount,
			Containers:         []corev1.Container{{Name: "c", Image: "busybox"}},
		},
	}
	if claim != "" {
		pod.Spec.Volumes = []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{
			PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim}}}}
		pod.Spec.Containers[0].VolumeMounts = []corev1.VolumeMount{{Name: "data", MountPath: "/data"}}
	}
	pod, err := cs.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create pod %s/%s: %v", ns, name, err)
	}
	return pod
}

// clientFor makes a clientset or fails the test.
func clientFor(t *testing.T, rc *rest.Config) kubernetes.Interface {
	t.Helper()
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	return cs
}

// evict evicts pod with a UID precondition, as the agent does.
func evict(ctx context.Context, cs kubernetes.Interface, pod *corev1.Pod) error {
	return cs.PolicyV1().Evictions(pod.Namespace).Evict(ctx, &policyv1.Eviction{
		ObjectMeta:    metav1.ObjectMeta{Namespace: pod.Namespace, Name: pod.Name},
		DeleteOptions: &metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &pod.UID}},
	})
}

// deleteUID deletes pod with a UID precondition, as the agent does.
func deleteUID(ctx context.Context, cs kubernetes.Interface, pod *corev1.Pod) error {
	return cs.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &pod.UID}})
}

// waitAllowed polls do until it succeeds (the Node authorizer's graph
// follows the API objects through informers).
func waitAllowed(ctx context.Context, t *testing.T, what string, do func() error) {
	t.Helper()
	var last error
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		last = do()
		return last == nil, nil
	})
	if err != nil {
		t.Fatalf("%s: never allowed: %v", what, last)
	}
}

// waitRefused polls do until it is refused with 403, and returns the
// refusal.
func waitRefused(ctx context.Context, t *testing.T, what string, do func() error) error {
	t.Helper()
	var last error
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		last = do()
		return apierrors.IsForbidden(last), nil
	})
	if err != nil {
		t.Fatalf("%s: never refused (last: %v)", what, last)
	}
	return last
}
