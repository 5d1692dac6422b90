package kubelet

import "testing"

func TestClassify(t *testing.T) {
	const root = "/var/lib/kubelet"
	const sha = "3c1322b59623fa39fb5812635250c05175816f4d79b00c35196efc3f601eeeb9"
	const rbdID = "0001-0009-rook-ceph-0000000000000002-5c2e1a3d-9b1f-11ef-8f3a-0a580a810215"
	rbdHash := HandleHash(rbdID)
	tests := map[string]struct {
		path string
		want Target
		ok   bool
	}{
		"csi publish": {
			path: root + "/pods/uid-1/volumes/kubernetes.io~csi/pvc-1/mount",
			want: Target{Kind: KindPublish, PodUID: "uid-1", Plugin: CSIPluginDir, Volume: "pvc-1"}, ok: true,
		},
		"csi staging per driver": {
			path: root + "/plugins/kubernetes.io/csi/ru.yandex.s3.csi/" + sha + "/globalmount",
			want: Target{Kind: KindStaging, Plugin: CSIPluginDir, Driver: "ru.yandex.s3.csi", HandleHash: sha}, ok: true,
		},
		"csi staging legacy pv": {
			path: root + "/plugins/kubernetes.io/csi/pv/pv-5/globalmount",
			want: Target{Kind: KindStaging, Plugin: CSIPluginDir, PV: "pv-5"}, ok: true,
		},
		"csi staging below globalmount (ceph-csi rbd)": {
			path: root + "/plugins/kubernetes.io/csi/rook-ceph.rbd.csi.ceph.com/" + rbdHash + "/globalmount/" + rbdID,
			want: Target{Kind: KindStaging, Plugin: CSIPluginDir, Driver: "rook-ceph.rbd.csi.ceph.com", HandleHash: rbdHash,
				Sub: rbdID}, ok: true,
		},
		"below globalmount, not the volume ID": {
			path: root + "/plugins/kubernetes.io/csi/rook-ceph.rbd.csi.ceph.com/" + rbdHash + "/globalmount/evil",
		},
		"below globalmount, another volume's ID": {
			path: root + "/plugins/kubernetes.io/csi/rook-ceph.rbd.csi.ceph.com/" + sha + "/globalmount/" + rbdID,
		},
		"below globalmount of a driver that stages on it": {
			path: root + "/plugins/kubernetes.io/csi/ru.yandex.s3.csi/" + rbdHash + "/globalmount/" + rbdID,
		},
		"below globalmount of an uncatalogued driver, the volume ID": {
			path: root + "/plugins/kubernetes.io/csi/fs.example.com/" + rbdHash + "/globalmount/" + rbdID,
			want: Target{Kind: KindStaging, Plugin: CSIPluginDir, Driver: "fs.example.com", HandleHash: rbdHash, Sub: rbdID}, ok: true,
		},
		"legacy staging below globalmount": {
			path: root + "/plugins/kubernetes.io/csi/pv/pv-5/globalmount/vol-1",
			want: Target{Kind: KindStaging, Plugin: CSIPluginDir, PV: "pv-5", Sub: "vol-1"}, ok: true,
		},
		"in-tree iscsi device mount": {
			path: root + "/plugins/kubernetes.io/iscsi/iface-default/10.0.0.9:3260-iqn.2003-01.org.linux-iscsi.t:sn.1-lun-0",
			want: Target{Kind: KindStaging, Plugin: "kubernetes.io~iscsi", Volume: "10.0.0.9:3260-iqn.2003-01.org.linux-iscsi.t:sn.1-lun-0"}, ok: true,
		},
		"in-tree rbd device mount": {
			path: root + "/plugins/kubernetes.io/rbd/mounts/rbd-image-kubernetes-dynamic-pvc-1",
			want: Target{Kind: KindStaging, Plugin: "kubernetes.io~rbd", Volume: "rbd-image-kubernetes-dynamic-pvc-1"}, ok: true,
		},
		"in-tree fc device mount": {
			path: root + "/plugins/kubernetes.io/fc/500a0981891b8dc5-lun-0",
			want: Target{Kind: KindStaging, Plugin: "kubernetes.io~fc", Volume: "500a0981891b8dc5-lun-0"}, ok: true,
		},
		"an unknown in-tree plugin dir is not staging": {
			path: root + "/plugins/kubernetes.io/foo/mounts/x",
		},
		"two directories below globalmount is not staging": {
			path: root + "/plugins/kubernetes.io/csi/drv/" + sha + "/globalmount/a/b",
		},
		"staging with a short hash is not staging": {
			path: root + "/plugins/kubernetes.io/csi/drv/abc/globalmount",
		},
		"staging with upper-case hex is not staging": {
			path: root + "/plugins/kubernetes.io/csi/drv/3C1322B59623FA39FB5812635250C05175816F4D79B00C35196EFC3F601EEEB9/globalmount",
		},
		"subpath": {
			path: root + "/pods/uid-1/volume-subpaths/pvc-1/app/3",
			want: Target{Kind: KindSubPath, PodUID: "uid-1", Volume: "pvc-1", Container: "app", Index: 3}, ok: true,
		},
		"subpath with a bad index": {
			path: root + "/pods/uid-1/volume-subpaths/pvc-1/app/x",
		},
		"subpath with a negative index": {
			path: root + "/pods/uid-1/volume-subpaths/pvc-1/app/-1",
		},
		"pod block device": {
			path: root + "/pods/uid-1/volumeDevices/kubernetes.io~csi/pvc-2",
			want: Target{Kind: KindBlock, PodUID: "uid-1", Plugin: CSIPluginDir, Volume: "pvc-2"}, ok: true,
		},
		"block staging": {
			path: root + "/plugins/kubernetes.io/csi/volumeDevices/staging/pvc-2",
			want: Target{Kind: KindBlock, Plugin: CSIPluginDir, PV: "pvc-2"}, ok: true,
		},
		"block staging below the staging path (ceph-csi rbd)": {
			path: root + "/plugins/kubernetes.io/csi/volumeDevices/staging/pvc-2/0001-0009-rook-ceph-0000000000000002-5c2e",
			want: Target{Kind: KindBlock, Plugin: CSIPluginDir, PV: "pvc-2", Sub: "0001-0009-rook-ceph-0000000000000002-5c2e"}, ok: true,
		},
		"block publish": {
			path: root + "/plugins/kubernetes.io/csi/volumeDevices/publish/pvc-2/uid-1",
			want: Target{Kind: KindBlock, Plugin: CSIPluginDir, PV: "pvc-2", PodUID: "uid-1"}, ok: true,
		},
		"block global map": {
			path: root + "/plugins/kubernetes.io/csi/volumeDevices/pvc-2/dev/uid-1",
			want: Target{Kind: KindBlock, Plugin: CSIPluginDir, PV: "pvc-2", PodUID: "uid-1"}, ok: true,
		},
		"nfs volume": {
			path: root + "/pods/uid-1/volumes/kubernetes.io~nfs/data",
			want: Target{Kind: KindPluginVolume, PodUID: "uid-1", Plugin: "kubernetes.io~nfs", Volume: "data"}, ok: true,
		},
		"csi volume dir without mount is not a target": {
			path: root + "/pods/uid-1/volumes/kubernetes.io~csi/pvc-1",
		},
		"deeper than a publish target": {
			path: root + "/pods/uid-1/volumes/kubernetes.io~csi/pvc-1/mount/x",
		},
		"the root itself": {path: root},
		"a sibling with the root as prefix": {
			path: root + "2/pods/uid-1/volumes/kubernetes.io~csi/pvc-1/mount",
		},
		"a lookalike elsewhere": {
			path: "/srv" + root + "/pods/uid-1/volumes/kubernetes.io~csi/pvc-1/mount",
		},
		"dot-dot segment": {
			path: root + "/pods/../pods/uid-1/volumes/kubernetes.io~csi/pvc-1/mount",
		},
		"double slash": {
			path: root + "/pods//uid-1/volumes/kubernetes.io~csi/pvc-1/mount",
		},
		"pods only":           {path: root + "/pods"},
		"unknown plugin tree": {path: root + "/plugins/other/x/y"},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			got, ok := Classify(root, tc.path)
			if ok != tc.ok || got != tc.want {
				t.Errorf("Classify(%q, %q) = %+v, %v; want %+v, %v", root, tc.path, got, ok, tc.want, tc.ok)
			}
		})
	}
}

func TestClassifyRootWithTrailingSlash(t *testing.T) {
	got, ok := Classify("/k/", "/k/pods/u/volume-subpaths/v/c/0")
	if !ok || got.Kind != KindSubPath {
		t.Errorf("Classify(/k/, ...) = %+v, %v; want a subpath", got, ok)
	}
}

func TestUnder(t *testing.T) {
	tests := map[string]struct {
		root, path string
		want       bool
	}{
		"below":          {"/var/lib/kubelet", "/var/lib/kubelet/pods", true},
		"itself":         {"/var/lib/kubelet", "/var/lib/kubelet", false},
		"sibling prefix": {"/var/lib/kubelet", "/var/lib/kubelet2/pods", false},
		"dot-dot out":    {"/var/lib/kubelet", "/var/lib/kubelet/../etc", false},
		"unclean root":   {"/var/lib/kubelet/", "/var/lib/kubelet/x", true},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			if got := Under(tc.root, tc.path); got != tc.want {
				t.Errorf("Under(%q, %q) = %v, want %v", tc.root, tc.path, got, tc.want)
			}
		})
	}
}

func FuzzClassify(f *testing.F) {
	for _, s := range []string{
		"/var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/v/mount",
		"/var/lib/kubelet/pods/u/volume-subpaths/v/c/0",
		"/var/lib/kubelet/plugins/kubernetes.io/csi/d/3c1322b59623fa39fb5812635250c05175816f4d79b00c35196efc3f601eeeb9/globalmount",
		"/var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/p/dev/u",
		"/var/lib/kubelet/../../etc",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, p string) {
		got, ok := Classify("/var/lib/kubelet", p)
		if !ok {
			if got != (Target{}) {
				t.Fatalf("Classify(%q) = %+v, false; want the zero Target", p, got)
			}
			return
		}
		if got.Kind == KindNone {
			t.Fatalf("Classify(%q) = ok with KindNone", p)
		}
		if !Under("/var/lib/kubelet", p) {
			t.Fatalf("Classify(%q) = ok for a path not under the root", p)
		}
		for _, s := range []string{got.PodUID, got.Volume, got.Container, got.Driver, got.PV} {
			for i := 0; i < len(s); i++ {
				if s[i] == '/' {
					t.Fatalf("Classify(%q) = %+v: a field holds a slash", p, got)
				}
			}
		}
	})
}

func TestStrayPath(t *testing.T) {
	const root = "/var/lib/kubelet"
	const id = "0001-0009-rook-ceph-0000000000000002-5c2e1a3d-9b1f-11ef-8f3a-0a580a810215"
	csi := root + "/plugins/kubernetes.io/csi/"
	tests := map[string]struct {
		path  string
		stray bool
	}{
		"the volume ID":                 {csi + "rbd.csi.ceph.com/" + HandleHash(id) + "/globalmount/" + id, false},
		"another name":                  {csi + "rbd.csi.ceph.com/" + HandleHash(id) + "/globalmount/x", true},
		"a driver staging on it":        {csi + "ru.yandex.s3.csi/" + HandleHash(id) + "/globalmount/" + id, true},
		"globalmount itself":            {csi + "rbd.csi.ceph.com/" + HandleHash(id) + "/globalmount", false},
		"legacy path (checked later)":   {csi + "pv/pv-1/globalmount/x", false},
		"two levels below":              {csi + "rbd.csi.ceph.com/" + HandleHash(id) + "/globalmount/x/y", false},
		"outside the root":              {"/srv/plugins/kubernetes.io/csi/rbd.csi.ceph.com/" + HandleHash(id) + "/globalmount/x", false},
		"block staging (checked later)": {csi + "volumeDevices/staging/pv-1/x", false},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			why := StrayPath(root, tc.path)
			if (why != "") != tc.stray {
				t.Errorf("StrayPath(%q) = %q, want stray %v", tc.path, why, tc.stray)
			}
			if _, ok := Classify(root, tc.path); ok && why != "" {
				t.Errorf("Classify(%q) = ok for a stray", tc.path)
			}
		})
	}
}
