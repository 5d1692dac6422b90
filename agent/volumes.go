package agent

import (
	"fmt"
	"slices"
	"sort"

	"github.com/mountmedic/mountmedic/probe"

	"github.com/mountmedic/mountmedic/probe/kubelet"
	"github.com/mountmedic/mountmedic/remount"
)

// brokenVolume is one volume with broken kubelet mounts on this node: a CSI
// volume (driver and volume handle) with its staging mount, publish targets
// and subPath binds, or another plugin's pod volume.
type brokenVolume struct {
	key string
	// csi is set for CSI filesystem volumes (staging, publish, subPath).
	csi bool
	// block is set for raw block volumes, which are reported, not repaired.
	block        bool
	driver       string // CSI driver, or the plugin of another volume
	volumeHandle string
	backend      *probe.Backend
	state        probe.State
	hung         bool
	err          error
	// mounts are the broken kubelet mounts, in inventory order.
	mounts []*probe.Mount
	// pods are the pods whose mounts are broken, by UID.
	pods map[string]*podUse
}

// podUse is one pod's broken mounts of a volume.
type podUse struct {
	uid string
	// specName is the directory of the publish target or plugin volume:
	// the PV name for a CSI PVC, the pod volume name for inline and
	// plugin volumes.
	specName string
	// volumeName is the pod's spec.volumes[].name when a mount names it
	// (plugin volumes do; a subPath bind names the inner spec, as specName).
	volumeName string
	dead       []*probe.Mount
}

// unguarded reports a CSI volume with a publish target kubelet set up, or
// a staging path (stagingGuardable), that is no longer a mount point and
// has no guard yet.
func (v *brokenVolume) unguarded() bool {
	if !v.csi {
		return false
	}
	if m := v.stagingGuardable(); m != nil && m.ID == 0 {
		return true
	}
	for _, u := range v.pods {
		for _, m := range u.dead {
			if m != nil && m.ID == 0 && m.Target.Kind == kubelet.KindPublish {
				return true
			}
		}
	}
	return false
}

// lostStaging is the volume's staging path when it lost its mount while
// pods still use the volume: not a mount point (the probe's Unmounted,
// ID 0), or mountmedic's guard standing there; nil otherwise. A stale
// FUSE daemon that unmounts its mountpoint by path does this to a mount
// re-staged under it.
func (v *brokenVolume) lostStaging() *probe.Mount {
	if !v.csi {
		return nil
	}
	for _, m := range v.mounts {
		if m.Target.Kind == kubelet.KindStaging && (m.ID == 0 || m.Guard) {
			return m
		}
	}
	return nil
}

// certain reports a failure that is not waited on for strikes: the FUSE
// connection of the volume is gone (ENOTCONN or ECONNABORTED on a FUSE
// backend), which never heals by itself, or its daemon has not answered a
// probe for a whole deadline (Hung: the prober never says so of a probe
// still within its deadline, however slow), whose callers stay blocked
// until the connection is aborted; or its staging path lost its mount
// under live publish targets and its driver is catalogued as staging
// there (stagingGuardable). Any other state, a lost staging path of a
// driver not catalogued included (kubelet leaves globalmount bare for a
// driver that does not stage), may be transient and waits for its
// strikes.
func (v *brokenVolume) certain() bool {
	if v.stagingGuardable() != nil {
		// kubelet never leaves the staging path of a driver that stages
		// bare under live publish targets: the next pod published there
		// would get the node's disk.
		return true
	}
	if v.nbdDaemonGone() {
		return true
	}
	if v.backend == nil || v.backend.Kind != probe.BackendFUSE {
		return false
	}
	return v.state == probe.Disconnected || v.state == probe.Hung
}

// podUIDs lists the pods of the volume in a stable order.
func (v *brokenVolume) podUIDs() []string {
	out := make([]string, 0, len(v.pods))
	for uid := range v.pods {
		out = append(out, uid)
	}
	sort.Strings(out)
	return out
}

// csiKey names the CSI volume a mount belongs to, from the mount or the
// mounts it was bound from: the volume handle (vol_data.json) or the
// staging path's handle hash. "" when neither is known.
func csiKey(m *probe.Mount) (key, driver, handle string) {
	for s := m; s != nil; s = s.From {
		if driver == "" {
			driver = s.Driver
		}
		if handle == "" {
			handle = s.VolumeHandle
		}
	}
	if driver == "" {
		return "", "", ""
	}
	if handle != "" {
		return "csi/" + driver + "/" + kubelet.HandleHash(handle), driver, handle
	}
	for s := m; s != nil; s = s.From {
		if s.Target.Kind == kubelet.KindStaging && s.Target.HandleHash != "" {
			return "csi/" + driver + "/" + s.Target.HandleHash, driver, ""
		}
	}
	return "", driver, ""
}

// groupBroken groups the broken per-mount results of a report into
// volumes. Mounts are linked by device number, never by path text; mounts
// whose volume cannot be named are grouped by their backend.
func groupBroken(rep *probe.Report) map[string]*brokenVolume {
	broken := rep.Broken()
	if len(broken) == 0 {
		return nil
	}
	type named struct{ key, driver, handle string }
	own := make([]named, len(broken))
	// A backend's CSI key, from any of its mounts, for broken mounts that
	// cannot name their volume themselves (a subPath bind whose publish
	// target is gone): looked up only for their backends.
	var backendKey map[*probe.Backend]string
	for i, r := range broken {
		k, d, h := csiKey(r.Mount)
		own[i] = named{k, d, h}
		if k == "" && r.Mount.Backend != nil && r.Mount.Target.Kind != kubelet.KindBlock {
			if backendKey == nil {
				backendKey = make(map[*probe.Backend]string)
			}
			backendKey[r.Mount.Backend] = ""
		}
	}
	if len(backendKey) > 0 {
		for _, r := range rep.Mounts {
			b := r.Mount.Backend
			if k, ok := backendKey[b]; !ok || k != "" {
				continue
			}
			if k, _, _ := csiKey(r.Mount); k != "" {
				backendKey[b] = k
			}
		}
	}
	out := make(map[string]*brokenVolume)
	for i, r := range broken {
		m := r.Mount
		key, driver, handle := own[i].key, own[i].driver, own[i].handle
		csi := key != ""
		switch {
		case m.Target.Kind == kubelet.KindBlock:
			key, csi = "block/"+m.Target.PV+"/"+m.Target.PodUID+"/"+m.Target.Volume, false
			if m.Target.PV == "" && m.Backend != nil {
				key = "block/dev/" + m.Backend.Dev.String()
			}
		case key == "" && m.Backend != nil && backendKey[m.Backend] != "":
			key, csi = backendKey[m.Backend], true
		case key == "" && m.Backend != nil:
			key = "dev/" + m.Backend.Dev.String()
		case key == "":
			key = "pod/" + m.Target.PodUID + "/" + m.Target.Volume
		}
		v := out[key]
		if v == nil {
			v = &brokenVolume{key: key, csi: csi, block: m.Target.Kind == kubelet.KindBlock,
				backend: r.Backend, state: r.State, err: r.Err, pods: make(map[string]*podUse)}
			out[key] = v
		}
		if v.driver == "" {
			v.driver = driver
			if v.driver == "" {
				v.driver = driverLabel(m)
			}
		}
		if v.volumeHandle == "" {
			v.volumeHandle = handle
		}
		if v.backend == nil {
			v.backend = r.Backend
		}
		if r.State == probe.Hung {
			v.hung = true
		}
		if m.Target.Kind == kubelet.KindStaging {
			// The staging mount's state is the volume's.
			v.state, v.err = r.State, r.Err
		}
		v.mounts = append(v.mounts, m)
		if m.Target.PodUID == "" {
			continue
		}
		u := v.pods[m.Target.PodUID]
		if u == nil {
			u = &podUse{uid: m.Target.PodUID}
			v.pods[m.Target.PodUID] = u
		}
		switch m.Target.Kind {
		case kubelet.KindPublish:
			u.specName = m.Target.Volume
		case kubelet.KindSubPath:
			// kubelet names the directory after the volume's inner spec
			// name, as it does the publish target: the PV of a claim, the
			// pod volume of an inline one (makeMounts in kubelet_pods.go).
			if u.specName == "" {
				u.specName = m.Target.Volume
			}
		case kubelet.KindPluginVolume:
			u.specName, u.volumeName = m.Target.Volume, m.Target.Volume
		}
		if !slices.Contains(u.dead, m) {
			u.dead = append(u.dead, m)
		}
	}
	addLiveUsers(rep, out)
	return out
}

// addLiveUsers gives a CSI volume whose only broken mount is its staging
// mount, gone from under live publish targets (probe says Missing), the
// pods of those targets: the re-stage needs a pod to build the volume's
// request from. They get no dead mount, so the re-stage stages the volume
// and leaves their mounts alone.
func addLiveUsers(rep *probe.Report, vols map[string]*brokenVolume) {
	for _, v := range vols {
		if !v.csi || len(v.pods) > 0 || !slices.ContainsFunc(v.mounts, func(m *probe.Mount) bool {
			return m.Target.Kind == kubelet.KindStaging
		}) {
			continue
		}
		for _, r := range rep.Mounts {
			m := r.Mount
			if m.Target.Kind != kubelet.KindPublish || r.State.Broken() {
				continue
			}
			if k, _, _ := csiKey(m); k != v.key {
				continue
			}
			if v.pods[m.Target.PodUID] == nil {
				v.pods[m.Target.PodUID] = &podUse{uid: m.Target.PodUID, specName: m.Target.Volume}
			}
		}
	}
}

// volumeDrivers lists the CSI drivers with mounts in the inventory.
func volumeDrivers(inv *probe.Inventory) []string {
	seen := make(map[string]bool)
	var out []string
	add := func(d string) {
		if d != "" && !seen[d] {
			seen[d] = true
			out = append(out, d)
		}
	}
	for _, m := range inv.Mounts {
		if m.Target.Plugin == kubelet.CSIPluginDir || m.Target.Kind == kubelet.KindStaging || m.Target.Kind == kubelet.KindSubPath {
			add(m.Driver)
		}
	}
	for _, m := range inv.Unmounted {
		add(m.Driver)
	}
	sort.Strings(out)
	return out
}

// notUnderstood says why a broken CSI volume is reported and not repaired,
// "" when the agent may repair it: a catalogued driver whose daemon a
// re-stage through its node plugin cannot bring back (a mount pod, a
// sidecar in the app pod, an engine pod, or a staging mount where the
// re-stage does not unmount), or, unless repairUnknown, a driver not in the
// catalogue that stages below kubelet's staging path.
func notUnderstood(v *brokenVolume, repairUnknown bool) string {
	if d, ok := kubelet.LookupDriver(v.driver); ok {
		if d.Restage || d.Reattach && v.csi && remount.IsNBD(v.backend) {
			return ""
		}
		return fmt.Sprintf("CSI driver %s (%s) is reported, not repaired: %s", v.driver, d.Project, d.Why)
	}
	if repairUnknown {
		return ""
	}
	for _, m := range v.mounts {
		for s := m; s != nil; s = s.From {
			if s.Target.Kind == kubelet.KindStaging && s.Target.Sub != "" {
				return fmt.Sprintf("CSI driver %s is not in mountmedic's driver catalogue and stages below kubelet's staging path (%s): "+
					"reported, not repaired; pass --repair-unknown-drivers to repair it as kubelet's plain layout", v.driver, s.Path)
			}
		}
	}
	return ""
}
