package agent

import (
	"context"
	"slices"
	"sort"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/util/flowcontrol"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// Background reads of PersistentVolumes: pvReadQPS a second at most (on
// top of the client's own limit), a failed read retried after pvRetry, or
// pvRetryUnreachable when the API server could not answer. A PV is kept
// pvKeep after its volume was last seen published: a repair unmounts and
// mounts again, and a table read between the two must not cost a read.
const (
	pvReadQPS          = 5
	pvRetry            = 10 * time.Minute
	pvRetryUnreachable = 30 * time.Second
	pvKeep             = 5 * time.Minute
)

// pvStore keeps the PersistentVolumes of the CSI volumes published on the
// node, each read once in the background when its volume is first seen
// mounted. A repair then reads only what can change and must be read at
// fault time: the pods (a shared LIST, nodePods) and the claim (its opt-out
// annotation). A storage outage that breaks 1,000 volumes costs 1,000
// fewer requests at the moment the API server is busiest, and the reads
// are spread over the quiet time before.
//
// What a repair takes from the PV cannot go stale: its CSI source (driver,
// handle, attributes, secret references) and volume mode cannot change
// after the PV is created. Its mount options and access modes are those of
// the read, taken after kubelet mounted the volume, so those the mount was
// made with or newer. A PV that no longer matches its claim (claimRef) or
// the mount fails the request's checks, is dropped (forget) and read
// afresh. An entry goes pvKeep after its volume was last seen published on
// the node.
type pvStore struct {
	get   func(ctx context.Context, name string) (*corev1.PersistentVolume, error)
	limit flowcontrol.RateLimiter
	now   func() time.Time

	mu sync.Mutex
	// want are the PV names of the last track; pvs the ones read;
	// unseen, since when a stored PV's volume is not in the track.
	want   map[string]bool
	pvs    map[string]*pvEntry
	unseen map[string]time.Time
	// retryAt holds the names whose read failed, until when they wait.
	retryAt map[string]time.Time
	wake    chan struct{}
}

func newPVStore(client kubernetes.Interface, timeout time.Duration) *pvStore {
	return &pvStore{
		get: func(ctx context.Context, name string) (*corev1.PersistentVolume, error) {
			ctx, cancel := context.WithTimeout(ctx, timeout)
			defer cancel()
			// ResourceVersion "0": the API server answers from its watch
			// cache, not etcd; the fields kept cannot change anyway.
			return client.CoreV1().PersistentVolumes().Get(ctx, name, metav1.GetOptions{ResourceVersion: "0"})
		},
		limit:   flowcontrol.NewTokenBucketRateLimiter(pvReadQPS, pvReadQPS),
		now:     time.Now,
		want:    make(map[string]bool),
		pvs:     make(map[string]*pvEntry),
		unseen:  make(map[string]time.Time),
		retryAt: make(map[string]time.Time),
		wake:    make(chan struct{}, 1),
	}
}

// publishedPVs lists the PersistentVolumes behind the CSI publish targets
// of inv: a target's directory is its PV's name, except for a CSI inline
// volume (named after the pod's volume), told apart by the pod's spec. A
// pod the informer does not have yet is left for a later track.
func publishedPVs(inv *probe.Inventory, pods podsByUID) []string {
	seen := make(map[string]bool)
	var out []string
	for _, m := range inv.Mounts {
		t := m.Target
		if t.Kind != kubelet.KindPublish || t.Plugin != kubelet.CSIPluginDir || seen[t.Volume] {
			continue
		}
		pod := pods.get(t.PodUID)
		if pod == nil || inlineCSI(pod, t.Volume) {
			continue
		}
		seen[t.Volume] = true
		out = append(out, t.Volume)
	}
	sort.Strings(out)
	return out
}

// inlineCSI reports whether the pod has a CSI inline volume of that name.
func inlineCSI(pod *corev1.Pod, name string) bool {
	for i := range pod.Spec.Volumes {
		if v := &pod.Spec.Volumes[i]; v.Name == name && v.CSI != nil {
			return true
		}
	}
	return false
}

// track sets the PVs of the volumes published now: those not read yet are
// read in the background (run); the others are dropped pvKeep after they
// were last tracked.
func (s *pvStore) track(names []string) {
	s.mu.Lock()
	now := s.now()
	want := make(map[string]bool, len(names))
	for _, n := range names {
		want[n] = true
	}
	s.want = want
	for n := range s.pvs {
		if want[n] {
			delete(s.unseen, n)
			continue
		}
		since, ok := s.unseen[n]
		if !ok {
			s.unseen[n] = now
		} else if now.Sub(since) >= pvKeep {
			delete(s.pvs, n)
			delete(s.unseen, n)
		}
	}
	for n := range s.retryAt {
		if !want[n] {
			delete(s.retryAt, n)
		}
	}
	s.mu.Unlock()
	s.poke()
}

func (s *pvStore) poke() {
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// lookup returns the stored PV of that name (a new object, with the
// fields a repair reads), or nil.
func (s *pvStore) lookup(name string) *corev1.PersistentVolume {
	if s == nil {
		return nil
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if e := s.pvs[name]; e != nil {
		return e.pv()
	}
	return nil
}

// forget drops a PV that did not match (it is read again in the
// background).
func (s *pvStore) forget(name string) {
	s.mu.Lock()
	delete(s.pvs, name)
	delete(s.unseen, name)
	delete(s.retryAt, name)
	s.mu.Unlock()
	s.poke()
}

// missing lists the wanted PVs not read yet whose retry time has come, and
// the earliest retry time still ahead (zero when none).
func (s *pvStore) missing() (names []string, next time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	for n := range s.want {
		if s.pvs[n] != nil {
			continue
		}
		if at, ok := s.retryAt[n]; ok && now.Before(at) {
			if next.IsZero() || at.Before(next) {
				next = at
			}
			continue
		}
		names = append(names, n)
	}
	sort.Strings(names)
	return names, next
}

// run reads the missing PVs, at most pvReadQPS a second, until ctx ends.
func (s *pvStore) run(ctx context.Context) {
	logger := klog.FromContext(ctx)
	retry := time.NewTimer(time.Hour)
	defer retry.Stop()
	for {
		names, next := s.missing()
		for _, name := range names {
			if err := s.limit.Wait(ctx); err != nil {
				return
			}
			s.mu.Lock()
			wanted := s.want[name] && s.pvs[name] == nil
			s.mu.Unlock()
			if !wanted {
				continue
			}
			pv, err := s.get(ctx, name)
			s.mu.Lock()
			switch {
			case err != nil:
				wait := pvRetry
				if unreachable(err) {
					wait = pvRetryUnreachable
				}
				s.retryAt[name] = s.now().Add(wait)
			case s.want[name]:
				s.pvs[name] = newPVEntry(pv)
				delete(s.retryAt, name)
			}
			s.mu.Unlock()
			if err != nil {
				logger.V(2).Info("Reading a PersistentVolume ahead of a repair failed; a repair reads it itself", "pv", name, "err", err)
			}
		}
		if len(names) > 0 {
			continue // a track or forget may have come meanwhile
		}
		wait := time.Hour
		if !next.IsZero() {
			wait = max(next.Sub(s.now()), time.Millisecond)
		}
		retry.Reset(wait)
		select {
		case <-ctx.Done():
			return
		case <-s.wake:
		case <-retry.C:
		}
	}
}

// pvEntry is what a repair reads of a PV (kubelet.BuildVolumeRequest and
// its checks): a third of the memory of a whole PersistentVolume (about
// 0.7 against 1.9 kB in Go's memory), which counts at a thousand volumes.
type pvEntry struct {
	name         string
	uid          types.UID
	csi          *corev1.CSIPersistentVolumeSource
	volumeMode   *corev1.PersistentVolumeMode
	accessModes  []corev1.PersistentVolumeAccessMode
	mountOptions []string
	claimRef     *corev1.ObjectReference // namespace, name and UID only
}

func newPVEntry(pv *corev1.PersistentVolume) *pvEntry {
	e := &pvEntry{
		name:         pv.Name,
		uid:          pv.UID,
		csi:          pv.Spec.CSI.DeepCopy(),
		accessModes:  slices.Clone(pv.Spec.AccessModes),
		mountOptions: slices.Clone(pv.Spec.MountOptions),
	}
	if m := pv.Spec.VolumeMode; m != nil {
		e.volumeMode = ptr.To(*m)
	}
	if r := pv.Spec.ClaimRef; r != nil {
		e.claimRef = &corev1.ObjectReference{Namespace: r.Namespace, Name: r.Name, UID: r.UID}
	}
	return e
}

// pv is the entry as a PersistentVolume of its own.
func (e *pvEntry) pv() *corev1.PersistentVolume {
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: e.name, UID: e.uid},
		Spec: corev1.PersistentVolumeSpec{
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: e.csi.DeepCopy()},
			AccessModes:            slices.Clone(e.accessModes),
			MountOptions:           slices.Clone(e.mountOptions),
		},
	}
	if e.volumeMode != nil {
		pv.Spec.VolumeMode = ptr.To(*e.volumeMode)
	}
	if e.claimRef != nil {
		pv.Spec.ClaimRef = e.claimRef.DeepCopy()
	}
	return pv
}
