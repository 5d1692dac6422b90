package agent

import (
	"fmt"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	coreinformers "k8s.io/client-go/informers/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
)

// uidIndex indexes the node's pods by UID, the key the mount table gives.
const uidIndex = "uid"

// podInformer returns an informer that lists and watches only the pods
// bound to node, with managed fields dropped. It is made on its own, not
// by an informer factory: a factory links every API group's informers into
// the binary.
func podInformer(client kubernetes.Interface, node string) (cache.SharedIndexInformer, error) {
	selector := fields.OneTermEqualSelector("spec.nodeName", node).String()
	inf := coreinformers.NewFilteredPodInformer(client, metav1.NamespaceAll, 0, cache.Indexers{},
		func(o *metav1.ListOptions) { o.FieldSelector = selector })
	if err := inf.SetTransform(func(obj any) (any, error) {
		if acc, ok := obj.(metav1.ObjectMetaAccessor); ok {
			acc.GetObjectMeta().SetManagedFields(nil)
		}
		return obj, nil
	}); err != nil {
		return nil, fmt.Errorf("set pod informer transform: %w", err)
	}
	if err := inf.AddIndexers(cache.Indexers{uidIndex: func(obj any) ([]string, error) {
		pod, ok := obj.(*corev1.Pod)
		if !ok {
			return nil, nil
		}
		return []string{string(pod.UID)}, nil
	}}); err != nil {
		return nil, fmt.Errorf("add pod uid index: %w", err)
	}
	return inf, nil
}

// podsByUID reads the pod informer's index.
type podsByUID struct{ idx cache.Indexer }

func (p podsByUID) get(uid string) *corev1.Pod {
	if p.idx == nil {
		return nil
	}
	objs, err := p.idx.ByIndex(uidIndex, uid)
	if err != nil || len(objs) == 0 {
		return nil
	}
	pod, _ := objs[0].(*corev1.Pod)
	return pod
}
