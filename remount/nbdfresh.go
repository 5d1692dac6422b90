package remount

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/mountmedic/mountmedic/probe"
	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// A fresh filesystem on the kept device.
//
// A filesystem that went to errors (shut down, or read-only after a
// journal abort) on a device that answers needs a fresh mount. But the
// kernel gives a second mount of a block device the superblock it already
// has (mount_bdev finds it by device): while any mount of the failed
// filesystem is left anywhere (a publish target, a subPath bind, a
// container's own bind), a re-stage mounts the failed filesystem again and
// a live swap swaps failed for failed. So every reference goes first:
// each pod's dead publish target is unmounted and mountmedic's guard put
// there, each container's bind of the failed filesystem is swapped for a
// clone of that guard (an empty read-only tmpfs), the dead subPath binds
// and the staging mount are unmounted; once the superblock is gone the
// driver stages the kept device afresh (the journal is replayed: what was
// fsync'd is there), publishes it, and the guard in each container is
// swapped for the fresh volume.

// releaseWait bounds the wait for the failed superblock to go.
const releaseWait = 10 * time.Second

// freshFilesystem replaces the failed filesystem of the volume's kept
// device with a fresh mount of it, everywhere the volume is seen (see
// above). st is the volume's staging mount of the failed filesystem.
func (r *Repairer) freshFilesystem(ctx context.Context, v *Volume, st reattachStaging, o *Outcome) {
	add := func(acts ...Action) { o.Actions = append(o.Actions, acts...) }
	staging := filepath.Clean(v.Stage.StagingPath)
	dev := st.mount.Dev
	if r.cfg.DryRun {
		add(Action{Op: opStage, Path: staging, DryRun: true,
			Detail: "release the failed filesystem of /dev/" + st.device + " (guard the publish targets, swap the containers onto the guard, unmount), stage and publish the kept device afresh, swap the containers back"})
		o.Err = actionsErr(o.Actions)
		return
	}
	table, err := r.hostTable()
	if err != nil {
		o.Err = err
		return
	}
	u := r.unmounter()
	dead := devSet{dev: true}
	var plans []*podPlan
	for i := range v.Pods {
		pv := &v.Pods[i]
		p := &podPlan{pv: pv, uid: podUID(pv), target: filepath.Clean(pv.Publish.TargetPath), deadRoot: "/"}
		if pv.Publish.TargetPath == "" {
			p.refused = fmt.Errorf("pod %s: no publish target path in its request", p.uid)
		} else if err := r.checkPlace(p.target); err != nil {
			p.refused = fmt.Errorf("pod %s: %w", p.uid, err)
		}
		if p.refused != nil {
			add(Action{Op: opSkip, Path: pv.Publish.TargetPath, Detail: "pod left alone", Err: p.refused})
		}
		plans = append(plans, p)
	}
	add(r.findProcs(ctx, plans)...)

	// 1. Each pod's publish target: the dead bind off, the guard on, the
	// containers onto clones of the guard.
	sw := &swapper{Root: r.root, ProcDir: r.procDir, Sys: r.cfg.Sys}
	guards := map[*podPlan]*probe.Mount{}
	for _, p := range plans {
		if p.refused != nil {
			continue
		}
		acts, err := table.unmountDead(ctx, u, p.target, dead)
		add(acts...)
		if err != nil {
			p.refused = err
			continue
		}
		if a := r.Guard(ctx, p.target); a.Err != nil {
			add(a)
			p.refused = a.Err
			continue
		} else {
			add(a)
		}
		after, err := r.hostTable()
		if err != nil {
			o.Err = err
			return
		}
		g := after.top(p.target)
		if g == nil {
			p.refused = fmt.Errorf("pod %s: no guard at %s after guarding it", p.uid, p.target)
			add(Action{Op: opSkip, Path: p.target, Err: p.refused})
			continue
		}
		guards[p] = g
		if p.procs != nil && len(p.procs.pids) > 0 {
			targets, err := planSwap(r.procDir, p.procs.containerPIDs(), []probe.Dev{dev}, "/", p.target)
			if err != nil {
				add(Action{Op: opSwap, Path: "pod " + string(p.uid), Err: err})
			}
			acts, _ := sw.Swap(ctx, targets)
			add(acts...)
		}
	}
	// 2. The other host mounts of the failed filesystem at the volume's
	// paths: its pods' subPath binds and the staging mount.
	if b := table.byDev[dev]; b != nil {
		for _, m := range b.Mounts {
			if m.Target.Kind != kubelet.KindSubPath {
				continue
			}
			for _, p := range plans {
				if p.refused == nil && m.Target.PodUID == string(p.uid) {
					acts, _ := table.unmountDead(ctx, u, m.Path, dead)
					add(acts...)
				}
			}
		}
	}
	if top := table.top(st.mount.Path); top != nil && top.ID == st.mount.ID {
		acts, _ := u.UnmountMounts(ctx, []*probe.Mount{{Path: st.mount.Path, ID: st.mount.ID}})
		add(acts...)
	}
	// 3. Wait for the failed superblock to go.
	start := time.Now()
	held := superblockHeld(st.device, st.mount.FSType)
	for deadline := time.Now().Add(releaseWait); held && time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		held = superblockHeld(st.device, st.mount.FSType)
	}
	a := Action{Op: opVerify, Path: "/dev/" + st.device, Took: time.Since(start), Detail: "failed filesystem released"}
	if held {
		a.Detail = "failed filesystem still held"
		a.Err = fmt.Errorf("the failed filesystem of /dev/%s is still held after %s (open files or working directories of the pods' processes): a fresh mount would be the failed one again; restart the pods", st.device, releaseWait)
	}
	add(a)
	// 4. Stage and publish afresh, then swap the containers back onto
	// the volume. A filesystem still held is staged again all the same,
	// so that the pods see their volume as it is, not a guard.
	var errs []error
	c, _, err := r.checkDriver(ctx, v.Driver)
	if err != nil {
		add(Action{Op: opCheckDriver, Path: v.Driver, Err: err, Detail: "driver does not answer: the pods see the guard until it does"})
		o.Err = errors.Join(fmt.Errorf("csi driver %s: %w", v.Driver, err), actionsErr(o.Actions))
		return
	}
	sa := Action{Op: opStage, Path: staging, Detail: "NodeStageVolume of " + v.VolumeHandle + ": the kept device afresh"}
	start = time.Now()
	sa.Err = c.NodeStageVolume(ctx, kubelet.StageRequest(v.Stage))
	sa.Took = time.Since(start)
	add(sa)
	if sa.Err != nil {
		o.Err = errors.Join(fmt.Errorf("stage volume %q: %w", v.VolumeHandle, sa.Err), actionsErr(o.Actions))
		return
	}
	if d := devAt(st.mount.Path); d != dev {
		errs = append(errs, fmt.Errorf("the driver staged %s on device %s, not the kept device %s", v.VolumeHandle, d, dev))
	}
	places := []place{hostPlace(st.mount.Path)}
	for _, p := range plans {
		g := guards[p]
		if p.refused != nil || g == nil {
			continue
		}
		acts, err := u.UnmountMounts(ctx, []*probe.Mount{{Path: p.target, ID: g.ID}})
		add(acts...)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		pa := Action{Op: opPublish, Path: p.target, Detail: "NodePublishVolume of " + v.VolumeHandle}
		start := time.Now()
		pa.Err = c.NodePublishVolume(ctx, kubelet.PublishRequest(p.pv.Publish))
		pa.Took = time.Since(start)
		add(pa)
		if pa.Err != nil {
			errs = append(errs, pa.Err)
			continue
		}
		places = append(places, hostPlace(p.target))
		if p.procs == nil || len(p.procs.pids) == 0 {
			if len(p.pv.Containers) > 0 {
				errs = append(errs, fmt.Errorf("pod %s: no process of its containers found: cannot swap or verify", p.uid))
			}
			continue
		}
		targets, err := planSwap(r.procDir, p.procs.containerPIDs(), []probe.Dev{g.Dev}, "/", p.target)
		if err != nil {
			errs = append(errs, err)
		}
		acts, _ = sw.Swap(ctx, targets)
		add(acts...)
		for _, ct := range p.pv.Containers {
			if pid, ok := p.procs.byContainer[ct.ContainerID]; ok && ct.MountPath != "" {
				places = append(places, containerPlace(r.procDir, pid, ct.MountPath))
			}
		}
	}
	if !held {
		if err := r.filesystemWrites(ctx, reattachStaging{mount: st.mount, device: st.device}); err != nil {
			errs = append(errs, fmt.Errorf("the fresh mount of /dev/%s refuses writes: %w", st.device, err))
		}
	} else {
		errs = append(errs, a.Err)
	}
	r.conclude(ctx, o, places, errs...)
}

// superblockHeld reports whether the kernel still has a superblock of
// fsType on the device: ext4 and xfs name it under /sys/fs/<type>/<device>
// until it is put.
func superblockHeld(device, fsType string) bool {
	switch fsType {
	case "ext4", "ext3", "ext2":
		fsType = "ext4"
	case "xfs":
	default:
		return false
	}
	_, err := os.Stat(filepath.Join("/sys/fs", fsType, device))
	return err == nil
}

// devAt is the device of the filesystem at path, zero when none.
func devAt(path string) probe.Dev {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return probe.Dev{}
	}
	return probe.Dev{Major: unix.Major(st.Dev), Minor: unix.Minor(st.Dev)}
}
