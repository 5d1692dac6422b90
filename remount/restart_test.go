package remount

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	corev1 "k8s.io/api/core/v1"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// The restart tier needs a container runtime and a kubelet that starts a
// stopped container again. Neither runs in this package's tests: fakeRuntime
// answers the CRI calls the Repairer makes (ListContainers, StopContainer,
// ContainerStatus) over a real unix socket, to the real CRIClient, for lab
// containers on real mounts, and the test plays kubelet: it starts a
// stopped container again with the binds kubelet would give it. The mounts,
// the driver and the verification are real; the runtime and kubelet are
// stand-ins.

type fakeRuntime struct {
	runtimeapi.UnimplementedRuntimeServiceServer
	mu      sync.Mutex
	ctrs    []*fakeCtr
	stopped chan *fakeCtr
	// stopErr, when set, fails every StopContainer and stops nothing.
	stopErr error
}

type fakeCtr struct {
	id, name, podUID string
	attempt          uint32
	running          bool
	c                *lab.Container
}

func startFakeRuntime(t testing.TB) (*fakeRuntime, string) {
	t.Helper()
	dir, err := os.MkdirTemp("", "mmcri")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "cri.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	rt := &fakeRuntime{stopped: make(chan *fakeCtr, 16)}
	srv := grpc.NewServer()
	runtimeapi.RegisterRuntimeServiceServer(srv, rt)
	go srv.Serve(ln)
	t.Cleanup(srv.Stop)
	return rt, "unix://" + sock
}

func (rt *fakeRuntime) add(c *fakeCtr) {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	rt.ctrs = append(rt.ctrs, c)
}

func (rt *fakeRuntime) ListContainers(_ context.Context, req *runtimeapi.ListContainersRequest) (*runtimeapi.ListContainersResponse, error) {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	resp := &runtimeapi.ListContainersResponse{}
	for _, c := range rt.ctrs {
		state := runtimeapi.ContainerState_CONTAINER_EXITED
		if c.running {
			state = runtimeapi.ContainerState_CONTAINER_RUNNING
		}
		f := req.GetFilter()
		if f.GetState() != nil && f.GetState().GetState() != state {
			continue
		}
		if uid, ok := f.GetLabelSelector()[criPodUIDLabel]; ok && uid != c.podUID {
			continue
		}
		resp.Containers = append(resp.Containers, &runtimeapi.Container{
			Id: c.id, State: state,
			Metadata: &runtimeapi.ContainerMetadata{Name: c.name, Attempt: c.attempt},
			Labels: map[string]string{criPodUIDLabel: c.podUID, criContainerNameLabel: c.name,
				criPodNameLabel: "pod", criPodNamespaceLabel: "default"},
		})
	}
	return resp, nil
}

func (rt *fakeRuntime) find(id string) *fakeCtr {
	for _, c := range rt.ctrs {
		if c.id == id {
			return c
		}
	}
	return nil
}

func (rt *fakeRuntime) StopContainer(_ context.Context, req *runtimeapi.StopContainerRequest) (*runtimeapi.StopContainerResponse, error) {
	rt.mu.Lock()
	c := rt.find(req.GetContainerId())
	if c == nil {
		rt.mu.Unlock()
		return nil, status.Errorf(codes.NotFound, "no container %s", req.GetContainerId())
	}
	if err := rt.stopErr; err != nil {
		rt.mu.Unlock()
		return nil, err
	}
	was := c.running
	c.running = false
	rt.mu.Unlock()
	if c.c != nil {
		c.c.Kill()
	}
	if was {
		rt.stopped <- c
	}
	return &runtimeapi.StopContainerResponse{}, nil
}

func (rt *fakeRuntime) ContainerStatus(_ context.Context, req *runtimeapi.ContainerStatusRequest) (*runtimeapi.ContainerStatusResponse, error) {
	rt.mu.Lock()
	defer rt.mu.Unlock()
	c := rt.find(req.GetContainerId())
	if c == nil || !c.running {
		return nil, status.Errorf(codes.NotFound, "no running container %s", req.GetContainerId())
	}
	return &runtimeapi.ContainerStatusResponse{
		Status: &runtimeapi.ContainerStatus{Id: c.id, State: runtimeapi.ContainerState_CONTAINER_RUNNING},
		Info:   map[string]string{"info": fmt.Sprintf(`{"pid":%d}`, c.c.Pid())},
	}, nil
}

// register adds the volume's running containers to the runtime.
func (rt *fakeRuntime) register(rv *realVolume) {
	for i, rp := range rv.pods {
		for _, cm := range rv.vol.Pods[i].Containers {
			if rt.find(cm.ContainerID) == nil {
				rt.add(&fakeCtr{id: cm.ContainerID, name: cm.Container, podUID: string(rp.uid), running: true, c: rp.ctrs[cm.Container]})
			}
		}
	}
}

// kubelet starts a stopped container again, as kubelet does under
// restartPolicy Always: a new container (new ID, next attempt) with the
// volume bound from the publish target and the subPath bind reused when it
// is there, made when it is not.
func (rt *fakeRuntime) kubelet(t testing.TB, d *driverLab, rv *realVolume, stopped *fakeCtr) {
	t.Helper()
	for _, rp := range rv.pods {
		if string(rp.uid) != stopped.podUID {
			continue
		}
		for _, def := range rp.def.ctrs {
			if def.name != stopped.name {
				continue
			}
			id := randomHex(t, 32)
			c := d.startContainer(t, rp, def, id)
			rp.ctrs[def.name] = c
			rt.add(&fakeCtr{id: id, name: def.name, podUID: string(rp.uid), attempt: stopped.attempt + 1, running: true, c: c})
		}
	}
}

// testRestartTier runs in TestRealDriver's lab.
func testRestartTier(t *testing.T, d *driverLab) {
	rt, endpoint := startFakeRuntime(t)
	r := d.repairer(t, Config{CRIEndpoint: endpoint, StopGrace: time.Second, RestartTimeout: failBound})
	const prefix = "vol2"
	rv := d.newVolume(t, prefix, podDef{name: "r", ctrs: []ctrDef{{name: "app", mounts: []corev1.VolumeMount{
		{Name: testVolumeName, MountPath: "/data"},
		{Name: testVolumeName, MountPath: "/data-sub", SubPath: "sub"},
	}}}})
	rt.register(rv)
	wantViews(t, rv.views(prefix))
	old := rv.pods[0].ctrs["app"].Pid()

	t.Run("containers run again on the fresh volume", func(t *testing.T) {
		d.drv.Kill()
		d.markDead(t, rv)
		wantDead(t, rv.views(prefix))
		d.restartDriver(t)

		outc := make(chan Outcome, 1)
		go func() { outc <- r.Restart(context.Background(), rv.vol) }()
		var o Outcome
		select {
		case stopped := <-rt.stopped:
			rt.kubelet(t, d, rv, stopped)
			o = <-outc
		case o = <-outc:
			t.Fatalf("Restart returned without stopping a container: healed %t, err %v", o.Healed, o.Err)
		case <-time.After(failBound):
			t.Fatalf("no container stopped")
		}
		logOutcome(t, "restart", o)
		if !o.Healed || o.Err != nil {
			t.Fatalf("Restart: healed %t, err %v", o.Healed, o.Err)
		}
		n := ops(o.Actions)
		if n[opStopContainer] != 1 || n[opWaitRunning] != 1 {
			t.Errorf("Restart actions %v: want one stop and one wait", n)
		}
		if got := rv.pods[0].ctrs["app"].Pid(); got == old {
			t.Errorf("container still runs as pid %d", old)
		}
		wantViews(t, rv.views(prefix))
	})

	t.Run("stop fails: nothing to wait for", func(t *testing.T) {
		rt.mu.Lock()
		rt.stopErr = status.Error(codes.Internal, "runtime says no")
		rt.mu.Unlock()
		defer func() {
			rt.mu.Lock()
			rt.stopErr = nil
			rt.mu.Unlock()
		}()
		// A wait for the container would last until RestartTimeout and end
		// in a wait action; a failed stop must end the tier at once.
		r := d.repairer(t, Config{CRIEndpoint: endpoint, StopGrace: time.Second, RestartTimeout: failBound})
		o := r.Restart(context.Background(), rv.vol)
		logOutcome(t, "restart, stop fails", o)
		n := ops(o.Actions)
		if o.Healed || status.Code(o.Err) != codes.Internal || n[opStopContainer] != 1 || n[opWaitRunning] != 0 {
			t.Errorf("Restart with a failing stop: healed %t, err %v, actions %v; want the stop's error and no wait", o.Healed, o.Err, n)
		}
	})

	t.Run("container not back: not verified", func(t *testing.T) {
		r := d.repairer(t, Config{CRIEndpoint: endpoint, StopGrace: time.Second, RestartTimeout: time.Second})
		o := r.Restart(context.Background(), rv.vol)
		logOutcome(t, "restart, no kubelet", o)
		select { // the test plays no kubelet this time
		case <-rt.stopped:
		case <-time.After(failBound):
			t.Fatalf("no container stopped")
		}
		if o.Healed || o.Err == nil || !strings.Contains(o.Err.Error(), "not running again") {
			t.Errorf("Restart with no container back: healed %t, err %v; want not verified", o.Healed, o.Err)
		}
	})
}

func TestUnmountTerminatingPod(t *testing.T) {
	for _, fault := range []string{"dead", "hung"} {
		t.Run(fault, func(t *testing.T) {
			lab.RequireRoot(t)
			k := newKubelet(t)
			root := k.Root()
			v := newLabVolume(t, k, labHandle, labVolume)
			tab := table(t, root)
			vol := &Volume{Driver: labDriver, VolumeHandle: labHandle, Backend: &probe.Backend{Dev: v.dev(), Kind: probe.BackendFUSE},
				Pods: []PodVolume{{Dead: []*probe.Mount{
					{ID: tab.top(v.target).ID, Path: v.target, Dev: v.dev()},
					{ID: tab.top(v.subPath).ID, Path: v.subPath, Dev: v.dev()},
				}}}}
			stagingID := tab.top(v.staging).ID
			if fault == "dead" {
				v.fs.Kill()
			} else {
				v.fs.Hang()
				vol.Hung = true
			}
			r, err := New(Config{KubeletRoot: root})
			if err != nil {
				t.Fatal(err)
			}
			done := make(chan Outcome, 1)
			go func() { done <- r.Unmount(context.Background(), vol) }()
			var o Outcome
			select {
			case o = <-done:
			case <-time.After(failBound):
				t.Fatalf("Unmount of a %s volume did not return", fault)
			}
			logOutcome(t, "unmount", o)
			if !o.Healed || o.Err != nil {
				t.Fatalf("Unmount: healed %t, err %v", o.Healed, o.Err)
			}
			n := ops(o.Actions)
			if n[opUnmount] != 2 || (fault == "hung") != (n[opAbortFUSE] == 1) {
				t.Errorf("Unmount actions %v: want two unmounts, and an abort when hung", n)
			}
			for _, p := range []string{v.target, v.subPath} {
				if id := topID(t, root, p); id != 0 {
					t.Errorf("mount %d still at %s", id, p)
				}
			}
			if id := topID(t, root, v.staging); id != stagingID {
				t.Errorf("staging mount %d became %d: Unmount must leave it to kubelet", stagingID, id)
			}
			again := r.Unmount(context.Background(), vol)
			if !again.Healed || ops(again.Actions)[opUnmount] != 0 {
				t.Errorf("second Unmount: healed %t, actions %v; want nothing to do", again.Healed, again.Actions)
			}
		})
	}
}

// testLiveSwapThroughCRI: where no cgroup names the pod, the container's
// process comes from the runtime's ContainerStatus. It runs in
// TestRealDriver's lab.
func testLiveSwapThroughCRI(t *testing.T, d *driverLab) {
	rt, endpoint := startFakeRuntime(t)
	const prefix = "vol3"
	rv := d.newVolume(t, prefix, podDef{name: "c", ctrs: []ctrDef{{name: "app", noCgroup: true, mounts: []corev1.VolumeMount{
		{Name: testVolumeName, MountPath: "/data"},
	}}}})
	rt.register(rv)
	d.drv.Kill()
	d.markDead(t, rv)
	d.restartDriver(t)

	// Without a runtime to ask, the container cannot be found.
	o := d.repairer(t, Config{}).LiveSwap(context.Background(), rv.vol)
	logOutcome(t, "liveswap without a runtime", o)
	if o.Healed || o.Err == nil || !strings.Contains(o.Err.Error(), "no process of its containers found") {
		t.Errorf("LiveSwap without cgroup or runtime: healed %t, err %v; want no process found", o.Healed, o.Err)
	}
	withCRI := d.repairer(t, Config{CRIEndpoint: endpoint})
	o = withCRI.LiveSwap(context.Background(), rv.vol)
	logOutcome(t, "liveswap", o)
	if !o.Healed || o.Err != nil {
		t.Fatalf("LiveSwap through the runtime: healed %t, err %v", o.Healed, o.Err)
	}
	i := slices.IndexFunc(o.Actions, func(a Action) bool { return a.Op == opFindProcesses })
	if i < 0 || !strings.Contains(o.Actions[i].Detail, "from the runtime") {
		t.Errorf("find-processes action %v: want processes from the runtime", o.Actions)
	}
	wantViews(t, rv.views(prefix))
}

// TestRestarterStopsNamedContainers: Restart stops the named running
// containers of the pod (all at once), reports the ones it stopped in the
// runtime's order, skips a name no running container has, and leaves the
// pod's other containers and other pods alone.
func TestRestarterStopsNamedContainers(t *testing.T) {
	rt, endpoint := startFakeRuntime(t)
	const pod, other = "11111111-2222-3333-4444-555555555555", "66666666-7777-8888-9999-000000000000"
	for _, c := range []*fakeCtr{
		{id: "ctr-app", name: "app", podUID: pod, running: true},
		{id: "ctr-side", name: "side", podUID: pod, running: true},
		{id: "ctr-keep", name: "keep", podUID: pod, running: true},
		{id: "ctr-other", name: "app", podUID: other, running: true},
	} {
		rt.add(c)
	}
	ctx := context.Background()
	cri, err := DialCRI(ctx, endpoint, CRIOptions{Timeout: failBound})
	if err != nil {
		t.Fatal(err)
	}
	defer cri.Close()
	r := &Restarter{CRI: cri, Grace: time.Second}
	stopped, acts, err := r.Restart(ctx, pod, "app", "side", "absent")
	if err != nil {
		t.Fatalf("Restart = %v", err)
	}
	var ids []string
	for _, c := range stopped {
		ids = append(ids, c.ID)
	}
	if want := []string{"ctr-app", "ctr-side"}; !slices.Equal(ids, want) {
		t.Errorf("stopped = %v, want %v", ids, want)
	}
	if n := ops(acts); n[opStopContainer] != 2 || n[opSkip] != 1 {
		t.Errorf("actions = %v, want 2 stops and 1 skip", acts)
	}
	rt.mu.Lock()
	defer rt.mu.Unlock()
	for id, want := range map[string]bool{"ctr-app": false, "ctr-side": false, "ctr-keep": true, "ctr-other": true} {
		if got := rt.find(id).running; got != want {
			t.Errorf("container %s running = %v, want %v", id, got, want)
		}
	}
}
