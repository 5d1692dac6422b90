package remount

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

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
//     too, and PlanSwap skips it because its namespace lacks the volume.
//  2. The runtime's verbose ContainerStatus (CRIClient.ContainerPID), for
//     containers the cgroups do not name: kubelet with cgroupsPerQOS: false
//     gives pods no cgroup of their own, and container IDs that the pod
//     status does not carry (yet). It is one call per container, and the
//     "pid" key of the verbose info is a containerd and CRI-O convention,
//     not part of the CRI.

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

// scanPodCgroups reads /proc/<pid>/cgroup of every process once and returns
// the processes of each pod in uids, and per pod the process of each of its
// containers that a cgroup path names.
func scanPodCgroups(procDir string, uids map[types.UID][]string) (map[types.UID]*podProcs, error) {
	entries, err := os.ReadDir(procDir)
	if err != nil {
		return nil, fmt.Errorf("list processes: %w", err)
	}
	out := make(map[types.UID]*podProcs, len(uids))
	for uid := range uids {
		out[uid] = &podProcs{byContainer: map[string]int{}}
	}
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid <= 0 {
			continue
		}
		data, err := os.ReadFile(filepath.Join(procDir, e.Name(), "cgroup"))
		if err != nil {
			continue // exited, or a kernel thread
		}
		for uid, ids := range uids {
			if !cgroupHasPod(data, string(uid)) {
				continue
			}
			pp := out[uid]
			pp.pids = append(pp.pids, pid)
			for _, id := range ids {
				if old, ok := pp.byContainer[id]; (!ok || pid < old) && cgroupHasContainer(data, id) {
					pp.byContainer[id] = pid
				}
			}
		}
	}
	for _, pp := range out {
		slices.Sort(pp.pids)
		if len(pp.pids) > 0 {
			pp.how = append(pp.how, fmt.Sprintf("%d processes in the pod's cgroup", len(pp.pids)))
		}
	}
	return out, nil
}

// minContainerID is the shortest container ID matched against cgroup names:
// shorter strings could match by accident.
const minContainerID = 12

// cgroupHasContainer reports whether a /proc/<pid>/cgroup file puts the
// process in the cgroup of container id: a path segment that is the ID
// (cgroupfs driver) or ends in "-<id>" with an optional ".scope" (systemd
// driver: cri-containerd-<id>.scope, crio-<id>.scope, docker-<id>.scope).
func cgroupHasContainer(data []byte, id string) bool {
	if len(id) < minContainerID || strings.ContainsAny(id, "/\n") {
		return false
	}
	sc := bufio.NewScanner(bytes.NewReader(data))
	for sc.Scan() {
		parts := strings.SplitN(sc.Text(), ":", 3)
		if len(parts) != 3 {
			continue
		}
		for _, seg := range strings.Split(parts[2], "/") {
			seg = strings.TrimSuffix(seg, ".scope")
			if seg == id || strings.HasSuffix(seg, "-"+id) {
				return true
			}
		}
	}
	return false
}

// findProcs finds the processes of the containers of each pod (see the
// comment above): the cgroups first, the CRI for what they leave out. A
// ContainerMount.Pid the caller set is taken as given. Errors are reported
// in the actions, not returned: a pod without processes is one whose
// containers cannot be reached, which the tiers say in their own terms.
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
	found, err := scanPodCgroups(r.procDir, uids)
	if err != nil {
		actions = append(actions, Action{Op: OpFindProcesses, Path: r.procDir, Err: err})
		found = map[types.UID]*podProcs{}
	}
	for _, p := range pods {
		pp := found[p.uid]
		if pp == nil {
			pp = &podProcs{byContainer: map[string]int{}}
		}
		for _, c := range p.pv.Containers {
			if c.Pid > 0 && c.ContainerID != "" {
				pp.byContainer[c.ContainerID] = c.Pid
			}
			if c.Pid > 0 && !slices.Contains(pp.pids, c.Pid) {
				pp.pids = append(pp.pids, c.Pid)
			}
		}
		a := Action{Op: OpFindProcesses, Path: "pod " + string(p.uid)}
		var missing []string
		for _, c := range p.pv.Containers {
			if _, ok := pp.byContainer[c.ContainerID]; !ok && c.ContainerID != "" && !slices.Contains(missing, c.ContainerID) {
				missing = append(missing, c.ContainerID)
			}
		}
		if (len(missing) > 0 || len(pp.pids) == 0) && r.cfg.CRIEndpoint != "" {
			a.Err = r.criProcs(ctx, p, pp, missing)
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
		ctrs, err := cri.PodContainers(ctx, string(p.uid))
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
		pid, err := cri.ContainerPID(ctx, id)
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
