package agent_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mountmedic/mountmedic/agent"
	"github.com/mountmedic/mountmedic/probe/kubelet"
	"github.com/mountmedic/mountmedic/remount"
	"github.com/mountmedic/mountmedic/scripts/csilab"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// cephFSVolume is a static CephFS volume of the lab's ceph-csi driver,
// staged with a real ceph-fuse, and the pod that uses it.
type cephFSVolume struct {
	handle  string
	pvc     *corev1.PersistentVolumeClaim
	pod     *corev1.Pod
	staging string
	target  string
	// app sees the volume at /data and its "sub" directory at /sub
	// through a subPath bind, with private propagation.
	app *lab.Container
}

// startCephFS starts the test binary's Ceph (once) and the lab's ceph-csi
// CephFS node plugin on the kubelet root's conventional socket, with its
// CSIDriver object.
func (e *env) startCephFS() *csilab.CephFSDriver {
	e.t.Helper()
	ceph := csilab.SharedCeph(e.t)
	name := csilab.CephFSDriverName
	drv := csilab.StartCephFSDriver(e.t, name, filepath.Join(e.kubelet.Root(), "plugins", name, "csi.sock"), ceph)
	attach := false
	if _, err := e.admin.StorageV1().CSIDrivers().Create(context.Background(), &storagev1.CSIDriver{
		ObjectMeta: metav1.ObjectMeta{Name: name},
		Spec:       storagev1.CSIDriverSpec{AttachRequired: &attach},
	}, metav1.CreateOptions{}); err != nil {
		e.t.Fatalf("create CSIDriver: %v", err)
	}
	return drv
}

// newCephFSVolume creates a subvolume with data.txt and sub/g.txt (written
// by a client of its own, which then leaves), a static PV of it with its
// node stage Secret, a bound PVC and a Running pod owned by a ReplicaSet,
// stages and publishes it through drv as kubelet would, and starts the
// pod's container.
func (e *env) newCephFSVolume(drv *csilab.CephFSDriver, name string) *cephFSVolume {
	t := e.t
	t.Helper()
	ctx := context.Background()
	ceph := csilab.SharedCeph(t)
	rootPath := ceph.Subvolume(t, "csi-vol-"+name)
	ceph.WriteFiles(t, rootPath, map[string]string{"data.txt": "data of " + name, "sub/g.txt": "sub of " + name})
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: testNamespace, Name: "ceph-" + name}, StringData: csilab.CephFSSecrets()}
	if _, err := e.admin.CoreV1().Secrets(testNamespace).Create(ctx, secret, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create Secret: %v", err)
	}
	ref := &corev1.SecretReference{Namespace: testNamespace, Name: secret.Name}
	v := e.createVolume(name, func(pv *corev1.PersistentVolume) {
		pv.Spec.AccessModes = []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany}
		pv.Spec.CSI = &corev1.CSIPersistentVolumeSource{Driver: drv.Name(), VolumeHandle: "static-" + name,
			VolumeAttributes: csilab.CephFSVolumeContext(rootPath), NodeStageSecretRef: ref}
	})
	labels := map[string]string{"app": name}
	pod := e.createPod(name, v, podOptions{owner: e.replicaSet("rs-"+name, labels), labels: labels, subPath: "sub"})

	c, err := remount.DialCSI(ctx, drv.Socket(), remount.CSIOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	caps, err := c.NodeGetCapabilities(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pvObj, err := e.admin.CoreV1().PersistentVolumes().Get(ctx, v.pv.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	secretObj, err := e.admin.CoreV1().Secrets(testNamespace).Get(ctx, secret.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	driverObj, err := e.admin.StorageV1().CSIDrivers().Get(ctx, drv.Name(), metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	vr, err := kubelet.BuildVolumeRequest(kubelet.VolumeObjects{Pod: pod, VolumeName: "data", PVC: v.pvc, PV: pvObj,
		CSIDriver: driverObj, StageSecret: secretObj, Capabilities: caps, KubeletRoot: e.kubelet.Root()})
	if err != nil {
		t.Fatal(err)
	}
	staging := e.kubelet.StagingPath(drv.Name(), pvObj.Spec.CSI.VolumeHandle)
	if vr.StagingPath != staging {
		t.Fatalf("request staging path %s, kubelet's %s", vr.StagingPath, staging)
	}
	if err := c.NodeStageVolume(ctx, kubelet.StageRequest(vr)); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	target := e.kubelet.PreparePublish(string(pod.UID), pvObj.Name, drv.Name(), pvObj.Spec.CSI.VolumeHandle)
	if err := c.NodePublishVolume(ctx, kubelet.PublishRequest(vr)); err != nil {
		t.Fatalf("NodePublishVolume: %v", err)
	}
	sub := e.kubelet.SubPath(string(pod.UID), pvObj.Name, "app", 1, filepath.Join(target, "sub"))
	s := &cephFSVolume{handle: pvObj.Spec.CSI.VolumeHandle, pvc: v.pvc, pod: pod, staging: staging, target: target}
	s.app = lab.StartContainer(t, "app-"+name, lab.PropagationPrivate, map[string]string{"/data": target, "/sub": sub},
		lab.WithChroot(), lab.WithPodCgroup(string(pod.UID), strings.Repeat("ab", 32)))
	return s
}

// reads checks the files through every place the pod sees the volume; nil
// when all read back.
func (s *cephFSVolume) reads(name string) error {
	var errs []error
	for p, want := range map[string]string{
		filepath.Join(s.target, "data.txt"):     "data of " + name,
		filepath.Join(s.target, "sub", "g.txt"): "sub of " + name,
		s.app.Path("/data/data.txt"):            "data of " + name,
		s.app.Path("/sub/g.txt"):                "sub of " + name,
	} {
		got, err := os.ReadFile(p)
		switch {
		case err != nil:
			errs = append(errs, err)
		case string(got) != want:
			errs = append(errs, errors.New(p+": read "+string(got)+", want "+want))
		}
	}
	return errors.Join(errs...)
}

// TestAgentHealsCephFSFuse runs the agent (the test configuration: fast
// probes, every tier) over two CephFS volumes staged by the lab's ceph-csi
// CephFS node plugin with a real ceph-fuse each against a real Ceph (mon,
// mgr, OSD, MDS), in ceph-csi's layout: ceph-fuse on kubelet's globalmount,
// bound onto the pod's publish target, a subPath bind below it, and a
// container holding both with private propagation. At once:
//
//   - kill -9: one ceph-fuse dies (a crash, or the node plugin's container
//     restarting under it) and every place its pod sees the volume answers
//     ENOTCONN;
//   - SIGSTOP: the other ceph-fuse stops; the agent's probe is Hung at its
//     deadline.
//
// Each must be re-staged through the plugin's socket (a fresh ceph-fuse;
// for the stopped one after its connection is aborted), the fresh mount
// swapped into the running container, and a VolumeRepaired event said on
// the pod and the claim. A fresh client waits for the capabilities the
// dead one held until the MDS finds that session stale
// (csilab.CephSessionTimeout): the heal takes that long, not a probe
// interval. The files the pods read were written by another client, which
// left cleanly.
func TestAgentHealsCephFSFuse(t *testing.T) {
	e := newEnv(t, nil)
	drv := e.startCephFS()
	killed := e.newCephFSVolume(drv, "killed")
	stopped := e.newCephFSVolume(drv, "stopped")
	for _, v := range []*cephFSVolume{killed, stopped} {
		if err := v.reads(v.pod.Name); err != nil {
			t.Fatalf("volume not readable before the fault: %v", err)
		}
	}
	cfg := e.config()
	a := e.startAgent(cfg, e.withRepairer(cfg, remount.Config{}, agent.Deps{}))
	appPids := map[string]int{"killed": killed.app.Pid(), "stopped": stopped.app.Pid()}
	firstPids := map[string]int{"killed": drv.FusePid(killed.handle), "stopped": drv.FusePid(stopped.handle)}

	start := time.Now()
	if err := drv.KillFuse(killed.handle); err != nil {
		t.Fatal(err)
	}
	pid, err := drv.StopFuse(stopped.handle)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		unix.Kill(pid, unix.SIGCONT)
		unix.Kill(pid, unix.SIGKILL)
	})
	if _, err := os.ReadFile(killed.app.Path("/data/data.txt")); !errors.Is(err, unix.ENOTCONN) {
		t.Fatalf("read in the container after ceph-fuse died: %v, want ENOTCONN", err)
	}
	var (
		mu    sync.Mutex
		wg    sync.WaitGroup
		heals = map[string]string{}
	)
	for _, v := range []*cephFSVolume{killed, stopped} {
		wg.Go(func() {
			for time.Since(start) < 3*time.Minute {
				if v.reads(v.pod.Name) == nil {
					mu.Lock()
					heals[v.pod.Name] = fmt.Sprintf("%.1fs", time.Since(start).Seconds())
					mu.Unlock()
					return
				}
				time.Sleep(100 * time.Millisecond)
			}
		})
	}
	wg.Wait()
	t.Logf("the pods read their volumes again after (kill -9, SIGSTOP at 0s; MDS session_timeout %ds): %v", csilab.CephSessionTimeout, heals)
	for _, v := range []*cephFSVolume{killed, stopped} {
		name := v.pod.Name
		if heals[name] == "" {
			t.Errorf("%s: the container does not read its volume 3 minutes after the fault: %v", name, v.reads(name))
			continue
		}
		ev := e.waitEvent(v.pod.UID, string(agent.ReasonVolumeRepaired), "repaired by")
		e.waitEvent(v.pvc.UID, string(agent.ReasonVolumeRepaired), "repaired by")
		t.Logf("%s: %s %q", name, ev.Reason, ev.Note)
		if now := drv.FusePid(v.handle); now == 0 || now == firstPids[name] {
			t.Errorf("%s: ceph-fuse pid %d after the repair (was %d), want a fresh one", name, now, firstPids[name])
		}
		if v.app.Pid() != appPids[name] {
			t.Errorf("%s: the container was restarted; the live tiers must heal in place", name)
		}
	}
	if drv.Mounts() != 4 {
		t.Errorf("%d ceph-fuse mounts made, want 4 (two stages, two re-stages)", drv.Mounts())
	}
	if n, _ := a.metric(`mountmedic_repairs_total{result="success",tier="restage"}`); n != 2 {
		t.Errorf("repairs_total{restage,success} = %v, want 2", n)
	}
	if n, _ := a.metric(`mountmedic_repairs_total{result="success",tier="liveswap"}`); n != 2 {
		t.Errorf("repairs_total{liveswap,success} = %v, want 2", n)
	}
	if n, _ := a.metric(`mountmedic_probes_total{state="Hung"}`); n < 1 {
		t.Errorf("probes_total{Hung} = %v, want at least 1 (the stopped ceph-fuse)", n)
	}
	e.waitFor("the stale mounts to be counted gone", func() (bool, error) {
		var n float64
		for _, st := range []string{"Disconnected", "Hung"} {
			v, _ := a.metric(`mountmedic_stale_mounts{driver="` + drv.Name() + `",kind="publish",state="` + st + `"}`)
			n += v
		}
		return n == 0, nil
	})
	for _, v := range []*cephFSVolume{killed, stopped} {
		t.Logf("%s events: %v", v.pod.Name, e.reasons(v.pod.UID))
	}
}
