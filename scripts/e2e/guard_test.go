package e2e_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/utils/ptr"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/scripts/csilab"
	"github.com/mountmedic/mountmedic/scripts/e2e"
)

// guardScenario: the plugin dies and the pod's publish target loses its
// mount, so a container started now would write into the bare directory on
// the node's disk (kubernetes/kubernetes#109955). The agent guards the
// target; the app container, stopped and started again by kubelet, cannot
// run on the node's disk; once the plugin is back the agent heals, the
// container runs and its write reaches S3. Then the same loss with the agent
// SIGKILLed after it guarded: kubelet still tears the pod down.
func guardScenario(t *testing.T, e *env, ns string) {
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	w := e.workload(t, ctx, ns)
	pod := w.pod(t, ctx)
	appID, err := appContainerID(pod)
	if err != nil {
		t.Fatal(err)
	}
	target := filepath.Join(e2e.KubeletRoot, "pods", string(pod.UID), "volumes", "kubernetes.io~csi", w.PV, "mount")
	// The node's own directory, below every mount: the bind source of the
	// node's kubelet root.
	disk := filepath.Join(e.n.Dir, "root", target)
	nodeDisk := func() []string {
		ents, err := os.ReadDir(disk)
		if err != nil {
			t.Fatalf("the node's directory of the publish target: %v", err)
		}
		var names []string
		for _, en := range ents {
			names = append(names, en.Name())
		}
		return names
	}
	lose := func() time.Time {
		t.Helper()
		if err := unmount(target); err != nil {
			t.Fatalf("unmount the publish target %s: %v", target, err)
		}
		lost := time.Now()
		at, ev, err := e.agent.WaitEvent(ctx, ns, "VolumeGuarded", lost)
		if err != nil {
			e.figs.Miss(e.scenario, "mount lost -> guarded", "s")
			t.Fatalf("no VolumeGuarded event: %v\n%s", err, e.diagnostics(ns))
		}
		// kubelet's publish window (15 s after vol_data.json) may hold it.
		e.figs.Duration(e.scenario, "mount lost -> guarded", at.Sub(lost))
		t.Logf("guarded %s after the mount was lost: %s", at.Sub(lost).Round(time.Millisecond), ev.Note)
		if m := mountAt(t, e.n.MountTable(), target); m == nil || m.Source != probe.GuardSource || m.FSType != "tmpfs" {
			t.Fatalf("the node's top mount at %s is %+v after the VolumeGuarded event, want the guard", target, m)
		}
		return lost
	}

	o := e.crash(t, ctx, w, pod, 0)
	lose()

	// kubelet starts the stopped app container again: on the guard, its
	// subPath cannot be prepared, and nothing reaches the node's disk.
	if _, err := e.n.CRI.StopContainer(ctx, &runtimeapi.StopContainerRequest{ContainerId: appID, Timeout: 0}); err != nil {
		t.Fatal(err)
	}
	e.wantGuardRefusal(t, ctx, w, pod.Name, 2*time.Minute)
	if names := nodeDisk(); len(names) != 0 {
		t.Errorf("the node's directory under the publish target holds %v, want nothing", names)
	}

	// The plugin is back: the agent heals, kubelet starts the container
	// on the volume, and its write reaches S3.
	o.back = e.bringBack(t)
	var next *corev1.Pod
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, healBound, true, func(ctx context.Context) (bool, error) {
		p, err := e.c.Client.CoreV1().Pods(ns).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil || !e2e.AppRunning(p) {
			return false, nil
		}
		if id, err := appContainerID(p); err != nil || id == appID {
			return false, nil
		}
		next = p
		return true, nil
	})
	if err != nil {
		e.figs.Miss(e.scenario, "driver back -> container runs", "s")
		t.Fatalf("the app container never ran again after the plugin came back: %v\n%s\n%s", err, w.Describe(ctx), e.diagnostics(ns))
	}
	e.figs.Duration(e.scenario, "driver back -> container runs", time.Since(o.back))
	if err := w.WaitLog(ctx, next, "ok", o.back); err != nil {
		t.Fatal(err)
	}
	if _, err := w.Exec(ctx, next, 10*time.Second, "sh", "-c", "echo guarded > "+e2e.WholeMount+"/guarded.txt"); err != nil {
		t.Fatal(err)
	}
	inS3 := filepath.Join(e.n.S3.Root, csilab.Bucket, ns, "guarded.txt") // versitygw's posix backend
	if err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 30*time.Second, true, func(context.Context) (bool, error) {
		_, err := os.Stat(inS3)
		return err == nil, nil
	}); err != nil {
		t.Errorf("the container's write after the heal is not in S3 (%s): %v", inS3, err)
	}
	if names := nodeDisk(); len(names) != 0 {
		t.Errorf("the node's directory under the publish target holds %v after the heal, want nothing", names)
	}
	if m := mountAt(t, e.n.MountTable(), target); m == nil || m.Source == probe.GuardSource {
		t.Errorf("the node's top mount at %s after the heal is %+v, want the volume", target, m)
	}

	// Again, and the agent is SIGKILLed once it guarded: kubelet's teardown
	// (the driver's NodeUnpublishVolume) takes the guard away.
	e.n.Driver.Kill()
	if err := w.WaitLog(ctx, next, "bad", o.back); err != nil {
		t.Fatal(err)
	}
	lose()
	e.killAgent(t, ctx)
	e.bringBack(t)
	dctx, dcancel := context.WithTimeout(ctx, 2*time.Minute)
	defer dcancel()
	if err := w.Delete(dctx); err != nil {
		t.Fatalf("kubelet could not tear the pod down with the guard of a SIGKILLed agent at its publish target: %v\n%s\nnode mounts:\n%s", err, w.Describe(ctx), e.nodeMounts())
	}
	if _, err := os.Stat(disk); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the publish directory %s after the teardown: %v, want removed by kubelet", disk, err)
	}
	// The agent back for the next run.
	if err := e.agent.Deploy(ctx); err != nil {
		t.Fatal(err)
	}
}

// unmount lazily unmounts path in the test's mount namespace, from where
// it propagates to the node's (the kubelet root is shared between them).
func unmount(path string) error {
	return unix.Unmount(path, unix.MNT_DETACH)
}

// killAgent deletes the agent's DaemonSet, leaving its pod, and then the
// pod with no grace period: kubelet SIGKILLs the agent.
func (e *env) killAgent(t *testing.T, ctx context.Context) {
	t.Helper()
	c := e.c.Client
	orphan := metav1.DeletePropagationOrphan
	if err := c.AppsV1().DaemonSets(e2e.AgentNamespace).Delete(ctx, e2e.AgentName, metav1.DeleteOptions{PropagationPolicy: &orphan}); err != nil {
		t.Fatal(err)
	}
	if err := c.CoreV1().Pods(e2e.AgentNamespace).Delete(ctx, e.agent.Pod.Name, metav1.DeleteOptions{GracePeriodSeconds: ptr.To[int64](0)}); err != nil {
		t.Fatal(err)
	}
	if err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, time.Minute, true, func(ctx context.Context) (bool, error) {
		_, err := c.CoreV1().Pods(e2e.AgentNamespace).Get(ctx, e.agent.Pod.Name, metav1.GetOptions{})
		return apierrors.IsNotFound(err), nil
	}); err != nil {
		t.Fatalf("the agent's pod %s is still there: %v", e.agent.Pod.Name, err)
	}
}

// wantGuardRefusal waits, up to timeout, for kubelet to report that it
// could not start the pod's app container on the guarded volume: the
// guard keeps it from creating the container's subPath
// (CreateContainerConfigError), so the container never runs on the node's
// disk.
func (e *env) wantGuardRefusal(t *testing.T, ctx context.Context, w *wl, podName string, timeout time.Duration) {
	t.Helper()
	var why string
	err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, timeout, true, func(ctx context.Context) (bool, error) {
		p, err := e.c.Client.CoreV1().Pods(w.Namespace).Get(ctx, podName, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		for _, cs := range p.Status.ContainerStatuses {
			if cs.Name == "app" && cs.State.Waiting != nil && cs.State.Waiting.Reason == "CreateContainerConfigError" {
				why = cs.State.Waiting.Message
				return true, nil
			}
		}
		return false, nil
	})
	if err != nil {
		t.Fatalf("kubelet never failed to start the app container on the guarded volume within %s: %v\n%s\n%s", timeout, err, w.Describe(ctx), e.diagnostics(w.Namespace))
	}
	t.Logf("kubelet on the guarded volume: %s", why)
	if !strings.Contains(why, "subPath") {
		t.Errorf("kubelet's error starting the app container = %q, want its subPath, which the guard keeps kubelet from creating", why)
	}
}
