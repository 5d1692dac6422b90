package agent

import (
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/remount"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// allBroken reads a captured table, names the CSI driver of publish targets
// that do not derive from a staging mount (a live inventory reads it from
// vol_data.json) and marks every mount Disconnected.
func allBroken(t *testing.T, inv *probe.Inventory, driver string) *probe.Report {
	t.Helper()
	for _, m := range inv.Mounts {
		if m.Driver == "" && (m.Target.Kind == kubelet.KindPublish || m.Target.Kind == kubelet.KindSubPath) {
			m.Driver, m.VolumeHandle = driver, "handle-"+m.Target.Volume
		}
	}
	rep := probe.Assess(inv)
	for i := range rep.Mounts {
		rep.Mounts[i].State, rep.Mounts[i].Err = probe.Disconnected, unix.ENOTCONN
	}
	return rep
}

// TestCatalogueGatesRepairs: a broken volume of every catalogued driver's
// real layout (probe/testdata, one table per driver) is repaired when a
// re-stage through the node plugin can bring it back, and reported only
// when its daemon is out of the plugin's reach or ceph-csi stages where the
// re-stage does not unmount; an uncatalogued driver is repaired in
// kubelet's plain layout and reported only when it stages below
// globalmount, unless --repair-unknown-drivers.
func TestCatalogueGatesRepairs(t *testing.T) {
	tests := map[string]struct {
		driver  string // of publish-only volumes, as vol_data.json names it
		vols    int
		repair  bool
		because string // in the skip message
	}{
		"ceph-rbd":      {vols: 2, because: "<volume ID>"},
		"nbd-faults":    {vols: 3, because: "<volume ID>"},
		"cephfs":        {vols: 2, repair: true},
		"juicefs":       {driver: "csi.juicefs.com", vols: 1, because: "mount pod"},
		"gcsfuse":       {driver: "gcsfuse.csi.storage.gke.io", vols: 2, because: "sidecar"},
		"blob":          {vols: 2, repair: true},
		"seaweedfs":     {vols: 1, repair: true},
		"k8s-csi-s3":    {vols: 2, repair: true},
		"s3fs-two-pods": {vols: 2, repair: true}, // and a projected volume
		"nfs":           {driver: "nfs.csi.k8s.io", vols: 2, repair: true},
		"smb":           {vols: 1, repair: true},
		"longhorn":      {vols: 1, because: "instance-manager"},
		"ebs":           {vols: 1, repair: true},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			inv, err := probe.ReadFile(filepath.Join("..", "probe", "testdata", name+".mountinfo"), probe.Options{})
			if err != nil {
				t.Fatal(err)
			}
			got := groupBroken(allBroken(t, inv, tc.driver))
			if len(got) != tc.vols {
				t.Errorf("groupBroken: %d volumes, want %d", len(got), tc.vols)
			}
			for key, v := range got {
				if !v.csi {
					if strings.HasPrefix(v.driver, "kubernetes.io~") {
						continue // a pod volume of another plugin
					}
					t.Errorf("volume %s is not taken for a CSI volume", key)
				}
				// An NBD volume of a driver that re-attaches is repaired
				// by the re-attach tier whatever its layout.
				repair := tc.repair
				if d, ok := kubelet.LookupDriver(v.driver); ok && d.Reattach && remount.IsNBD(v.backend) {
					repair = true
				}
				for _, unknown := range []bool{false, true} {
					why := notUnderstood(v, unknown)
					switch {
					case repair && why != "":
						t.Errorf("volume %s of %s (--repair-unknown-drivers=%v): not repaired (%s), want repaired", key, v.driver, unknown, why)
					case !repair && !strings.Contains(why, tc.because):
						t.Errorf("volume %s of %s (--repair-unknown-drivers=%v): skip = %q, want a report naming %q", key, v.driver, unknown, why, tc.because)
					}
				}
			}
		})
	}
}

// TestUnknownDriverLayouts: a driver not in the catalogue is repaired in
// kubelet's plain layout; staged below globalmount it is reported only,
// unless the user opts it in.
func TestUnknownDriverLayouts(t *testing.T) {
	const (
		root = "1 0 254:1 / / rw - ext4 /dev/vda1 rw\n"
		// The directory is the hash of the volume handle vol-1.
		stage = "/var/lib/kubelet/plugins/kubernetes.io/csi/fs.example.com/d2e8363faaac7ae76def3b14091d8eb5755f6b92e9531627aeec833a8731cc49/globalmount"
		pub   = "/var/lib/kubelet/pods/u1/volumes/kubernetes.io~csi/pv-1/mount"
	)
	tests := map[string]struct {
		table  string
		repair bool
	}{
		"plain":             {root + "2 1 0:50 / " + stage + " rw - fuse.x x rw\n3 1 0:50 / " + pub + " rw - fuse.x x rw\n", true},
		"below globalmount": {root + "2 1 0:50 / " + stage + "/vol-1 rw - fuse.x x rw\n3 1 0:50 / " + pub + " rw - fuse.x x rw\n", false},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			inv, err := probe.Parse([]byte(tc.table), name, probe.Options{})
			if err != nil {
				t.Fatal(err)
			}
			got := groupBroken(allBroken(t, inv, ""))
			if len(got) != 1 {
				t.Fatalf("groupBroken: %d volumes, want 1", len(got))
			}
			for key, v := range got {
				why := notUnderstood(v, false)
				if (why == "") != tc.repair {
					t.Errorf("volume %s: skip = %q, want repaired %v", key, why, tc.repair)
				}
				if !tc.repair && !strings.Contains(why, "--repair-unknown-drivers") {
					t.Errorf("volume %s: skip = %q does not name --repair-unknown-drivers", key, why)
				}
				if why := notUnderstood(v, true); why != "" {
					t.Errorf("volume %s with --repair-unknown-drivers: skip = %q, want repaired", key, why)
				}
			}
		})
	}
}
