package agent

import (
	"context"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/mountmedic/mountmedic/remount"
	"github.com/mountmedic/mountmedic/scripts/kubetest"
	"github.com/mountmedic/mountmedic/scripts/lab"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// recordingRepairer records the tiers called and heals nothing.
type recordingRepairer struct {
	mu    sync.Mutex
	calls []string
}

func (r *recordingRepairer) record(tier string) remount.Outcome {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.calls = append(r.calls, tier)
	return remount.Outcome{Healed: true}
}

func (r *recordingRepairer) Restage(context.Context, *remount.Volume) remount.Outcome {
	return r.record("restage")
}
func (r *recordingRepairer) LiveSwap(context.Context, *remount.Volume) remount.Outcome {
	return r.record("liveswap")
}
func (r *recordingRepairer) Restart(context.Context, *remount.Volume) remount.Outcome {
	return r.record("restart")
}
func (r *recordingRepairer) Guard(context.Context, string) remount.Action {
	return remount.Action{}
}

func (r *recordingRepairer) Unmount(context.Context, *remount.Volume) remount.Outcome {
	return r.record("unmount")
}

func (r *recordingRepairer) take() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	c := r.calls
	r.calls = nil
	return c
}

// TestRepairReadsPodsFresh: a run whose pods came from a cache that has not
// caught up (right after a partition) acts only on pods the API server
// still has under the same UID on this node: a pod force-deleted, or
// replaced under its name by another UID, is never swapped, restarted or
// evicted. The pod that is still there is repaired.
func TestRepairReadsPodsFresh(t *testing.T) {
	lab.RequireRoot(t)
	c := kubetest.Start(t, kubetest.Options{})
	c.CreateNamespace(t, "apps")
	ctx := context.Background()
	cfg := DefaultConfig()
	cfg.NodeName = lab.DefaultNodeName
	cfg.KubeletRoot = t.TempDir()
	cfg.MetricsAddr = ""
	cfg.Version = "test"
	rep := &recordingRepairer{}
	a, err := New(cfg, Deps{Client: c.Client, Repairer: rep, DriverCaps: func(context.Context, string) (kubelet.NodeCapabilities, error) {
		return kubelet.NodeCapabilities{}, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	newPod := func(name string) *corev1.Pod {
		p, err := c.Client.CoreV1().Pods("apps").Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: "apps", Name: name},
			Spec:       corev1.PodSpec{NodeName: cfg.NodeName, Containers: []corev1.Container{{Name: "app", Image: "busybox"}}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}
	forceDelete := func(p *corev1.Pod) {
		if err := c.Client.CoreV1().Pods("apps").Delete(ctx, p.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}); err != nil {
			t.Fatal(err)
		}
	}
	// runFor runs the ladder from the live swap (a residual: the host was
	// re-staged before the partition) for the cached pod.
	runFor := func(cached *corev1.Pod) []string {
		bv := &brokenVolume{key: "vol/" + string(cached.UID), csi: true, driver: "lab.csi", volumeHandle: "h",
			pods: map[string]*podUse{string(cached.UID): {uid: string(cached.UID)}}}
		rs := &residual{vol: bv, r: &resolved{
			vol:         &remount.Volume{Driver: "lab.csi", VolumeHandle: "h", Pods: []remount.PodVolume{{Publish: kubelet.VolumeRequest{PodUID: cached.UID}}}},
			pods:        []*corev1.Pod{cached},
			restageable: true, needSwap: true,
			ownBinds: map[string][]string{string(cached.UID): {"c1"}},
		}}
		j := &job{key: bv.key, vol: bv, active: []*corev1.Pod{cached}, since: time.Now(), resume: rs}
		a.run(ctx, j)
		return rep.take()
	}

	live := newPod("live")
	if got := runFor(live); len(got) == 0 || got[0] != "liveswap" {
		t.Fatalf("tiers for a pod that is still there: %v, want liveswap", got)
	}
	deleted := newPod("deleted")
	forceDelete(deleted)
	if got := runFor(deleted); len(got) != 0 {
		t.Errorf("tiers for a force-deleted pod the cache still has: %v, want none", got)
	}
	old := newPod("replaced")
	forceDelete(old)
	now := newPod("replaced")
	if now.UID == old.UID {
		t.Fatal("the replacement has the same UID")
	}
	if got := runFor(old); len(got) != 0 {
		t.Errorf("tiers for a pod replaced under its name (uid %s, cached %s): %v, want none", now.UID, old.UID, got)
	}
}
