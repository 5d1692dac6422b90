package remount

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"github.com/moby/sys/mountinfo"
	"google.golang.org/grpc"
	"k8s.io/apimachinery/pkg/types"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/scripts/lab"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// Unit tests of the Repairer's pure logic; the tiers themselves are tested
// on real mounts (root_test.go, driver_test.go, restart_test.go).

func TestBuildHostTable(t *testing.T) {
	const root = "/var/lib/kubelet"
	pub := root + "/pods/u1/volumes/kubernetes.io~csi/pv/mount"
	stg := root + "/plugins/kubernetes.io/csi/d/0000000000000000000000000000000000000000000000000000000000000000/globalmount"
	infos := []*mountinfo.Info{
		// Listed out of order on purpose: the stack follows parent IDs.
		{ID: 30, Parent: 20, Major: 0, Minor: 52, Root: "/", Mountpoint: pub, FSType: "fuse.s3fs"},
		{ID: 20, Parent: 10, Major: 0, Minor: 50, Root: "/", Mountpoint: pub, FSType: "fuse.s3fs"},
		{ID: 10, Parent: 1, Major: 8, Minor: 1, Root: "/var/lib/kubelet", Mountpoint: root + "/pods", FSType: "ext4"},
		{ID: 40, Parent: 30, Major: 0, Minor: 53, Root: "/", Mountpoint: pub, FSType: "fuse.s3fs"},
		{ID: 50, Parent: 1, Major: 0, Minor: 52, Root: "/", Mountpoint: stg, FSType: "fuse.s3fs"},
	}
	tab := buildHostTable(probe.Build(infos, "test", probe.Options{Root: root}))
	var ids []int
	for _, m := range tab.stack(pub) {
		ids = append(ids, m.ID)
	}
	if want := []int{20, 30, 40}; !slices.Equal(ids, want) {
		t.Errorf("stack(%s) = %v, want %v (bottom first)", pub, ids, want)
	}
	if top := tab.top(pub); top == nil || top.ID != 40 {
		t.Errorf("top(%s) = %v, want mount 40", pub, top)
	}
	if top := tab.top(root + "/nothing"); top != nil {
		t.Errorf("top of a path with no mount = %v, want nil", top)
	}
	if k := tab.top(stg).Target.Kind; k != kubelet.KindStaging {
		t.Errorf("staging mount classified %s", k)
	}
	for _, tc := range []struct {
		name string
		dead devSet
		want []int
	}{
		{"top dead", devSet{{Major: 0, Minor: 53}: true}, []int{40}},
		{"top two dead", devSet{{Major: 0, Minor: 53}: true, {Major: 0, Minor: 52}: true}, []int{40, 30}},
		{"top alive", devSet{{Major: 0, Minor: 50}: true}, nil},
	} {
		var got []int
		for _, m := range tab.deadTop(pub, tc.dead) {
			got = append(got, m.ID)
		}
		if !slices.Equal(got, tc.want) {
			t.Errorf("%s: deadTop = %v, want %v (topmost first, stop at the first live one)", tc.name, got, tc.want)
		}
	}
}

func TestSnapshotFindsPodContainers(t *testing.T) {
	const (
		uid  = "3f0c9a52-5a1b-4c33-9d0e-0c6a1f3b2e44"
		uidU = "3f0c9a52_5a1b_4c33_9d0e_0c6a1f3b2e44"
		id1  = "4f1c2d3e4a5b6c7d8e9f00112233445566778899aabbccddeeff001122334455"
		id2  = "aa1c2d3e4a5b6c7d8e9f00112233445566778899aabbccddeeff0011223344bb"
		id3  = "cc1c2d3e4a5b6c7d8e9f00112233445566778899aabbccddeeff0011223344dd"
	)
	proc := t.TempDir()
	for pid, cgroup := range map[string]string{
		// cgroupfs, v1 and v2 lines.
		"100": "4:memory:/kubepods/besteffort/pod" + uid + "/" + id1 + "\n0::/kubepods/besteffort/pod" + uid + "/" + id1 + "\n",
		// systemd driver, containerd.
		"101": "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + uidU + ".slice/cri-containerd-" + id2 + ".scope\n",
		// the sandbox: the pod's cgroup only.
		"102": "0::/kubepods/besteffort/pod" + uid + "/" + "sandbox0123456789abcdef\n",
		// another pod, a container ID that only starts like id3.
		"103": "0::/kubepods/besteffort/pod11111111-2222-3333-4444-555555555555/" + id3 + "0\n",
		// not a pod at all.
		"104":  "0::/system.slice/podman.service\n",
		"self": "0::/\n",
	} {
		if err := os.MkdirAll(filepath.Join(proc, pid), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(proc, pid, "cgroup"), []byte(cgroup), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	snap, err := takeSnapshot(proc)
	if err != nil {
		t.Fatal(err)
	}
	got := snap.podProcs(map[types.UID][]string{uid: {id1, id2, id3}, "11111111-2222-3333-4444-555555555555": {id3}})
	pp := got[uid]
	if want := []int{100, 101, 102}; !slices.Equal(pp.pids, want) {
		t.Errorf("pod processes = %v, want %v", pp.pids, want)
	}
	want := map[string]int{id1: 100, id2: 101}
	if len(pp.byContainer) != len(want) || pp.byContainer[id1] != 100 || pp.byContainer[id2] != 101 {
		t.Errorf("container processes = %v, want %v", pp.byContainer, want)
	}
	if other := got["11111111-2222-3333-4444-555555555555"]; len(other.byContainer) != 0 || !slices.Equal(other.pids, []int{103}) {
		t.Errorf("other pod: %+v; want pid 103 and no container (its cgroup is %s0, not %s)", other, id3, id3)
	}
	if pids, err := PodPIDs(proc, uid); err != nil || !slices.Equal(pids, []int{100, 101, 102}) {
		t.Errorf("PodPIDs(%s) = %v, %v; want [100 101 102]", uid, pids, err)
	}
	if _, err := PodPIDs(proc, "../pod"); err == nil {
		t.Errorf("PodPIDs of a malformed UID: want an error")
	}
	for _, seg := range []string{"kubepods", "kubepods.slice", "kubepods-besteffort.slice", "podman.service", "pod", "poda-b"} {
		if uid, ok := podOfSegment(seg); ok {
			t.Errorf("podOfSegment(%q) = %q, want no pod", seg, uid)
		}
	}
}

func TestDeadDevs(t *testing.T) {
	v := &Volume{Backend: &probe.Backend{Dev: probe.Dev{Major: 0, Minor: 50}}, Pods: []PodVolume{
		{Dead: []*probe.Mount{{Dev: probe.Dev{Major: 0, Minor: 50}}, {Dev: probe.Dev{Major: 0, Minor: 51}}, nil}},
		{Dead: []*probe.Mount{{Path: "/missing"}}}, // a publish target without its mount: 0:0
	}}
	got := deadDevs(v).list()
	want := []probe.Dev{{Major: 0, Minor: 50}, {Major: 0, Minor: 51}}
	if !slices.Equal(got, want) {
		t.Errorf("deadDevs = %v, want %v", got, want)
	}
}

func TestNewChecksKubeletRoot(t *testing.T) {
	dir := t.TempDir()
	link := filepath.Join(dir, "link")
	if err := os.Symlink(dir, link); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, root string
		ok         bool
	}{
		{"relative", "var/lib/kubelet", false},
		{"symlink", link, false},
		{"directory", dir, true},
		{"missing is fine", filepath.Join(dir, "later"), true},
	} {
		r, err := New(Config{KubeletRoot: tc.root})
		if (err == nil) != tc.ok {
			t.Errorf("%s: New(%q) = %v, want ok %t", tc.name, tc.root, err, tc.ok)
		}
		if r != nil {
			r.Close()
		}
	}
}

// recordingSys counts the calls that would change a mount.
func recordingSys(n *atomic.Int32) Syscalls {
	count := func() error { n.Add(1); return errors.New("must not be called") }
	return Syscalls{
		Unmount:   func(string, int) error { return count() },
		Mount:     func(string, string, string, uintptr, string) error { return count() },
		WriteFile: func(string, []byte) error { return count() },
	}
}

// TestRestageDriverDownChangesNothing: a volume whose FUSE daemon died,
// with its staging mount, publish target and subPath bind under the kubelet
// root, and no driver registered: no tier unmounts, mounts or aborts
// anything.
func TestRestageDriverDownChangesNothing(t *testing.T) {
	lab.RequireRoot(t)
	k := newKubelet(t)
	root := k.Root()
	lv := newLabVolume(t, k, labHandle, labVolume)
	tab := table(t, root)
	dead := []*probe.Mount{
		{ID: tab.top(lv.target).ID, Path: lv.target, Dev: lv.dev(), Target: kubelet.Target{Kind: kubelet.KindPublish, PodUID: labPod}},
		{ID: tab.top(lv.subPath).ID, Path: lv.subPath, Dev: lv.dev(), Target: kubelet.Target{Kind: kubelet.KindSubPath, PodUID: labPod}},
	}
	lv.fs.Kill()
	var changes atomic.Int32
	var finds atomic.Int32
	r, err := New(Config{KubeletRoot: root, Sys: recordingSys(&changes),
		FindDriver: func(ctx context.Context, kubeletRoot, driver string) (Endpoint, error) {
			finds.Add(1)
			return FindDriver(ctx, kubeletRoot, driver) // nothing registered: not found
		}})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	vr := kubelet.VolumeRequest{Driver: labDriver, VolumeHandle: labHandle, StageUnstage: true,
		StagingPath: lv.staging, TargetPath: lv.target, PodUID: labPod}
	v := &Volume{Driver: vr.Driver, VolumeHandle: vr.VolumeHandle, Stage: vr, Hung: true,
		Backend: &probe.Backend{Dev: lv.dev(), Kind: probe.BackendFUSE},
		Pods:    []PodVolume{{Publish: vr, Dead: dead}}}
	before := mountTables(t, os.Getpid())
	for _, tier := range []func(context.Context, *Volume) Outcome{r.Restage, r.LiveSwap, r.Restart} {
		o := tier(context.Background(), v)
		if !errors.Is(o.Err, ErrDriverUnavailable) || !errors.Is(o.Err, errDriverNotFound) || o.Healed {
			t.Errorf("%s with no driver: healed %t, err %v; want ErrDriverUnavailable and errDriverNotFound", o.Tier, o.Healed, o.Err)
		}
	}
	if n := changes.Load(); n != 0 {
		t.Errorf("%d mount changes with the driver down, want none", n)
	}
	if after := mountTables(t, os.Getpid()); after != before {
		t.Errorf("the mount table changed with the driver down")
	}
	// Each call looks for the driver afresh: it may have registered since.
	if n := finds.Load(); n < 3 {
		t.Errorf("FindDriver called %d times over three calls", n)
	}
}

func TestBlockVolumeLeftToEviction(t *testing.T) {
	r, err := New(Config{KubeletRoot: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	v := &Volume{Driver: "d", VolumeHandle: "h", Stage: kubelet.VolumeRequest{Block: true}}
	var wg sync.WaitGroup
	for _, tier := range []func(context.Context, *Volume) Outcome{r.Restage, r.LiveSwap, r.Restart} {
		wg.Go(func() {
			o := tier(context.Background(), v)
			if !errors.Is(o.Err, errBlockVolume) || o.Healed {
				t.Errorf("%s of a block volume: healed %t, err %v; want errBlockVolume", o.Tier, o.Healed, o.Err)
			}
		})
	}
	wg.Wait()
}

// TestDriverReRegistersElsewhere: the Repairer keeps the endpoint it found,
// and finds it again when the driver stops answering there, as after a
// restart that registered another socket.
func TestDriverReRegistersElsewhere(t *testing.T) {
	const name = "moving.csi.example.com"
	root := socketDir(t)
	if err := os.MkdirAll(filepath.Join(root, "plugins_registry"), 0o755); err != nil {
		t.Fatal(err)
	}
	reg := filepath.Join(root, "plugins_registry", name+"-reg.sock")
	a, b := &fakeDriver{}, &fakeDriver{}
	sockA, srvA := serveDriver(t, a)
	regA := serveUnix(t, reg, func(s *grpc.Server) {
		registerapi.RegisterRegistrationServer(s, &fakeRegistration{info: &registerapi.PluginInfo{
			Type: registerapi.CSIPlugin, Name: name, Endpoint: sockA, SupportedVersions: []string{"1.0.0"}}})
	})
	r, err := New(Config{KubeletRoot: root})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ctx := context.Background()
	c, _, err := r.checkDriver(ctx, name)
	if err != nil || c.Endpoint() != sockA {
		t.Fatalf("checkDriver = %v, %v; want endpoint %s", c, err, sockA)
	}
	if _, _, err := r.checkDriver(ctx, name); err != nil || a.capsCalls.Load() != 2 {
		t.Fatalf("second checkDriver = %v, driver asked %d times; want 2 (it is asked every time)", err, a.capsCalls.Load())
	}

	srvA.Stop()
	regA.Stop()
	sockB, _ := serveDriver(t, b)
	serveUnix(t, reg, func(s *grpc.Server) {
		registerapi.RegisterRegistrationServer(s, &fakeRegistration{info: &registerapi.PluginInfo{
			Type: registerapi.CSIPlugin, Name: name, Endpoint: sockB, SupportedVersions: []string{"1.0.0"}}})
	})
	c, _, err = r.checkDriver(ctx, name)
	if err != nil || c.Endpoint() != sockB || b.capsCalls.Load() != 1 {
		t.Fatalf("checkDriver after the move = %v, %v (driver b asked %d times); want endpoint %s", c, err, b.capsCalls.Load(), sockB)
	}
}

// TestDriverBackAnswersAtOnce: a client whose connection failed while the
// driver was down reaches the driver on the first call once it is back,
// not after gRPC's reconnect backoff.
func TestDriverBackAnswersAtOnce(t *testing.T) {
	f := &fakeDriver{}
	path, srv := serveDriver(t, f)
	c, err := DialCSI(context.Background(), path, CSIOptions{ReconnectMaxDelay: 30 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx := context.Background()
	if _, err := c.NodeGetCapabilities(ctx); err != nil {
		t.Fatal(err)
	}
	srv.Stop()
	deadSocket(t, path)
	for range 3 { // grow the backoff
		if _, err := c.NodeGetCapabilities(ctx); !errors.Is(err, ErrDriverUnavailable) {
			t.Fatalf("NodeGetCapabilities with the driver down = %v, want ErrDriverUnavailable", err)
		}
	}
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	serveUnix(t, path, func(s *grpc.Server) { registerDriver(s, f) })
	if _, err := c.NodeGetCapabilities(ctx); err != nil {
		t.Errorf("first NodeGetCapabilities with the driver back = %v, want an answer", err)
	}
}

// TestCapabilities: the driver is asked through the Repairer's endpoint
// every time (a restarted driver may advertise otherwise), and a driver that
// is not registered, or whose socket stopped answering, is unavailable.
func TestCapabilities(t *testing.T) {
	const name = "caps.csi.example.com"
	root := socketDir(t)
	sock := filepath.Join(root, "plugins", name, "csi.sock")
	if err := os.MkdirAll(filepath.Dir(sock), 0o755); err != nil {
		t.Fatal(err)
	}
	f := &fakeDriver{caps: []csi.NodeServiceCapability_RPC_Type{
		csi.NodeServiceCapability_RPC_STAGE_UNSTAGE_VOLUME,
		csi.NodeServiceCapability_RPC_VOLUME_MOUNT_GROUP,
	}}
	srv := serveUnix(t, sock, func(s *grpc.Server) { registerDriver(s, f) })
	r, err := New(Config{KubeletRoot: root})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ctx := t.Context()
	want := kubelet.NodeCapabilities{StageUnstage: true, VolumeMountGroup: true}
	for i := range 2 {
		if got, err := r.Capabilities(ctx, name); err != nil || got != want {
			t.Fatalf("Capabilities(%s) call %d = %+v, %v; want %+v", name, i, got, err, want)
		}
	}
	if n := f.capsCalls.Load(); n != 2 {
		t.Errorf("driver asked %d times over two calls, want 2 (never from a cache)", n)
	}
	if _, err := r.Capabilities(ctx, "missing.csi.example.com"); !errors.Is(err, ErrDriverUnavailable) {
		t.Errorf("Capabilities of a driver nobody registered = %v, want ErrDriverUnavailable", err)
	}
	srv.Stop()
	deadSocket(t, sock)
	if got, err := r.Capabilities(ctx, name); !errors.Is(err, ErrDriverUnavailable) || got != (kubelet.NodeCapabilities{}) {
		t.Errorf("Capabilities with the driver down = %+v, %v; want none and ErrDriverUnavailable", got, err)
	}
}

func TestParseMaps(t *testing.T) {
	maps := []byte(`55d0c0a00000-55d0c0a01000 r--p 00000000 00:34 12 /data/lib.so
55d0c0a01000-55d0c0a02000 r-xp 00001000 00:34 12 /data/lib.so
7f0000000000-7f0000001000 rw-s 00000000 00:35 7 /other/file with space
7f0000001000-7f0000002000 rw-p 00000000 00:34 0
7f0000002000-7f0000003000 r--p 00000000 103:02 99 /big/dev
7f0000003000-7f0000004000 r--p 00000000 08:01 5 /host/libc.so
`)
	dead := devSet{{Major: 0, Minor: 0x34}: true, {Major: 0, Minor: 0x35}: true, {Major: 0x103, Minor: 2}: true}
	var got []string
	for _, h := range parseMaps(bytes.NewReader(maps), dead) {
		got = append(got, h.Dev.String()+" "+h.Path)
	}
	want := []string{"0:52 /data/lib.so", "0:53 /other/file with space", "259:2 /big/dev"}
	if !slices.Equal(got, want) {
		t.Errorf("parseMaps = %q, want %q (each file once, with its device; anonymous and live ones left out)", got, want)
	}
}
