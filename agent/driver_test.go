package agent_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/mountmedic/mountmedic/agent"
	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/remount"
	"github.com/mountmedic/mountmedic/scripts/csilab"
	"github.com/mountmedic/mountmedic/scripts/kubetest"
	"github.com/mountmedic/mountmedic/scripts/lab"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// s3Volume is a volume of the real k8s-csi-s3 driver: its API objects, and
// the pod that uses it with its lab containers.
type s3Volume struct {
	pvc    *corev1.PersistentVolumeClaim
	pod    *corev1.Pod
	target string
	// staging is the volume's staging path.
	staging string
	// private sees the volume at /data and its "sub" directory at /sub
	// through a subPath bind, with private propagation; slave sees it at
	// /data with HostToContainer propagation.
	private, slave *lab.Container
}

// driverEnv is env with the real driver on the lab kubelet root's
// conventional socket and an S3 server.
type driverEnv struct {
	*env
	s3  *csilab.S3
	drv *csilab.Driver
}

func newDriverEnv(t testing.TB, controllers ...string) *driverEnv {
	t.Helper()
	e := newEnv(t, controllers)
	d := &driverEnv{env: e, s3: csilab.StartS3(t)}
	sock := filepath.Join(e.kubelet.Root(), "plugins", csilab.DriverName, "csi.sock")
	if err := os.MkdirAll(filepath.Dir(sock), 0o750); err != nil {
		t.Fatal(err)
	}
	d.drv = csilab.StartDriver(t, sock, e.node)
	attach := false
	if _, err := e.admin.StorageV1().CSIDrivers().Create(context.Background(), &storagev1.CSIDriver{
		ObjectMeta: metav1.ObjectMeta{Name: csilab.DriverName},
		Spec:       storagev1.CSIDriverSpec{AttachRequired: &attach},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create CSIDriver: %v", err)
	}
	return d
}

// newVolume creates an S3-backed volume in the API (Secret, PV, bound PVC,
// a Running pod with a whole-volume and a subPath mount), stages and
// publishes it through the driver at kubelet's paths, writes data.txt and
// sub/g.txt, and starts the pod's two lab containers.
func (d *driverEnv) newVolume(name string) *s3Volume {
	return d.newOwnedVolume(name, podOptions{})
}

// newOwnedVolume is newVolume with the pod's owner and labels from o.
func (d *driverEnv) newOwnedVolume(name string, o podOptions) *s3Volume {
	t := d.t
	t.Helper()
	ctx := context.Background()
	if err := d.s3.PutObject(csilab.Bucket, name+"/", nil); err != nil {
		t.Fatal(err)
	}
	sv := d.s3.Volume(csilab.Bucket, name)
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: testNamespace, Name: "s3-" + name}, StringData: sv.Secrets}
	if _, err := d.admin.CoreV1().Secrets(testNamespace).Create(ctx, secret, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create Secret: %v", err)
	}
	ref := &corev1.SecretReference{Namespace: testNamespace, Name: secret.Name}
	v := d.createVolume(name, func(pv *corev1.PersistentVolume) {
		pv.Spec.AccessModes = []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany}
		pv.Spec.CSI = &corev1.CSIPersistentVolumeSource{Driver: csilab.DriverName, VolumeHandle: sv.Handle,
			VolumeAttributes: sv.Attributes, NodeStageSecretRef: ref, NodePublishSecretRef: ref}
	})
	h2c := corev1.MountPropagationHostToContainer
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: testNamespace, Name: name, Labels: o.labels},
		Spec: corev1.PodSpec{
			NodeName: d.node,
			Containers: []corev1.Container{
				{Name: "app", Image: "busybox", VolumeMounts: []corev1.VolumeMount{
					{Name: "data", MountPath: "/data"}, {Name: "data", MountPath: "/sub", SubPath: "sub"}}},
				{Name: "watcher", Image: "busybox", VolumeMounts: []corev1.VolumeMount{
					{Name: "data", MountPath: "/data", MountPropagation: &h2c}}},
			},
			Volumes: []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{
				PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: v.pvc.Name}}}},
		},
	}
	if o.owner != nil {
		pod.OwnerReferences = []metav1.OwnerReference{*o.owner}
	}
	pod, err := d.admin.CoreV1().Pods(testNamespace).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create pod: %v", err)
	}
	ids := map[string]string{"app": strings.Repeat("a1", 32), "watcher": strings.Repeat("b2", 32)}
	now := metav1.Now()
	pod.Status = corev1.PodStatus{Phase: corev1.PodRunning,
		Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: now}}}
	for _, c := range pod.Spec.Containers {
		pod.Status.ContainerStatuses = append(pod.Status.ContainerStatuses, corev1.ContainerStatus{
			Name: c.Name, Ready: true, Image: "busybox", ImageID: "busybox", ContainerID: "containerd://" + ids[c.Name],
			State: corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: now}}})
	}
	if pod, err = d.admin.CoreV1().Pods(testNamespace).UpdateStatus(ctx, pod, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("set pod running: %v", err)
	}

	// Stage and publish as kubelet would, with the request built from the
	// same API objects.
	csi, err := remount.DialCSI(ctx, d.drv.Socket(), remount.CSIOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer csi.Close()
	caps, err := csi.NodeGetCapabilities(ctx)
	if err != nil {
		t.Fatal(err)
	}
	pvObj, err := d.admin.CoreV1().PersistentVolumes().Get(ctx, v.pv.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	secretObj, err := d.admin.CoreV1().Secrets(testNamespace).Get(ctx, secret.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	driverObj, err := d.admin.StorageV1().CSIDrivers().Get(ctx, csilab.DriverName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	vr, err := kubelet.BuildVolumeRequest(kubelet.VolumeObjects{Pod: pod, VolumeName: "data", PVC: v.pvc, PV: pvObj,
		CSIDriver: driverObj, StageSecret: secretObj, PublishSecret: secretObj, Capabilities: caps, KubeletRoot: d.kubelet.Root()})
	if err != nil {
		t.Fatal(err)
	}
	staging := d.kubelet.StagingPath(csilab.DriverName, sv.Handle)
	if vr.StagingPath != staging {
		t.Fatalf("request staging path %s, kubelet's %s", vr.StagingPath, staging)
	}
	if err := csi.NodeStageVolume(ctx, kubelet.StageRequest(vr)); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	target := d.kubelet.PreparePublish(string(pod.UID), pvObj.Name, csilab.DriverName, sv.Handle)
	if err := csi.NodePublishVolume(ctx, kubelet.PublishRequest(vr)); err != nil {
		t.Fatalf("NodePublishVolume: %v", err)
	}
	writeFile(t, filepath.Join(target, "data.txt"), "data of "+name)
	writeFile(t, filepath.Join(target, "sub", "g.txt"), "sub of "+name)
	sub := d.kubelet.SubPath(string(pod.UID), pvObj.Name, "app", 1, filepath.Join(target, "sub"))
	s := &s3Volume{pvc: v.pvc, pod: pod, target: target, staging: staging}
	s.private = lab.StartContainer(t, "app-"+name, lab.PropagationPrivate, map[string]string{"/data": target, "/sub": sub},
		lab.WithChroot(), lab.WithPodCgroup(string(pod.UID), ids["app"]))
	s.slave = lab.StartContainer(t, "watcher-"+name, lab.PropagationSlave, map[string]string{"/data": target},
		lab.WithChroot(), lab.WithPodCgroup(string(pod.UID), ids["watcher"]))
	return s
}

func writeFile(t testing.TB, path, data string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
		t.Fatalf("write %s: %v", path, err)
	}
}

// reads checks the files through every place a user of the volume sees it;
// it returns nil when all read back.
func (s *s3Volume) reads(name string) error {
	checks := map[string]string{
		filepath.Join(s.target, "data.txt"):     "data of " + name,
		filepath.Join(s.target, "sub", "g.txt"): "sub of " + name,
		s.private.Path("/data/data.txt"):        "data of " + name,
		s.private.Path("/sub/g.txt"):            "sub of " + name,
		s.slave.Path("/data/data.txt"):          "data of " + name,
	}
	var errs []error
	for p, want := range checks {
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

// TestAgentHealsRealDriverRestart is the mission: the real k8s-csi-s3 node
// plugin is killed with its whole process tree (every s3fs dies with it),
// every place the pod sees its volume answers ENOTCONN, the plugin comes
// back, and the agent, untuned but for a fast test probe interval, heals it
// everywhere without restarting the containers.
func TestAgentHealsRealDriverRestart(t *testing.T) {
	d := newDriverEnv(t)
	s := d.newVolume("heal")
	if err := s.reads("heal"); err != nil {
		t.Fatalf("volume not readable before the crash: %v", err)
	}
	cfg := d.config()
	a := d.startAgent(cfg, d.withRepairer(cfg, remount.Config{}, agent.Deps{}))
	privatePid, slavePid := s.private.Pid(), s.slave.Pid()

	d.drv.Kill()
	if _, err := os.ReadFile(s.private.Path("/data/data.txt")); !errors.Is(err, unix.ENOTCONN) {
		t.Fatalf("read in the container after the plugin died: %v, want ENOTCONN", err)
	}
	d.waitEvent(s.pod.UID, string(agent.ReasonDriverDown), csilab.DriverName)
	d.waitEvent(s.pvc.UID, string(agent.ReasonDriverDown), csilab.DriverName)

	back := time.Now()
	if err := d.drv.Restart(); err != nil {
		t.Fatal(err)
	}
	ev := d.waitEvent(s.pod.UID, string(agent.ReasonVolumeRepaired), "repaired by")
	healed := time.Now()
	d.waitEvent(s.pvc.UID, string(agent.ReasonVolumeRepaired), "repaired by")
	if err := s.reads("heal"); err != nil {
		t.Errorf("after the repair: %v", err)
	}
	if s.private.Pid() != privatePid || s.slave.Pid() != slavePid {
		t.Error("a container was restarted; the live tiers must heal in place")
	}
	if n, _ := a.metric(`mountmedic_repairs_total{result="driver_unavailable",tier="restage"}`); n < 1 {
		t.Errorf("repairs_total{restage,driver_unavailable} = %v, want at least 1 (the attempt while the plugin was down)", n)
	}
	d.waitFor("the stale mounts to be counted gone", func() (bool, error) {
		v, _ := a.metric(`mountmedic_stale_mounts{driver="` + csilab.DriverName + `",kind="publish",state="Disconnected"}`)
		return v == 0, nil
	})
	t.Logf("%s %q; event seen %.2fs after the plugin's restart returned", ev.Reason, ev.Note, healed.Sub(back).Seconds())
}

// TestAgentSwapsContainersReportedLate: kubelet reports a container
// running a status sync after it starts, so a container that started on
// the volume just before its FUSE daemon died can be invisible to the live
// swap when the agent repairs the volume (its status still says
// ContainerCreating). The agent re-stages the host at once and swaps the
// fresh mount into that container as soon as kubelet reports it, without
// restarting it; before, the run said "repaired" and the container kept
// the dead mount for good (what an e2e run saw: the next pod after a
// repair lost its connection at its first write and never read its
// volume).
func TestAgentSwapsContainersReportedLate(t *testing.T) {
	d := newDriverEnv(t)
	s := d.newVolume("late")
	if err := s.reads("late"); err != nil {
		t.Fatalf("volume not readable before the crash: %v", err)
	}
	ctx := context.Background()
	setApp := func(running bool) {
		t.Helper()
		pod, err := d.admin.CoreV1().Pods(testNamespace).Get(ctx, s.pod.Name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for i, st := range pod.Status.ContainerStatuses {
			if st.Name != "app" {
				continue
			}
			if running {
				pod.Status.ContainerStatuses[i] = s.pod.Status.ContainerStatuses[i]
			} else {
				pod.Status.ContainerStatuses[i] = corev1.ContainerStatus{Name: "app", Image: "busybox",
					State: corev1.ContainerState{Waiting: &corev1.ContainerStateWaiting{Reason: "ContainerCreating"}}}
			}
		}
		if _, err := d.admin.CoreV1().Pods(testNamespace).UpdateStatus(ctx, pod, metav1.UpdateOptions{}); err != nil {
			t.Fatalf("set the app container's status: %v", err)
		}
	}
	setApp(false) // it runs (the lab container holds its binds); kubelet has not said so yet
	cfg := d.config()
	d.startAgent(cfg, d.withRepairer(cfg, remount.Config{}, agent.Deps{}))
	privatePid := s.private.Pid()

	d.drv.Kill()
	if _, err := os.ReadFile(s.private.Path("/data/data.txt")); !errors.Is(err, unix.ENOTCONN) {
		t.Fatalf("read in the container after the plugin died: %v, want ENOTCONN", err)
	}
	if err := d.drv.Restart(); err != nil {
		t.Fatal(err)
	}
	d.waitEvent(s.pod.UID, string(agent.ReasonVolumeRepaired), "repaired by")
	if _, err := os.ReadFile(s.private.Path("/data/data.txt")); !errors.Is(err, unix.ENOTCONN) {
		t.Fatalf("read in the unreported container after the host repair: %v, want ENOTCONN (the swap cannot know it yet)", err)
	}

	setApp(true) // kubelet's status sync
	d.waitFor("the container reported late to read its volume", func() (bool, error) {
		err := s.reads("late")
		return err == nil, err
	})
	if s.private.Pid() != privatePid {
		t.Error("the container was restarted; the live swap must heal it in place")
	}
}

// TestAgentRestagesStagingGoneUnderLiveBinds: a FUSE daemon whose hung
// connection was aborted and replaced can wake up and exit through its
// unmount of its mountpoint path, which by then holds the fresh staging
// mount (rclone does; issue 14 item 5). The pod reads on through its own
// binds while the staging directory is bare, and the next pod would be
// published from the node's disk. The agent stages the volume again and
// touches nothing the pod uses: its publish target stays the same mount,
// its containers run on.
func TestAgentRestagesStagingGoneUnderLiveBinds(t *testing.T) {
	d := newDriverEnv(t)
	s := d.newVolume("unstaged")
	cfg := d.config()
	d.startAgent(cfg, d.withRepairer(cfg, remount.Config{}, agent.Deps{}))
	privatePid, slavePid := s.private.Pid(), s.slave.Pid()
	targetID := mountID(t, s.target)

	if err := unix.Unmount(s.staging, unix.MNT_DETACH); err != nil {
		t.Fatalf("unmount the staging mount by its path: %v", err)
	}
	// How long the staging path stays bare (neither the guard nor the
	// fresh mount there): at most one probe cycle.
	lost := time.Now()
	bare := make(chan time.Duration, 1)
	go func() {
		for time.Since(lost) < time.Minute {
			if ms, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(s.staging)); err == nil && len(ms) > 0 {
				bare <- time.Since(lost)
				return
			}
			time.Sleep(10 * time.Millisecond)
		}
		bare <- -1
	}()
	if err := s.reads("unstaged"); err != nil {
		t.Fatalf("the pod's binds stopped reading with the staging mount gone: %v", err)
	}
	// A driver catalogued as staging (k8s-csi-s3): guarded and staged
	// again at once, each said in an event.
	guarded := d.waitEvent(s.pod.UID, string(agent.ReasonVolumeGuarded), "staging mount is gone")
	ev := d.waitEvent(s.pod.UID, string(agent.ReasonVolumeRepaired), "staged again, the staging mount was gone")
	t.Logf("staging path bare for %s after its mount went; %s %q", <-bare, guarded.Reason, guarded.Note)
	if got, err := os.ReadFile(filepath.Join(s.staging, "data.txt")); err != nil || string(got) != "data of unstaged" {
		t.Errorf("staging path after the repair: read %q, %v; want the volume's data.txt", got, err)
	}
	// The guard that covered the bare staging path until the re-stage is
	// gone: the fresh FUSE mount is alone there.
	if infos, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(s.staging)); err != nil || len(infos) != 1 || !strings.HasPrefix(infos[0].FSType, "fuse") {
		t.Errorf("mounts at the staging path after the repair: %v, %v; want the fresh FUSE mount alone", infos, err)
	}
	if id := mountID(t, s.target); id != targetID {
		t.Errorf("publish target is mount %d after the repair, was %d: the live target must be left alone", id, targetID)
	}
	if err := s.reads("unstaged"); err != nil {
		t.Errorf("after the repair: %v", err)
	}
	if s.private.Pid() != privatePid || s.slave.Pid() != slavePid {
		t.Error("a container was restarted for a staging mount its pod did not need")
	}
	t.Logf("%s %q", ev.Reason, ev.Note)
}

// TestAgentDryRunShowsTheRepairPlan runs a dry-run agent with a dry-run
// repairer over the same crash: its events name each step a real run would
// take, and nothing is changed.
func TestAgentDryRunShowsTheRepairPlan(t *testing.T) {
	d := newDriverEnv(t)
	s := d.newVolume("plan")
	rep := d.dryRunRepairer()
	d.drv.Kill()
	if err := d.drv.Restart(); err != nil {
		t.Fatal(err)
	}
	before := mountID(t, s.target)
	cfg := d.config()
	cfg.DryRun = true
	a := d.startAgent(cfg, agent.Deps{Repairer: rep})

	ev := d.waitEvent(s.pod.UID, string(agent.ReasonWouldRepair), "[dry-run] would restage", "unmount")
	t.Logf("dry-run plan: %s", ev.Note)
	time.Sleep(time.Second)
	if after := mountID(t, s.target); after != before {
		t.Errorf("the dead publish target changed (mount %d -> %d) in a dry run", before, after)
	}
	if _, err := os.ReadFile(s.private.Path("/data/data.txt")); !errors.Is(err, unix.ENOTCONN) {
		t.Errorf("the container's volume after a dry run: %v, want still ENOTCONN", err)
	}
	if n, _ := a.metric(`mountmedic_repairs_total{result="dry_run",tier="restage"}`); n < 1 {
		t.Errorf("repairs_total{restage,dry_run} = %v, want at least 1", n)
	}
	// A dry-run agent refuses a repairer that would act.
	acting, err := remount.New(remount.Config{KubeletRoot: d.kubelet.Root()})
	if err != nil {
		t.Fatal(err)
	}
	defer acting.Close()
	if _, err := agent.New(cfg, agent.Deps{Client: d.admin, Repairer: acting}); err == nil || !strings.Contains(err.Error(), "dry-run") {
		t.Errorf("agent.New(dry run, acting repairer) = %v, want a refusal", err)
	}
}

// TestAgentHealsRepeatedCrashes crashes the plugin again after each repair:
// a volume healed once (a fresh mount over or in place of the dead one)
// must heal again, and again.
func TestAgentHealsRepeatedCrashes(t *testing.T) {
	d := newDriverEnv(t)
	s := d.newVolume("again")
	// The defaults, as deployed: the plugin's return, not the probe
	// interval, drives the repair.
	cfg := agent.DefaultConfig()
	cfg.NodeName, cfg.KubeletRoot, cfg.MetricsAddr = d.node, d.kubelet.Root(), ""
	d.startAgent(cfg, d.withRepairer(cfg, remount.Config{}, agent.Deps{}))
	for round := 1; round <= 3; round++ {
		d.drv.Kill()
		if _, err := os.ReadFile(s.private.Path("/data/data.txt")); !errors.Is(err, unix.ENOTCONN) {
			t.Fatalf("round %d: read in the container after the plugin died: %v, want ENOTCONN", round, err)
		}
		time.Sleep(time.Second) // the DaemonSet brings the plugin back a second later
		if err := d.drv.Restart(); err != nil {
			t.Fatal(err)
		}
		d.waitFor("round "+strconv.Itoa(round)+" to heal", func() (bool, error) {
			return s.reads("again") == nil, nil
		})
	}
}

// TestAgentRollsForwardAfterCrashMidRepair leaves a volume as an agent that
// was killed in the middle of a re-stage leaves it (the dead staging mount
// already detached, nothing staged yet, the publish targets and subPath
// binds still dead) and starts a new agent: it recomputes from the mount
// table and the API and finishes the repair.
func TestAgentRollsForwardAfterCrashMidRepair(t *testing.T) {
	d := newDriverEnv(t)
	s := d.newVolume("midway")
	// The path before the kill: StagingPath makes its directory, and on
	// 6.1 a stat of the dead mount there fails (ENOTCONN).
	staging := d.kubelet.StagingPath(csilab.DriverName, d.s3.Volume(csilab.Bucket, "midway").Handle)
	d.drv.Kill()
	if err := unix.Unmount(staging, unix.MNT_DETACH); err != nil {
		t.Fatalf("detach the dead staging mount as the interrupted repair did: %v", err)
	}
	if err := d.drv.Restart(); err != nil {
		t.Fatal(err)
	}
	cfg := d.config()
	d.startAgent(cfg, d.withRepairer(cfg, remount.Config{}, agent.Deps{}))
	d.waitEvent(s.pod.UID, string(agent.ReasonVolumeRepaired), "repaired by")
	if err := s.reads("midway"); err != nil {
		t.Errorf("after the new agent's repair: %v", err)
	}
}

// TestAgentEvictsWhenOnlyTheHostHealed runs the ladder restage, evict with
// a PodDisruptionBudget at its limit: the re-stage heals the host (the
// probe then sees nothing broken) but not the container's private binds,
// and the eviction is blocked. The agent keeps the volume as a residual and
// evicts as soon as the budget allows.
func TestAgentEvictsWhenOnlyTheHostHealed(t *testing.T) {
	d := newDriverEnv(t, kubetest.DefaultControllers...)
	ctx := context.Background()
	labels := map[string]string{"app": "resid"}
	s := d.newOwnedVolume("resid", podOptions{owner: d.replicaSet("resid", labels), labels: labels})
	one := intstr.FromInt32(1)
	pdb, err := d.admin.PolicyV1().PodDisruptionBudgets(testNamespace).Create(ctx, &policyv1.PodDisruptionBudget{
		ObjectMeta: metav1.ObjectMeta{Namespace: testNamespace, Name: "resid"},
		Spec:       policyv1.PodDisruptionBudgetSpec{MinAvailable: &one, Selector: &metav1.LabelSelector{MatchLabels: labels}},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	d.waitFor("the disruption controller to count the pod", func() (bool, error) {
		p, err := d.admin.PolicyV1().PodDisruptionBudgets(testNamespace).Get(ctx, "resid", metav1.GetOptions{})
		return err == nil && p.Status.ObservedGeneration == p.Generation && p.Status.CurrentHealthy == 1, err
	})
	cfg := d.config()
	cfg.Tiers = remount.NewTierSet(remount.TierRestage, remount.TierEvict)
	d.startAgent(cfg, d.withRepairer(cfg, remount.Config{}, agent.Deps{}))

	d.drv.Kill()
	if err := d.drv.Restart(); err != nil {
		t.Fatal(err)
	}
	d.waitEvent(s.pod.UID, string(agent.ReasonRepairEscalated), "re-staged on the host")
	d.waitEvent(s.pod.UID, string(agent.ReasonEvictionBlocked), "PodDisruptionBudget")
	if _, err := os.ReadFile(s.private.Path("/data/data.txt")); err == nil {
		t.Fatal("the private container reads its volume: the scenario needs it still dead")
	}
	pdb, err = d.admin.PolicyV1().PodDisruptionBudgets(testNamespace).Get(ctx, pdb.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	zero := intstr.FromInt32(0)
	pdb.Spec.MinAvailable = &zero
	if _, err := d.admin.PolicyV1().PodDisruptionBudgets(testNamespace).Update(ctx, pdb, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	d.waitEvent(s.pod.UID, string(agent.ReasonEvicting), "evicted the pod")
}

// TestAgentSaysWhenNoTierReachesTheContainers runs the re-stage alone: the
// host heals, the container's private binds cannot, and the agent says so
// instead of reporting the volume repaired.
func TestAgentSaysWhenNoTierReachesTheContainers(t *testing.T) {
	d := newDriverEnv(t)
	s := d.newVolume("alone")
	cfg := d.config()
	cfg.Tiers = remount.NewTierSet(remount.TierRestage)
	d.startAgent(cfg, d.withRepairer(cfg, remount.Config{}, agent.Deps{}))
	d.drv.Kill()
	if err := d.drv.Restart(); err != nil {
		t.Fatal(err)
	}
	d.waitEvent(s.pod.UID, string(agent.ReasonNotRepaired), "no further tier")
	for _, ev := range d.eventsOf(s.pod.UID) {
		if ev.Reason == string(agent.ReasonVolumeRepaired) {
			t.Errorf("VolumeRepaired reported while the container still sees the dead mount: %s", ev.Note)
		}
	}
}

// TestAgentGuardsALostPublishTarget: the real plugin dies, and then the
// pod's publish target loses its mount as well (a bare directory on the
// node's disk, where a container started now would write). The agent,
// whose repair waits for the driver, guards it at once, so that writes
// there fail, and lifts the guard with its repair once the driver is back.
func TestAgentGuardsALostPublishTarget(t *testing.T) {
	d := newDriverEnv(t)
	s := d.newVolume("guard")
	cfg := d.config()
	cfg.Resync = time.Hour // only the guard pass of each probe cycle can guard in time
	a := d.startAgent(cfg, d.withRepairer(cfg, remount.Config{}, agent.Deps{}))
	d.drv.Kill()
	// The run finds the driver down and waits for it: the target lost
	// after that is guarded all the same.
	d.waitEvent(s.pod.UID, string(agent.ReasonDriverDown), csilab.DriverName)
	if err := unix.Unmount(s.target, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	d.kubelet.AgeVolData(s.target, time.Minute)

	d.waitEvent(s.pod.UID, string(agent.ReasonVolumeGuarded), "mounted a read-only guard")
	if g := guardAt(t, s.target); g == nil {
		t.Fatalf("no guard at %s after the VolumeGuarded event", s.target)
	}
	if err := os.WriteFile(filepath.Join(s.target, "lost.txt"), []byte("x"), 0o644); !errors.Is(err, unix.EROFS) {
		t.Errorf("write at the guarded publish target = %v, want EROFS", err)
	}
	if n, _ := a.metric(`mountmedic_guards_total{result="success"}`); n != 1 {
		t.Errorf("mountmedic_guards_total{result=success} = %v, want 1", n)
	}

	if err := d.drv.Restart(); err != nil {
		t.Fatal(err)
	}
	d.waitEvent(s.pod.UID, string(agent.ReasonVolumeRepaired), "repaired by")
	if err := s.reads("guard"); err != nil {
		t.Errorf("after the repair: %v", err)
	}
	if g := guardAt(t, s.target); g != nil {
		t.Errorf("guard still at %s after the repair: %v", s.target, g)
	}
}

// guardAt returns the mountinfo entry of mountmedic's guard at path, nil
// when there is none.
func guardAt(t testing.TB, path string) *mountinfo.Info {
	t.Helper()
	infos, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(path))
	if err != nil {
		t.Fatal(err)
	}
	for _, in := range infos {
		if in.Source == probe.GuardSource && in.FSType == "tmpfs" {
			return in
		}
	}
	return nil
}
