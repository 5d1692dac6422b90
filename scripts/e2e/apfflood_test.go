package e2e_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"

	coordinationv1 "k8s.io/api/coordination/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/mountmedic/mountmedic/scripts/e2e"
)

// apfFlood is a stolen agent token flooding the heartbeat FlowSchema's
// flow (deploy/apf.yaml, mountmedic-heartbeat: Lease writes of the agents'
// ServiceAccount in its namespace, one flow for every agent): Lease
// updates as fast as 16 connections go, without a client-side limit, of
// the node's heartbeat Lease at a stale resourceVersion with the
// ServiceAccount's token without a pod binding: every write is refused
// (a conflict, or by admission), after API Priority and Fairness gave it
// its seat.
type apfFlood struct {
	sent, throttled, refused atomic.Int64
	cancel                   context.CancelFunc
	wg                       sync.WaitGroup
	once                     sync.Once
}

func startAPFFlood(t *testing.T, e *env, node string) *apfFlood {
	t.Helper()
	rc := e.c.ServiceAccountConfig(t, e2e.AgentNamespace, "mountmedic")
	rc.QPS = -1 // no client-side rate limit
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	f := &apfFlood{cancel: cancel}
	lease := &coordinationv1.Lease{ObjectMeta: metav1.ObjectMeta{Name: node, Namespace: e2e.AgentNamespace, ResourceVersion: "1"},
		Spec: coordinationv1.LeaseSpec{HolderIdentity: ptr.To("flooder")}}
	for range 16 {
		f.wg.Go(func() {
			for ctx.Err() == nil {
				// A copy per request: the client's encoder writes the
				// object's TypeMeta.
				_, err := cs.CoordinationV1().Leases(e2e.AgentNamespace).Update(ctx, lease.DeepCopy(), metav1.UpdateOptions{})
				f.sent.Add(1)
				switch {
				case apierrors.IsTooManyRequests(err):
					f.throttled.Add(1)
				case err != nil:
					f.refused.Add(1)
				}
			}
		})
	}
	return f
}

// stop ends the flood and returns the writes sent, those throttled (429)
// and those refused otherwise.
func (f *apfFlood) stop() (sent, throttled, refused int64) {
	f.once.Do(func() {
		f.cancel()
		f.wg.Wait()
	})
	return f.sent.Load(), f.throttled.Load(), f.refused.Load()
}
