package e2e

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/utils/ptr"

	"github.com/mountmedic/mountmedic/scripts/csilab"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// Files the workload's container writes at its first start, and where it
// reads them back: WholeFile through the whole volume, SubFile through the
// subPath mount (it is also sub/sub.txt of the whole volume).
const (
	WholeMount = "/data"
	SubMount   = "/sub"
	WholeFile  = WholeMount + "/whole.txt"
	SubFile    = SubMount + "/sub.txt"
	WholeText  = "written through the whole volume"
	SubText    = "written through the subPath"
	container  = "app"
)

// appScript is the workload container: it writes one file through each
// mount on first start, then checks both mounts ten times a second and
// prints "ok" or "bad" each time the answer changes. The CRI log stamps each
// line with the runtime's clock: the log is the record of when the container
// lost and regained its volume. A check that took longer than SlowRead
// also prints "slow <start>", the time it began (busybox ash's
// $EPOCHREALTIME, seconds and microseconds), before its state line: a read
// blocked on a hung daemon logs when it began only once it returns.
var appScript = `trap 'exit 0' TERM INT
[ -e ` + WholeFile + ` ] || echo "` + WholeText + `" > ` + WholeFile + `
[ -e ` + SubFile + ` ] || echo "` + SubText + `" > ` + SubFile + `
last=
while :; do
  t=$EPOCHREALTIME
  if cat ` + WholeFile + ` ` + SubFile + ` ` + WholeMount + `/sub/sub.txt >/dev/null 2>&1; then s=ok; else s=bad; fi
  e=$EPOCHREALTIME
  if [ $(( ${e%.*}${e#*.} - ${t%.*}${t#*.} )) -gt ` + slowReadMicros + ` ]; then echo "slow $t"; fi
  if [ "$s" != "$last" ]; then echo "$s"; last=$s; fi
  usleep 100000
done
`

// SlowRead is how long a check of the workload's mounts may take before
// the container logs it as slow ("slow <start>"): a read of a healthy
// volume takes milliseconds.
const SlowRead = 500 * time.Millisecond

// slowReadMicros is SlowRead in microseconds, as the script compares.
var slowReadMicros = strconv.FormatInt(SlowRead.Microseconds(), 10)

// Workload is one scenario's application: a namespace with the S3 Secret,
// a static PV (its own prefix of the lab bucket) bound to a claim, and a
// one-replica hostNetwork busybox Deployment mounting the claim whole and
// through a subPath.
type Workload struct {
	Namespace string
	// Name of the Deployment, the PVC and (prefixed with the namespace) the PV.
	Name   string
	PV     string
	Handle string
	node   *Node
}

// EnsureCSIDriver creates the CSIDriver object of the lab's driver
// (attachRequired false: kubelet stages without a VolumeAttachment).
func (n *Node) EnsureCSIDriver(ctx context.Context) error {
	d := &storagev1.CSIDriver{
		ObjectMeta: metav1.ObjectMeta{Name: csilab.DriverName},
		Spec: storagev1.CSIDriverSpec{
			AttachRequired: ptr.To(false),
			PodInfoOnMount: ptr.To(false),
		},
	}
	_, err := n.Cluster.Client.StorageV1().CSIDrivers().Create(ctx, d, metav1.CreateOptions{})
	if err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("create CSIDriver %s: %w", csilab.DriverName, err)
	}
	return nil
}

// WorkloadOptions change the workload's pod.
type WorkloadOptions struct {
	// Tolerations replace the default (tolerate every taint).
	Tolerations []corev1.Toleration
	// Affinity is the pod's affinity (none by default).
	Affinity *corev1.Affinity
	// NoWait returns once the objects exist, without waiting for the pod.
	NoWait bool
	// Mounter is the volume's FUSE daemon (k8s-csi-s3's mounter attribute):
	// s3fs when empty, or rclone.
	Mounter string
	// Replicas of the Deployment (1 when 0). Its pods share the claim, so
	// they share one staging mount and one FUSE daemon on the node. With
	// more than one, DeployWorkloadWith waits for none of them (WaitPods).
	Replicas int32
	// ClaimAnnotations are the claim's annotations.
	ClaimAnnotations map[string]string
	// PodAnnotations are the pod template's annotations.
	PodAnnotations map[string]string
	// Writes makes the container also write one new file a quarter
	// second, WriteDir/<pod name>-<n> for n = 1, 2...: each lands in the
	// bucket as an object of its own, the record of when this pod wrote.
	Writes bool
}

// WriteDir is where a Writes workload's container writes its files (the
// object prefix <namespace>/w/ in the bucket).
const WriteDir = WholeMount + "/w"

// writerScript is the background writer of a Writes workload.
const writerScript = `( mkdir -p ` + WriteDir + `; n=0; while :; do n=$((n+1)); echo $n > ` + WriteDir + `/$POD_NAME-$n; usleep 250000; done ) &
`

// volumeAttributes are the PV's CSI attributes for mounter. Debian's rclone
// 1.60 needs --s3-provider=Other against a loopback S3 server, or it tries
// virtual-host addressing. rclone uploads a written file once nobody has
// used it for --vfs-write-back (5 s by default); the workload reads its
// files every second, so without 0s they would never reach S3.
func volumeAttributes(mounter string) map[string]string {
	switch mounter {
	case "", "s3fs":
		return map[string]string{"mounter": "s3fs"}
	case "rclone":
		return map[string]string{"mounter": "rclone", "options": "--s3-provider=Other --vfs-write-back=0s"}
	}
	return map[string]string{"mounter": mounter}
}

// DeployWorkload creates the workload of namespace ns and waits until its
// pod runs and has written its files.
func (n *Node) DeployWorkload(ctx context.Context, ns string) (*Workload, error) {
	return n.DeployWorkloadWith(ctx, ns, WorkloadOptions{})
}

// DeployWorkloadWith is DeployWorkload with options.
func (n *Node) DeployWorkloadWith(ctx context.Context, ns string, opts WorkloadOptions) (*Workload, error) {
	tolerations := opts.Tolerations
	if tolerations == nil {
		tolerations = []corev1.Toleration{{Operator: corev1.TolerationOpExists}}
	}
	w := &Workload{Namespace: ns, Name: "reader", PV: ns + "-data", Handle: csilab.Bucket + "/" + ns, node: n}
	c := n.Cluster.Client
	if err := n.EnsureCSIDriver(ctx); err != nil {
		return nil, err
	}
	if err := n.S3.PutObject(csilab.Bucket, ns+"/", nil); err != nil {
		return nil, err
	}
	if _, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		return nil, fmt.Errorf("create namespace %s: %w", ns, err)
	}
	secret := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "s3-keys", Namespace: ns},
		StringData: map[string]string{
			"accessKeyID":     csilab.AccessKey,
			"secretAccessKey": csilab.SecretKey,
			"endpoint":        n.S3.Endpoint,
		},
	}
	if _, err := c.CoreV1().Secrets(ns).Create(ctx, secret, metav1.CreateOptions{}); err != nil {
		return nil, fmt.Errorf("create secret: %w", err)
	}
	ref := &corev1.SecretReference{Name: "s3-keys", Namespace: ns}
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: w.PV},
		Spec: corev1.PersistentVolumeSpec{
			Capacity:                      corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")},
			AccessModes:                   []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			PersistentVolumeReclaimPolicy: corev1.PersistentVolumeReclaimRetain,
			StorageClassName:              "",
			ClaimRef:                      &corev1.ObjectReference{Namespace: ns, Name: w.Name},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver:               csilab.DriverName,
				VolumeHandle:         w.Handle,
				VolumeAttributes:     volumeAttributes(opts.Mounter),
				NodeStageSecretRef:   ref,
				NodePublishSecretRef: ref,
			}},
		},
	}
	if _, err := c.CoreV1().PersistentVolumes().Create(ctx, pv, metav1.CreateOptions{}); err != nil {
		return nil, fmt.Errorf("create PV: %w", err)
	}
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: w.Name, Namespace: ns, Annotations: opts.ClaimAnnotations},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce},
			StorageClassName: ptr.To(""),
			VolumeName:       w.PV,
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
		},
	}
	if _, err := c.CoreV1().PersistentVolumeClaims(ns).Create(ctx, pvc, metav1.CreateOptions{}); err != nil {
		return nil, fmt.Errorf("create PVC: %w", err)
	}
	labels := map[string]string{"app": w.Name}
	script := appScript
	var env []corev1.EnvVar
	if opts.Writes {
		script = writerScript + appScript
		env = []corev1.EnvVar{{Name: "POD_NAME", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "metadata.name"}}}}
	}
	dep := &appsv1.Deployment{
		ObjectMeta: metav1.ObjectMeta{Name: w.Name, Namespace: ns},
		Spec: appsv1.DeploymentSpec{
			Replicas: ptr.To(max(opts.Replicas, 1)),
			Selector: &metav1.LabelSelector{MatchLabels: labels},
			Strategy: appsv1.DeploymentStrategy{Type: appsv1.RecreateDeploymentStrategyType},
			Template: corev1.PodTemplateSpec{
				ObjectMeta: metav1.ObjectMeta{Labels: labels, Annotations: opts.PodAnnotations},
				Spec: corev1.PodSpec{
					HostNetwork:                   true,
					DNSPolicy:                     corev1.DNSDefault,
					EnableServiceLinks:            ptr.To(false),
					AutomountServiceAccountToken:  ptr.To(false),
					TerminationGracePeriodSeconds: ptr.To[int64](5),
					Tolerations:                   tolerations,
					Affinity:                      opts.Affinity,
					Containers: []corev1.Container{{
						Name:            container,
						Image:           BusyboxImage,
						ImagePullPolicy: corev1.PullNever,
						Command:         []string{"/bin/sh", "-c", script},
						Env:             env,
						VolumeMounts: []corev1.VolumeMount{
							{Name: "data", MountPath: WholeMount},
							{Name: "data", MountPath: SubMount, SubPath: "sub"},
						},
					}},
					Volumes: []corev1.Volume{{
						Name:         "data",
						VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: w.Name}},
					}},
				},
			},
		},
	}
	if _, err := c.AppsV1().Deployments(ns).Create(ctx, dep, metav1.CreateOptions{}); err != nil {
		return nil, fmt.Errorf("create deployment: %w", err)
	}
	if opts.NoWait || opts.Replicas > 1 {
		return w, nil
	}
	pod, err := w.WaitRunning(ctx, "")
	if err != nil {
		return nil, err
	}
	if err := w.WaitLog(ctx, pod, "ok", time.Time{}); err != nil {
		return nil, err
	}
	if opts.Mounter == "rclone" {
		// rclone (--vfs-cache-mode=writes) uploads a written file some
		// seconds after its close: a daemon killed before that loses it,
		// which no repair can bring back. The faults come after the upload.
		if err := n.waitObjects(ctx, ns+"/whole.txt", ns+"/sub/sub.txt"); err != nil {
			return nil, err
		}
	}
	return w, nil
}

// waitObjects waits until every key is in the lab bucket.
func (n *Node) waitObjects(ctx context.Context, keys ...string) error {
	return wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(context.Context) (bool, error) {
		for _, k := range keys {
			ok, err := n.S3.HasObject(csilab.Bucket, k)
			if err != nil || !ok {
				return false, err
			}
		}
		return true, nil
	})
}

// Pods lists the workload's pods that are not being deleted.
func (w *Workload) Pods(ctx context.Context) ([]corev1.Pod, error) {
	list, err := w.node.Cluster.Client.CoreV1().Pods(w.Namespace).List(ctx, metav1.ListOptions{
		LabelSelector: labels.SelectorFromSet(labels.Set{"app": w.Name}).String(),
	})
	if err != nil {
		return nil, fmt.Errorf("list pods of %s/%s: %w", w.Namespace, w.Name, err)
	}
	var out []corev1.Pod
	for _, p := range list.Items {
		if p.DeletionTimestamp == nil {
			out = append(out, p)
		}
	}
	return out, nil
}

// WaitRunning waits for a pod of the workload whose UID is not notUID to run
// with its container started, and returns it.
func (w *Workload) WaitRunning(ctx context.Context, notUID string) (*corev1.Pod, error) {
	var got *corev1.Pod
	var last string
	err := wait.PollUntilContextCancel(ctx, 200*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		pods, err := w.Pods(ctx)
		if err != nil {
			last = err.Error()
			return false, nil
		}
		for i := range pods {
			p := &pods[i]
			if string(p.UID) == notUID {
				continue
			}
			last = describePod(p)
			if p.Status.Phase == corev1.PodRunning && AppRunning(p) {
				got = p
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		return nil, fmt.Errorf("wait for a running pod of %s/%s: %w (last: %s)", w.Namespace, w.Name, err, last)
	}
	return got, nil
}

// WaitPods waits until the workload has n pods whose app container runs
// and has read its files ("ok" in its log), and returns them by name.
func (w *Workload) WaitPods(ctx context.Context, n int) ([]corev1.Pod, error) {
	var got []corev1.Pod
	var last string
	err := wait.PollUntilContextCancel(ctx, 250*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		pods, err := w.Pods(ctx)
		if err != nil {
			last = err.Error()
			return false, nil
		}
		got = got[:0]
		for i := range pods {
			p := &pods[i]
			last = describePod(p)
			if p.Status.Phase != corev1.PodRunning || !AppRunning(p) {
				return false, nil
			}
			if lines, err := w.Log(p, true); err != nil || !slices.ContainsFunc(lines, func(l LogLine) bool { return l.Text == "ok" }) {
				last = fmt.Sprintf("pod %s has not read its files yet", p.Name)
				return false, nil
			}
			got = append(got, *p)
		}
		return len(got) == n, nil
	})
	if err != nil {
		return nil, fmt.Errorf("wait for %d running pods of %s/%s: %w (last: %s)", n, w.Namespace, w.Name, err, last)
	}
	slices.SortFunc(got, func(a, b corev1.Pod) int { return strings.Compare(a.Name, b.Name) })
	return got, nil
}

// AppRunning reports whether the pod's app container runs.
func AppRunning(p *corev1.Pod) bool {
	for _, cs := range p.Status.ContainerStatuses {
		if cs.Name == container {
			return cs.State.Running != nil
		}
	}
	return false
}

func describePod(p *corev1.Pod) string {
	var b strings.Builder
	fmt.Fprintf(&b, "pod %s phase %s", p.Name, p.Status.Phase)
	for _, cs := range p.Status.ContainerStatuses {
		switch {
		case cs.State.Waiting != nil:
			fmt.Fprintf(&b, ", %s waiting: %s %s", cs.Name, cs.State.Waiting.Reason, cs.State.Waiting.Message)
		case cs.State.Terminated != nil:
			fmt.Fprintf(&b, ", %s terminated: %s", cs.Name, cs.State.Terminated.Reason)
		case cs.State.Running != nil:
			fmt.Fprintf(&b, ", %s running (restarts %d)", cs.Name, cs.RestartCount)
		}
	}
	return b.String()
}

// containerID returns the CRI ID of the app container of pod.
func containerID(p *corev1.Pod) (string, error) {
	for _, cs := range p.Status.ContainerStatuses {
		if cs.Name == container && cs.ContainerID != "" {
			_, id, ok := strings.Cut(cs.ContainerID, "://")
			if ok {
				return id, nil
			}
		}
	}
	return "", fmt.Errorf("pod %s has no %s container ID yet", p.Name, container)
}

// Exec runs cmd in the pod's app container through the CRI and returns its
// standard output, or an error with its standard error.
func (w *Workload) Exec(ctx context.Context, p *corev1.Pod, timeout time.Duration, cmd ...string) (string, error) {
	id, err := containerID(p)
	if err != nil {
		return "", err
	}
	resp, err := w.node.CRI.ExecSync(ctx, &runtimeapi.ExecSyncRequest{ContainerId: id, Cmd: cmd, Timeout: int64(timeout / time.Second)})
	if err != nil {
		return "", fmt.Errorf("exec %v in %s: %w", cmd, p.Name, err)
	}
	if resp.ExitCode != 0 {
		return string(resp.Stdout), fmt.Errorf("exec %v in %s: exit %d: %s", cmd, p.Name, resp.ExitCode, strings.TrimSpace(string(resp.Stderr)))
	}
	return string(resp.Stdout), nil
}

// ReadFiles reads both files through both mounts inside the pod's container
// and checks their contents.
func (w *Workload) ReadFiles(ctx context.Context, p *corev1.Pod) error {
	want := map[string]string{WholeFile: WholeText, SubFile: SubText, WholeMount + "/sub/sub.txt": SubText}
	for path, text := range want {
		out, err := w.Exec(ctx, p, 10*time.Second, "cat", path)
		if err != nil {
			return err
		}
		if strings.TrimSpace(out) != text {
			return fmt.Errorf("%s in pod %s reads %q, want %q", path, p.Name, out, text)
		}
	}
	return nil
}

// LogLine is one line of a container's CRI log.
type LogLine struct {
	Time time.Time
	Text string
}

// Log reads the CRI log of the pod's app container (the current instance,
// or every instance with all).
func (w *Workload) Log(p *corev1.Pod, all bool) ([]LogLine, error) {
	dir := filepath.Join(PodLogs, fmt.Sprintf("%s_%s_%s", p.Namespace, p.Name, p.UID), container)
	files, err := filepath.Glob(filepath.Join(dir, "*.log"))
	if err != nil {
		return nil, err
	}
	if !all && len(files) > 0 {
		files = files[len(files)-1:]
	}
	var out []LogLine
	for _, f := range files {
		data, err := os.ReadFile(f)
		if err != nil {
			return nil, err
		}
		sc := bufio.NewScanner(bytes.NewReader(data))
		for sc.Scan() {
			// <RFC3339Nano> <stream> <P|F> <text>
			parts := strings.SplitN(sc.Text(), " ", 4)
			if len(parts) != 4 {
				continue
			}
			ts, err := time.Parse(time.RFC3339Nano, parts[0])
			if err != nil {
				continue
			}
			out = append(out, LogLine{Time: ts, Text: parts[3]})
		}
	}
	return out, nil
}

// WaitLog waits until the pod's container logged text at or after since
// and returns nil, or the context's error.
func (w *Workload) WaitLog(ctx context.Context, p *corev1.Pod, text string, since time.Time) error {
	_, err := w.WaitLogTime(ctx, p, text, since)
	return err
}

// WaitLogTime is WaitLog returning the time stamp of the line.
func (w *Workload) WaitLogTime(ctx context.Context, p *corev1.Pod, text string, since time.Time) (time.Time, error) {
	var at time.Time
	err := wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(context.Context) (bool, error) {
		lines, err := w.Log(p, true)
		if err != nil {
			return false, nil
		}
		for _, l := range lines {
			if l.Text == text && !l.Time.Before(since) {
				at = l.Time
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		lines, _ := w.Log(p, true)
		return at, fmt.Errorf("wait for %q in the log of pod %s since %s: %w (log: %v)", text, p.Name, since.Format(time.RFC3339Nano), err, lines)
	}
	return at, nil
}

// SlowReads returns when each check of the pod's container that took
// longer than SlowRead began ("slow <start>" lines), of the lines logged at
// or after since, in the order logged.
func (w *Workload) SlowReads(p *corev1.Pod, since time.Time) ([]time.Time, error) {
	lines, err := w.Log(p, true)
	if err != nil {
		return nil, err
	}
	var out []time.Time
	for _, l := range lines {
		rest, ok := strings.CutPrefix(l.Text, "slow ")
		if !ok || l.Time.Before(since) {
			continue
		}
		sec, usec, ok := strings.Cut(rest, ".")
		s, errS := strconv.ParseInt(sec, 10, 64)
		u, errU := strconv.ParseInt(usec, 10, 64)
		if !ok || len(usec) != 6 || errS != nil || errU != nil {
			return nil, fmt.Errorf("pod %s logged %q, want slow <seconds>.<microseconds>", p.Name, l.Text)
		}
		out = append(out, time.Unix(s, u*int64(time.Microsecond)))
	}
	return out, nil
}

// Delete deletes the workload's namespace and PV and waits until its pods
// are gone (kubelet unpublished and unstaged the volume).
func (w *Workload) Delete(ctx context.Context) error {
	c := w.node.Cluster.Client
	if err := c.AppsV1().Deployments(w.Namespace).Delete(ctx, w.Name, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete deployment: %w", err)
	}
	err := wait.PollUntilContextCancel(ctx, 200*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		list, err := c.CoreV1().Pods(w.Namespace).List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		for _, p := range list.Items {
			if p.DeletionTimestamp == nil {
				_ = c.CoreV1().Pods(w.Namespace).Delete(ctx, p.Name, metav1.DeleteOptions{})
			}
		}
		return len(list.Items) == 0, nil
	})
	if err != nil {
		return fmt.Errorf("wait for the pods of %s to go: %w", w.Namespace, err)
	}
	if err := c.CoreV1().Namespaces().Delete(ctx, w.Namespace, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete namespace: %w", err)
	}
	if err := c.CoreV1().PersistentVolumes().Delete(ctx, w.PV, metav1.DeleteOptions{}); err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("delete PV: %w", err)
	}
	return nil
}

// Describe summarises the workload's pods and their latest events (for
// logs and failure messages).
func (w *Workload) Describe(ctx context.Context) string {
	return describeNamespace(ctx, w.node.Cluster.Client, w.Namespace)
}

// describeNamespace summarises the pods of a namespace and its latest
// events.
func describeNamespace(ctx context.Context, c kubernetes.Interface, ns string) string {
	var b strings.Builder
	list, err := c.CoreV1().Pods(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		return err.Error()
	}
	for i := range list.Items {
		b.WriteString(describePod(&list.Items[i]))
		b.WriteString("; ")
	}
	events, err := c.CoreV1().Events(ns).List(ctx, metav1.ListOptions{})
	if err == nil {
		seen := map[string]bool{}
		for i := len(events.Items) - 1; i >= 0 && len(seen) < 8; i-- {
			e := events.Items[i]
			key := e.InvolvedObject.Name + e.Reason
			if seen[key] {
				continue
			}
			seen[key] = true
			fmt.Fprintf(&b, "event %s %s: %s; ", e.InvolvedObject.Name, e.Reason, e.Message)
		}
	}
	return b.String()
}

// StagingPath is where the node's kubelet stages a CSI volume of the lab's
// driver (kubelet.StagingPath).
func StagingPath(handle string) string {
	return kubelet.StagingPath(KubeletRoot, csilab.DriverName, handle)
}
