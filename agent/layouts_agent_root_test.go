package agent_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/mountmedic/mountmedic/agent"
	"github.com/mountmedic/mountmedic/probe/kubelet"
	"github.com/mountmedic/mountmedic/remount"
	"github.com/mountmedic/mountmedic/scripts/csilab"
)

// envHealthySoak sets how long TestHealthyLayoutsUnderRunningAgent leaves
// the agent running over the healthy volumes (a Go duration); 30s when
// unset. scripts/bench-healthy-layouts.sh runs it for 10 minutes.
const envHealthySoak = "MOUNTMEDIC_HEALTHY_SOAK"

// layoutVolume is one healthy volume of a catalogued layout in the lab.
type layoutVolume struct {
	layout, driver string
	pod            *corev1.Pod
	target         string
	lab            *csilab.LayoutDriver // nil: not served by a LayoutDriver
}

// TestHealthyLayoutsUnderRunningAgent runs the agent with the shipped
// configuration (agent.DefaultConfig, which the DaemonSet's flags leave as
// it is but for its paths, and an acting repairer) over a healthy volume of
// each catalogued layout, each with Running pods in the API:
//
//   - globalmount, daemon in the node plugin: the real k8s-csi-s3 with s3fs;
//   - globalmount, daemon in the node plugin: the lab's ceph-csi CephFS
//     plugin with a real ceph-fuse against a real Ceph;
//   - globalmount/<volumeID> (ceph-csi RBD), a tmpfs standing in for the
//     krbd device;
//   - publish-only, daemon in a mount pod (JuiceFS CSI): rclone outside the
//     kubelet root, the volume's directory bound onto the target;
//   - publish-only, daemon in the app pod's sidecar (GCS FUSE CSI): rclone
//     on the publish target;
//   - publish-only, daemon in the node plugin, a driver not in the catalogue
//     that advertises no STAGE_UNSTAGE_VOLUME: its bare globalmount is what
//     kubelet leaves, not a lost staging mount.
//
// For the soak the agent must take no action: no repair of any tier, no
// guard, no eviction, no event, and the kubelet mounts are the same mounts
// (no unmount, no stage, no publish) at the end. Then the mount pod's and
// the sidecar's daemons are killed, out of the node plugin's reach: each
// volume must get a NotRepaired event naming where its daemon lives, and
// still no re-stage, publish or unmount.
func TestHealthyLayoutsUnderRunningAgent(t *testing.T) {
	soak := 30 * time.Second
	if v := os.Getenv(envHealthySoak); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil || d <= 0 {
			t.Fatalf("%s=%q: give a positive Go duration such as 10m", envHealthySoak, v)
		}
		soak = d
	}
	d := newDriverEnv(t)
	root := d.kubelet.Root()
	var vols []layoutVolume

	s3v := d.newVolume("s3")
	vols = append(vols, layoutVolume{layout: "globalmount (k8s-csi-s3, s3fs)", driver: csilab.DriverName, pod: s3v.pod, target: s3v.target})

	cephfs := d.newCephFSVolume(d.startCephFS(), "cephfs")
	vols = append(vols, layoutVolume{layout: "globalmount (ceph-csi CephFS, ceph-fuse)", driver: csilab.CephFSDriverName, pod: cephfs.pod, target: cephfs.target})

	// ceph-csi RBD: staged at <globalmount>/<volumeID>, published by bind.
	const rbd, rbdID = "rook-ceph.rbd.csi.ceph.com", "0001-0009-rook-ceph-0000000000000002-5c2e1a3d"
	rv := d.layoutAPIVolume("rbd", rbd, rbdID)
	rbdStage := filepath.Join(d.kubelet.StagingPath(rbd, rbdID), rbdID)
	if err := os.MkdirAll(rbdStage, 0o750); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("/dev/rbd0", rbdStage, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(rbdStage, unix.MNT_DETACH) })
	rbdTarget := d.kubelet.Publish(string(rv.UID), "pv-rbd", rbd, rbdID, rbdStage, false)
	vols = append(vols, layoutVolume{layout: "globalmount/<volumeID> (ceph-csi RBD)", driver: rbd, pod: rv, target: rbdTarget})

	for _, l := range []struct {
		tag, layout, driver string
		home                kubelet.DaemonHome
		opts                []csilab.LayoutOption
	}{
		{"jfs", "publish-only, mount pod (JuiceFS), rclone", "csi.juicefs.com", kubelet.DaemonMountPod, nil},
		{"gcs", "publish-only, app sidecar (GCS FUSE), sshfs", "gcsfuse.csi.storage.gke.io", kubelet.DaemonAppSidecar, []csilab.LayoutOption{csilab.WithSSHFS()}},
		{"nostage", "publish-only, node plugin, not catalogued, rclone", "nostage.lab", kubelet.DaemonNodePlugin, nil},
	} {
		drv := csilab.StartLayoutDriver(t, l.driver, filepath.Join(root, "plugins", l.driver, "csi.sock"), t.TempDir(), l.home, l.opts...)
		handle := "handle-" + l.tag
		pod := d.layoutAPIVolume(l.tag, l.driver, handle)
		// kubelet makes globalmount and vol_data.json for every CSI
		// volume, and calls NodePublishVolume alone when the driver
		// does not stage.
		d.kubelet.StagingPath(l.driver, handle)
		target := d.kubelet.PreparePublish(string(pod.UID), "pv-"+l.tag, l.driver, handle)
		publish(t, drv.Socket(), handle, target)
		vols = append(vols, layoutVolume{layout: l.layout, driver: l.driver, pod: pod, target: target, lab: drv})
	}

	rep, err := remount.New(remount.Config{KubeletRoot: root})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rep.Close() })
	cfg := agent.DefaultConfig()
	cfg.NodeName, cfg.KubeletRoot, cfg.MetricsAddr, cfg.Version = d.node, root, "", "test"
	before := kubeletMounts(t, root)
	ra := d.startAgent(cfg, agent.Deps{Repairer: rep})

	start := time.Now()
	time.Sleep(soak)
	scans, _ := ra.metric("mountmedic_last_scan_timestamp_seconds ")
	cycles, _ := ra.metric("mountmedic_scan_duration_seconds_count ")
	acted := actions(ra)
	var events int
	for _, v := range vols {
		events += len(d.eventsOf(v.pod.UID))
	}
	after := kubeletMounts(t, root)
	gone, added := diffMounts(before, after)
	t.Logf("healthy soak of %s over %d volumes of %d layouts: %g probe cycles; actions %v, events %d, unmounts %d, new mounts (stages, publishes) %d; last scan %s after start",
		time.Since(start).Round(time.Second), len(vols), len(vols), cycles, acted, events, len(gone), len(added),
		time.Unix(int64(scans), 0).Sub(start).Round(time.Second))
	if p := os.Getenv("MOUNTMEDIC_HEALTHY_REPORT"); p != "" {
		report := fmt.Sprintf("soak=%s volumes=%d probe_cycles=%g actions=%g events=%d unmounts=%d mounts_added=%d kubelet_mounts=%d\n",
			time.Since(start).Round(time.Second), len(vols), cycles, sum(acted), events, len(gone), len(added), len(after))
		if err := os.WriteFile(p, []byte(report), 0o644); err != nil {
			t.Error(err)
		}
	}
	if sum(acted) != 0 || events != 0 || len(gone) != 0 || len(added) != 0 {
		t.Errorf("healthy volumes touched: actions %v, events %d, mounts gone %v, mounts added %v", acted, events, gone, added)
	}
	if scans == 0 || time.Unix(int64(scans), 0).Before(start) {
		t.Errorf("the agent did not scan during the soak (last scan %v)", scans)
	}

	// The daemons out of the node plugin's reach die.
	before = kubeletMounts(t, root)
	for _, v := range vols {
		if v.lab == nil || v.driver == "nostage.lab" {
			continue
		}
		if err := v.lab.KillDaemon("handle-" + strings.TrimPrefix(v.pod.Name, "pod-")); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []struct{ pod, why string }{{"pod-jfs", "mount pod"}, {"pod-gcs", "sidecar"}} {
		for _, v := range vols {
			if v.pod.Name == c.pod {
				e := d.waitEvent(v.pod.UID, string(agent.ReasonNotRepaired), c.why)
				t.Logf("%s: %s", v.layout, e.Note)
			}
		}
	}
	// A cycle more for anything the agent would do after its report.
	time.Sleep(3 * cfg.ProbeInterval)
	gone, added = diffMounts(before, kubeletMounts(t, root))
	if len(gone) != 0 || len(added) != 0 {
		t.Errorf("daemons out of the plugin's reach killed: mounts gone %v, added %v; want them reported, left as they are", gone, added)
	}
	if n := actions(ra); sum(n) != 0 {
		t.Errorf("daemons out of the plugin's reach killed: actions %v, want none", n)
	}
}

// layoutAPIVolume creates a bound PV (of driver, with handle) and PVC and a
// Running pod pod-<tag> using it, owned by a ReplicaSet, and the CSIDriver
// object when missing.
func (d *env) layoutAPIVolume(tag, driver, handle string) *corev1.Pod {
	d.t.Helper()
	return d.layoutAPIVolumeOwned(tag, driver, handle, true)
}

// layoutAPIVolumeOwned is layoutAPIVolume; owned false leaves the pod
// without an owner.
func (d *env) layoutAPIVolumeOwned(tag, driver, handle string, owned bool) *corev1.Pod {
	d.t.Helper()
	attach := false
	_, _ = d.admin.StorageV1().CSIDrivers().Create(context.Background(), &storagev1.CSIDriver{
		ObjectMeta: metav1.ObjectMeta{Name: driver},
		Spec:       storagev1.CSIDriverSpec{AttachRequired: &attach},
	}, metav1.CreateOptions{})
	v := d.createVolume(tag, func(pv *corev1.PersistentVolume) {
		pv.Spec.AccessModes = []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany}
		pv.Spec.CSI.Driver, pv.Spec.CSI.VolumeHandle = driver, handle
	})
	o := podOptions{labels: map[string]string{"app": tag}}
	if owned {
		o.owner = d.replicaSet("rs-"+tag, o.labels)
	}
	return d.createPod("pod-"+tag, v, o)
}

// publish calls NodePublishVolume on the driver's socket as kubelet does for
// a driver that does not stage.
func publish(t *testing.T, socket, handle, target string) {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := csi.NewNodeClient(conn).NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
		VolumeId: handle, TargetPath: target,
		VolumeCapability: &csi.VolumeCapability{
			AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{}},
			AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER},
		},
	}); err != nil {
		t.Fatalf("NodePublishVolume %s: %v", handle, err)
	}
}

// actions reads the agent's action counters: repairs of every tier and
// result, guards and evictions.
func actions(ra *runningAgent) map[string]float64 {
	out := map[string]float64{}
	for _, line := range strings.Split(ra.get("/metrics").body, "\n") {
		for _, name := range []string{"mountmedic_repairs_total", "mountmedic_guards_total", "mountmedic_evictions_total"} {
			if !strings.HasPrefix(line, name) {
				continue
			}
			var v float64
			if i := strings.LastIndexByte(line, ' '); i > 0 {
				fmt.Sscanf(line[i+1:], "%g", &v)
			}
			if v != 0 {
				out[line[:strings.LastIndexByte(line, ' ')]] = v
			}
		}
	}
	return out
}

func sum(m map[string]float64) float64 {
	var s float64
	for _, v := range m {
		s += v
	}
	return s
}

// kubeletMounts lists the mounts under the kubelet root as "<mount ID>
// <path>": an unmount, a re-stage or a re-publish changes the list.
func kubeletMounts(t *testing.T, root string) map[string]bool {
	t.Helper()
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	out := map[string]bool{}
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 4 && strings.HasPrefix(fields[4], root+"/") {
			out[fields[0]+" "+fields[4]] = true
		}
	}
	return out
}

func diffMounts(before, after map[string]bool) (gone, added []string) {
	for m := range before {
		if !after[m] {
			gone = append(gone, m)
		}
	}
	for m := range after {
		if !before[m] {
			added = append(added, m)
		}
	}
	sort.Strings(gone)
	sort.Strings(added)
	return gone, added
}

// TestOutOfReachEscalation runs the agent, opted in with
// --escalate-out-of-reach and with an acting repairer, over volumes whose
// real daemons live out of the node plugin's reach: sshfs as a GCS FUSE
// sidecar (the catalogue: nothing recovers it, evict at once) for a pod a
// ReplicaSet owns and for a pod no controller owns, rclone as a JuiceFS
// mount pod (the catalogue: its own recovery gets 2 minutes), and a
// healthy sidecar volume. The hostile actor is the application pod's own
// user, who controls its sidecar: killing it gets at most that user's own
// controller-owned pod evicted, never a pod no controller owns, never a
// re-stage or an unmount on the node.
//
// A dry run first reports exactly the decisions of the real run that
// follows: the owned pod evicted (against the real API server), the
// unowned one refused, the mount pod's volume left to its recovery, the
// healthy volume untouched; and neither run unmounts, stages or publishes
// anything.
func TestOutOfReachEscalation(t *testing.T) {
	e := newEnv(t, nil)
	ctx := context.Background()
	root := e.kubelet.Root()
	const gcs, jfs = "gcsfuse.csi.storage.gke.io", "csi.juicefs.com"
	drivers := map[string]*csilab.LayoutDriver{
		gcs: csilab.StartLayoutDriver(t, gcs, filepath.Join(root, "plugins", gcs, "csi.sock"), t.TempDir(), kubelet.DaemonAppSidecar, csilab.WithSSHFS()),
		jfs: csilab.StartLayoutDriver(t, jfs, filepath.Join(root, "plugins", jfs, "csi.sock"), t.TempDir(), kubelet.DaemonMountPod),
	}
	pods := map[string]*corev1.Pod{}
	for _, v := range []struct {
		tag, driver string
		owned       bool
	}{
		{"gcs-owned", gcs, true},
		{"gcs-lone", gcs, false},
		{"jfs-owned", jfs, true},
		{"gcs-healthy", gcs, true},
	} {
		handle := "handle-" + v.tag
		pods[v.tag] = e.layoutAPIVolumeOwned(v.tag, v.driver, handle, v.owned)
		e.kubelet.StagingPath(v.driver, handle)
		target := e.kubelet.PreparePublish(string(pods[v.tag].UID), "pv-"+v.tag, v.driver, handle)
		publish(t, drivers[v.driver].Socket(), handle, target)
	}
	for tag, driver := range map[string]string{"gcs-owned": gcs, "gcs-lone": gcs, "jfs-owned": jfs} {
		if err := drivers[driver].KillDaemon("handle-" + tag); err != nil {
			t.Fatal(err)
		}
	}
	before := kubeletMounts(t, root)

	cfg := e.config()
	cfg.EscalateOutOfReach, cfg.DryRun = true, true
	dry := e.startAgent(cfg, agent.Deps{Repairer: e.dryRunRepairer()})
	e.waitEvent(pods["gcs-owned"].UID, string(agent.ReasonNotRepaired), "[dry-run]", "sidecar", "will evict")
	e.waitEvent(pods["gcs-owned"].UID, string(agent.ReasonEvicting), "[dry-run] would evict")
	e.waitEvent(pods["gcs-lone"].UID, string(agent.ReasonNotRepaired), "[dry-run]", "no controller owner")
	jfsNote := e.waitEvent(pods["jfs-owned"].UID, string(agent.ReasonNotRepaired), "[dry-run]", "mount pod", "--enable-manager", "2m0s")
	t.Logf("mount pod: %s", jfsNote.Note)
	// Stopped here and again at the cleanup: its result stays for that.
	dry.cancel()
	dryErr := <-dry.done
	dry.done <- dryErr
	for tag, p := range pods {
		got, err := e.admin.CoreV1().Pods(testNamespace).Get(ctx, p.Name, metav1.GetOptions{})
		if err != nil || got.DeletionTimestamp != nil {
			t.Errorf("%s after the dry run: %v, deletion %v; want it untouched", tag, err, got.DeletionTimestamp)
		}
		checkDryRunMarks(t, e, p.UID)
	}

	rep, err := remount.New(remount.Config{KubeletRoot: root})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rep.Close() })
	cfg.DryRun = false
	ra := e.startAgent(cfg, agent.Deps{Repairer: rep})
	ev := e.waitEvent(pods["gcs-owned"].UID, string(agent.ReasonEvicting), "evicted the pod", "ReplicaSet")
	t.Logf("sidecar, owned: %s", ev.Note)
	e.waitFor("the owned pod to be terminating", func() (bool, error) {
		p, err := e.admin.CoreV1().Pods(testNamespace).Get(ctx, pods["gcs-owned"].Name, metav1.GetOptions{})
		return err == nil && p.DeletionTimestamp != nil, err
	})
	e.waitFor("the refusal in the metrics", func() (bool, error) {
		n, _ := ra.metric(`mountmedic_evictions_total{result="no_controller"}`)
		return n >= 1, nil
	})
	// A few cycles more for anything the agent would do after.
	time.Sleep(10 * cfg.ProbeInterval)
	for _, tag := range []string{"gcs-lone", "jfs-owned", "gcs-healthy"} {
		p, err := e.admin.CoreV1().Pods(testNamespace).Get(ctx, pods[tag].Name, metav1.GetOptions{})
		if err != nil || p.DeletionTimestamp != nil {
			t.Errorf("%s: %v, deletion %v; want it left alone (no controller owner; its driver's recovery still has time; healthy)", tag, err, p.DeletionTimestamp)
		}
	}
	if evs := e.eventsOf(pods["gcs-healthy"].UID); len(evs) != 0 {
		t.Errorf("healthy sidecar volume: %d events, first %s %q; want none", len(evs), evs[0].Reason, evs[0].Note)
	}
	if n, _ := ra.metric(`mountmedic_evictions_total{result="evicted"}`); n != 1 {
		t.Errorf("mountmedic_evictions_total{evicted} = %v, want 1", n)
	}
	for m, n := range actions(ra) {
		if !strings.Contains(m, `tier="evict"`) && !strings.HasPrefix(m, "mountmedic_evictions_total") {
			t.Errorf("%s = %v: an action other than the eviction rung", m, n)
		}
	}
	if gone, added := diffMounts(before, kubeletMounts(t, root)); len(gone) != 0 || len(added) != 0 {
		t.Errorf("daemons out of the plugin's reach: mounts gone %v, added %v; want none unmounted, staged or published", gone, added)
	}
}
