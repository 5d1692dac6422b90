package remount

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/types"
)

// Finding a pod's container processes.
//
// The Repairer needs a process of each container to read its mount table,
// to enter its mount namespace (live swap) and to probe its view of the
// volume (/proc/<pid>/root/<mountPath>). It looks in two places, in order:
//
//  1. The pod UID in /proc/<pid>/cgroup. kubelet puts each pod in a cgroup
//     named after its UID (cgroupfs: .../pod<uid>/<containerID>; systemd:
//     ...-pod<uid_with_underscores>.slice/cri-containerd-<id>.scope), and
//     the runtime puts each container's processes below it, in a cgroup
//     named after the container ID. One pass over /proc reads VFS data
//     only, needs no runtime socket, works with any runtime, finds every
//     container of the pod at once and keeps working while the runtime is
//     busy or restarting; the sandbox (pause) process is in the pod cgroup
//     too, and planSwap skips it because its namespace lacks the volume.
//  2. The runtime's verbose ContainerStatus (CRIClient.containerPID), for
//     every container when a CRI endpoint is set (the runtime's process of
//     a container is the one whose mount namespace a swap enters, over what
//     the cgroups say), and the only source for containers the cgroups do
//     not name: kubelet with cgroupsPerQOS: false gives pods no cgroup of
//     their own, and container IDs that the pod status does not carry
//     (yet). It is one call per container, and the
//     "pid" key of the verbose info is a containerd and CRI-O convention,
//     not part of the CRI.

// containerPIDs are the processes of byContainer, one per container, sorted:
// the mount namespaces a swap may enter are theirs.
func (pp *podProcs) containerPIDs() []int {
	var out []int
	for _, pid := range pp.byContainer {
		if !slices.Contains(out, pid) {
			out = append(out, pid)
		}
	}
	slices.Sort(out)
	return out
}

// podProcs are the processes found for one pod.
type podProcs struct {
	// pids are every process found: the pod's (cgroup), or one per
	// container (CRI).
	pids []int
	// byContainer maps container IDs to a process of the container (its
	// lowest PID, usually its init).
	byContainer map[string]int
	// how says where they were found, for the actions.
	how []string
}

// procSnapshot is one pass over /proc/<pid>/cgroup: the processes of each
// pod (by UID, dashed) and, per process, the cgroup path segment right below
// its pod's cgroup (where runtimes name container cgroups).
type procSnapshot struct {
	taken time.Time
	byPod map[string][]int
	ctr   map[int]string
}

// snapshotMaxAge is how long a snapshot serves later calls. The tiers of
// one repair (Restage, then LiveSwap) and the repairs of many volumes at
// once share one pass over /proc instead of one each; a container started
// since is missed by that much at most (its processes are then not swapped,
// but it bound the fresh mount when it started).
const snapshotMaxAge = time.Second

// procCache shares snapshots between concurrent calls.
type procCache struct {
	mu       sync.Mutex
	snap     *procSnapshot
	inflight chan struct{}
	err      error
}

func (c *procCache) get(procDir string) (*procSnapshot, error) {
	c.mu.Lock()
	for {
		if c.snap != nil && time.Since(c.snap.taken) < snapshotMaxAge {
			s := c.snap
			c.mu.Unlock()
			return s, nil
		}
		if c.inflight == nil {
			break
		}
		wait := c.inflight
		c.mu.Unlock()
		<-wait
		c.mu.Lock()
		if c.err != nil {
			err := c.err
			c.mu.Unlock()
			return nil, err
		}
	}
	done := make(chan struct{})
	c.inflight = done
	c.mu.Unlock()
	snap, err := takeSnapshot(procDir)
	c.mu.Lock()
	c.snap, c.err, c.inflight = snap, err, nil
	c.mu.Unlock()
	close(done)
	return snap, err
}

func takeSnapshot(procDir string) (*procSnapshot, error) {
	s := &procSnapshot{taken: time.Now(), byPod: map[string][]int{}, ctr: map[int]string{}}
	entries, err := os.ReadDir(procDir)
	if err != nil {
		return nil, fmt.Errorf("list processes: %w", err)
	}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid <= 0 {
			continue
		}
		data, err := readProcHead(filepath.Join(procDir, e.Name(), "cgroup"), maxCgroupFile+1)
		if err != nil || len(data) > maxCgroupFile {
			continue // exited, a kernel thread, or paths no runtime makes
		}
		if uid, ctr, ok := podOfCgroup(data); ok {
			s.byPod[uid] = append(s.byPod[uid], pid)
			if ctr != "" {
				s.ctr[pid] = ctr
			}
		}
	}
	return s, nil
}

// maxCgroupFile bounds a /proc/<pid>/cgroup read: a line per hierarchy,
// each path at most PATH_MAX; a process of a pod with a writable cgroup
// chooses its depth.
const maxCgroupFile = 64 << 10

// readProcHead reads at most max bytes of a /proc file: the files a pod's
// processes can grow are never read whole.
func readProcHead(path string, max int64) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return io.ReadAll(io.LimitReader(f, max))
}

// podOfCgroup reads the pod of a process from its /proc/<pid>/cgroup: the
// first pod segment of each cgroup path, and the container's segment right
// after it. Only kubelet makes pod cgroups, and only the runtime makes
// the container cgroups right below them: a segment a container user made
// further down (a writable cgroup, .../pod<A>/<ctr>/pod<B>) names nothing.
// A process whose hierarchies (cgroup v1) disagree on its pod or container
// is nobody's.
func podOfCgroup(data []byte) (uid, ctr string, ok bool) {
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		// hierarchy-ID:controllers:path; the path may hold colons.
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 {
			continue
		}
		segs := strings.Split(parts[2], "/")
		for i, seg := range segs {
			u, isPod := podOfSegment(seg)
			if !isPod {
				continue
			}
			if !kubeletPodCgroup(segs, i) {
				// The first pod segment is the only one that can name
				// the process's pod: one outside kubelet's hierarchy
				// names none.
				break
			}
			c := ""
			if i+1 < len(segs) {
				c = segs[i+1]
			}
			switch {
			case uid == "":
				uid, ctr = u, c
			case u != uid:
				return "", "", false
			case c != ctr:
				// A hierarchy without the container's cgroup (a v1
				// controller the runtime left at the pod level) says
				// nothing of the container; two different ones disagree.
				if ctr == "" {
					ctr = c
				} else if c != "" {
					return "", "", false
				}
			}
			break
		}
	}
	return uid, ctr, uid != ""
}

// kubeletPodCgroup reports whether the pod segment segs[i] sits where
// kubelet puts pod cgroups: right below its kubepods cgroup, or below a QoS
// class cgroup (burstable, besteffort) right below it. cgroupfs names them
// kubepods/<qos>/pod<uid>; systemd kubepods.slice/kubepods-<qos>.slice/
// kubepods-<qos>-pod<uid>.slice, each slice named after the whole path
// (kubernetes pkg/kubelet/cm/cgroup_manager_linux.go, ToSystemd;
// pkg/kubelet/cm/qos_container_manager_linux.go). A cgroup anyone else made
// (0::/user.slice/pod<uid>/..., a user's delegated systemd subtree) names no
// pod: the kubepods cgroup must have no systemd service or scope above it,
// the units systemd delegates to users, nor user.slice. A ".." segment is
// where the reader's cgroup namespace elides the path it shares with ours:
// in a private cgroup namespace the agent (itself a pod) shares kubepods
// and maybe its QoS class with the other pods, and sees them as
// /../../<qos>/pod<uid> or /../pod<uid>; a path outside kubepods keeps the
// names below the common ancestor, and is refused by them.
func kubeletPodCgroup(segs []string, i int) bool {
	seg := segs[i]
	j := i - 1 // the pod cgroup's parent
	if strings.HasSuffix(seg, ".slice") {
		// systemd: <parent>-pod<uid>.slice below <parent>.slice.
		base := strings.TrimSuffix(seg, ".slice")
		k := strings.LastIndex(base, "-pod")
		if k < 0 {
			return false
		}
		parent := base[:k]
		if j >= 0 && segs[j] == ".." {
			return aboveKubepodsClean(segs[:j])
		}
		if j < 0 || segs[j] != parent+".slice" {
			return false
		}
		name := parent[strings.LastIndex(parent, "-")+1:]
		if name == "burstable" || name == "besteffort" {
			parent = strings.TrimSuffix(parent, "-"+name)
			j--
			if j >= 0 && segs[j] == ".." {
				return aboveKubepodsClean(segs[:j])
			}
			if j < 0 || segs[j] != parent+".slice" {
				return false
			}
		}
		if parent != "kubepods" && !strings.HasSuffix(parent, "-kubepods") {
			return false
		}
		return aboveKubepodsClean(segs[:j])
	}
	// cgroupfs: kubepods[/<qos>]/pod<uid>.
	if j >= 0 && (segs[j] == "burstable" || segs[j] == "besteffort") {
		j--
	}
	switch {
	case j >= 0 && segs[j] == "..":
	case j >= 0 && segs[j] == "kubepods":
	default:
		return false
	}
	return aboveKubepodsClean(segs[:j])
}

// aboveKubepodsClean reports whether the segments above kubelet's kubepods
// cgroup hold no unit systemd delegates (a service, a scope) nor
// user.slice: a subtree someone may write to. One scope is let through: a
// container runtime's scope right below system.slice or machine.slice
// (docker-<id>.scope, libpod-<id>.scope), where a node that runs in a
// container (kind, k3d, minikube's docker driver, with the host's cgroup
// namespace) has its kubelet; only root's systemd makes units there, and
// a user's scopes sit below user.slice.
func aboveKubepodsClean(segs []string) bool {
	if len(segs) > 0 && segs[0] == "" { // the path's leading slash
		segs = segs[1:]
	}
	for i, s := range segs {
		switch {
		case s == "user.slice" || strings.HasSuffix(s, ".service"):
			return false
		case strings.HasSuffix(s, ".scope"):
			if i != 1 || (segs[0] != "system.slice" && segs[0] != "machine.slice") {
				return false
			}
		}
	}
	return true
}

// podOfSegment reads a pod UID from a cgroup path segment as kubelet names
// pod cgroups: "pod<uid>" (cgroupfs) or "...-pod<uid with _>.slice"
// (systemd).
func podOfSegment(seg string) (string, bool) {
	var uid string
	switch {
	case strings.HasSuffix(seg, ".slice"):
		base := strings.TrimSuffix(seg, ".slice")
		i := strings.LastIndex(base, "pod")
		if i < 0 || (i > 0 && base[i-1] != '-') {
			return "", false
		}
		uid = strings.ReplaceAll(base[i+3:], "_", "-")
	case strings.HasPrefix(seg, "pod"):
		uid = seg[3:]
	default:
		return "", false
	}
	// Pod UIDs are UUIDs, or 32 hex digits for static pods.
	return uid, len(uid) >= 32 && validUID(uid)
}

// PodPIDs lists, sorted, the processes whose cgroup names the pod podUID
// (its metadata.uid), from one pass over <procDir>/<pid>/cgroup ("/proc"
// when procDir is empty): the cgroupfs driver names the pod's cgroup
// "pod<uid>", the systemd driver "...-pod<uid with _ for ->.slice". Paths
// outside the reader's cgroup namespace show with ".." segments and still
// match. The sandbox (pause) process is included; planSwap skips it because
// its namespace lacks the volume.
func PodPIDs(procDir, podUID string) ([]int, error) {
	if procDir == "" {
		procDir = "/proc"
	}
	if !validUID(podUID) {
		return nil, fmt.Errorf("pod UID %q: want the pod's metadata.uid (hex digits and dashes)", podUID)
	}
	s, err := takeSnapshot(procDir)
	if err != nil {
		return nil, err
	}
	pids := slices.Clone(s.byPod[podUID])
	slices.Sort(pids)
	return pids, nil
}

func validUID(uid string) bool {
	if uid == "" {
		return false
	}
	for _, c := range uid {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') && (c < 'A' || c > 'F') && c != '-' {
			return false
		}
	}
	return true
}

// podProcs returns the processes of the pods in uids from a snapshot, and
// per pod the process of each of its containers that a cgroup names.
func (s *procSnapshot) podProcs(uids map[types.UID][]string) map[types.UID]*podProcs {
	out := make(map[types.UID]*podProcs, len(uids))
	for uid, ids := range uids {
		pp := &podProcs{byContainer: map[string]int{}}
		pp.pids = slices.Clone(s.byPod[string(uid)])
		slices.Sort(pp.pids)
		for _, pid := range pp.pids {
			for _, id := range ids {
				if _, ok := pp.byContainer[id]; !ok && segmentNames(s.ctr[pid], id) {
					pp.byContainer[id] = pid
				}
			}
		}
		if len(pp.pids) > 0 {
			pp.how = append(pp.how, fmt.Sprintf("%d processes in the pod's cgroup", len(pp.pids)))
		}
		out[uid] = pp
	}
	return out
}

// segmentNames reports whether the container segment of a process's cgroup
// names container id: the segment is the ID, or ends in "-<id>" (systemd
// scopes such as cri-containerd-<id>.scope).
func segmentNames(seg, id string) bool {
	if len(id) < minContainerID {
		return false
	}
	seg = strings.TrimSuffix(seg, ".scope")
	return seg == id || strings.HasSuffix(seg, "-"+id)
}

// minContainerID is the shortest container ID matched against cgroup names:
// shorter strings could match by accident.
const minContainerID = 12

// findProcs finds the processes of the containers of each pod (see the
// comment above): the cgroups first, the CRI for what they leave out.
// Errors are reported in the actions, not returned: a pod without processes
// is one whose containers cannot be reached, which the tiers say in their
// own terms.
func (r *Repairer) findProcs(ctx context.Context, pods []*podPlan) []Action {
	uids := make(map[types.UID][]string)
	for _, p := range pods {
		ids := uids[p.uid]
		for _, c := range p.pv.Containers {
			if c.ContainerID != "" {
				ids = append(ids, c.ContainerID)
			}
		}
		uids[p.uid] = ids
	}
	if len(uids) == 0 {
		return nil
	}
	var actions []Action
	found := map[types.UID]*podProcs{}
	snap, err := r.procs.get(r.procDir)
	if err != nil {
		actions = append(actions, Action{Op: opFindProcesses, Path: r.procDir, Err: err})
	} else {
		found = snap.podProcs(uids)
	}
	for _, p := range pods {
		pp := found[p.uid]
		if pp == nil {
			pp = &podProcs{byContainer: map[string]int{}}
		}
		a := Action{Op: opFindProcesses, Path: "pod " + string(p.uid)}
		var missing []string
		for _, c := range p.pv.Containers {
			if _, ok := pp.byContainer[c.ContainerID]; !ok && c.ContainerID != "" && !slices.Contains(missing, c.ContainerID) {
				missing = append(missing, c.ContainerID)
			}
		}
		if r.cfg.CRIEndpoint != "" {
			// The runtime has the last word on each container's process
			// (whose mount namespace a swap enters): every container is
			// asked, not only the ones the cgroups left out.
			var ids []string
			for _, c := range p.pv.Containers {
				if c.ContainerID != "" && !slices.Contains(ids, c.ContainerID) {
					ids = append(ids, c.ContainerID)
				}
			}
			err := r.criProcs(ctx, p, pp, ids)
			found := true
			for _, id := range ids {
				if _, ok := pp.byContainer[id]; !ok {
					found = false
				}
			}
			if err != nil && found {
				// The cgroups name every container: go on with them.
				pp.how = append(pp.how, "the runtime did not answer for every container ("+err.Error()+"), its cgroup named it")
				err = nil
			}
			a.Err = err
		}
		p.procs = pp
		a.Detail = strings.Join(pp.how, "; ")
		if len(pp.pids) == 0 {
			a.Detail = "no process found"
			if len(p.pv.Containers) == 0 {
				continue // nothing was looked for
			}
		}
		actions = append(actions, a)
	}
	return actions
}

// criProcs asks the runtime for the processes of the containers missing
// from the cgroup scan, or of every running container of the pod when the
// scan found none and the pod status named no IDs.
func (r *Repairer) criProcs(ctx context.Context, p *podPlan, pp *podProcs, ids []string) error {
	cri, err := r.criClient(ctx)
	if err != nil {
		return fmt.Errorf("find container processes of pod %s: %w", p.uid, err)
	}
	if len(ids) == 0 && len(pp.pids) == 0 {
		ctrs, err := cri.podContainers(ctx, string(p.uid))
		if err != nil {
			return fmt.Errorf("find container processes of pod %s: %w", p.uid, err)
		}
		for _, c := range ctrs {
			ids = append(ids, c.ID)
		}
	}
	var errs []error
	n := 0
	for _, id := range ids {
		pid, err := cri.containerPID(ctx, id)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		n++
		pp.byContainer[id] = pid
		if !slices.Contains(pp.pids, pid) {
			pp.pids = append(pp.pids, pid)
		}
	}
	if n > 0 {
		pp.how = append(pp.how, fmt.Sprintf("%d container processes from the runtime", n))
	}
	return errors.Join(errs...)
}
