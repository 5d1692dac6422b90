//go:build guest

package agent_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/moby/sys/mountinfo"
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

// The agent over NBD volumes on a real nbd driver (the guest of
// scripts/guest: go test ./scripts/guest -run TestInGuest/agent): the lab
// NBD driver (ceph-csi RBD's rbd-nbd contract, nbdkit as the daemon) on
// the lab kubelet root's socket, the pods, claims and volumes in a real API
// server (the host's, through kubetest's broker), and a lab container per
// pod holding a private bind of its publish target. The agent runs its
// whole loop: informers, probes, strikes, the ladder (re-attach first for
// ceph-csi's rbd-nbd volumes), events.

// nbdAgentMapOptions are the lab's device settings: rbd-nbd's
// dead-connection hold (--reattach-timeout), within which a re-attach
// finds the kernel device, its filesystem and the pods' binds as they
// were, and an I/O timeout.
var nbdAgentMapOptions = csilab.NBDOptions{IOTimeout: 15 * time.Second, DeadConnTimeout: 90 * time.Second}

// nbdEnv is env with the lab NBD driver and its CSIDriver object.
type nbdEnv struct {
	*env
	drv *csilab.NBDDriver
}

func newNBDEnv(t testing.TB, opts ...csilab.NBDDriverOption) *nbdEnv {
	t.Helper()
	lab.RequireRoot(t)
	if _, err := os.Stat("/sys/module/nbd"); err != nil {
		lab.SkipOrFail(t, "no nbd driver (%v): these tests run in the guest of scripts/guest", err)
	}
	e := newEnv(t, nil)
	sock := filepath.Join(e.kubelet.Root(), "plugins", csilab.NBDDriverName, "csi.sock")
	drv := csilab.StartNBDDriver(t, sock, append([]csilab.NBDDriverOption{csilab.WithNBDOptions(nbdAgentMapOptions)}, opts...)...)
	attach := false
	if _, err := e.admin.StorageV1().CSIDrivers().Create(context.Background(), &storagev1.CSIDriver{
		ObjectMeta: metav1.ObjectMeta{Name: csilab.NBDDriverName},
		Spec:       storagev1.CSIDriverSpec{AttachRequired: &attach},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create CSIDriver: %v", err)
	}
	return &nbdEnv{env: e, drv: drv}
}

// nbdVolume is an rbd-nbd volume of the lab driver, the pod that uses it
// and its container.
type nbdVolume struct {
	id      string
	pod     *corev1.Pod
	pvc     *corev1.PersistentVolumeClaim
	mount   string // the driver's mount, <staging>/<volumeID>
	target  string
	app     *lab.Container
	ack     []byte // written and fsync'd before any fault
	dev     string // major:minor of the device under mount
	mountID int
}

// newVolume creates the Secret, a static PV with ceph-csi RBD's rbd-nbd
// attributes, its bound PVC and a Running pod owned by a ReplicaSet; stages
// and publishes it through the driver with the request kubelet would build
// from those objects; writes and fsyncs the acknowledged file and starts
// the pod's container.
func (e *nbdEnv) newVolume(name string) *nbdVolume {
	t := e.t
	t.Helper()
	ctx := context.Background()
	secret := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Namespace: testNamespace, Name: "rbd-" + name},
		StringData: map[string]string{"userID": "lab", "userKey": "secret"}}
	if _, err := e.admin.CoreV1().Secrets(testNamespace).Create(ctx, secret, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create Secret: %v", err)
	}
	id := "0001-" + name
	v := e.createVolume(name, func(pv *corev1.PersistentVolume) {
		pv.Spec.CSI = &corev1.CSIPersistentVolumeSource{Driver: csilab.NBDDriverName, VolumeHandle: id, FSType: "ext4",
			VolumeAttributes:   map[string]string{"mounter": "rbd-nbd", "pool": "lab", "imageName": "csi-vol-" + name},
			NodeStageSecretRef: &corev1.SecretReference{Namespace: testNamespace, Name: secret.Name}}
	})
	labels := map[string]string{"app": name}
	pod := e.createPod(name, v, podOptions{owner: e.replicaSet("rs-"+name, labels), labels: labels})

	c, err := remount.DialCSI(ctx, e.drv.Socket(), remount.CSIOptions{StageTimeout: 3 * time.Minute, PublishTimeout: time.Minute})
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
	driverObj, err := e.admin.StorageV1().CSIDrivers().Get(ctx, csilab.NBDDriverName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	vr, err := kubelet.BuildVolumeRequest(kubelet.VolumeObjects{Pod: pod, VolumeName: "data", PVC: v.pvc, PV: pvObj,
		CSIDriver: driverObj, StageSecret: secretObj, Capabilities: caps, KubeletRoot: e.kubelet.Root()})
	if err != nil {
		t.Fatal(err)
	}
	if staging := e.kubelet.StagingPath(csilab.NBDDriverName, id); vr.StagingPath != staging {
		t.Fatalf("request staging path %s, kubelet's %s", vr.StagingPath, staging)
	}
	if err := c.NodeStageVolume(ctx, kubelet.StageRequest(vr)); err != nil {
		t.Fatalf("NodeStageVolume: %v", err)
	}
	target := e.kubelet.PreparePublish(string(pod.UID), pvObj.Name, csilab.NBDDriverName, id)
	if err := c.NodePublishVolume(ctx, kubelet.PublishRequest(vr)); err != nil {
		t.Fatalf("NodePublishVolume: %v", err)
	}
	s := &nbdVolume{id: id, pod: pod, pvc: v.pvc, mount: filepath.Join(vr.StagingPath, id), target: target}
	s.ack = make([]byte, 128<<10)
	_, _ = rand.Read(s.ack)
	if err := writeSynced(filepath.Join(target, "acked"), s.ack); err != nil {
		t.Fatalf("acknowledged write: %v", err)
	}
	s.app = lab.StartContainer(t, "app-"+name, lab.PropagationPrivate, map[string]string{"/data": target},
		lab.WithChroot(), lab.WithPodCgroup(string(pod.UID), strings.Repeat("ab", 32)))
	s.dev, s.mountID = mountAt(t, s.mount)
	return s
}

// readerOK is the container-side reader: the acknowledged data read back
// uncached through the container's own bind, and a new write acknowledged.
func (s *nbdVolume) readerOK() error {
	got, err := readUncached(s.app.Path("/data/acked"))
	if err != nil {
		return fmt.Errorf("%s: the container reads its volume: %w", s.id, err)
	}
	if !bytes.Equal(got, s.ack) {
		return fmt.Errorf("%s: the container reads %d bytes of the acknowledged file, not the %d written before the fault", s.id, len(got), len(s.ack))
	}
	if err := writeSynced(s.app.Path("/data/after-heal"), []byte("ok")); err != nil {
		return fmt.Errorf("%s: the container writes its volume: %w", s.id, err)
	}
	return nil
}

// readerBack runs readerOK until it passes, each try on its own goroutine
// (a read of a device whose daemon died waits for the re-attach), and
// returns when it passed, or the last error after limit.
func (s *nbdVolume) readerBack(start time.Time, limit time.Duration) (time.Duration, error) {
	var last error
	for time.Since(start) < limit {
		done := make(chan error, 1)
		go func() { done <- s.readerOK() }()
		select {
		case err := <-done:
			if err == nil {
				return time.Since(start), nil
			}
			last = err
			time.Sleep(50 * time.Millisecond)
		case <-time.After(time.Until(start.Add(limit))):
			return 0, fmt.Errorf("%s: the container's read still blocked %v after the fault", s.id, limit)
		}
	}
	return 0, last
}

// wantKept checks the heal kept what the container had: the same pod and
// container process, the same device under the same mount, one mount at
// the driver's path and at the publish target.
func (e *nbdEnv) wantKept(s *nbdVolume, appPid int) {
	t := e.t
	t.Helper()
	if s.app.Pid() != appPid {
		t.Errorf("%s: the container was restarted (pid %d, was %d); a re-attach heals in place", s.id, s.app.Pid(), appPid)
	}
	pod, err := e.admin.CoreV1().Pods(testNamespace).Get(context.Background(), s.pod.Name, metav1.GetOptions{})
	if err != nil || pod.UID != s.pod.UID || pod.DeletionTimestamp != nil {
		t.Errorf("%s: pod after the heal: %v (err %v); want the same pod, not deleted", s.id, pod.GetUID(), err)
	}
	if dev, id := mountAt(t, s.mount); dev != s.dev || id != s.mountID {
		t.Errorf("%s: mount %d on %s after the heal, want the same mount %d on %s", s.id, id, dev, s.mountID, s.dev)
	}
	for _, p := range []string{s.mount, s.target} {
		if n := len(mountsAt(t, p)); n != 1 {
			t.Errorf("%s: %d mounts at %s after the heal, want 1", s.id, n, p)
		}
	}
}

// mountAt is the device and the ID of the top mount at path.
func mountAt(t testing.TB, path string) (dev string, id int) {
	t.Helper()
	ms := mountsAt(t, path)
	if len(ms) == 0 {
		t.Fatalf("nothing mounted at %s", path)
	}
	top := ms[len(ms)-1]
	return fmt.Sprintf("%d:%d", top.Major, top.Minor), top.ID
}

func mountsAt(t testing.TB, path string) []*mountinfo.Info {
	t.Helper()
	ms, err := mountinfo.GetMounts(mountinfo.SingleEntryFilter(path))
	if err != nil {
		t.Fatal(err)
	}
	return ms
}

// connectedNBD counts the nbd devices with a size (mapped).
func connectedNBD() int {
	ms, _ := filepath.Glob("/sys/block/nbd*/size")
	n := 0
	for _, m := range ms {
		if raw, err := os.ReadFile(m); err == nil && strings.TrimSpace(string(raw)) != "0" {
			n++
		}
	}
	return n
}

func writeSynced(path string, data []byte) error {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// readUncached reads a file after dropping its clean pages, so the read
// reaches the device.
func readUncached(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	_ = unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED)
	var buf bytes.Buffer
	_, err = buf.ReadFrom(f)
	return buf.Bytes(), err
}

// nbdConfig is the agent configuration of the tests: the tests' own (fast
// backoff), with a probe cycle every half second: under emulation a cycle
// every 100 ms takes the guest's CPU from the daemons it probes.
func (e *nbdEnv) nbdConfig() agent.Config {
	cfg := e.config()
	cfg.ProbeInterval = 500 * time.Millisecond
	return cfg
}

// defaultConfig is the agent's default configuration on the lab's node and
// kubelet root, for the figures: everything that times a heal (probe
// interval and deadline, strikes, resync, backoff, concurrency) as shipped.
func (e *nbdEnv) defaultConfig() agent.Config {
	cfg := agent.DefaultConfig()
	cfg.NodeName, cfg.KubeletRoot, cfg.MetricsAddr, cfg.Version = e.node, e.kubelet.Root(), "", "test"
	return cfg
}

// TestAgentHealsNBD runs the agent over rbd-nbd volumes of the lab NBD
// driver: one volume's daemon is killed with the plugin up (which
// ceph-csi's own healer never sees), then the node plugin restarts with
// every daemon (3 volumes). Each is
// healed by the re-attach alone: the same pod and container process, the
// data fsync'd before the fault read back uncached through the container's
// bind, a new write acknowledged, the same kernel device under the same
// mount, no second device or mount, nothing staged again; a VolumeRepaired
// event on the pod.
func TestAgentHealsNBD(t *testing.T) {
	const n = 3
	e := newNBDEnv(t)
	var vs []*nbdVolume
	for i := range n {
		vs = append(vs, e.newVolume(fmt.Sprintf("v%02d", i)))
	}
	pids := map[string]int{}
	for _, s := range vs {
		if err := s.readerOK(); err != nil {
			t.Fatalf("before the fault: %v", err)
		}
		pids[s.id] = s.app.Pid()
	}
	cfg := e.nbdConfig()
	a := e.startAgent(cfg, e.withRepairer(cfg, remount.Config{}, agent.Deps{}))
	devices, stages := connectedNBD(), e.drv.Stages

	killed := vs[0]
	old := e.drv.Daemon(killed.id)
	start := time.Now()
	old.Kill()
	took, err := killed.readerBack(start, 3*time.Minute)
	if err != nil {
		t.Fatalf("daemon killed: %v", err)
	}
	asked := e.drv.Daemon(killed.id) != old
	e.wantKept(killed, pids[killed.id])
	ev := e.waitEvent(killed.pod.UID, string(agent.ReasonVolumeRepaired), "reattach")
	t.Logf("nbd figures: agent, daemon killed: the container reads and writes again %v after the kill; %s %q",
		took.Round(time.Millisecond), ev.Reason, ev.Note)
	if !asked {
		t.Errorf("%s: the driver's daemon is the killed one; want a fresh one from the re-attach", killed.id)
	}

	start = time.Now()
	if err := e.drv.Restart(); err != nil {
		t.Fatal(err)
	}
	var (
		mu    sync.Mutex
		wg    sync.WaitGroup
		times []time.Duration
	)
	for _, s := range vs {
		wg.Go(func() {
			took, err := s.readerBack(start, 3*time.Minute)
			if err != nil {
				t.Errorf("plugin restarted: %v", err)
				return
			}
			mu.Lock()
			times = append(times, took)
			mu.Unlock()
		})
	}
	wg.Wait()
	for _, s := range vs {
		e.wantKept(s, pids[s.id])
	}
	if got := connectedNBD(); got != devices {
		t.Errorf("%d nbd devices mapped after the heals, want %d as before", got, devices)
	}
	if e.drv.Stages != stages {
		t.Errorf("the driver staged %d times during the heals, want 0 (re-attaches only)", e.drv.Stages-stages)
	}
	if got, _ := a.metric(`mountmedic_repairs_total{result="success",tier="reattach"}`); got < float64(n+1) {
		t.Errorf("repairs_total{reattach,success} = %v, want at least %d", got, n+1)
	}
	for _, tier := range []string{"restage", "liveswap", "restart", "evict"} {
		if got, _ := a.metric(`mountmedic_repairs_total{result="success",tier="` + tier + `"}`); got != 0 {
			t.Errorf("repairs_total{%s,success} = %v, want 0: the re-attach heals in place", tier, got)
		}
	}
	slices.Sort(times)
	if len(times) > 0 {
		t.Logf("nbd figures: agent, plugin restarted with %d volumes: all containers read and write again %v after the restart (first %v)",
			n, times[len(times)-1].Round(time.Millisecond), times[0].Round(time.Millisecond))
	}
}

// TestAgentNBDFigures are issue 24's NBD figures with the agent at its
// defaults; they run only when asked (the test does nothing without its
// settings):
//
//   - MOUNTMEDIC_NBD_KILLS=n: one volume's daemon killed n times with the
//     plugin up; each time, from the kill to the driver's fresh daemon
//     for it (detection: probes, strikes; then the run's start, its device
//     check and the daemon's start) and on to the container reading its
//     acknowledged data again and writing (the re-attach and its checks);
//   - MOUNTMEDIC_NBD_VOLUMES=n: the node plugin restarted with n volumes
//     staged (every daemon dies), healed by the agent ("agent"), and
//     the same with only ceph-csi's healer: the driver re-attaches every
//     volume it staged as it starts, no agent runs ("healer").
func TestAgentNBDFigures(t *testing.T) {
	kills, _ := strconv.Atoi(os.Getenv("MOUNTMEDIC_NBD_KILLS"))
	vols, _ := strconv.Atoi(os.Getenv("MOUNTMEDIC_NBD_VOLUMES"))
	if kills <= 0 && vols <= 0 {
		t.Log("neither MOUNTMEDIC_NBD_KILLS nor MOUNTMEDIC_NBD_VOLUMES is set: nothing measured")
		return
	}
	if kills > 0 {
		t.Run("kill", func(t *testing.T) {
			e := newNBDEnv(t)
			s := e.newVolume("killed")
			cfg := e.defaultConfig()
			e.startAgent(cfg, e.withRepairer(cfg, remount.Config{}, agent.Deps{}))
			pid := s.app.Pid()
			var total, detect []time.Duration
			for i := range kills {
				old := e.drv.Daemon(s.id)
				start := time.Now()
				asked := e.watchDaemons(start, s)
				old.Kill()
				took, err := s.readerBack(start, 3*time.Minute)
				if err != nil {
					t.Fatalf("kill %d: %v", i, err)
				}
				d := (<-asked)[s.id]
				total, detect = append(total, took), append(detect, d)
				t.Logf("nbd figures: kill %d: the fresh daemon up %v after the kill, the container reads and writes %v after it",
					i, d.Round(time.Millisecond), took.Round(time.Millisecond))
				e.wantKept(s, pid)
				// The next kill after the agent's volume state settled
				// (its probes of the healed device answered).
				time.Sleep(3 * cfg.ProbeInterval)
			}
			t.Logf("nbd figures: agent defaults, daemon killed %d times: kill -> reads and writes p50 %v p99 %v max %v; kill -> fresh daemon up p50 %v p99 %v; -> reads p50 %v",
				kills, pct(total, 0.5), pct(total, 0.99), pct(total, 1), pct(detect, 0.5), pct(detect, 0.99), pct(diffs(total, detect), 0.5))
		})
	}
	if vols > 0 {
		for _, mode := range []string{"agent", "healer"} {
			t.Run("restart/"+mode, func(t *testing.T) {
				var opts []csilab.NBDDriverOption
				if mode == "healer" {
					opts = append(opts, csilab.WithHealAtStart())
				}
				e := newNBDEnv(t, opts...)
				var vs []*nbdVolume
				for i := range vols {
					vs = append(vs, e.newVolume(fmt.Sprintf("r%02d", i)))
				}
				if mode == "agent" {
					cfg := e.defaultConfig()
					e.startAgent(cfg, e.withRepairer(cfg, remount.Config{}, agent.Deps{}))
				}
				start := time.Now()
				asked := e.watchDaemons(start, vs...)
				if err := e.drv.Restart(); err != nil {
					t.Fatal(err)
				}
				restarted := time.Since(start)
				var (
					mu    sync.Mutex
					wg    sync.WaitGroup
					times = map[string]time.Duration{}
				)
				for _, s := range vs {
					wg.Go(func() {
						took, err := s.readerBack(start, 5*time.Minute)
						if err != nil {
							t.Errorf("%s: %v", mode, err)
							return
						}
						mu.Lock()
						times[s.id] = took
						mu.Unlock()
					})
				}
				wg.Wait()
				at := <-asked
				var total, ask []time.Duration
				for _, s := range vs {
					total, ask = append(total, times[s.id]), append(ask, at[s.id])
					// Past the agent's event burst its events come
					// summed up: a volume's own may be missing.
					note := ""
					for _, ev := range e.eventsOf(s.pod.UID) {
						if ev.Reason == string(agent.ReasonVolumeRepaired) {
							note = ev.Note
						}
					}
					t.Logf("nbd figures: %s %s: fresh daemon up %v, reads and writes %v after the restart %s", mode, s.id,
						at[s.id].Round(time.Millisecond), times[s.id].Round(time.Millisecond), note)
				}
				t.Logf("nbd figures: plugin restart, %d volumes, %s: all read and write again %v after the restart (first %v, p50 %v); fresh daemons up from %v to %v; the driver's restart returned after %v",
					vols, mode, pct(total, 1), pct(total, 0), pct(total, 0.5), pct(ask, 0), pct(ask, 1), restarted.Round(time.Millisecond))
			})
		}
	}
}

// watchDaemons watches the volumes' daemons from start, and sends on the
// channel returned, once each volume's daemon was replaced (the driver
// was asked to re-attach: it starts a fresh daemon first) or after five
// minutes, when each was first seen replaced.
func (e *nbdEnv) watchDaemons(start time.Time, vs ...*nbdVolume) <-chan map[string]time.Duration {
	olds := map[string]*csilab.NBDDaemon{}
	for _, s := range vs {
		olds[s.id] = e.drv.Daemon(s.id)
	}
	out := make(chan map[string]time.Duration, 1)
	go func() {
		at := map[string]time.Duration{}
		for len(at) < len(vs) && time.Since(start) < 5*time.Minute {
			for _, s := range vs {
				if _, ok := at[s.id]; !ok {
					if d := e.drv.Daemon(s.id); d != nil && d != olds[s.id] {
						at[s.id] = time.Since(start)
					}
				}
			}
			time.Sleep(10 * time.Millisecond)
		}
		out <- at
	}()
	return out
}

// pct is the q-quantile of ds (0: the least, 1: the greatest), rounded.
func pct(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[min(len(s)-1, int(q*float64(len(s))))].Round(time.Millisecond)
}

// diffs is a[i]-b[i].
func diffs(a, b []time.Duration) []time.Duration {
	out := make([]time.Duration, len(a))
	for i := range a {
		out[i] = a[i] - b[i]
	}
	return out
}
