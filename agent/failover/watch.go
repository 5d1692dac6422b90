package failover

import (
	"context"
	"sync"
	"time"

	coordinationv1 "k8s.io/api/coordination/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/tools/cache"
)

// What the controller keeps of the objects it watches. At 5,000 nodes a
// full Node (images, volumesInUse, managedFields, capacity, addresses...)
// is tens of kilobytes; the controller reads a handful of fields, so each
// informer's transform keeps those and drops the rest before the object
// reaches the cache. The Leases are small, but their managedFields are not.

// stripNode keeps of a Node what the evidence, the recovery and the events
// read: name, UID and resourceVersion, the failed-over annotation, the
// taints, and the Ready condition's status and heartbeat.
func stripNode(obj any) (any, error) {
	n, ok := obj.(*corev1.Node)
	if !ok {
		return obj, nil // a tombstone: its object was stripped when stored
	}
	out := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n.Name, UID: n.UID, ResourceVersion: n.ResourceVersion}}
	if v, ok := n.Annotations[FailedOverAnnotation]; ok {
		out.Annotations = map[string]string{FailedOverAnnotation: v}
	}
	if len(n.Spec.Taints) > 0 {
		out.Spec.Taints = n.Spec.Taints
	}
	for _, c := range n.Status.Conditions {
		if c.Type == corev1.NodeReady {
			out.Status.Conditions = []corev1.NodeCondition{{Type: c.Type, Status: c.Status, LastHeartbeatTime: c.LastHeartbeatTime}}
			break
		}
	}
	return out, nil
}

// stripLease keeps of a Lease what leaseVersion and the heartbeat's
// judgement read: holder, renew time and duration.
func stripLease(obj any) (any, error) {
	l, ok := obj.(*coordinationv1.Lease)
	if !ok {
		return obj, nil
	}
	out := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: l.Name, Namespace: l.Namespace, UID: l.UID, ResourceVersion: l.ResourceVersion}}
	out.Spec.HolderIdentity = l.Spec.HolderIdentity
	out.Spec.RenewTime = l.Spec.RenewTime
	out.Spec.LeaseDurationSeconds = l.Spec.LeaseDurationSeconds
	return out, nil
}

// sight tracks whether the controller's watches see the API server. A watch
// that breaks and cannot be re-established (the API server is down,
// restarting, or out of reach) blinds it: client-go's reflector retries a
// refused connection quietly, so the wrapped list and watch calls of every
// informer report what they got. Sight is regained when every informer's
// last list or watch call succeeded again; the controller then
// restarts every silence clock (observer.restartAll), because what changed
// while it was blind is unknown.
type sight struct {
	mu      sync.Mutex
	blind   bool
	since   time.Time
	ok      []bool
	regains int
	now     func() time.Time
	// regained is called (without the lock) each time sight returns.
	regained func()
}

func newSight(now func() time.Time) *sight { return &sight{now: now} }

// register adds an informer and returns its index.
func (s *sight) register() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ok = append(s.ok, true)
	return len(s.ok) - 1
}

// report records the outcome of informer id's list or watch call.
func (s *sight) report(id int, err error) {
	s.mu.Lock()
	regained := false
	switch {
	case err != nil:
		s.ok[id] = false
		if !s.blind {
			s.blind, s.since = true, s.now()
		}
	default:
		s.ok[id] = true
		if !s.blind {
			break
		}
		all := true
		for _, ok := range s.ok {
			all = all && ok
		}
		if all {
			s.blind = false
			s.regains++
			regained = true
		}
	}
	cb := s.regained
	s.mu.Unlock()
	if regained && cb != nil {
		cb()
	}
}

// state says whether the controller is blind, since when, and how many
// times it regained sight so far.
func (s *sight) state() (blind bool, since time.Time, regains int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.blind, s.since, s.regains
}

// listWatch is a ListerWatcher whose calls report to the sight.
func (s *sight) listWatch(list func(context.Context, metav1.ListOptions) (runtime.Object, error),
	watchFn func(context.Context, metav1.ListOptions) (watch.Interface, error)) *cache.ListWatch {
	id := s.register()
	return &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			obj, err := list(ctx, o)
			if ctx.Err() == nil {
				s.report(id, err)
			}
			return obj, err
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			w, err := watchFn(ctx, o)
			if ctx.Err() == nil {
				s.report(id, err)
			}
			return w, err
		},
	}
}
