package agent

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
)

// kube is the agent's access to the API server beyond the pod informer:
// GETs by name through a bounded cache, Secrets without one, evictions and
// deletions.
type kube struct {
	client  kubernetes.Interface
	cache   *objectCache
	timeout time.Duration
	// pvs are the PVs of the node's volumes, read ahead of any repair.
	pvs *pvStore

	// flights are the GETs in flight by cache key: a run that asks for
	// an object whose read (its own claim read ahead, readAhead) is under
	// way takes that answer instead of a second request.
	mu      sync.Mutex
	flights map[string]*flight
}

// flight is one GET in flight; done is closed when obj and err are set.
type flight struct {
	done chan struct{}
	obj  any
	err  error
}

// unreachable reports whether err means the API server could not answer
// (network error, timeout, 5xx, 429), as opposed to an answer such as
// NotFound or Forbidden.
func unreachable(err error) bool {
	var st apierrors.APIStatus
	if !errors.As(err, &st) {
		return true
	}
	code := st.Status().Code
	return code >= http.StatusInternalServerError || code == http.StatusTooManyRequests ||
		apierrors.IsTimeout(err) || apierrors.IsServerTimeout(err)
}

// cachedGet answers from the cache while the entry is fresh, else asks the
// API server; when the server cannot be reached it serves a stale entry.
func cachedGet[T any](ctx context.Context, k *kube, key string, fetch func(context.Context) (T, error)) (T, error) {
	if obj, fresh, ok := k.cache.get(key); ok && fresh {
		return obj.(T), nil
	}
	got, err := k.shared(ctx, key, func(ctx context.Context) (any, error) {
		cctx, cancel := context.WithTimeout(ctx, k.timeout)
		defer cancel()
		v, err := fetch(cctx)
		if err == nil {
			k.cache.put(key, v) // before the flight ends: no second read
		}
		return v, err
	})
	obj, _ := got.(T)
	if err == nil {
		return obj, nil
	}
	if apierrors.IsNotFound(err) {
		k.cache.remove(key)
		return obj, err
	}
	if obj, _, ok := k.cache.get(key); ok && unreachable(err) {
		klog.FromContext(ctx).V(2).Info("API server unreachable, using the cached object", "object", key, "err", err)
		return obj.(T), nil
	}
	return obj, err
}

// shared runs fetch for key, or waits for the one in flight for the same
// key and takes its answer. A caller whose ctx ends stops waiting.
func (k *kube) shared(ctx context.Context, key string, fetch func(context.Context) (any, error)) (any, error) {
	k.mu.Lock()
	if f := k.flights[key]; f != nil {
		k.mu.Unlock()
		select {
		case <-f.done:
			return f.obj, f.err
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	f := &flight{done: make(chan struct{})}
	if k.flights == nil {
		k.flights = make(map[string]*flight)
	}
	k.flights[key] = f
	k.mu.Unlock()
	f.obj, f.err = fetch(ctx)
	k.mu.Lock()
	delete(k.flights, key)
	k.mu.Unlock()
	close(f.done)
	return f.obj, f.err
}

func (k *kube) pvc(ctx context.Context, ns, name string) (*corev1.PersistentVolumeClaim, error) {
	return cachedGet(ctx, k, "pvc/"+ns+"/"+name, func(ctx context.Context) (*corev1.PersistentVolumeClaim, error) {
		return k.client.CoreV1().PersistentVolumeClaims(ns).Get(ctx, name, metav1.GetOptions{})
	})
}

// pv answers from the PVs read ahead (pvStore) when it has the PV, else
// through the cache.
func (k *kube) pv(ctx context.Context, name string) (*corev1.PersistentVolume, error) {
	if k.pvs != nil {
		if pv := k.pvs.lookup(name); pv != nil {
			return pv, nil
		}
	}
	return cachedGet(ctx, k, "pv/"+name, func(ctx context.Context) (*corev1.PersistentVolume, error) {
		return k.client.CoreV1().PersistentVolumes().Get(ctx, name, metav1.GetOptions{})
	})
}

// csiDriver returns the CSIDriver object, or nil when the cluster has none
// for driver (kubelet's defaults then apply).
func (k *kube) csiDriver(ctx context.Context, name string) (*storagev1.CSIDriver, error) {
	d, err := cachedGet(ctx, k, "csidriver/"+name, func(ctx context.Context) (*storagev1.CSIDriver, error) {
		return k.client.StorageV1().CSIDrivers().Get(ctx, name, metav1.GetOptions{})
	})
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	return d, err
}

func (k *kube) volumeAttachment(ctx context.Context, name string) (*storagev1.VolumeAttachment, error) {
	return cachedGet(ctx, k, "volumeattachment/"+name, func(ctx context.Context) (*storagev1.VolumeAttachment, error) {
		return k.client.StorageV1().VolumeAttachments().Get(ctx, name, metav1.GetOptions{})
	})
}

// forget drops the cached objects of a volume (after a mismatch, which a
// stale cache can cause).
func (k *kube) forget(keys ...string) {
	for _, key := range keys {
		k.cache.remove(key)
		if name, ok := strings.CutPrefix(key, "pv/"); ok && k.pvs != nil {
			k.pvs.forget(name)
		}
	}
}

// secret GETs a Secret. It is never cached: the caller drops it after the
// repair.
func (k *kube) secret(ctx context.Context, ns, name string) (*corev1.Secret, error) {
	ctx, cancel := context.WithTimeout(quietBodies(ctx), k.timeout)
	defer cancel()
	return k.client.CoreV1().Secrets(ns).Get(ctx, name, metav1.GetOptions{})
}

// evict asks the Eviction API to evict pod, with a UID precondition so that
// a pod re-created under the same name is never evicted in its place.
func (k *kube) evict(ctx context.Context, pod *corev1.Pod) error {
	ctx, cancel := context.WithTimeout(ctx, k.timeout)
	defer cancel()
	uid := pod.UID
	return k.client.PolicyV1().Evictions(pod.Namespace).Evict(ctx, &policyv1.Eviction{
		ObjectMeta:    metav1.ObjectMeta{Namespace: pod.Namespace, Name: pod.Name},
		DeleteOptions: &metav1.DeleteOptions{Preconditions: &metav1.Preconditions{UID: &uid}},
	})
}

// deletePod deletes pod with a UID precondition; grace nil keeps the pod's
// own grace period, 0 force-deletes.
func (k *kube) deletePod(ctx context.Context, pod *corev1.Pod, grace *int64) error {
	ctx, cancel := context.WithTimeout(ctx, k.timeout)
	defer cancel()
	uid := pod.UID
	return k.client.CoreV1().Pods(pod.Namespace).Delete(ctx, pod.Name, metav1.DeleteOptions{
		GracePeriodSeconds: grace,
		Preconditions:      &metav1.Preconditions{UID: &uid},
	})
}
