package agent

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/remount"
)

// budget allows at most max disruptive actions (evictions, deletions) per
// sliding window on this node.
type budget struct {
	mu     sync.Mutex
	max    int
	window time.Duration
	now    func() time.Time
	taken  []time.Time
}

func newBudget(max int, window time.Duration, now func() time.Time) *budget {
	if now == nil {
		now = time.Now
	}
	return &budget{max: max, window: window, now: now}
}

func (b *budget) prune(now time.Time) {
	i := 0
	for i < len(b.taken) && now.Sub(b.taken[i]) >= b.window {
		i++
	}
	b.taken = b.taken[i:]
}

// take reserves one action; the reservation is returned with give when the
// action did not happen.
func (b *budget) take() (time.Time, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.now()
	b.prune(now)
	if len(b.taken) >= b.max {
		return time.Time{}, false
	}
	b.taken = append(b.taken, now)
	return now, true
}

// available reports whether an action could be taken now, without taking
// it (dry run).
func (b *budget) available() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.prune(b.now())
	return len(b.taken) < b.max
}

// give returns a reservation made at t.
func (b *budget) give(t time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if i := slices.Index(b.taken, t); i >= 0 {
		b.taken = slices.Delete(b.taken, i, i+1)
	}
}

// evictResult sums up the eviction rung of one run.
type evictResult struct {
	evicted, blocked, failed, refused int
	// waiting: blocked by a budget (PDB or the node's), not a failure.
	waiting bool
}

// ownerVerdict says whether a pod may be evicted or deleted, and why not.
func (a *Agent) ownerVerdict(pod *corev1.Pod) (ok bool, noController bool, why string) {
	owner := metav1.GetControllerOf(pod)
	if owner == nil {
		return false, true, "the pod has no controller owner: mountmedic never evicts or deletes it; restart or delete it yourself"
	}
	if !slices.Contains(a.cfg.EvictOwnerKinds, owner.Kind) {
		return false, false, fmt.Sprintf("the pod is owned by %s %s, not one of --evict-owner-kinds %v: not evicted", owner.Kind, owner.Name, a.cfg.EvictOwnerKinds)
	}
	return true, false, ""
}

// evictPods runs the eviction rung for the pods of a volume: Eviction API
// (PodDisruptionBudgets respected), or with the opt-in delete tier a
// deletion with a UID precondition when eviction is off or failed for a
// reason other than a budget or a refusal (403 Forbidden).
func (a *Agent) evictPods(ctx context.Context, key string, pods []*corev1.Pod, pvc *corev1.PersistentVolumeClaim) evictResult {
	var res evictResult
	for _, pod := range pods {
		logger := klog.FromContext(ctx).WithValues("pod", klog.KObj(pod))
		ok, noController, why := a.ownerVerdict(pod)
		if !ok {
			res.refused++
			if noController {
				a.metrics.evictions.WithLabelValues(evictNoController).Inc()
			}
			if a.notes.once(key, noteRefused, string(pod.UID)) {
				logger.V(2).Info("Not evicting pod", "reason", why)
				a.report.pod(pod, pvc, corev1.EventTypeWarning, ReasonNotRepaired, actionEvict, a.report.message("%s", why))
			}
			continue
		}
		if a.cfg.DryRun {
			verb := "evict"
			if !a.cfg.Tiers.Has(remount.TierEvict) {
				verb = "delete (UID precondition)"
			}
			note := a.report.message("would %s the pod so that its controller replaces it with fresh mounts", verb)
			if !a.budget.available() {
				note = a.report.message("would %s the pod, but the node's budget of %d per %s is used up", verb, a.cfg.MaxEvictions, a.cfg.EvictionWindow)
			}
			a.metrics.evictions.WithLabelValues(evictDryRun).Inc()
			a.report.pod(pod, pvc, corev1.EventTypeNormal, ReasonEvicting, actionEvict, note)
			res.waiting = true
			continue
		}
		at, ok := a.budget.take()
		if !ok {
			res.waiting = true
			note := a.report.message("eviction waits: the node's budget of %d evictions per %s is used up", a.cfg.MaxEvictions, a.cfg.EvictionWindow)
			if a.notes.once(key, noteBudget, string(pod.UID)) {
				a.report.pod(pod, pvc, corev1.EventTypeWarning, ReasonNotRepaired, actionEvict, note)
			}
			continue
		}
		var err error
		if a.cfg.Tiers.Has(remount.TierEvict) {
			err = a.kube.evict(ctx, pod)
			switch {
			case err == nil:
				res.evicted++
				a.metrics.evictions.WithLabelValues(evictEvicted).Inc()
				logger.V(2).Info("Evicted pod")
				a.report.pod(pod, pvc, corev1.EventTypeNormal, ReasonEvicting, actionEvict,
					a.report.message("evicted the pod so that its %s replaces it with fresh mounts", metav1.GetControllerOf(pod).Kind))
				continue
			case apierrors.IsNotFound(err) || apierrors.IsConflict(err):
				// Gone, or replaced under the same name: nothing to evict.
				a.budget.give(at)
				continue
			case apierrors.IsForbidden(err):
				// Refused by RBAC or an admission policy: a deletion
				// would go around that refusal, so the delete tier does
				// not follow.
				a.budget.give(at)
				res.failed++
				a.metrics.evictions.WithLabelValues(evictFailed).Inc()
				logger.Error(err, "Eviction refused")
				a.report.pod(pod, pvc, corev1.EventTypeWarning, ReasonNotRepaired, actionEvict,
					a.report.message("eviction refused, not deleting the pod instead: %v", apiMessage(err)))
				continue
			case apierrors.IsTooManyRequests(err):
				a.budget.give(at)
				res.blocked++
				res.waiting = true
				a.metrics.evictions.WithLabelValues(evictBlockedByPDB).Inc()
				logger.V(2).Info("Eviction blocked by a PodDisruptionBudget", "err", err)
				a.report.pod(pod, pvc, corev1.EventTypeWarning, ReasonEvictionBlocked, actionEvict,
					a.report.message("waiting for PodDisruptionBudget: %v", apiMessage(err)))
				continue
			}
			a.metrics.evictions.WithLabelValues(evictFailed).Inc()
			logger.Error(err, "Eviction failed")
			if !a.cfg.Tiers.Has(remount.TierDelete) {
				a.budget.give(at)
				res.failed++
				if unreachable(err) {
					res.waiting = true
				}
				a.report.pod(pod, pvc, corev1.EventTypeWarning, ReasonNotRepaired, actionEvict,
					a.report.message("eviction failed: %v", apiMessage(err)))
				continue
			}
		}
		// The opt-in delete tier.
		derr := a.kube.deletePod(ctx, pod, nil)
		switch {
		case derr == nil:
			res.evicted++
			logger.V(2).Info("Deleted pod (UID precondition)", "evictionErr", err)
			note := "deleted the pod (UID precondition) so that its controller replaces it with fresh mounts"
			if err != nil {
				note += fmt.Sprintf(" after eviction failed: %v", apiMessage(err))
			}
			a.report.pod(pod, pvc, corev1.EventTypeNormal, ReasonEvicting, actionDelete, a.report.message("%s", note))
		case apierrors.IsNotFound(derr) || apierrors.IsConflict(derr):
			a.budget.give(at)
		default:
			a.budget.give(at)
			res.failed++
			logger.Error(derr, "Deleting pod failed")
			a.report.pod(pod, pvc, corev1.EventTypeWarning, ReasonNotRepaired, actionDelete,
				a.report.message("deleting the pod failed: %v", apiMessage(derr)))
		}
	}
	return res
}

// forceDeleteOverdue reports whether a terminating pod is stuck past its
// deletion deadline by more than ForceDeleteAfter.
func (a *Agent) forceDeleteOverdue(pod *corev1.Pod, now time.Time) bool {
	if pod.DeletionTimestamp == nil {
		return false
	}
	return now.Sub(pod.DeletionTimestamp.Time) >= a.cfg.ForceDeleteAfter
}

// forceDelete deletes a pod stuck terminating with grace period 0 (opt-in),
// when a controller owns it and the node's budget allows.
func (a *Agent) forceDelete(ctx context.Context, key string, pod *corev1.Pod, pvc *corev1.PersistentVolumeClaim) {
	logger := klog.FromContext(ctx).WithValues("pod", klog.KObj(pod))
	if metav1.GetControllerOf(pod) == nil {
		if a.notes.once(key, noteForce, string(pod.UID)) {
			a.report.pod(pod, pvc, corev1.EventTypeWarning, ReasonNotRepaired, actionDelete,
				a.report.message("the pod is stuck terminating on a dead mount and has no controller owner: mountmedic never force-deletes it"))
		}
		return
	}
	if a.cfg.DryRun {
		a.report.pod(pod, pvc, corev1.EventTypeNormal, ReasonEvicting, actionDelete,
			a.report.message("would force-delete the pod stuck terminating on a dead mount"))
		return
	}
	at, ok := a.budget.take()
	if !ok {
		return
	}
	zero := int64(0)
	err := a.kube.deletePod(ctx, pod, &zero)
	switch {
	case err == nil:
		logger.V(2).Info("Force-deleted pod stuck terminating")
		a.report.pod(pod, pvc, corev1.EventTypeNormal, ReasonEvicting, actionDelete,
			a.report.message("force-deleted the pod: stuck terminating %s past its deletion time on a dead mount", a.cfg.ForceDeleteAfter))
	case apierrors.IsNotFound(err) || apierrors.IsConflict(err):
		a.budget.give(at)
	default:
		a.budget.give(at)
		logger.Error(err, "Force delete failed")
	}
}

// apiMessage is the API server's message for a status error (without the
// client-go prefix), or the error.
func apiMessage(err error) string {
	var st apierrors.APIStatus
	if errors.As(err, &st) && st.Status().Message != "" {
		return st.Status().Message
	}
	return err.Error()
}
