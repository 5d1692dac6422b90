package failover

import (
	"errors"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/ptr"
)

func testPod(ns, name string, owner string, claims ...string) *corev1.Pod {
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, UID: types.UID("uid-" + name), Annotations: map[string]string{}},
		Spec:       corev1.PodSpec{NodeName: "node-1"},
		Status:     corev1.PodStatus{Phase: corev1.PodRunning},
	}
	if owner != "" {
		p.OwnerReferences = []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: owner, Name: "own", UID: "own-uid", Controller: ptr.To(true)}}
	}
	for _, c := range claims {
		p.Spec.Volumes = append(p.Spec.Volumes, corev1.Volume{Name: "v-" + c,
			VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: c}}})
	}
	return p
}

func TestDecide(t *testing.T) {
	rwo := claimInfo{PV: "pv-rwo", AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}, StorageClass: "ssd"}
	rwop := claimInfo{PV: "pv-rwop", AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOncePod}, StorageClass: "ssd"}
	rwx := claimInfo{PV: "pv-rwx", AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany}, StorageClass: "nfs"}
	local := claimInfo{PV: "pv-local", AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}, StorageClass: "local", NodeLocal: true}
	unbound := claimInfo{AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}}
	broken := claimInfo{Err: errors.New("timeout")}
	claims := map[string]claimInfo{"rwo": rwo, "rwop": rwop, "rwx": rwx, "local": local, "unbound": unbound, "broken": broken}

	tests := map[string]struct {
		pod       *corev1.Pod
		edit      func(*Config)
		eligible  bool
		reason    string
		pvs       []string
		uncertain bool
	}{
		"statefulset rwo":    {pod: testPod("db", "db-0", "StatefulSet", "rwo"), eligible: true, reason: reasonEligible, pvs: []string{"pv-rwo"}},
		"replicaset rwop":    {pod: testPod("db", "web", "ReplicaSet", "rwop", "rwx"), eligible: true, reason: reasonEligible, pvs: []string{"pv-rwop"}},
		"rwx only":           {pod: testPod("db", "web", "ReplicaSet", "rwx"), reason: reasonNoRWO},
		"no claims":          {pod: testPod("db", "web", "ReplicaSet"), reason: reasonNoVolumesClaims},
		"bare pod":           {pod: testPod("db", "db-0", "", "rwo"), reason: reasonNoController},
		"daemonset":          {pod: testPod("db", "ds", "DaemonSet", "rwo"), reason: reasonDaemonSet},
		"node local":         {pod: testPod("db", "db-0", "StatefulSet", "local"), reason: reasonNodeLocal},
		"unbound":            {pod: testPod("db", "db-0", "StatefulSet", "unbound"), reason: reasonStorageClass},
		"unreadable":         {pod: testPod("db", "db-0", "StatefulSet", "broken"), reason: reasonLookupFailed, uncertain: true},
		"missing claim":      {pod: testPod("db", "db-0", "StatefulSet", "nosuch"), reason: reasonLookupFailed, uncertain: true},
		"rwo and unreadable": {pod: testPod("db", "db-0", "StatefulSet", "rwo", "broken"), eligible: true, reason: reasonEligible, pvs: []string{"pv-rwo"}, uncertain: true},
		"terminated": {pod: func() *corev1.Pod {
			p := testPod("db", "db-0", "StatefulSet", "rwo")
			p.Status.Phase = corev1.PodFailed
			return p
		}(), reason: reasonTerminated},
		"mirror": {pod: func() *corev1.Pod {
			p := testPod("db", "db-0", "Node", "rwo")
			p.Annotations[mirrorPodAnnotation] = "x"
			return p
		}(), reason: reasonMirror},
		"opted out": {pod: func() *corev1.Pod {
			p := testPod("db", "db-0", "StatefulSet", "rwo")
			p.Annotations[Annotation] = "false"
			return p
		}(), reason: reasonOptedOut},
		"bad annotation": {pod: func() *corev1.Pod {
			p := testPod("db", "db-0", "StatefulSet", "rwo")
			p.Annotations[Annotation] = "yes"
			return p
		}(), reason: `annotation mountmedic.io/failover is neither true nor false ("yes"): fix the annotation`},
		"namespace excluded":     {pod: testPod("db", "db-0", "StatefulSet", "rwo"), edit: func(c *Config) { c.ExcludeNamespaces = []string{"db"} }, reason: reasonNamespace},
		"namespace not included": {pod: testPod("db", "db-0", "StatefulSet", "rwo"), edit: func(c *Config) { c.IncludeNamespaces = []string{"prod"} }, reason: reasonNamespace},
		"annotation beats include list": {pod: func() *corev1.Pod {
			p := testPod("db", "db-0", "StatefulSet", "rwo")
			p.Annotations[Annotation] = "true"
			return p
		}(), edit: func(c *Config) { c.IncludeNamespaces = []string{"prod"}; c.IncludeStorageClasses = []string{"hdd"} }, eligible: true, reason: reasonEligible, pvs: []string{"pv-rwo"}},
		"annotation loses to exclude list": {pod: func() *corev1.Pod {
			p := testPod("db", "db-0", "StatefulSet", "rwo")
			p.Annotations[Annotation] = "true"
			return p
		}(), edit: func(c *Config) { c.ExcludeNamespaces = []string{"db"} }, reason: reasonNamespace},
		"storage class excluded":     {pod: testPod("db", "db-0", "StatefulSet", "rwo"), edit: func(c *Config) { c.ExcludeStorageClasses = []string{"ssd"} }, reason: reasonStorageClass},
		"storage class not included": {pod: testPod("db", "db-0", "StatefulSet", "rwo"), edit: func(c *Config) { c.IncludeStorageClasses = []string{"hdd"} }, reason: reasonStorageClass},
		"one class of two included": {pod: testPod("db", "db-0", "StatefulSet", "rwo", "rwop"), edit: func(c *Config) {
			c.ExcludeStorageClasses = []string{"nfs"}
		}, eligible: true, reason: reasonEligible, pvs: []string{"pv-rwo", "pv-rwop"}},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			c := validConfig()
			if tc.edit != nil {
				tc.edit(&c)
			}
			d := c.decide(tc.pod, claims)
			if d.Eligible != tc.eligible || d.Reason != tc.reason || d.Uncertain != tc.uncertain || !slices.Equal(d.PVs, tc.pvs) {
				t.Errorf("decide(%s) = %+v, want eligible %v reason %q pvs %v uncertain %v", tc.pod.Name, d, tc.eligible, tc.reason, tc.pvs, tc.uncertain)
			}
		})
	}
}

func TestClaimNamesEphemeral(t *testing.T) {
	p := testPod("db", "web-1", "ReplicaSet", "data")
	p.Spec.Volumes = append(p.Spec.Volumes, corev1.Volume{Name: "scratch", VolumeSource: corev1.VolumeSource{Ephemeral: &corev1.EphemeralVolumeSource{}}},
		corev1.Volume{Name: "cfg", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}})
	if got, want := claimNames(p), []string{"data", "web-1-scratch"}; !slices.Equal(got, want) {
		t.Errorf("claimNames = %v, want %v", got, want)
	}
}
