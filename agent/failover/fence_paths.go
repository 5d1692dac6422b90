package failover

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"

	"github.com/mountmedic/mountmedic/probe"
	"github.com/mountmedic/mountmedic/remount"
)

// Per-path fencing. Where the kernel reads the mounts at a path by itself
// (remount.Unmounter.PerPath), the fence finds the pods' volume mounts at
// their own paths in our mount namespace and compares each path with
// HostTable's namespace through that namespace's root (/proc/1/root):
// before the unmount, a path where the two show different mounts is left
// alone (the mount the fence would take off is not the host's); after it, a
// difference means our unmounts did not reach there. Nothing reads a whole
// mount table, so a fence costs the pods' paths, not the node's mounts.

func (f *NodeFence) unmounter() *remount.Unmounter {
	return &remount.Unmounter{Root: f.KubeletRoot, DryRun: f.DryRun}
}

// hostRoot is the root of HostTable's mount namespace: /proc/<pid>/root
// for a /proc/<pid>/mountinfo; "" for a table read from elsewhere (a file),
// which the fence then reads whole.
func (f *NodeFence) hostRoot() string {
	t := filepath.Clean(f.HostTable)
	if filepath.Base(t) != "mountinfo" || !strings.HasPrefix(t, "/proc/") {
		return ""
	}
	return filepath.Join(filepath.Dir(t), "root")
}

// agreeing returns the mounts at the paths where HostTable's namespace
// shows what ours does (remount.Unmounter.DifferIn), and an error naming
// the others, which are left alone. The pod's CSI paths are compared too,
// so that a volume mounted there only (a namespace ours does not receive
// mounts from) is an error rather than a fence done. Without per-path
// lookups every mount was read from HostTable itself: all of them.
func (f *NodeFence) agreeing(u *remount.Unmounter, uid string, mounts []*probe.Mount) ([]*probe.Mount, error) {
	root := f.hostRoot()
	if root == "" || !u.PerPath() {
		return mounts, nil
	}
	paths, err := f.podPaths(u, uid, mounts)
	if err != nil {
		return nil, err
	}
	differ, err := u.DifferIn(root, paths)
	if err != nil {
		return nil, fmt.Errorf("compare with %s: %w", f.HostTable, err)
	}
	if len(differ) == 0 {
		return mounts, nil
	}
	kept := slices.DeleteFunc(slices.Clone(mounts), func(m *probe.Mount) bool {
		return slices.Contains(differ, filepath.Clean(m.Path))
	})
	return kept, fmt.Errorf("%s: our mount namespace shows another mount there than %s: left alone: %w",
		strings.Join(differ, ", "), f.HostTable, remount.ErrMountChanged)
}

// checkGoneAt fails each pod whose unmounts went through but at whose
// paths HostTable's namespace still shows something else than ours.
func (f *NodeFence) checkGoneAt(byPod map[string][]*probe.Mount, podUIDs []string, out []PodResult) {
	u := f.unmounter()
	for i, uid := range podUIDs {
		if out[i].Err != nil {
			continue
		}
		paths, err := f.podPaths(u, uid, byPod[uid])
		var differ []string
		if err == nil {
			differ, err = u.DifferIn(f.hostRoot(), paths)
		}
		switch {
		case err != nil:
			out[i].Err = fmt.Errorf("check the unmounts of pod %s: %w", uid, err)
		case len(differ) > 0:
			out[i].Err = fmt.Errorf("pod %s: %s is still mounted in %s after its unmount: our unmounts do not reach that mount namespace (is the kubelet root mounted with Bidirectional propagation?)", uid, differ[0], f.HostTable)
		}
	}
}

// podPaths lists the paths of mounts and the pod's CSI paths, each once.
func (f *NodeFence) podPaths(u *remount.Unmounter, uid string, mounts []*probe.Mount) ([]string, error) {
	csi, err := u.CSIPaths([]string{uid})
	if err != nil {
		return nil, fmt.Errorf("list the volume paths of pod %s: %w", uid, err)
	}
	paths := mountPaths(mounts)
	for _, p := range csi[uid] {
		if !slices.Contains(paths, p) {
			paths = append(paths, p)
		}
	}
	return paths, nil
}

// mountPaths lists the clean paths of mounts, each once.
func mountPaths(mounts []*probe.Mount) []string {
	var out []string
	for _, m := range mounts {
		if p := filepath.Clean(m.Path); !slices.Contains(out, p) {
			out = append(out, p)
		}
	}
	return out
}
