package remount

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/scripts/csilab"
	"github.com/mountmedic/mountmedic/scripts/lab"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// The Repairer against the real k8s-csi-s3 driver (s3driver + s3fs) and a
// versitygw S3 server, on a lab kubelet tree with lab containers.

// driverLab is one S3 server, one s3driver on the conventional socket of a
// lab kubelet root, and a Repairer.
type driverLab struct {
	k    *lab.Kubelet
	root string
	s3   *csilab.S3
	drv  *csilab.Driver
	csi  *CSIClient
	r    *Repairer
}

func startDriverLab(t testing.TB, cfg Config) *driverLab {
	t.Helper()
	lab.RequireRoot(t)
	k := newKubelet(t)
	d := &driverLab{k: k, root: k.Root()}
	d.s3 = csilab.StartS3(t)
	sock := filepath.Join(d.root, "plugins", csilab.DriverName, "csi.sock")
	if err := os.MkdirAll(filepath.Dir(sock), 0o750); err != nil {
		t.Fatal(err)
	}
	d.drv = csilab.StartDriver(t, sock, lab.DefaultNodeName)
	var err error
	if d.csi, err = DialCSI(context.Background(), sock, CSIOptions{}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.csi.Close() })
	d.r = d.repairer(t, cfg)
	return d
}

func (d *driverLab) repairer(t testing.TB, cfg Config) *Repairer {
	t.Helper()
	cfg.KubeletRoot = d.root
	if cfg.Probe.Timeout == 0 {
		cfg.Probe.Timeout = 2 * time.Second
	}
	r, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

// restartDriver brings the driver back, as its DaemonSet would.
func (d *driverLab) restartDriver(t testing.TB) {
	t.Helper()
	if err := d.drv.Restart(); err != nil {
		t.Fatal(err)
	}
}

// ctrDef is a container of a pod: its volumeMounts of the volume.
type ctrDef struct {
	name        string
	propagation corev1.MountPropagationMode // "" for None
	mounts      []corev1.VolumeMount
	readOnly    []string
	// noCgroup: no cgroup names the pod (kubelet with cgroupsPerQOS:
	// false); only the runtime knows the container's process.
	noCgroup bool
}

type podDef struct {
	name string
	ctrs []ctrDef
}

// realVolume is a k8s-csi-s3 volume staged and published into the lab by
// the driver, with its pods' containers running.
type realVolume struct {
	handle  string
	pv      string
	staging string
	vol     *Volume
	pods    []*realPod
}

type realPod struct {
	uid    types.UID
	target string
	ctrs   map[string]*lab.Container
	// subPaths are the host subPath binds by container path, and the
	// containers' mounts by name, to start a container again.
	subPaths map[string]string
	def      podDef
}

const testVolumeName = "data" // the pod's spec.volumes[].name

func randomHex(t testing.TB, n int) string {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(b)
}

func randomUID(t testing.TB) types.UID {
	h := randomHex(t, 16)
	return types.UID(h[:8] + "-" + h[8:12] + "-" + h[12:16] + "-" + h[16:20] + "-" + h[20:])
}

// newVolume creates the volume (an S3 prefix), builds each pod's request
// from API objects with kubelet.BuildVolumeRequest, stages and publishes it through
// the driver as kubelet would, writes data.txt and sub/g.txt, makes the
// subPath binds and starts the containers (in their pod's cgroup).
func (d *driverLab) newVolume(t testing.TB, prefix string, pods ...podDef) *realVolume {
	t.Helper()
	return d.newVolumeWith(t, prefix, nil, pods...)
}

// newVolumeWith is newVolume with the PV's volumeAttributes attrs (the
// lab's, mounter s3fs, when nil).
func (d *driverLab) newVolumeWith(t testing.TB, prefix string, attrs map[string]string, pods ...podDef) *realVolume {
	t.Helper()
	ctx := context.Background()
	if err := d.s3.PutObject(csilab.Bucket, prefix+"/", nil); err != nil {
		t.Fatal(err)
	}
	sv := d.s3.Volume(csilab.Bucket, prefix)
	if attrs != nil {
		sv.Attributes = attrs
	}
	rv := &realVolume{handle: sv.Handle, pv: "pv-" + prefix}
	rv.staging = d.k.StagingPath(csilab.DriverName, sv.Handle)
	caps, err := d.csi.NodeGetCapabilities(ctx)
	if err != nil {
		t.Fatal(err)
	}
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "s3-" + prefix}, Data: map[string][]byte{}}
	for k, v := range sv.Secrets {
		secret.Data[k] = []byte(v)
	}
	ref := &corev1.SecretReference{Namespace: secret.Namespace, Name: secret.Name}
	pvc := &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: "claim-" + prefix, UID: randomUID(t)},
		Spec:       corev1.PersistentVolumeClaimSpec{VolumeName: rv.pv},
		Status:     corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound},
	}
	pv := &corev1.PersistentVolume{
		ObjectMeta: metav1.ObjectMeta{Name: rv.pv},
		Spec: corev1.PersistentVolumeSpec{
			AccessModes: []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany},
			ClaimRef:    &corev1.ObjectReference{Namespace: pvc.Namespace, Name: pvc.Name, UID: pvc.UID},
			PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
				Driver: csilab.DriverName, VolumeHandle: sv.Handle, VolumeAttributes: sv.Attributes,
				NodeStageSecretRef: ref, NodePublishSecretRef: ref,
			}},
		},
	}
	attach := false
	driverObj := &storagev1.CSIDriver{ObjectMeta: metav1.ObjectMeta{Name: csilab.DriverName}, Spec: storagev1.CSIDriverSpec{AttachRequired: &attach}}

	rv.vol = &Volume{Driver: csilab.DriverName, VolumeHandle: sv.Handle}
	for i, pd := range pods {
		uid := randomUID(t)
		pod := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: pd.name, UID: uid},
			Spec: corev1.PodSpec{NodeName: lab.DefaultNodeName, Volumes: []corev1.Volume{{Name: testVolumeName,
				VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: pvc.Name}}}}},
		}
		for _, c := range pd.ctrs {
			pod.Spec.Containers = append(pod.Spec.Containers, corev1.Container{Name: c.name, VolumeMounts: c.mounts})
		}
		vr, err := kubelet.BuildVolumeRequest(kubelet.VolumeObjects{Pod: pod, VolumeName: testVolumeName, PVC: pvc, PV: pv, CSIDriver: driverObj,
			StageSecret: secret, PublishSecret: secret, Capabilities: caps, KubeletRoot: d.root})
		if err != nil {
			t.Fatal(err)
		}
		if vr.StagingPath != rv.staging {
			t.Fatalf("staging path %s, the lab kubelet's %s", vr.StagingPath, rv.staging)
		}
		if i == 0 {
			rv.vol.Stage = vr
			if err := d.csi.NodeStageVolume(ctx, kubelet.StageRequest(vr)); err != nil {
				t.Fatal(err)
			}
		}
		target := d.k.PreparePublish(string(uid), rv.pv, csilab.DriverName, sv.Handle)
		if target != vr.TargetPath {
			t.Fatalf("publish path %s, the lab kubelet's %s", vr.TargetPath, target)
		}
		if err := d.csi.NodePublishVolume(ctx, kubelet.PublishRequest(vr)); err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			writeFile(t, filepath.Join(target, "data.txt"), "data of "+prefix)
			writeFile(t, filepath.Join(target, "sub", "g.txt"), "sub of "+prefix)
		}
		rp := &realPod{uid: uid, target: target, ctrs: map[string]*lab.Container{}, subPaths: map[string]string{}, def: pd}
		pvol := PodVolume{Publish: vr}
		for _, c := range pd.ctrs {
			id := randomHex(t, 32)
			for _, m := range c.mounts {
				pvol.Containers = append(pvol.Containers, ContainerMount{PodUID: uid, Container: c.name, ContainerID: id, MountPath: m.MountPath})
			}
			rp.ctrs[c.name] = d.startContainer(t, rp, c, id)
		}
		rv.vol.Pods = append(rv.vol.Pods, pvol)
		rv.pods = append(rv.pods, rp)
	}
	return rv
}

// startContainer binds the container's volumeMounts as kubelet and the
// runtime do: the publish target for the whole volume, a subPath bind
// under volume-subpaths (made when missing, reused when there) for a
// subPath; HostToContainer gives a slave container.
func (d *driverLab) startContainer(t testing.TB, rp *realPod, c ctrDef, id string) *lab.Container {
	t.Helper()
	binds := map[string]string{}
	for i, m := range c.mounts {
		if m.SubPath == "" {
			binds[m.MountPath] = rp.target
			continue
		}
		sp := filepath.Join(d.root, "pods", string(rp.uid), "volume-subpaths", testVolumeName, c.name, strconv.Itoa(i))
		if topID(t, d.root, sp) == 0 {
			sp = d.k.SubPath(string(rp.uid), testVolumeName, c.name, i, filepath.Join(rp.target, m.SubPath))
		}
		rp.subPaths[c.name+":"+m.MountPath] = sp
		binds[m.MountPath] = sp
	}
	prop := lab.PropagationPrivate
	if c.propagation == corev1.MountPropagationHostToContainer {
		prop = lab.PropagationSlave
	}
	opts := []lab.ContainerOption{lab.WithChroot()}
	if !c.noCgroup {
		opts = append(opts, lab.WithPodCgroup(string(rp.uid), id))
	}
	if len(c.readOnly) > 0 {
		opts = append(opts, lab.WithReadOnly(c.readOnly...))
	}
	return lab.StartContainer(t, c.name+"-"+id[:8], prop, binds, opts...)
}

// markDead fills what the agent's inventory would: the dead backend of
// each volume's staging mount, whether it is hung, and each pod's mounts on
// it.
func (d *driverLab) markDead(t testing.TB, rvs ...*realVolume) {
	t.Helper()
	inv, err := probe.ReadFile("/proc/self/mountinfo", probe.Options{Root: d.root, Live: true})
	if err != nil {
		t.Fatal(err)
	}
	rep := probe.NewProber(probe.Config{Timeout: time.Second, Parallel: 8}).Probe(context.Background(), inv)
	for _, rv := range rvs {
		markDeadIn(t, rep, rv)
	}
}

func markDeadIn(t testing.TB, rep *probe.Report, rv *realVolume) {
	t.Helper()
	var backend *probe.Backend
	var state probe.State
	for _, res := range rep.Mounts {
		if res.Mount.Path == rv.staging && !res.Mount.Covered {
			backend, state = res.Mount.Backend, res.State
		}
	}
	if backend == nil || !state.Broken() {
		t.Fatalf("staging mount of %s: backend %v state %s, want a broken one", rv.handle, backend, state)
	}
	rv.vol.Backend, rv.vol.Hung = backend, state == probe.Hung
	for i, rp := range rv.pods {
		rv.vol.Pods[i].Dead = nil
		for _, res := range rep.Mounts {
			if res.Mount.Backend == backend && res.Mount.Target.PodUID == string(rp.uid) {
				rv.vol.Pods[i].Dead = append(rv.vol.Pods[i].Dead, res.Mount)
			}
		}
	}
}

// views are every place a volume is seen: staging, publish targets,
// subPath binds and each container's mounts, with what each must read.
type view struct {
	path, file, data string
}

func (rv *realVolume) views(prefix string) []view {
	data, sub := "data of "+prefix, "sub of "+prefix
	out := []view{{rv.staging, "data.txt", data}}
	for _, rp := range rv.pods {
		out = append(out, view{rp.target, "data.txt", data})
		for _, sp := range rp.subPaths {
			out = append(out, view{sp, "g.txt", sub})
		}
		for _, c := range rp.def.ctrs {
			for _, m := range c.mounts {
				if m.SubPath == "" {
					out = append(out, view{rp.ctrs[c.name].Path(m.MountPath), "data.txt", data})
				} else {
					out = append(out, view{rp.ctrs[c.name].Path(m.MountPath), "g.txt", sub})
				}
			}
		}
	}
	return out
}

func wantViews(t testing.TB, views []view) {
	t.Helper()
	for _, v := range views {
		wantFile(t, filepath.Join(v.path, v.file), v.data)
	}
}

func wantDead(t testing.TB, views []view) {
	t.Helper()
	for _, v := range views {
		if err := statfsErr(v.path, failBound); !errors.Is(err, unix.ENOTCONN) {
			t.Errorf("statfs %s after the driver died = %v, want ENOTCONN", v.path, err)
		}
	}
}

// pids are the containers' processes, to show they were not restarted.
func (rv *realVolume) pids() []int {
	var out []int
	for _, rp := range rv.pods {
		for _, c := range rp.ctrs {
			out = append(out, c.Pid())
		}
	}
	slices.Sort(out)
	return out
}

func ops(acts []Action) map[Op]int {
	n := map[Op]int{}
	for _, a := range acts {
		n[a.Op]++
	}
	return n
}

func logOutcome(t testing.TB, what string, o Outcome) {
	t.Helper()
	var b strings.Builder
	for _, a := range o.Actions {
		fmt.Fprintf(&b, "\n  %s (%s)", a, a.Took.Round(time.Microsecond))
	}
	t.Logf("%s: healed %t in %s, err %v; actions:%s", what, o.Healed, o.Took.Round(time.Millisecond), o.Err, b.String())
}

// repair runs the agent's ladder as far as LiveSwap: Restage, then LiveSwap
// (the agent goes on when containers hold their own bind).
func repair(t testing.TB, r *Repairer, v *Volume) (Outcome, Outcome) {
	t.Helper()
	ctx := context.Background()
	re := r.Restage(ctx, v)
	logOutcome(t, "restage", re)
	ls := r.LiveSwap(ctx, v)
	logOutcome(t, "liveswap", ls)
	return re, ls
}

// twoPods is the scenario: pod a with a private container that
// mounts the volume whole and a subPath of it, and a HostToContainer
// sidecar; pod b with a private reader.
func twoPods() []podDef {
	hostToContainer := corev1.MountPropagationHostToContainer
	return []podDef{
		{name: "a", ctrs: []ctrDef{
			{name: "app", mounts: []corev1.VolumeMount{
				{Name: testVolumeName, MountPath: "/data"},
				{Name: testVolumeName, MountPath: "/data-sub", SubPath: "sub"},
			}},
			{name: "sidecar", propagation: hostToContainer, mounts: []corev1.VolumeMount{
				{Name: testVolumeName, MountPath: "/data", MountPropagation: &hostToContainer},
			}},
		}},
		{name: "b", ctrs: []ctrDef{
			{name: "reader", readOnly: []string{"/data"}, mounts: []corev1.VolumeMount{
				{Name: testVolumeName, MountPath: "/data", ReadOnly: true},
			}},
		}},
	}
}

// TestRealDriver runs the tests against the real driver on one shared lab
// (S3 server, driver, kubelet root): each subtest makes its own volume and
// Repairer, and starts with the driver running, whatever the one before left.
func TestRealDriver(t *testing.T) {
	d := startDriverLab(t, Config{})
	for _, tc := range []struct {
		name string
		fn   func(*testing.T, *driverLab)
	}{
		{"repairs", func(t *testing.T, d *driverLab) { testRepairs(t, d, "vol1", lookupUnknown) }},
		{"repairs reading the whole table", func(t *testing.T, d *driverLab) { testRepairs(t, d, "vol1t", lookupTable) }},
		{"restart tier", testRestartTier},
		{"live swap through the CRI", testLiveSwapThroughCRI},
		{"guard", testGuardOnRealDriver},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if !d.drv.Running() {
				d.restartDriver(t)
			}
			tc.fn(t, d)
		})
	}
}

// testRepairs: one volume in two pods (twoPods) repaired in place after the
// driver died, again, while the driver is down, dry, hung and with a planted
// symlink; with the lookups the kernel allows (lookupUnknown), or forced.
func testRepairs(t *testing.T, d *driverLab, prefix string, mode lookupMode) {
	r := d.repairer(t, Config{})
	if mode != lookupUnknown {
		r.lookup.mode = mode
	}
	t.Logf("lookups: %d (1 per path, 2 the whole table)", r.lookup.get(r.procDir))
	rv := d.newVolume(t, prefix, twoPods()...)
	views := rv.views(prefix)
	wantViews(t, views)
	pids := rv.pids()
	ctx := context.Background()

	t.Run("driver killed and back: repaired in place", func(t *testing.T) {
		d.drv.Kill()
		wantDead(t, views)
		d.markDead(t, rv)
		d.restartDriver(t)

		re, ls := repair(t, r, rv.vol)
		if !re.Healed || re.Err != nil {
			t.Fatalf("Restage: healed %t, err %v", re.Healed, re.Err)
		}
		// Restage reaches the HostToContainer sidecar by over-mounting
		// the dead publish target it is a slave of.
		n := ops(re.Actions)
		if n[opOverMount] != 1 || n[opStage] != 1 || n[opPublish] != 2 {
			t.Errorf("Restage actions %v: want one stage, one publish per pod and one over-mount", n)
		}
		if !Changed(re.Actions) {
			t.Errorf("Changed says a re-stage changed nothing")
		}
		wantFile(t, rv.pods[0].ctrs["sidecar"].Path("/data/data.txt"), "data of "+prefix)
		if !ls.Healed || ls.Err != nil {
			t.Fatalf("LiveSwap: healed %t, err %v", ls.Healed, ls.Err)
		}
		if n := ops(ls.Actions); n[opSwap] != 3 {
			t.Errorf("LiveSwap swapped %d mounts, want 3 (app's /data and /data-sub, reader's /data)", n[opSwap])
		}
		wantViews(t, views)
		if got := rv.pids(); !slices.Equal(got, pids) {
			t.Errorf("container processes %v, were %v: restarted", got, pids)
		}
		// The read-only volumeMount stays read-only.
		if err := os.WriteFile(rv.pods[1].ctrs["reader"].Path("/data/x"), []byte("x"), 0o644); !errors.Is(err, unix.EROFS) {
			t.Errorf("write in the read-only container mount = %v, want EROFS", err)
		}
		writeFile(t, rv.pods[0].ctrs["app"].Path("/data/after.txt"), "written after the repair")
		wantFile(t, rv.pods[0].ctrs["sidecar"].Path("/data/after.txt"), "written after the repair")
	})

	t.Run("repair run twice changes nothing", func(t *testing.T) {
		before := mountTables(t, append([]int{os.Getpid()}, rv.pids()...)...)
		re, ls := repair(t, r, rv.vol)
		if !re.Healed || !ls.Healed {
			t.Fatalf("second repair: restage healed %t (%v), liveswap healed %t (%v)", re.Healed, re.Err, ls.Healed, ls.Err)
		}
		for _, o := range []Outcome{re, ls} {
			for op, n := range ops(o.Actions) {
				if op != opVerify && op != opFindProcesses {
					t.Errorf("%s of a healthy volume took %d %s actions", o.Tier, n, op)
				}
			}
		}
		if after := mountTables(t, append([]int{os.Getpid()}, rv.pids()...)...); after != before {
			t.Errorf("a second repair changed the mount tables")
		}
	})

	// What the agent acts on when its probe's report is older than a mount
	// made since at the same path that got the dead mount's device number
	// (and mount ID): the kernel hands out the lowest free ones. Here the
	// report names the healthy mount's own device, as dead, and as hung
	// with the probe that found the hang returned since.
	// The Repairer's prober has no probe of that device blocked: the hung
	// report's probe has returned.
	for _, tc := range []struct {
		name string
		hung bool
	}{
		{"a report naming the fresh mount's device dead changes nothing", false},
		{"a report naming it hung, its probe returned, changes nothing", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			inv, err := probe.ReadFile("/proc/self/mountinfo", probe.Options{Root: d.root, Live: true})
			if err != nil {
				t.Fatal(err)
			}
			stale := *rv.vol
			stale.Pods = slices.Clone(rv.vol.Pods)
			stale.Backend, stale.Hung = nil, tc.hung
			for _, m := range inv.Mounts {
				if m.Path == rv.staging && !m.Covered {
					stale.Backend = m.Backend
				}
			}
			if stale.Backend == nil {
				t.Fatalf("no staging mount at %s", rv.staging)
			}
			for i, rp := range rv.pods {
				stale.Pods[i].Dead = nil
				for _, m := range inv.Mounts {
					if m.Backend == stale.Backend && m.Target.PodUID == string(rp.uid) {
						stale.Pods[i].Dead = append(stale.Pods[i].Dead, m)
					}
				}
			}
			before := mountTables(t, append([]int{os.Getpid()}, rv.pids()...)...)
			o := r.Restage(ctx, &stale)
			logOutcome(t, "restage", o)
			if !o.Healed || o.Err != nil {
				t.Fatalf("Restage of a healthy volume reported broken: healed %t, err %v", o.Healed, o.Err)
			}
			n := ops(o.Actions)
			for op, c := range n {
				if op != opVerify && op != opSkip {
					t.Errorf("Restage took %d %s actions on a healthy mount reported broken", c, op)
				}
			}
			if n[opSkip] == 0 {
				t.Errorf("Restage did not say it left the answering mount alone: %v", n)
			}
			// So do the live swap (the containers' views) and the unmount
			// tier (a terminating pod's dead mounts).
			ls := r.LiveSwap(ctx, &stale)
			logOutcome(t, "liveswap", ls)
			if !ls.Healed || ls.Err != nil {
				t.Errorf("LiveSwap of a healthy volume reported broken: healed %t, err %v", ls.Healed, ls.Err)
			}
			for op, c := range ops(ls.Actions) {
				if op != opVerify && op != opSkip && op != opFindProcesses {
					t.Errorf("LiveSwap took %d %s actions on a healthy mount reported broken", c, op)
				}
			}
			if Changed(o.Actions) || Changed(ls.Actions) {
				t.Errorf("Changed says a tier that left everything alone changed something")
			}
			u := r.Unmount(ctx, &stale)
			logOutcome(t, "unmount", u)
			for op, c := range ops(u.Actions) {
				if op != opSkip {
					t.Errorf("Unmount took %d %s actions on a healthy mount reported broken", c, op)
				}
			}
			if after := mountTables(t, append([]int{os.Getpid()}, rv.pids()...)...); after != before {
				t.Errorf("a repair of a healthy mount reported broken changed the mount tables")
			}
			wantViews(t, views)
		})
	}

	t.Run("driver still down: nothing unmounted", func(t *testing.T) {
		d.drv.Kill()
		d.markDead(t, rv)
		before := mountTables(t, append([]int{os.Getpid()}, rv.pids()...)...)
		for _, tier := range []func(context.Context, *Volume) Outcome{r.Restage, r.LiveSwap, r.Restart} {
			o := tier(ctx, rv.vol)
			logOutcome(t, "driver down", o)
			if o.Healed || !errors.Is(o.Err, ErrDriverUnavailable) {
				t.Errorf("%s with the driver down: healed %t, err %v; want ErrDriverUnavailable", o.Tier, o.Healed, o.Err)
			}
			if n := ops(o.Actions); n[opUnmount]+n[opAbortFUSE]+n[opStage]+n[opPublish]+n[opSwap]+n[opStopContainer] != 0 {
				t.Errorf("%s with the driver down acted: %v", o.Tier, n)
			}
		}
		if after := mountTables(t, append([]int{os.Getpid()}, rv.pids()...)...); after != before {
			t.Errorf("the mount tables changed while the driver was down")
		}
		d.restartDriver(t)
		if _, ls := repair(t, r, rv.vol); !ls.Healed {
			t.Fatalf("repair once the driver is back: %v", ls.Err)
		}
		wantViews(t, views)
	})

	t.Run("dry-run reports the plan and changes nothing", func(t *testing.T) {
		d.drv.Kill()
		d.markDead(t, rv)
		d.restartDriver(t)
		dry := d.repairer(t, Config{DryRun: true})
		dry.lookup.mode = r.lookup.get(r.procDir)
		before := mountTables(t, append([]int{os.Getpid()}, rv.pids()...)...)
		for _, tier := range []func(context.Context, *Volume) Outcome{dry.Restage, dry.LiveSwap} {
			o := tier(ctx, rv.vol)
			logOutcome(t, "dry-run", o)
			if o.Healed || o.Err != nil {
				t.Errorf("dry-run %s: healed %t, err %v; want a plan without errors", o.Tier, o.Healed, o.Err)
			}
			n := ops(o.Actions)
			if n[opUnmount] == 0 || n[opStage] != 1 || n[opPublish] != 2 || n[opOverMount] != 1 {
				t.Errorf("dry-run %s plan %v: want unmounts, a stage, two publishes, an over-mount", o.Tier, n)
			}
			if o.Tier == TierLiveSwap && n[opSwap] == 0 {
				t.Errorf("dry-run liveswap plans no swap")
			}
			for _, a := range o.Actions {
				if a.Op != opCheckDriver && a.Op != opFindProcesses && !a.DryRun {
					t.Errorf("dry-run action %v not marked dry-run", a)
				}
			}
		}
		if after := mountTables(t, append([]int{os.Getpid()}, rv.pids()...)...); after != before {
			t.Errorf("dry-run changed the mount tables")
		}
		wantDead(t, views[:2])
		if _, ls := repair(t, r, rv.vol); !ls.Healed {
			t.Fatalf("repair after the dry-run: %v", ls.Err)
		}
		wantViews(t, views)
	})

	t.Run("hung FUSE daemon: aborted, then repaired", func(t *testing.T) {
		// Every s3fs started for this staging path: one that an earlier
		// subtest's re-stage left serving a detached mount has the same
		// arguments, and stopping only it (the oldest) left the live one
		// answering: "state Healthy, want a broken one", now and then.
		daemons := s3fsOf(t, rv.staging)
		t.Logf("s3fs processes started for %s: %v", rv.staging, daemons)
		for _, s3fs := range daemons {
			if err := syscall.Kill(s3fs, syscall.SIGSTOP); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { syscall.Kill(s3fs, syscall.SIGKILL) })
		}
		// kill(2) returns once the stop is queued; a thread of s3fs running
		// on the other core can still answer the probe that follows (a
		// Healthy staging mount in 183 us on a loaded machine). Probe only
		// once every thread shows it stopped.
		for _, s3fs := range daemons {
			waitStopped(t, s3fs)
		}
		d.markDead(t, rv)
		if !rv.vol.Hung {
			t.Fatalf("the stopped s3fs did not make the volume hang")
		}
		re, ls := repair(t, r, rv.vol)
		if !re.Healed || !ls.Healed {
			t.Fatalf("repair of a hung volume: restage %v, liveswap %v", re.Err, ls.Err)
		}
		if ops(re.Actions)[opAbortFUSE] != 1 {
			t.Errorf("Restage of a hung volume: want one FUSE abort")
		}
		if ops(re.Actions)[opKillServer] != 1 {
			t.Errorf("Restage of a hung volume: want the s3fs serving it killed, got %v", ops(re.Actions))
		}
		wantViews(t, views)
		if got := rv.pids(); !slices.Equal(got, pids) {
			t.Errorf("container processes %v, were %v: restarted", got, pids)
		}

		// The stale daemons wake (a slow backend answers at last): the one
		// that served the aborted connection was killed, and whichever
		// wakes must not take the fresh staging mount with it (libfuse
		// lazily unmounts its mountpoint by path on its way out). The
		// staging path is polled every 10 ms for 3 s.
		fresh := topID(t, d.root, rv.staging)
		for _, s3fs := range daemons {
			syscall.Kill(s3fs, syscall.SIGCONT)
		}
		for end := time.Now().Add(3 * time.Second); time.Now().Before(end); time.Sleep(10 * time.Millisecond) {
			if id := topID(t, d.root, rv.staging); id != fresh {
				t.Fatalf("the staging path holds mount %d, not the fresh mount %d, after the stale s3fs woke", id, fresh)
			}
		}
		wantViews(t, views)
	})

	t.Run("symlink planted under a pod's volume dir: refused", func(t *testing.T) {
		uid := randomUID(t)
		target, outside := plantSymlink(t, d.root, string(uid), rv.pv)
		outBefore := outsideMounts(t, outside)
		d.drv.Kill()
		d.markDead(t, rv)
		d.restartDriver(t)
		bad := rv.vol.Pods[0].Publish
		bad.PodUID, bad.TargetPath = uid, target
		v := *rv.vol
		v.Pods = append(slices.Clone(rv.vol.Pods), PodVolume{Publish: bad})
		re, ls := repair(t, r, &v)
		for _, o := range []Outcome{re, ls} {
			if o.Healed || !errors.Is(o.Err, errUnsafePath) || !strings.Contains(o.Err.Error(), target) {
				t.Errorf("%s with a planted symlink: healed %t, err %v; want errUnsafePath naming %s", o.Tier, o.Healed, o.Err, target)
			}
		}
		// The other pods are repaired all the same; outside is untouched.
		wantViews(t, views)
		if after := outsideMounts(t, outside); !slices.Equal(after, outBefore) {
			t.Errorf("mounts at %s went from %v to %v", outside, outBefore, after)
		}
		if _, err := os.Stat(filepath.Join(outside, "data.txt")); err == nil {
			t.Errorf("the volume was published outside the kubelet root")
		}
	})
}

// waitStopped waits until every thread of pid is stopped (state T in
// /proc/<pid>/task/*/stat).
func waitStopped(t testing.TB, pid int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
		if err != nil {
			t.Fatalf("threads of %d: %v", pid, err)
		}
		running := 0
		for _, task := range tasks {
			stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/stat", pid, task.Name()))
			if err != nil {
				continue // the thread exited
			}
			// The state follows the command name in parentheses.
			if i := strings.LastIndexByte(string(stat), ')'); i < 0 || i+2 >= len(stat) || (stat[i+2] != 'T' && stat[i+2] != 't') {
				running++
			}
		}
		if running == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d threads of %d not stopped 10 s after SIGSTOP", running, pid)
		}
		time.Sleep(time.Millisecond)
	}
}

// s3fsOf finds the s3fs processes started for the mount at path.
func s3fsOf(t testing.TB, path string) []int { return daemonsOf(t, "s3fs", path) }

// daemonsOf finds the processes named name whose arguments hold path.
func daemonsOf(t testing.TB, name, path string) []int {
	t.Helper()
	entries, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmd, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(string(cmd), "\x00")
		if len(args) > 0 && filepath.Base(args[0]) == name && slices.Contains(args, path) {
			pids = append(pids, pid)
		}
	}
	if len(pids) == 0 {
		t.Fatalf("no %s serves %s", name, path)
	}
	return pids
}
