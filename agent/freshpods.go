package agent

import (
	"context"
	"fmt"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
)

// freshAge is how long a LIST of the node's pods answers the repair runs
// that ask after it started. A run acts on the pods the API server has now,
// not on the informer's copy (freshPods); sharing one LIST between the runs
// of a burst, instead of a GET per pod, makes that read one request per
// second however many volumes broke. What a run acts on is then at most
// freshAge older than its own read would have been; a run's read was
// already seconds old when its last rung acted.
const freshAge = time.Second

// nodePods reads the pods bound to the node from the API server (a
// consistent LIST with the node's field selector, which the Node authorizer
// allows), shared between the runs that ask within maxAge of its start.
type nodePods struct {
	list    func(ctx context.Context) (*corev1.PodList, error)
	maxAge  time.Duration
	timeout time.Duration
	now     func() time.Time

	mu   sync.Mutex
	last *podList // the newest LIST, in flight or done
	// life ends the LISTs in flight (the agent's Run); fetches counts
	// them, for Run to wait for.
	life    context.Context
	fetches sync.WaitGroup
}

// podList is one LIST of the node's pods.
type podList struct {
	start time.Time
	done  chan struct{} // closed when pods and err are set
	pods  map[types.NamespacedName]*corev1.Pod
	err   error
}

func newNodePods(client kubernetes.Interface, node string, timeout time.Duration) *nodePods {
	selector := fields.OneTermEqualSelector("spec.nodeName", node).String()
	return &nodePods{
		list: func(ctx context.Context) (*corev1.PodList, error) {
			// ResourceVersion "" is a consistent read: the API server
			// answers as of now, not from a cache that may lag.
			return client.CoreV1().Pods(metav1.NamespaceAll).List(ctx, metav1.ListOptions{FieldSelector: selector})
		},
		maxAge:  freshAge,
		timeout: timeout,
		now:     time.Now,
		life:    context.Background(),
	}
}

// live makes the LISTs started from now on end with ctx (the agent's Run);
// wait waits for those in flight to end.
func (n *nodePods) live(ctx context.Context) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.life = ctx
}

func (n *nodePods) wait() { n.fetches.Wait() }

// read returns a LIST of the node's pods that started at most maxAge
// before the call: the newest one when it is young enough and did not fail,
// else a new one. The LIST runs on its own deadline (n.timeout), not the
// caller's: other runs wait for it too. A caller whose ctx ends stops
// waiting.
func (n *nodePods) read(ctx context.Context) (*podList, error) {
	n.mu.Lock()
	l := n.last
	now := n.now()
	if l == nil || now.Sub(l.start) > n.maxAge || l.failed() {
		l = &podList{start: now, done: make(chan struct{})}
		n.last = l
		// Not the caller's deadline, but its logger, and the agent's
		// life: a LIST in flight at shutdown ends with it.
		life := n.life
		if life == nil {
			life = context.Background()
		}
		fctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
		stop := context.AfterFunc(life, cancel)
		n.fetches.Add(1)
		go func() {
			defer n.fetches.Done()
			defer stop()
			defer cancel()
			n.fetch(fctx, l)
		}()
	}
	n.mu.Unlock()
	select {
	case <-l.done:
		return l, l.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// failed reports a LIST that ended in an error: it is never reused.
func (l *podList) failed() bool {
	select {
	case <-l.done:
		return l.err != nil
	default:
		return false
	}
}

func (n *nodePods) fetch(ctx context.Context, l *podList) {
	defer close(l.done)
	ctx, cancel := context.WithTimeout(ctx, n.timeout)
	defer cancel()
	got, err := n.list(ctx)
	if err != nil {
		l.err = fmt.Errorf("list the node's pods: %w", err)
		return
	}
	l.pods = make(map[types.NamespacedName]*corev1.Pod, len(got.Items))
	for i := range got.Items {
		p := &got.Items[i]
		l.pods[types.NamespacedName{Namespace: p.Namespace, Name: p.Name}] = p
	}
	klog.FromContext(ctx).V(4).Info("Listed the node's pods for repair runs", "pods", len(got.Items))
}

// pod returns a copy of the pod of that name in the LIST, or nil.
func (l *podList) pod(namespace, name string) *corev1.Pod {
	p := l.pods[types.NamespacedName{Namespace: namespace, Name: name}]
	if p == nil {
		return nil
	}
	return p.DeepCopy()
}

// freshResult is the answer of freshPods.
type freshResult struct {
	pods []*corev1.Pod
	gone []string
	err  error
}

// freshPods reads the pods from the API server (a LIST of the node's pods
// shared by the runs of a burst, nodePods, not the informer's cache) and
// keeps those still there with the same UID, bound to this node and not
// being deleted, in their current state; gone names the others. An API
// server out of reach is errAPIWait: nothing is repaired on the cache's
// word.
func (a *Agent) freshPods(ctx context.Context, pods []*corev1.Pod) (fresh []*corev1.Pod, gone []string, err error) {
	l, err := a.nodePods.read(ctx)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %w", errAPIWait, err)
	}
	for _, pod := range pods {
		cur := l.pod(pod.Namespace, pod.Name)
		switch {
		case cur == nil:
			gone = append(gone, klog.KObj(pod).String()+" (deleted, or no longer bound to this node)")
			continue
		case cur.UID != pod.UID:
			gone = append(gone, fmt.Sprintf("%s (replaced: uid %s, was %s)", klog.KObj(pod), cur.UID, pod.UID))
			continue
		case cur.DeletionTimestamp != nil:
			gone = append(gone, klog.KObj(pod).String()+" (being deleted)")
			continue
		case cur.Spec.NodeName != pod.Spec.NodeName:
			gone = append(gone, klog.KObj(pod).String()+" (on node "+cur.Spec.NodeName+")")
			continue
		}
		fresh = append(fresh, cur)
	}
	return fresh, gone, nil
}

// awaitFresh waits for the fresh pods and returns r for them alone (their
// current objects), or nil when none is left or the API server could not
// say: then nothing is repaired.
func (a *Agent) awaitFresh(ctx context.Context, j *job, r *resolved, freshc <-chan freshResult) *resolved {
	logger := klog.FromContext(ctx)
	f := <-freshc
	if f.err != nil {
		logger.V(2).Info("Repair waits for the API server", "err", f.err)
		if a.notes.once(j.key, noteAPIWait, "") {
			a.report.volume(j.active, r.pvc, corev1.EventTypeWarning, ReasonNotRepaired, actionRepair, a.report.message("repair waits: %v", f.err))
		}
		return nil
	}
	if len(f.gone) > 0 {
		logger.V(2).Info("Pods gone or replaced since the cache saw them: not repaired", "pods", f.gone)
	}
	if len(f.pods) == 0 {
		return nil
	}
	keep := make(map[types.UID]*corev1.Pod, len(f.pods))
	for _, p := range f.pods {
		keep[p.UID] = p
	}
	var pods []*corev1.Pod
	for _, p := range r.pods {
		if cur := keep[p.UID]; cur != nil {
			pods = append(pods, cur)
		}
	}
	if len(pods) == 0 {
		return nil
	}
	fresh := (&residual{r: r}).forPods(pods)
	fresh.refreshContainers()
	return fresh
}
