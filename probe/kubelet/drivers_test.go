package kubelet

import "testing"

func TestLookupDriver(t *testing.T) {
	tests := map[string]struct {
		name, fsType, source string
		project, mounter     string
		daemon               DaemonHome
		restage              bool
	}{
		"rook rbd krbd":      {"rook-ceph.rbd.csi.ceph.com", "ext4", "/dev/rbd0", "ceph-csi RBD", "krbd", DaemonKernel, false},
		"rbd-nbd":            {"rbd.csi.ceph.com", "xfs", "/dev/nbd3", "ceph-csi RBD", "rbd-nbd", DaemonNodePlugin, false},
		"cephfs kernel":      {"openshift-storage.cephfs.csi.ceph.com", "ceph", "10.0.0.1:6789:/volumes/x", "ceph-csi CephFS", "kernel", DaemonKernel, true},
		"ceph-fuse":          {"cephfs.csi.ceph.com", "fuse.ceph-fuse", "ceph-fuse", "ceph-csi CephFS", "ceph-fuse", DaemonNodePlugin, true},
		"juicefs":            {"csi.juicefs.com", "fuse.juicefs", "JuiceFS:vol", "JuiceFS CSI", "juicefs", DaemonMountPod, false},
		"gcsfuse":            {"gcsfuse.csi.storage.gke.io", "fuse.gcsfuse", "bucket", "Cloud Storage FUSE CSI", "gcsfuse", DaemonAppSidecar, false},
		"blobfuse2":          {"blob.csi.azure.com", "fuse", "blobfuse2", "Azure Blob CSI", "blobfuse2", DaemonHostService, true},
		"blob nfs":           {"blob.csi.azure.com", "nfs", "acct.blob.core.windows.net:/acct/c", "Azure Blob CSI", "nfs", DaemonKernel, true},
		"k8s-csi-s3 s3fs":    {"ru.yandex.s3.csi", "fuse.s3fs", "s3fs", "k8s-csi-s3", "s3fs", DaemonNodePlugin, true},
		"k8s-csi-s3 geesefs": {"ru.yandex.s3.csi", "fuse.geesefs", "b:p", "k8s-csi-s3", "geesefs", DaemonHostService, true},
		"longhorn":           {"driver.longhorn.io", "ext4", "/dev/longhorn/pvc-1", "Longhorn", "longhorn engine", DaemonEnginePod, false},
		"ebs":                {"ebs.csi.aws.com", "xfs", "/dev/nvme1n1", "AWS EBS CSI", "block", DaemonKernel, true},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			d, ok := LookupDriver(tc.name)
			if !ok {
				t.Fatalf("LookupDriver(%q): not catalogued", tc.name)
			}
			m, ok := d.Mounter(tc.fsType, tc.source)
			if d.Project != tc.project || !ok || m.Name != tc.mounter || m.Daemon != tc.daemon || d.Restage != tc.restage {
				t.Errorf("LookupDriver(%q).Mounter(%q, %q) = %s %s %s restage %v, want %s %s %s restage %v",
					tc.name, tc.fsType, tc.source, d.Project, m.Name, m.Daemon, d.Restage, tc.project, tc.mounter, tc.daemon, tc.restage)
			}
			if !d.Restage && d.Why == "" {
				t.Errorf("%s cannot be re-staged but says not why", d.Project)
			}
		})
	}
	for _, name := range []string{"", "lab.csi.mountmedic.io", "rbd.csi.ceph.com.evil", "xrbd.csi.ceph.com"} {
		if d, ok := LookupDriver(name); ok {
			t.Errorf("LookupDriver(%q) = %s, want not catalogued", name, d.Project)
		}
	}
}

func TestGuessPublishOnly(t *testing.T) {
	for fsType, want := range map[string]string{"fuse.juicefs": "csi.juicefs.com", "fuse.gcsfuse": "gcsfuse.csi.storage.gke.io",
		"nfs4": "nfs.csi.k8s.io", "fuse.s3fs": "", "ext4": ""} {
		d, ok := GuessPublishOnly(fsType)
		if got := ""; ok {
			got = d.Name
			if got != want {
				t.Errorf("GuessPublishOnly(%q) = %s, want %q", fsType, got, want)
			}
		} else if want != "" {
			t.Errorf("GuessPublishOnly(%q): none, want %s", fsType, want)
		}
	}
}

// TestOutOfReachDriversSayHowTheyRecover: every catalogued driver whose
// daemon the node plugin cannot restart (a mount pod, a sidecar, an engine
// pod) and that a re-stage cannot repair says who recovers it, and no
// other driver has a recovery: for those the agent's own ladder is it.
func TestOutOfReachDriversSayHowTheyRecover(t *testing.T) {
	for _, d := range Catalogue() {
		outOfReach := false
		for _, m := range d.Mounters {
			switch m.Daemon {
			case DaemonMountPod, DaemonAppSidecar, DaemonEnginePod:
				outOfReach = true
			}
		}
		switch r := d.Recovery; {
		case outOfReach && !d.Restage && r == nil:
			t.Errorf("%s: its daemon is out of the node plugin's reach and it has no Recovery", d.Project)
		case (!outOfReach || d.Restage) && r != nil:
			t.Errorf("%s: Recovery %+v on a driver the agent's ladder repairs or that has no daemon out of reach", d.Project, *r)
		case r != nil && (r.By == "" || r.Grace < 0 || r.Then.String() == "" || r.Then > EscalateEvict):
			t.Errorf("%s: Recovery %+v: want who recovers, a grace >= 0 and a known escalation", d.Project, *r)
		}
	}
}
