package agent

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/flowcontrol"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// TestPublishedPVs: the PVs behind the CSI publish targets are those of
// PVC volumes of pods the informer has; a CSI inline volume (its
// directory is the pod's volume name, not a PV), a pod not seen yet and
// mounts of other kinds give none.
func TestPublishedPVs(t *testing.T) {
	idx := cache.NewIndexer(cache.MetaNamespaceKeyFunc, cache.Indexers{uidIndex: func(obj any) ([]string, error) {
		return []string{string(obj.(*corev1.Pod).UID)}, nil
	}})
	pod := func(uid string, vols ...corev1.Volume) {
		if err := idx.Add(&corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "a", Name: uid, UID: types.UID(uid)}, Spec: corev1.PodSpec{Volumes: vols}}); err != nil {
			t.Fatal(err)
		}
	}
	pod("p1", corev1.Volume{Name: "data", VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: "c"}}},
		corev1.Volume{Name: "inline", VolumeSource: corev1.VolumeSource{CSI: &corev1.CSIVolumeSource{Driver: "d"}}})
	pod("p2")
	publish := func(uid, vol string) *probe.Mount {
		return &probe.Mount{Target: kubelet.Target{Kind: kubelet.KindPublish, Plugin: kubelet.CSIPluginDir, PodUID: uid, Volume: vol}}
	}
	inv := &probe.Inventory{Mounts: []*probe.Mount{
		publish("p1", "pv-b"),
		publish("p1", "inline"),
		publish("p2", "pv-a"),
		publish("p2", "pv-b"),
		publish("unseen", "pv-c"),
		{Target: kubelet.Target{Kind: kubelet.KindPublish, Plugin: "kubernetes.io~nfs", PodUID: "p1", Volume: "pv-nfs"}},
		{Target: kubelet.Target{Kind: kubelet.KindStaging, Driver: "d", HandleHash: "ab"}},
	}}
	if got, want := publishedPVs(inv, podsByUID{idx: idx}), []string{"pv-a", "pv-b"}; !slices.Equal(got, want) {
		t.Fatalf("publishedPVs = %q, want %q", got, want)
	}
}

// TestPVStoreReadsAhead: the store reads each tracked PV once, serves
// copies, drops what is no longer tracked, reads a forgotten PV again,
// and retries a failed read only after its wait (pvRetry, or
// pvRetryUnreachable when the API server did not answer).
func TestPVStoreReadsAhead(t *testing.T) {
	var (
		mu    sync.Mutex
		now   = time.Unix(1000, 0)
		reads = map[string]int{}
		fail  = map[string]error{}
	)
	s := newPVStore(nil, time.Second)
	s.limit = flowcontrol.NewFakeAlwaysRateLimiter()
	s.now = func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	s.get = func(_ context.Context, name string) (*corev1.PersistentVolume, error) {
		mu.Lock()
		defer mu.Unlock()
		reads[name]++
		if err := fail[name]; err != nil {
			return nil, err
		}
		return &corev1.PersistentVolume{
			ObjectMeta: metav1.ObjectMeta{Name: name, UID: "u-" + types.UID(name), ManagedFields: []metav1.ManagedFieldsEntry{{Manager: "m"}}, Annotations: map[string]string{"x": "y"}},
			Spec:       corev1.PersistentVolumeSpec{PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{Driver: "d", VolumeHandle: "h-" + name}}},
		}, nil
	}
	readsOf := func(name string) int { mu.Lock(); defer mu.Unlock(); return reads[name] }
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); s.run(ctx) }()
	defer func() { cancel(); <-done }()
	eventually := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); !cond(); {
			if time.Now().After(deadline) {
				t.Fatalf("after 10 s: %s", what)
			}
			time.Sleep(time.Millisecond)
		}
	}

	mu.Lock()
	fail["gone"] = apierrors.NewNotFound(schema.GroupResource{Resource: "persistentvolumes"}, "gone")
	fail["far"] = errors.New("connection refused")
	mu.Unlock()
	s.track([]string{"a", "b", "gone", "far"})
	eventually("a and b stored", func() bool { return s.lookup("a") != nil && s.lookup("b") != nil })
	eventually("gone and far read", func() bool { return readsOf("gone") == 1 && readsOf("far") == 1 })
	pv := s.lookup("a")
	if pv.Spec.CSI.VolumeHandle != "h-a" || pv.UID != "u-a" || len(pv.ManagedFields) > 0 || len(pv.Annotations) > 0 {
		t.Fatalf("stored PV %+v: want name, UID and spec only", pv)
	}
	pv.Spec.CSI.VolumeHandle = "changed"
	if got := s.lookup("a").Spec.CSI.VolumeHandle; got != "h-a" {
		t.Fatalf("a reader's change reached the store: handle %q", got)
	}
	s.track([]string{"a", "b", "gone", "far"})
	time.Sleep(50 * time.Millisecond)
	if readsOf("a") != 1 || readsOf("gone") != 1 || readsOf("far") != 1 {
		t.Fatalf("reads after a second track of the same PVs: %v, want one each", reads)
	}

	// A forgotten PV (it did not match) is read again.
	s.forget("a")
	eventually("a read again after forget", func() bool { return readsOf("a") == 2 && s.lookup("a") != nil })

	// An unreachable API server is retried after pvRetryUnreachable, any
	// other failure after pvRetry.
	mu.Lock()
	now = now.Add(pvRetryUnreachable + time.Second)
	delete(fail, "far")
	mu.Unlock()
	s.poke()
	eventually("far read again after its wait", func() bool { return s.lookup("far") != nil })
	if readsOf("gone") != 1 {
		t.Fatalf("a NotFound PV read %d times before pvRetry, want 1", readsOf("gone"))
	}
	mu.Lock()
	now = now.Add(pvRetry)
	mu.Unlock()
	s.poke()
	eventually("gone read again after pvRetry", func() bool { return readsOf("gone") == 2 })

	// A PV whose volume is no longer published is kept pvKeep (a repair
	// unmounts and mounts it again), then dropped; it is never read again.
	s.track([]string{"b"})
	if s.lookup("a") == nil || s.lookup("far") == nil {
		t.Fatal("a and far dropped at the first track without them, want them kept pvKeep")
	}
	mu.Lock()
	now = now.Add(pvKeep)
	mu.Unlock()
	s.track([]string{"b", "far"}) // far is back: kept
	if s.lookup("a") != nil || s.lookup("far") == nil || s.lookup("b") == nil {
		t.Fatal("pvKeep after a was last tracked: want a dropped, b and far kept")
	}
	s.track([]string{"b"})
	mu.Lock()
	now = now.Add(pvKeep - time.Second)
	mu.Unlock()
	s.track([]string{"b"})
	if s.lookup("far") == nil {
		t.Fatal("far dropped before pvKeep since it was last tracked")
	}
	mu.Lock()
	now = now.Add(2 * pvRetry)
	mu.Unlock()
	s.poke()
	time.Sleep(50 * time.Millisecond)
	if readsOf("gone") != 2 || readsOf("a") != 2 {
		t.Fatalf("reads of untracked PVs went on: %v", reads)
	}
}

// TestPVEntryKeepsWhatARepairReads: a PV kept by the store comes back with
// every field kubelet.BuildVolumeRequest and its checks read, unchanged,
// and nothing else; the entry shares no memory with what it returns.
func TestPVEntryKeepsWhatARepairReads(t *testing.T) {
	block := corev1.PersistentVolumeBlock
	full := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: "pv-1", UID: "u-1", ResourceVersion: "7", Labels: map[string]string{"a": "b"},
			Annotations: map[string]string{"pv.kubernetes.io/provisioned-by": "d"}, Finalizers: []string{"kubernetes.io/pv-protection"}},
		Spec: corev1.PersistentVolumeSpec{
			Capacity: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver: "d", VolumeHandle: "h", ReadOnly: true, FSType: "ext4",
				VolumeAttributes:     map[string]string{"bucket": "b"},
				NodeStageSecretRef:   &corev1.SecretReference{Namespace: "s", Name: "stage"},
				NodePublishSecretRef: &corev1.SecretReference{Namespace: "s", Name: "publish"},
			}},
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOncePod},
			ClaimRef:         &corev1.ObjectReference{Kind: "PersistentVolumeClaim", Namespace: "apps", Name: "c", UID: "cu", ResourceVersion: "3"},
			MountOptions:     []string{"ro", "noatime"},
			VolumeMode:       &block,
			StorageClassName: "sc",
			NodeAffinity:     &corev1.VolumeNodeAffinity{Required: &corev1.NodeSelector{}},
		},
		Status: corev1.PersistentVolumeStatus{Phase: corev1.VolumeBound},
	}
	want := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: "pv-1", UID: "u-1"},
		Spec: corev1.PersistentVolumeSpec{
			PersistentVolumeSource: *full.Spec.PersistentVolumeSource.DeepCopy(),
			AccessModes:            []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOncePod},
			ClaimRef:               &corev1.ObjectReference{Namespace: "apps", Name: "c", UID: "cu"},
			MountOptions:           []string{"ro", "noatime"},
			VolumeMode:             &block,
		},
	}
	e := newPVEntry(full.DeepCopy())
	got := e.pv()
	if !equality.Semantic.DeepEqual(got, want) {
		t.Fatalf("PV from the store:\n%+v\nwant\n%+v", got, want)
	}
	got.Spec.CSI.VolumeAttributes["bucket"] = "changed"
	got.Spec.MountOptions[0] = "rw"
	*got.Spec.VolumeMode = corev1.PersistentVolumeFilesystem
	got.Spec.ClaimRef.Name = "other"
	if again := e.pv(); !equality.Semantic.DeepEqual(again, want) {
		t.Fatalf("a change to a returned PV reached the store: %+v", again)
	}
}
