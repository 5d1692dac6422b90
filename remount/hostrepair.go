package remount

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"slices"
	"strconv"
	"time"

	"github.com/mountmedic/mountmedic/probe"
	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// freshPublishName is the directory beside a kept publish target where the
// driver publishes the fresh volume before it is bound over the dead one.
const freshPublishName = ".mountmedic-publish"

// podPlan is one pod of a volume during a tier run.
type podPlan struct {
	pv     *PodVolume
	uid    types.UID
	target string
	// refused is why the pod is left alone (an unsafe or missing path);
	// none of its mounts is touched then.
	refused error
	// publish: the publish target is dead or missing and needs a publish.
	publish bool
	// keep is the dead mount on top of the publish target when containers
	// of the pod receive host mounts there (HostToContainer,
	// Bidirectional): it stays attached and the fresh mount goes on top of
	// it, so that it propagates to them.
	keep *probe.Mount
	// subPaths are the pod's dead subPath binds on the host.
	subPaths []subPathBind
	// deadRoot is the mountinfo root of the dead publish target ("/" for
	// a bind of the staging mount's root).
	deadRoot string
	// procs are the pod's container processes, once looked for.
	procs *podProcs
	// views are the containers' views of the volume that the host repair
	// reaches by propagation, to verify.
	views []place
}

// subPathBind is a subPath bind of kubelet's: the host path under
// volume-subpaths and its mountinfo root, the directory (or file) of the
// volume it shows.
type subPathBind struct {
	path string
	root string
}

// hostRun is the host side of a repair of one volume, shared by the tiers:
// what was found, what was done, and what to verify.
type hostRun struct {
	r       *Repairer
	v       *Volume
	logger  klog.Logger
	table   *hostTable
	dead    devSet
	staging string
	stage   bool
	pods    []*podPlan
	actions []Action
	client  *CSIClient
}

func (h *hostRun) add(acts ...Action) { h.actions = append(h.actions, acts...) }

// places are what the host repair can reach: the staging path, each pod's
// publish target and the container views that receive the fresh mount by
// propagation.
func (h *hostRun) places() []place {
	var out []place
	if h.staging != "" {
		out = append(out, hostPlace(h.staging))
	}
	for _, p := range h.pods {
		if p.refused != nil {
			continue
		}
		out = append(out, hostPlace(p.target))
		out = append(out, p.views...)
	}
	return out
}

// fresh checks that the pod's publish target answers a probe: what a swap
// clones and what a restarted container binds. In dry-run the host is not
// repaired, so it is not checked.
func (h *hostRun) fresh(ctx context.Context, p *podPlan) error {
	if h.r.cfg.DryRun {
		return nil
	}
	if st, err := h.r.check(ctx, p.target); err != nil {
		return fmt.Errorf("pod %s: its publish target %s is not healthy (%s: %w): nothing fresh to give its containers", p.uid, p.target, st, err)
	}
	return nil
}

// refusedErr joins why pods were left alone.
func (h *hostRun) refusedErr() error {
	var errs []error
	for _, p := range h.pods {
		if p.refused != nil {
			errs = append(errs, p.refused)
		}
	}
	return errors.Join(errs...)
}

// podUID finds the pod of a PodVolume: its publish request, its containers
// or its dead mounts name it.
func podUID(pv *PodVolume) types.UID {
	if pv.Publish.PodUID != "" {
		return pv.Publish.PodUID
	}
	for _, c := range pv.Containers {
		if c.PodUID != "" {
			return c.PodUID
		}
	}
	for _, m := range pv.Dead {
		if m != nil && m.Target.PodUID != "" {
			return types.UID(m.Target.PodUID)
		}
	}
	return ""
}

// errBlockVolume marks a raw block volume: remount does not re-stage or
// swap block devices; the agent leaves such volumes to eviction.
var errBlockVolume = errors.New("raw block volume: not repaired in place, left to eviction")

// repairHost brings the volume back on the host, idempotently: staging
// mount and publish targets healthy, dead subPath binds gone. With nothing
// dead on the host it only reads the mount table and probes the tops. The
// error is set when the volume as a whole cannot be repaired (a refused
// staging path, the driver down, a failed NodeStageVolume); a pod whose
// paths are refused is left alone and named in refusedErr.
func (r *Repairer) repairHost(ctx context.Context, v *Volume) (*hostRun, error) {
	h := &hostRun{r: r, v: v, logger: klog.FromContext(ctx)}
	switch {
	case v == nil:
		return h, errors.New("repair: no volume given")
	case v.Stage.Block:
		h.add(Action{Op: opSkip, Path: v.Stage.StagingPath, Detail: "raw block volume", Err: errBlockVolume})
		return h, fmt.Errorf("volume %q of %s: %w", v.VolumeHandle, v.Driver, errBlockVolume)
	case v.Driver == "":
		return h, fmt.Errorf("volume %q: no CSI driver named: the agent resolves it from the PV", v.VolumeHandle)
	case v.Stage.StageUnstage && v.Stage.StagingPath == "":
		return h, fmt.Errorf("volume %q of %s: the driver stages volumes but the request has no staging path", v.VolumeHandle, v.Driver)
	}
	if v.Stage.StageUnstage {
		h.staging = filepath.Clean(v.Stage.StagingPath)
	}
	h.dead = deadDevs(v)

	// Every path is checked before anything is changed.
	if h.staging != "" {
		if err := r.checkPlace(h.staging); err != nil {
			h.add(Action{Op: opSkip, Path: h.staging, Detail: "staging path refused: the volume is left as it is", Err: err})
			return h, fmt.Errorf("volume %q of %s: %w", v.VolumeHandle, v.Driver, err)
		}
	}
	for i := range v.Pods {
		pv := &v.Pods[i]
		p := &podPlan{pv: pv, uid: podUID(pv), target: filepath.Clean(pv.Publish.TargetPath), deadRoot: "/"}
		h.pods = append(h.pods, p)
		if pv.Publish.TargetPath == "" {
			p.refused = fmt.Errorf("pod %s: no publish target path in its request: the agent fills it from the pod", p.uid)
		} else if err := r.checkPlace(p.target); err != nil {
			p.refused = fmt.Errorf("pod %s: %w", p.uid, err)
		}
		if p.refused != nil {
			h.add(Action{Op: opSkip, Path: pv.Publish.TargetPath, Detail: "pod left alone", Err: p.refused})
			h.logger.Error(p.refused, "Pod left alone", "podUID", p.uid)
		}
	}
	var err error
	if h.table, err = r.readStacks(h.ownPaths()); err != nil {
		return h, err
	}

	h.confirmDead(ctx)

	// What is dead: tops on a known dead device, or tops that fail a probe.
	// A top on a dead device is not probed again (it may hang).
	needs := func(path string) bool {
		top := h.table.top(path)
		switch {
		case top == nil:
			return true
		case h.dead[top.Dev]:
			return true
		case top.Guard:
			// The guard stands where the volume lost its mount: it goes
			// like a dead mount, and containers that bound it get the
			// fresh mount swapped in.
			h.dead[top.Dev] = true
			return true
		}
		if _, err := r.check(ctx, path); err != nil {
			h.logger.V(2).Info("Mount on top is broken too", "path", path, "dev", top.Dev, "err", err)
			h.dead[top.Dev] = true
			return true
		}
		return false
	}
	if h.staging != "" {
		h.stage = needs(h.staging)
	}
	for _, p := range h.pods {
		if p.refused != nil {
			continue
		}
		p.publish = needs(p.target)
		if d := h.table.deadTop(p.target, h.dead); len(d) > 0 {
			p.deadRoot = d[0].Root
		} else {
			for _, m := range p.pv.Dead {
				if m != nil && m.Target.Kind == kubelet.KindPublish && m.Root != "" {
					p.deadRoot = m.Root
				}
			}
		}
	}
	for _, dev := range h.dead.list() {
		b := h.table.byDev[dev]
		if b == nil {
			continue
		}
		for _, m := range b.Mounts {
			if m.Target.Kind != kubelet.KindSubPath {
				continue
			}
			for _, p := range h.pods {
				if p.refused == nil && string(p.uid) == m.Target.PodUID &&
					!slices.ContainsFunc(p.subPaths, func(b subPathBind) bool { return b.path == m.Path }) {
					p.subPaths = append(p.subPaths, subPathBind{path: m.Path, root: m.Root})
				}
			}
		}
	}
	work := h.stage
	for _, p := range h.pods {
		work = work || p.publish || len(p.subPaths) > 0
	}
	if !work {
		h.logger.V(4).Info("Nothing dead on the host")
		return h, nil
	}

	// The driver must answer before anything is unmounted: a driver that
	// is down leaves every mount as it was.
	if err := h.checkDriver(ctx); err != nil {
		return h, err
	}
	h.planKeep(ctx)
	h.abortHung(ctx)
	if err := h.unmountDead(ctx); err != nil {
		return h, err
	}
	if err := h.stageVolume(ctx); err != nil {
		return h, err
	}
	for _, p := range h.pods {
		if p.refused != nil {
			continue
		}
		var err error
		switch {
		case !p.publish:
		case p.keep != nil:
			err = h.publishOver(ctx, p)
		default:
			err = h.publishPod(ctx, p)
		}
		if errors.Is(err, ErrDriverUnavailable) {
			return h, err
		}
		if err == nil {
			h.rebindSubPaths(ctx, p)
		}
	}
	return h, nil
}

// ownPaths are the volume's own paths, where a repair looks for mounts:
// the staging path, and each pod's publish target, its subPath binds and
// the paths of its dead mounts that the caller named.
func (h *hostRun) ownPaths() []string {
	var out []string
	if h.staging != "" {
		out = append(out, h.staging)
	}
	for _, p := range h.pods {
		if p.refused != nil {
			continue
		}
		out = append(out, p.target)
		binds, err := h.r.subPathBinds(p.target)
		if err != nil {
			h.logger.V(2).Info("Listing the subPath binds failed", "podUID", p.uid, "err", err)
		}
		out = append(out, binds...)
		for _, m := range p.pv.Dead {
			if m != nil && m.Path != "" {
				out = append(out, m.Path)
			}
		}
	}
	return out
}

// confirmDead probes again, before anything is changed, one mount of each
// device the caller found dead that is on top at the volume's own paths
// (its staging path, then its pods' targets), and forgets a device whose
// mount answers: it is not the dead mount the caller's probe found. A
// device number (and, in one mount namespace, a mount ID) is free for reuse
// once the dead filesystem is gone, and the kernel hands out the lowest
// free one: a mount that someone else (a CSI driver recovering its own
// mounts, an earlier run) made at the same path since the caller's probe
// can carry both, and without this probe would be unmounted and staged
// again. A dead FUSE connection answers at once (ENOTCONN), so the probe
// costs nothing on a volume that is still dead. Only FUSE filesystems are
// probed again: a filesystem on a dead block device answers statfs and
// statx from memory (the agent's probe found it by reading the device or
// its error counter), and its device number is the block device's, not one
// handed out to the next mount. mountmedic's guard, which answers, goes
// like a dead mount and is not probed.
func (h *hostRun) confirmDead(ctx context.Context) {
	for _, dev := range h.dead.list() {
		if path, top := h.ownTop(dev); top != nil && !top.Guard && h.table.fuse(dev) && !h.r.stillBroken(ctx, h.v, path) {
			h.leaveAnswering(path, top)
		}
	}
}

// stillBroken says whether the mount at path, on a device v names broken,
// is still the broken one the caller found. A hung volume whose probe is
// still stuck is (see Volume.Hung), and so is one without a backend to ask
// about; any other is probed, and is broken unless it answers.
func (r *Repairer) stillBroken(ctx context.Context, v *Volume, path string) bool {
	if v.Hung && (v.Backend == nil || r.prober.Stuck(v.Backend.Dev)) {
		return true
	}
	_, err := r.check(ctx, path)
	return err != nil
}

// answering is the action of a tier that left a mount on a device reported
// broken alone because it answered.
func answering(path string, top *probe.Mount, dryRun bool) Action {
	return Action{Op: opSkip, Path: path, DryRun: dryRun,
		Detail: fmt.Sprintf("mount %d on device %s answers: not the broken mount that was found (its device was reused, or it recovered); left alone", top.ID, top.Dev)}
}

// ownTop returns the first of the volume's own paths (staging path, then
// the pods' targets) whose top mount is on dev, and that mount.
func (h *hostRun) ownTop(dev probe.Dev) (string, *probe.Mount) {
	if h.staging != "" {
		if top := h.table.top(h.staging); top != nil && top.Dev == dev {
			return h.staging, top
		}
	}
	for _, p := range h.pods {
		if p.refused != nil {
			continue
		}
		if top := h.table.top(p.target); top != nil && top.Dev == dev {
			return p.target, top
		}
	}
	return "", nil
}

// leaveAnswering forgets the dead device of top, a mount that answered.
func (h *hostRun) leaveAnswering(path string, top *probe.Mount) {
	delete(h.dead, top.Dev)
	h.add(answering(path, top, h.r.cfg.DryRun))
	h.logger.Info("A mount on a device reported broken answers: left alone", "path", path, "mountID", top.ID, "dev", top.Dev.String())
}

// checkPlace proves that path, or its closest existing ancestor, lies below
// the kubelet root without a symlink (openSafe).
func (r *Repairer) checkPlace(path string) error {
	p := filepath.Clean(path)
	for {
		sp, err := openSafe(r.root, p)
		if err == nil {
			sp.Close()
			return nil
		}
		if !errors.Is(err, fs.ErrNotExist) {
			return err
		}
		parent := filepath.Dir(p)
		if parent == r.root {
			return nil // nothing below the root exists yet: no symlink either
		}
		if parent == p || !kubelet.Under(r.root, parent) {
			return fmt.Errorf("resolve %s: %w", path, err)
		}
		p = parent
	}
}

func (h *hostRun) checkDriver(ctx context.Context) error {
	start := time.Now()
	c, caps, err := h.r.checkDriver(ctx, h.v.Driver)
	a := Action{Op: opCheckDriver, Path: h.v.Driver, Took: time.Since(start)}
	if err != nil {
		a.Err = fmt.Errorf("csi driver %s: %w", h.v.Driver, err)
		a.Detail = "driver does not answer: nothing unmounted"
		h.add(a)
		h.logger.V(2).Info("CSI driver does not answer; nothing changed", "err", err)
		return a.Err
	}
	a.Detail = fmt.Sprintf("endpoint %s, stage/unstage %t", c.Endpoint(), caps.StageUnstage)
	h.add(a)
	h.client = c
	return nil
}

// planKeep finds the pods whose containers see the dead publish target
// through propagation (slave or shared mounts of the whole volume). Their
// dead publish target stays attached, and the fresh mount is bound on top
// of it: the mount propagates to those containers. A host unmount would
// not reach them (see the package documentation).
func (h *hostRun) planKeep(ctx context.Context) {
	var look []*podPlan
	for _, p := range h.pods {
		if top := h.table.top(p.target); top != nil && top.Guard {
			// No container receives the guard by propagation (a
			// container's bind of it is its own mount, which the swap
			// replaces): it is unmounted, never kept under the fresh
			// mount, where it would outlive the repair.
			continue
		}
		if p.refused == nil && p.publish && len(p.pv.Containers) > 0 && len(h.table.deadTop(p.target, h.dead)) > 0 {
			look = append(look, p)
		}
	}
	if len(look) == 0 {
		return
	}
	h.add(h.r.findProcs(ctx, look)...)
	for _, p := range look {
		if p.procs == nil || len(p.procs.pids) == 0 {
			continue
		}
		// Only the containers' own mount namespaces: one a process of the
		// pod made is the pod's to fill, and receives nothing from us.
		mounts, err := namespaceMounts(h.r.procDir, p.procs.containerPIDs(), h.dead.list())
		if err != nil {
			h.logger.V(2).Info("Reading container mount tables failed", "podUID", p.uid, "err", err)
		}
		for _, m := range mounts {
			if m.Covered || propagationOf(m.Optional) == propagationNone {
				continue
			}
			if sub, ok := relRoot(p.deadRoot, m.Root); !ok || sub != "" {
				continue // a subPath: no host mount reaches it
			}
			p.views = append(p.views, containerPlace(h.r.procDir, m.Pid, m.Path))
		}
		if len(p.views) > 0 {
			p.keep = h.table.top(p.target)
			h.logger.V(2).Info("Containers receive host mounts: over-mounting the dead publish target", "podUID", p.uid, "views", len(p.views))
		}
	}
}

// abortHung aborts the FUSE connections of the dead filesystems when the
// volume is hung (the caller's probe said so): blocked callers then get ECONNABORTED instead of hanging on
// the mount once it is detached. A connection is aborted only while our
// mount table holds a mount of it on top at one of this volume's own paths
// (staging path, publish targets, dead subPath binds): connection numbers
// are reused once a connection ends.
func (h *hostRun) abortHung(ctx context.Context) {
	if !h.v.Hung {
		// Requests waiting on a connection the probe did not find hung are
		// a live daemon's work (a dead daemon's connection ends with it):
		// aborting it would break a healthy, busy volume (say, one whose
		// only fault is a publish target kubelet has not mounted yet).
		return
	}
	u := h.r.unmounter()
	u.Users, u.Home = h.v.users(), h.v.daemonHome()
	var own []string
	if h.staging != "" {
		own = append(own, h.staging)
	}
	for _, p := range h.pods {
		if p.refused != nil {
			continue
		}
		own = append(own, p.target)
		for _, sp := range p.subPaths {
			own = append(own, sp.path)
		}
	}
	for _, dev := range h.dead.list() {
		at := h.table.fuseMountOn(dev, own)
		if at == nil {
			continue
		}
		// The probe that found the hang may have returned since
		// confirmDead: then the connection on this number may be
		// another's, and it is probed before it is aborted.
		if !h.r.stillBroken(ctx, h.v, at.Path) {
			h.leaveAnswering(at.Path, at)
			continue
		}
		acts, _ := u.AbortFUSE(ctx, dev, at)
		h.add(acts...)
	}
}

// unmountDead lazily unmounts the dead mounts that a fresh stage or publish
// must replace, deepest path first: the pods' dead subPath binds (kubelet
// binds them again when a container starts), the dead publish targets of
// pods that keep none, and the staging mount. On each path it unmounts the
// dead mounts from the top down, each only while it is the one on top.
func (h *hostRun) unmountDead(ctx context.Context) error {
	type job struct {
		path string
		pod  *podPlan // nil for the staging path
	}
	var jobs []job
	for _, p := range h.pods {
		if p.refused != nil {
			continue
		}
		for _, sp := range p.subPaths {
			jobs = append(jobs, job{sp.path, p})
		}
		if p.publish && p.keep == nil {
			jobs = append(jobs, job{p.target, p})
		}
	}
	if h.stage {
		jobs = append(jobs, job{h.staging, nil})
	}
	slices.SortStableFunc(jobs, func(a, b job) int { return depth(b.path) - depth(a.path) })
	u := h.r.unmounter()
	for _, j := range jobs {
		acts, err := h.table.unmountDead(ctx, u, j.path, h.dead)
		h.add(acts...)
		switch {
		case err == nil:
		case j.pod == nil:
			return fmt.Errorf("volume %q of %s: unmount the dead staging mount: %w", h.v.VolumeHandle, h.v.Driver, err)
		case j.path == j.pod.target:
			j.pod.refused = fmt.Errorf("pod %s: unmount its dead publish target: %w", j.pod.uid, err)
		}
	}
	return nil
}

// unmountDead lazily unmounts the dead mounts on top of path, from the top
// down, each only while it is the mount on top there (UnmountMounts); it
// stops at the first that fails. In dry-run the top is checked and planned,
// and the dead mounts below it are planned as such.
func (t *hostTable) unmountDead(ctx context.Context, u *Unmounter, path string, dead devSet) ([]Action, error) {
	var out []Action
	for i, m := range t.deadTop(path, dead) {
		if i > 0 && u.DryRun {
			out = append(out, Action{Op: opUnmount, Path: path, DryRun: true, Detail: "mount " + strconv.Itoa(m.ID) + ", below the one above"})
			continue
		}
		acts, err := u.UnmountMounts(ctx, []*probe.Mount{{Path: path, ID: m.ID, UniqueID: m.UniqueID}})
		out = append(out, acts...)
		if err != nil {
			return out, err
		}
	}
	return out, nil
}

func (h *hostRun) stageVolume(ctx context.Context) error {
	if !h.stage {
		return nil
	}
	a := Action{Op: opStage, Path: h.staging, DryRun: h.r.cfg.DryRun, Detail: "NodeStageVolume of " + h.v.VolumeHandle}
	if h.r.cfg.DryRun {
		h.add(a)
		return nil
	}
	start := time.Now()
	err := h.client.NodeStageVolume(ctx, kubelet.StageRequest(h.v.Stage))
	a.Took = time.Since(start)
	if err != nil {
		a.Err = fmt.Errorf("stage volume %q at %s: %w", h.v.VolumeHandle, h.staging, err)
		h.add(a)
		h.logger.Error(err, "NodeStageVolume failed", "stagingPath", h.staging)
		return a.Err
	}
	h.add(a)
	h.logger.V(2).Info("Staged volume", "stagingPath", h.staging, "took", a.Took)
	return nil
}

// publishPod sends NodePublishVolume for the pod's publish target, which
// holds no dead mount any more.
func (h *hostRun) publishPod(ctx context.Context, p *podPlan) error {
	a := Action{Op: opPublish, Path: p.target, DryRun: h.r.cfg.DryRun, Detail: "NodePublishVolume of " + h.v.VolumeHandle}
	if h.r.cfg.DryRun {
		h.add(a)
		return nil
	}
	start := time.Now()
	err := h.client.NodePublishVolume(ctx, kubelet.PublishRequest(p.pv.Publish))
	a.Took = time.Since(start)
	if err != nil {
		a.Err = fmt.Errorf("publish volume %q at %s: %w", h.v.VolumeHandle, p.target, err)
		h.logger.Error(err, "NodePublishVolume failed", "targetPath", p.target)
	} else {
		h.logger.V(2).Info("Published volume", "targetPath", p.target, "took", a.Took)
	}
	h.add(a)
	return a.Err
}

// publishOver gives a pod whose containers receive host mounts the fresh
// volume without taking the dead publish target away: the driver publishes
// the volume at a directory beside the target (its own NodePublishVolume,
// read-only and mount flags included), the fresh mount is bound over the
// dead one (overMounter; it propagates into the containers), and the
// directory beside is lazily unmounted and removed. The bind keeps the
// fresh filesystem alive; NodeUnpublishVolume is not used on the directory
// beside because a driver that runs one FUSE daemon per publish would stop
// it.
func (h *hostRun) publishOver(ctx context.Context, p *podPlan) error {
	dir := filepath.Dir(p.target)
	temp := filepath.Join(dir, freshPublishName)
	desc := fmt.Sprintf("NodePublishVolume of %s beside the dead publish target, to bind over it", h.v.VolumeHandle)
	if h.r.cfg.DryRun {
		h.add(Action{Op: opPublish, Path: temp, DryRun: true, Detail: desc},
			Action{Op: opOverMount, Path: p.target, DryRun: true, Detail: fmt.Sprintf("bind the fresh mount at %s over dead mount %d (containers with propagation receive it)", temp, p.keep.ID)},
			Action{Op: opUnmount, Path: temp, DryRun: true, Detail: "the fresh mount beside, once bound over"})
		return nil
	}
	fail := func(op Op, path string, err error) error {
		err = fmt.Errorf("pod %s: %s %s: %w", p.uid, op, path, err)
		h.add(Action{Op: op, Path: path, Err: err})
		h.logger.Error(err, "Over-mount of the publish target failed")
		return err
	}
	// The top may have changed: another pod's over-mount propagates to
	// this pod's publish target too (both are peers of the staging mount).
	cur, err := openSafe(h.r.root, p.target)
	if err != nil {
		return fail(opOverMount, p.target, err)
	}
	topID := cur.MountID
	changed := cur.isMount(p.keep)
	cur.Close()
	if changed != nil {
		h.add(Action{Op: opOverMount, Path: p.target, Detail: fmt.Sprintf("mount %d is on top now, not dead mount %d: received by propagation, nothing to publish", topID, p.keep.ID)})
		return nil
	}
	parent, err := openSafe(h.r.root, dir)
	if err != nil {
		return fail(opPublish, temp, err)
	}
	defer parent.Close()
	if err := unix.Mkdirat(parent.FD(), freshPublishName, 0o750); err != nil && !errors.Is(err, unix.EEXIST) {
		return fail(opPublish, temp, fmt.Errorf("create directory: %w", err))
	}
	u := h.r.unmounter()
	cleanup := func() {
		acts, _ := u.Unmount(ctx, []string{temp})
		for i := range acts {
			acts[i].Detail = "fresh mount beside: " + acts[i].Detail
		}
		h.add(acts...)
		if err := unix.Unlinkat(parent.FD(), freshPublishName, unix.AT_REMOVEDIR); err != nil && !errors.Is(err, unix.ENOENT) {
			h.logger.Error(err, "Removing the directory beside the publish target failed", "path", temp)
		}
	}
	// A mount left there by an interrupted run goes first.
	if sp, err := openSafe(h.r.root, temp); err == nil {
		if sp.IsMountPoint() {
			acts, _ := u.Unmount(ctx, []string{temp})
			h.add(acts...)
		}
		sp.Close()
	}

	req := kubelet.PublishRequest(p.pv.Publish)
	req.TargetPath = temp
	start := time.Now()
	err = h.client.NodePublishVolume(ctx, req)
	a := Action{Op: opPublish, Path: temp, Detail: desc, Took: time.Since(start)}
	if err != nil {
		a.Err = fmt.Errorf("pod %s: publish volume %q at %s: %w", p.uid, h.v.VolumeHandle, temp, err)
		h.add(a)
		cleanup()
		return a.Err
	}
	h.add(a)
	om := &overMounter{Root: h.r.root, Sys: h.r.cfg.Sys}
	acts, err := om.overMount(ctx, temp, &probe.Mount{Path: p.target, ID: p.keep.ID, UniqueID: p.keep.UniqueID})
	h.add(acts...)
	cleanup()
	if err != nil {
		return fmt.Errorf("pod %s: %w", p.uid, err)
	}
	h.logger.V(2).Info("Bound the fresh volume over the dead publish target", "targetPath", p.target, "deadMountID", p.keep.ID)
	return nil
}

// rebindSubPaths binds the pod's subPath binds again from its fresh publish
// target, as kubelet binds them when a container starts: the subdirectory
// (or file) is opened below the publish target without following any
// symlink (it is the user's data: a symlink must not bind a host path),
// the target under volume-subpaths must pass openSafe and hold no mount.
// kubelet reuses the bind when a container starts again; a running
// container keeps its own (LiveSwap replaces that).
//
// One failure is logged once: binds of the same subdirectory (several
// containers, several mounts) that fail for the same reason share a line.
func (h *hostRun) rebindSubPaths(ctx context.Context, p *podPlan) {
	type failure struct {
		err   error
		paths []string
	}
	var failed []*failure
	defer func() {
		for _, f := range failed {
			h.logger.Error(f.err, "Binding a subPath again failed", "podUID", p.uid, "paths", f.paths)
		}
	}()
	for _, b := range p.subPaths {
		sub, ok := relRoot(p.deadRoot, liveRoot(b.root))
		if !ok || sub == "" {
			continue
		}
		a := Action{Op: opBind, Path: b.path, DryRun: h.r.cfg.DryRun, Detail: "bind " + filepath.Join(p.target, sub) + " again, as kubelet binds a subPath"}
		if h.r.cfg.DryRun {
			h.add(a)
			continue
		}
		start := time.Now()
		err := h.r.bindSubPath(ctx, p.target, sub, b.path)
		a.Took = time.Since(start)
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				// The fresh volume lacks what the dead one showed: data its
				// daemon acknowledged but never stored died with it.
				err = fmt.Errorf("%w: the fresh volume has no %s (writes the dead daemon acknowledged but never stored are lost)", err, sub)
			}
			a.Err = fmt.Errorf("pod %s: bind subPath %s at %s: %w", p.uid, sub, b.path, err)
			i := slices.IndexFunc(failed, func(f *failure) bool { return f.err.Error() == err.Error() })
			if i < 0 {
				failed = append(failed, &failure{err: err})
				i = len(failed) - 1
			}
			failed[i].paths = append(failed[i].paths, b.path)
		}
		h.add(a)
	}
}

// bindSubPath binds sub, below the fresh publish target, onto target. The
// lookup of sub asks the fresh volume's filesystem: it is bounded
// (freshLookupTimeout, lookupFlights), so a fresh daemon that never
// answers fails the bind instead of holding the repair worker for good.
func (r *Repairer) bindSubPath(ctx context.Context, publish, sub, target string) error {
	src, err := openSafe(r.root, publish)
	if err != nil {
		return err
	}
	defer src.Close()
	if !src.IsMountPoint() {
		return fmt.Errorf("publish target %s is not a mount point", publish)
	}
	fd, err := r.lookups.open(ctx, filepath.Join(publish, sub), src.FD(), sub, r.lookupTimeout)
	if err != nil {
		if errors.Is(err, probe.ErrHung) || ctx.Err() != nil {
			return err
		}
		return resolveErr(publish, filepath.Join(publish, sub), filepath.Join(publish, sub), err)
	}
	defer unix.Close(fd)
	dst, err := openSafe(r.root, target)
	if err != nil {
		return err
	}
	defer dst.Close()
	if dst.IsMountPoint() {
		return fmt.Errorf("mount %d is on %s already: %w", dst.MountID, target, ErrMountChanged)
	}
	return r.cfg.Sys.orHost().Mount("/proc/self/fd/"+strconv.Itoa(fd), dst.FDPath(), "", unix.MS_BIND, "")
}
