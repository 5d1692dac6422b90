package agent

import (
	"context"
	"slices"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/probe/kubelet"
	"github.com/mountmedic/mountmedic/remount"
)

func TestOptedOut(t *testing.T) {
	tests := map[string]struct {
		ann           map[string]string
		out, complain bool
	}{
		"none":    {nil, false, false},
		"true":    {map[string]string{OptOutAnnotation: "true"}, false, false},
		"false":   {map[string]string{OptOutAnnotation: "false"}, true, false},
		"garbage": {map[string]string{OptOutAnnotation: "no"}, true, true},
	}
	for name, tc := range tests {
		out, complaint := optedOut(tc.ann)
		if out != tc.out || (complaint != "") != tc.complain {
			t.Errorf("%s: optedOut(%v) = %v, %q; want %v, complaint %v", name, tc.ann, out, complaint, tc.out, tc.complain)
		}
	}
}

func TestExpandSubPath(t *testing.T) {
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "web-0", Namespace: "apps", UID: "u1"}}
	env := []corev1.EnvVar{
		{Name: "DIR", Value: "data"},
		{Name: "NESTED", Value: "$(DIR)/x"},
		{Name: "POD", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.name"}}},
		{Name: "SECRET", ValueFrom: &corev1.EnvVarSource{SecretKeyRef: &corev1.SecretKeySelector{Key: "k"}}},
	}
	tests := map[string]struct {
		expr string
		want string
		ok   bool
	}{
		"literal":        {"$(DIR)/logs", "data/logs", true},
		"nested":         {"$(NESTED)", "data/x", true},
		"downward":       {"pods/$(POD)", "pods/web-0", true},
		"escaped dollar": {"$$(DIR)", "$(DIR)", true},
		"unknown stays":  {"$(NOPE)/a", "$(NOPE)/a", true},
		"secret refused": {"$(SECRET)", "", false},
	}
	for name, tc := range tests {
		got, ok := expandSubPath(tc.expr, pod, env)
		if got != tc.want || ok != tc.ok {
			t.Errorf("%s: expandSubPath(%q) = %q, %v; want %q, %v", name, tc.expr, got, ok, tc.want, tc.ok)
		}
	}
}

func TestContainerMounts(t *testing.T) {
	h2c := corev1.MountPropagationHostToContainer
	running := corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: metav1.NewTime(time.Unix(1, 0))}}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "n", UID: "uid-1"},
		Spec: corev1.PodSpec{Containers: []corev1.Container{
			{Name: "app", VolumeMounts: []corev1.VolumeMount{
				{Name: "data", MountPath: "/data"},
				{Name: "data", MountPath: "/cfg", SubPath: "conf", ReadOnly: true},
				{Name: "other", MountPath: "/other"},
			}},
			{Name: "sidecar", VolumeMounts: []corev1.VolumeMount{{Name: "data", MountPath: "/d", MountPropagation: &h2c}}},
			{Name: "stopped", VolumeMounts: []corev1.VolumeMount{{Name: "data", MountPath: "/x"}}},
		}},
		Status: corev1.PodStatus{ContainerStatuses: []corev1.ContainerStatus{
			{Name: "app", ContainerID: "containerd://aaa", State: running},
			{Name: "sidecar", ContainerID: "containerd://bbb", State: running},
			{Name: "stopped", ContainerID: "containerd://ccc"},
		}},
	}
	got, own, _ := containerMounts(pod, "data")
	want := []remount.ContainerMount{
		{PodUID: "uid-1", Container: "app", ContainerID: "aaa", MountPath: "/data"},
		{PodUID: "uid-1", Container: "app", ContainerID: "aaa", MountPath: "/cfg"},
		{PodUID: "uid-1", Container: "sidecar", ContainerID: "bbb", MountPath: "/d"},
	}
	if !slices.Equal(got, want) {
		t.Errorf("containerMounts = %+v\nwant %+v", got, want)
	}
	if !slices.Equal(own, []string{"aaa"}) {
		t.Errorf("containerMounts: own binds = %v, want [aaa] (app's private mount and subPath; not the HostToContainer sidecar)", own)
	}
	// Only HostToContainer mounts: the re-stage reaches them, no swap.
	pod.Spec.Containers = pod.Spec.Containers[1:2]
	if _, own, _ := containerMounts(pod, "data"); len(own) != 0 {
		t.Errorf("containerMounts: own binds %v for a HostToContainer mount only, want none", own)
	}
}

func TestBudget(t *testing.T) {
	now := time.Unix(1000, 0)
	b := newBudget(2, time.Minute, func() time.Time { return now })
	t1, ok1 := b.take()
	_, ok2 := b.take()
	_, ok3 := b.take()
	if !ok1 || !ok2 || ok3 {
		t.Fatalf("take x3 = %v %v %v, want true true false", ok1, ok2, ok3)
	}
	b.give(t1)
	if !b.available() {
		t.Error("a returned reservation is not available again")
	}
	b.take()
	now = now.Add(time.Minute)
	if _, ok := b.take(); !ok {
		t.Error("the window passed and the budget is still used up")
	}
}

func TestObjectCache(t *testing.T) {
	now := time.Unix(1000, 0)
	c := newObjectCache(2, time.Minute, func() time.Time { return now })
	c.put("a", 1)
	c.put("b", 2)
	c.get("a") // a is now the most recently used
	c.put("c", 3)
	if _, _, ok := c.get("b"); ok {
		t.Error("the least recently used entry b was not evicted")
	}
	if _, fresh, ok := c.get("a"); !ok || !fresh {
		t.Errorf("get(a) = fresh %v ok %v, want fresh and present", fresh, ok)
	}
	now = now.Add(2 * time.Minute)
	if obj, fresh, ok := c.get("c"); !ok || fresh || obj != 3 {
		t.Errorf("get(c) after the TTL = %v fresh %v ok %v, want a stale 3", obj, fresh, ok)
	}
	c.remove("c")
	if _, _, ok := c.get("c"); ok {
		t.Error("get(c) after remove: present, want gone")
	}
	if _, _, ok := c.get("a"); !ok {
		t.Error("remove(c) dropped a as well")
	}
}

// TestResidualTakesFreshRequests: a residual's requests lost their secret
// values when its run ended, and a resume that re-stages must send the
// fresh ones (without them, the e2e's driver refused NodeStageVolume and
// the ladder escalated to restart and evict). What holds the dead mount
// stays what the residual knew; the stored residual is not changed.
func TestResidualTakesFreshRequests(t *testing.T) {
	req := func(uid string, secret string) kubelet.VolumeRequest {
		return kubelet.VolumeRequest{Driver: "d", VolumeHandle: "h", PodUID: types.UID(uid),
			StageSecrets: map[string]string{"key": secret}, PublishSecrets: map[string]string{"key": secret}}
	}
	dead := []*probe.Mount{{ID: 7, Path: "/k/pods/a/volumes/kubernetes.io~csi/pv/mount"}}
	old := &resolved{
		vol: &remount.Volume{Driver: "d", VolumeHandle: "h", Stage: req("a", "s3cret"), Pods: []remount.PodVolume{
			{Publish: req("a", "s3cret"), Dead: dead, Containers: []remount.ContainerMount{{PodUID: "a", Container: "app", ContainerID: "c1"}}},
			{Publish: req("b", "s3cret"), Containers: []remount.ContainerMount{{PodUID: "b", Container: "app", ContainerID: "c2"}}},
		}},
		ownBinds:    map[string][]string{"a": {"c1"}, "b": {"c2"}},
		restageable: true,
	}
	old.wipe()
	rs := &residual{r: old}
	pods := []*corev1.Pod{{ObjectMeta: metav1.ObjectMeta{UID: "a"}}}
	fresh := &resolved{vol: &remount.Volume{Driver: "d", VolumeHandle: "h", Stage: req("a", "new"),
		Pods: []remount.PodVolume{{Publish: req("a", "new"), Containers: []remount.ContainerMount{{PodUID: "a", Container: "app", ContainerID: "c9"}}}}}}

	got := rs.forPods(pods).withRequests(fresh)
	if s := got.vol.Stage.StageSecrets["key"]; s != "new" {
		t.Errorf("stage secret = %q, want the fresh one", s)
	}
	if len(got.vol.Pods) != 1 {
		t.Fatalf("pods = %d, want the one still holding the mount", len(got.vol.Pods))
	}
	pv := got.vol.Pods[0]
	if pv.Publish.PublishSecrets["key"] != "new" || pv.Publish.StageSecrets["key"] != "new" {
		t.Errorf("publish request secrets = %v / %v, want the fresh ones", pv.Publish.StageSecrets, pv.Publish.PublishSecrets)
	}
	if len(pv.Dead) != 1 || pv.Dead[0].ID != 7 || len(pv.Containers) != 1 || pv.Containers[0].ContainerID != "c1" {
		t.Errorf("dead mounts %v, containers %v: want the residual's", pv.Dead, pv.Containers)
	}
	if len(old.vol.Pods) != 2 || len(old.vol.Pods[0].Publish.PublishSecrets) != 0 || len(old.vol.Stage.StageSecrets) != 0 {
		t.Errorf("the stored residual changed: %+v", old.vol)
	}
}

func TestContainerMountsUnseen(t *testing.T) {
	h2c := corev1.MountPropagationHostToContainer
	running := corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: metav1.NewTime(time.Unix(1, 0))}}
	creating := corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "ContainerCreating"}}
	done := corev1.ContainerState{Terminated: &corev1.ContainerStateTerminated{ExitCode: 0}}
	mounts := []corev1.VolumeMount{{Name: "data", MountPath: "/data"}}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "n", UID: "uid-1"},
		Spec: corev1.PodSpec{
			InitContainers: []corev1.Container{{Name: "init", VolumeMounts: mounts}},
			Containers: []corev1.Container{
				{Name: "up", VolumeMounts: mounts},
				{Name: "creating", VolumeMounts: mounts},
				{Name: "nostatus", VolumeMounts: []corev1.VolumeMount{{Name: "data", MountPath: "/s", SubPath: "s"}}},
				{Name: "propagated", VolumeMounts: []corev1.VolumeMount{{Name: "data", MountPath: "/d", MountPropagation: &h2c}}},
				{Name: "exited", VolumeMounts: mounts},
				{Name: "unrelated", VolumeMounts: []corev1.VolumeMount{{Name: "other", MountPath: "/o"}}},
			}},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, ContainerStatuses: []corev1.ContainerStatus{
			{Name: "up", ContainerID: "containerd://aaa", State: running},
			{Name: "creating", State: creating},
			{Name: "propagated", State: creating},
			{Name: "exited", ContainerID: "containerd://ccc", State: done},
		}},
	}
	tests := map[string]struct {
		edit func(*corev1.Pod)
		want []string
	}{
		// Own binds whose container kubelet has not reported running: no
		// status yet, or waiting. Not an init container, not one the
		// re-stage reaches by propagation, not one that exited.
		"running pod":   {func(*corev1.Pod) {}, []string{"creating", "nostatus"}},
		"pending pod":   {func(p *corev1.Pod) { p.Status.Phase = corev1.PodPending }, []string{"creating", "nostatus"}},
		"being deleted": {func(p *corev1.Pod) { p.DeletionTimestamp = &metav1.Time{Time: time.Unix(2, 0)} }, nil},
		"finished pod":  {func(p *corev1.Pod) { p.Status.Phase = corev1.PodSucceeded }, nil},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			p := pod.DeepCopy()
			tc.edit(p)
			_, own, unseen := containerMounts(p, "data")
			if !slices.Equal(unseen, tc.want) {
				t.Errorf("containerMounts(%s): unseen = %v, want %v", name, unseen, tc.want)
			}
			if !slices.Equal(own, []string{"aaa"}) {
				t.Errorf("containerMounts(%s): own = %v, want [aaa]", name, own)
			}
		})
	}
}

func TestResidualWaitsForUnseenContainers(t *testing.T) {
	now := time.Unix(100, 0)
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "p", Namespace: "n", UID: "uid-1"},
		Status: corev1.PodStatus{Phase: corev1.PodRunning, ContainerStatuses: []corev1.ContainerStatus{
			{Name: "app", State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "ContainerCreating"}}}}}}
	get := func(uid string) *corev1.Pod {
		if uid == string(pod.UID) {
			return pod
		}
		return nil
	}
	rs := &residual{r: &resolved{unseen: map[string][]string{"uid-1": {"app"}}}, unseenUntil: now.Add(unseenWait)}
	if out, waiting := rs.holders(get, now); len(out) != 0 || !waiting {
		t.Errorf("holders while app is not reported: %d pods, waiting %t; want none, waiting", len(out), waiting)
	}
	pod.Status.ContainerStatuses[0] = corev1.ContainerStatus{Name: "app", ContainerID: "containerd://aaa",
		State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{}}}
	if out, waiting := rs.holders(get, now); len(out) != 1 || waiting {
		t.Errorf("holders once app runs: %d pods, waiting %t; want the pod, not waiting", len(out), waiting)
	}
	if out, waiting := rs.holders(get, now.Add(unseenWait)); len(out) != 0 || waiting {
		t.Errorf("holders past unseenWait: %d pods, waiting %t; want none, not waiting", len(out), waiting)
	}
}

// TestMultiClaimPodReadsTheBoundClaim: a pod with three claims whose
// broken volume's PV was read ahead reads only the claim that PV names;
// without the PV, or when the claim it names is bound to another PV, the
// claims are read in order until the bound one. (A fake clientset: which
// requests are made is the logic under test.)
func TestMultiClaimPodReadsTheBoundClaim(t *testing.T) {
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "apps", Name: "p"}}
	for _, c := range []string{"c1", "c2", "c3"} {
		pod.Spec.Volumes = append(pod.Spec.Volumes, corev1.Volume{Name: "v-" + c,
			VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: c}}})
	}
	claim := func(name, pv string) *corev1.PersistentVolumeClaim {
		return &corev1.PersistentVolumeClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "apps", Name: name}, Spec: corev1.PersistentVolumeClaimSpec{VolumeName: pv}}
	}
	pv := func(claim string) *corev1.PersistentVolume {
		return &corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: "pv-3"},
			Spec: corev1.PersistentVolumeSpec{ClaimRef: &corev1.ObjectReference{Namespace: "apps", Name: claim}}}
	}
	for name, tc := range map[string]struct {
		pv     *corev1.PersistentVolume // read ahead; nil: not
		c1PV   string                   // the PV claim c1 is bound to
		claims int                      // claim GETs wanted
	}{
		"PV read ahead":             {pv("c3"), "pv-1", 1},
		"no PV read ahead":          {nil, "pv-1", 3},
		"PV names a claim rebound":  {pv("c1"), "pv-other", 3},
		"PV names another claim ns": {&corev1.PersistentVolume{ObjectMeta: metav1.ObjectMeta{Name: "pv-3"}, Spec: corev1.PersistentVolumeSpec{ClaimRef: &corev1.ObjectReference{Namespace: "other", Name: "c3"}}}, "pv-1", 3},
	} {
		t.Run(name, func(t *testing.T) {
			cs := fake.NewClientset(claim("c1", tc.c1PV), claim("c2", "pv-2"), claim("c3", "pv-3"))
			store := newPVStore(cs, time.Second)
			if tc.pv != nil {
				store.pvs["pv-3"] = newPVEntry(tc.pv)
			}
			a := &Agent{kube: &kube{client: cs, cache: newObjectCache(100, time.Minute, nil), timeout: time.Second, pvs: store}}
			v, pvc, err := a.podVolume(context.Background(), pod, &podUse{specName: "pv-3"})
			if err != nil {
				t.Fatal(err)
			}
			if v.Name != "v-c3" || pvc == nil || pvc.Name != "c3" {
				t.Fatalf("podVolume = volume %s, claim %v; want v-c3, c3", v.Name, pvc)
			}
			gets := 0
			for _, act := range cs.Actions() {
				if act.GetVerb() == "get" && act.GetResource().Resource == "persistentvolumeclaims" {
					gets++
				}
			}
			if gets != tc.claims {
				t.Errorf("%d claim GETs, want %d", gets, tc.claims)
			}
		})
	}
}
