package agent

import (
	"path/filepath"
	"slices"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/probe"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// reportWith assesses a captured table and marks every mount on the backend
// with device dev as broken with state st.
func reportWith(t *testing.T, table string, dev probe.Dev, st probe.State, err error) (*probe.Inventory, *probe.Report) {
	t.Helper()
	inv, rerr := probe.ReadFile(filepath.Join("..", "probe", "testdata", table), probe.Options{})
	if rerr != nil {
		t.Fatal(rerr)
	}
	rep := probe.Assess(inv)
	for i := range rep.Mounts {
		if m := rep.Mounts[i].Mount; m.Backend != nil && m.Backend.Dev == dev {
			rep.Mounts[i].State, rep.Mounts[i].Err = st, err
		}
	}
	return inv, rep
}

func TestGroupBrokenSharedVolume(t *testing.T) {
	inv, rep := reportWith(t, "s3fs-two-pods.mountinfo", probe.Dev{Major: 0, Minor: 52}, probe.Disconnected, unix.ENOTCONN)
	got := groupBroken(rep)
	if len(got) != 1 {
		t.Fatalf("groupBroken: %d volumes, want 1 (staging, two publish targets and two subPaths of one s3fs volume)", len(got))
	}
	// Offline, the volume is named by its staging path's handle hash.
	const key = "csi/ru.yandex.s3.csi/3c1322b59623fa39fb5812635250c05175816f4d79b00c35196efc3f601eeeb9"
	v := got[key]
	if v == nil {
		t.Fatalf("groupBroken: no volume %s in %v", key, got)
	}
	if !v.csi || v.driver != "ru.yandex.s3.csi" || v.block {
		t.Errorf("volume: csi %v driver %q block %v, want a CSI volume of ru.yandex.s3.csi", v.csi, v.driver, v.block)
	}
	if len(v.mounts) != 5 {
		t.Errorf("volume has %d broken mounts, want 5", len(v.mounts))
	}
	if want := []string{"8d0e4c6a-5b7e-4a63-9f1e-0c2f6b0a1d11", "f3b2a1c0-2222-4e5f-8a9b-3c4d5e6f7a80"}; !slices.Equal(v.podUIDs(), want) {
		t.Errorf("pods = %v, want %v", v.podUIDs(), want)
	}
	u := v.pods["f3b2a1c0-2222-4e5f-8a9b-3c4d5e6f7a80"]
	if u.specName != "pvc-1b2c3d4e-0000-4000-8000-000000000001" || len(u.dead) != 2 {
		t.Errorf("pod use = spec %q, %d dead mounts; want the PV name and 2 (publish + subPath)", u.specName, len(u.dead))
	}
	// kubelet names volume-subpaths/<dir> after the PV too, not after the
	// pod's volume: a subPath bind must not be taken for a pod volume name.
	if u.volumeName != "" {
		t.Errorf("pod use volume name = %q from the subPath bind, want none (the directory is the PV name)", u.volumeName)
	}
	if !v.certain() {
		t.Error("a Disconnected FUSE volume is not certain")
	}
	if got := volumeDrivers(inv); !slices.Equal(got, []string{"ru.yandex.s3.csi"}) {
		t.Errorf("volumeDrivers = %v, want [ru.yandex.s3.csi]", got)
	}
}

func TestGroupBrokenHungStates(t *testing.T) {
	_, rep := reportWith(t, "s3fs-two-pods.mountinfo", probe.Dev{Major: 0, Minor: 52}, probe.Hung, probe.ErrHung)
	got := groupBroken(rep)
	if len(got) != 1 {
		t.Fatalf("groupBroken of a Hung volume: %d volumes, want 1", len(got))
	}
	for _, v := range got {
		// The prober calls Hung only a probe past its whole deadline,
		// never a slow answer within it: its FUSE connection is aborted
		// at once, without waiting for strikes.
		if !v.certain() {
			t.Errorf("a Hung FUSE volume is not certain: its callers stay blocked through the strikes")
		}
		if !v.hung {
			t.Error("a Hung volume is not marked hung (its FUSE connection must be aborted first)")
		}
	}
	nfs := &brokenVolume{state: probe.Hung, hung: true, backend: &probe.Backend{Kind: probe.BackendNetwork, FSType: "nfs4"}}
	if nfs.certain() {
		t.Error("a Hung NFS volume is certain; a slow server must get its strikes")
	}
}

// TestGroupBrokenTableOnlyFaults groups what the mount table alone says is
// broken (no probe ran): nothing on a healthy node; on the NBD capture, one
// named volume per shut-down, journal-aborted or read-only filesystem, with
// its staging mount, publish target and subPath binds.
func TestGroupBrokenTableOnlyFaults(t *testing.T) {
	type want struct {
		state  probe.State
		mounts int
	}
	const ceph = "csi/rbd.csi.ceph.com/"
	tests := map[string]struct {
		table string
		want  map[string]want
	}{
		"healthy node": {"mixed-node.mountinfo", map[string]want{}},
		"nbd faults": {"nbd-faults.mountinfo", map[string]want{
			ceph + "b30a22c69f8445afa7c10bf1a7ed27969249e24f2b0d22264c9d083105422805": {probe.Shutdown, 2},
			ceph + "13ea42c1d89fe8881cf0f9e711dfbdda6a8bb38a8e944a8e551b5a738b9848e6": {probe.ReadOnly, 2},
			ceph + "3aae01f37af6e2758da1122c5289a61b49ef007f55ab58ef0f7b0f9d483733db": {probe.ReadOnly, 3},
		}},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			_, rep := reportWith(t, tc.table, probe.Dev{}, probe.Healthy, nil)
			got := groupBroken(rep)
			for key, w := range tc.want {
				v := got[key]
				if v == nil {
					t.Errorf("groupBroken: no volume %s", key)
					continue
				}
				if v.state != w.state || len(v.mounts) != w.mounts || !v.csi {
					t.Errorf("volume %s = state %s, %d mounts, csi %v; want %s, %d, true", key, v.state, len(v.mounts), v.csi, w.state, w.mounts)
				}
			}
			for key := range got {
				if _, ok := tc.want[key]; !ok {
					t.Errorf("groupBroken: unexpected volume %s", key)
				}
			}
		})
	}
}

// A staging mount gone from under live publish targets: the volume's pods
// are those targets', with no dead mount (the re-stage leaves their mounts
// alone); another volume's pods are not added.
func TestGroupBrokenStagingGoneUnderLiveBinds(t *testing.T) {
	const driver = "s3.csi.example.com"
	publish := func(uid, handle string) probe.Result {
		return probe.Result{State: probe.Healthy, Mount: &probe.Mount{
			Path: "/var/lib/kubelet/pods/" + uid + "/volumes/kubernetes.io~csi/pv-" + handle + "/mount", Driver: driver, VolumeHandle: handle,
			Target: kubelet.Target{Kind: kubelet.KindPublish, PodUID: uid, Plugin: kubelet.CSIPluginDir, Volume: "pv-" + handle}}}
	}
	staging := &probe.Mount{Path: kubelet.StagingPath("/var/lib/kubelet", driver, "a"), Driver: driver, VolumeHandle: "a",
		Target: kubelet.Target{Kind: kubelet.KindStaging, Plugin: kubelet.CSIPluginDir, Driver: driver, HandleHash: kubelet.HandleHash("a")}}
	rep := &probe.Report{Mounts: []probe.Result{
		publish("pod-1", "a"), publish("pod-2", "a"), publish("pod-3", "b"),
		{Mount: staging, State: probe.Missing},
	}}
	got := groupBroken(rep)
	if len(got) != 1 {
		t.Fatalf("groupBroken: %d volumes, want 1", len(got))
	}
	v := got["csi/"+driver+"/"+kubelet.HandleHash("a")]
	if v == nil || v.state != probe.Missing || !v.csi {
		t.Fatalf("groupBroken = %v, want volume a Missing", got)
	}
	if want := []string{"pod-1", "pod-2"}; !slices.Equal(v.podUIDs(), want) {
		t.Errorf("pods = %v, want %v (the live targets of volume a)", v.podUIDs(), want)
	}
	for uid, u := range v.pods {
		if len(u.dead) != 0 || u.specName != "pv-a" {
			t.Errorf("pod %s: %d dead mounts, spec %q; want none and pv-a", uid, len(u.dead), u.specName)
		}
	}
}

func TestOnlyUnpublished(t *testing.T) {
	pub := kubelet.Target{Kind: kubelet.KindPublish, PodUID: "p", Plugin: kubelet.CSIPluginDir, Volume: "pv"}
	sub := kubelet.Target{Kind: kubelet.KindSubPath, PodUID: "p", Volume: "pv"}
	unpublished := &probe.Mount{Path: "/k/pods/p/volumes/kubernetes.io~csi/pv/mount", Target: pub}
	deadPublish := &probe.Mount{ID: 40, Path: unpublished.Path, Target: pub}
	deadSub := &probe.Mount{ID: 41, Path: "/k/pods/p/volume-subpaths/pv/app/0", Target: sub}
	for _, c := range []struct {
		name string
		use  *podUse
		want bool
	}{
		{"no use", nil, false},
		{"nothing dead", &podUse{uid: "p"}, false},
		{"publish target not mounted yet", &podUse{uid: "p", dead: []*probe.Mount{unpublished}}, true},
		{"a mounted publish target is dead", &podUse{uid: "p", dead: []*probe.Mount{unpublished, deadPublish}}, false},
		{"a subPath bind is dead", &podUse{uid: "p", dead: []*probe.Mount{unpublished, deadSub}}, false},
	} {
		if got := onlyUnpublished(c.use); got != c.want {
			t.Errorf("%s: onlyUnpublished = %v, want %v", c.name, got, c.want)
		}
	}
}

// TestLostStaging: a staging path that lost its mount under live publish
// targets (not a mount point, or the guard there) is repaired without
// waiting for strikes; only the bare one still needs a guard.
func TestLostStaging(t *testing.T) {
	staging := kubelet.Target{Kind: kubelet.KindStaging, Plugin: kubelet.CSIPluginDir}
	for _, tc := range []struct {
		name                string
		driver              string
		m                   *probe.Mount
		lost, cert, unguard bool
	}{
		// A driver catalogued as staging at globalmount (k8s-csi-s3): a
		// lost staging path is guarded and staged again at once.
		{"bare, stager", "ru.yandex.s3.csi", &probe.Mount{Path: "/s", Target: staging}, true, true, true},
		{"guarded, stager", "ru.yandex.s3.csi", &probe.Mount{Path: "/s", ID: 7, Guard: true, Target: staging}, true, true, false},
		// A driver not catalogued, or one that does not stage, waits for
		// its strikes and gets no guard: kubelet leaves globalmount bare
		// for a driver that does not stage.
		{"bare, not catalogued", "lab.csi.example.com", &probe.Mount{Path: "/s", Target: staging}, true, false, false},
		{"bare, publish-only", "gcsfuse.csi.storage.gke.io", &probe.Mount{Path: "/s", Target: staging}, true, false, false},
		{"dead mount", "ru.yandex.s3.csi", &probe.Mount{Path: "/s", ID: 7, Target: staging}, false, false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v := &brokenVolume{csi: true, driver: tc.driver, mounts: []*probe.Mount{tc.m}}
			if got := v.lostStaging() != nil; got != tc.lost {
				t.Errorf("lostStaging() = %t, want %t", got, tc.lost)
			}
			if got := v.certain(); got != tc.cert {
				t.Errorf("certain() = %t, want %t", got, tc.cert)
			}
			if got := v.unguarded(); got != tc.unguard {
				t.Errorf("unguarded() = %t, want %t", got, tc.unguard)
			}
		})
	}
}
