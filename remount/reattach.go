package remount

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/mountmedic/mountmedic/probe"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// The re-attach tier.
//
// An NBD volume (ceph-csi's rbd-nbd mounter) is a filesystem on /dev/nbdN
// whose userspace daemon runs in the node plugin. When the daemon dies or
// hangs, the kernel keeps the device, the filesystem on it and every bind
// of it (publish targets, subPaths, containers' own binds); with a
// dead-connection timeout (rbd-nbd's --reattach-timeout, 30 s by default)
// it holds the I/O meanwhile. A fresh daemon given to the same device
// (NBD_CMD_RECONFIGURE, `rbd-nbd attach --device`) resumes it: nothing is
// unmounted, no container restarted, no swap needed. Only the driver can
// start that daemon (it holds the cluster's configuration and the user's
// key, and the daemon must live in its container), so the tier asks the
// driver through its own socket: ceph-csi's NodeStageVolume with the
// volumeContext key volumeHealerContext "true" re-attaches the device its
// stash recorded at stage time (internal/rbd/nodeserver.go: NodeStageVolume
// -> healerStageTransaction -> attachRBDImage with the stashed device),
// which is what ceph-csi's own healer sends once at plugin start
// (internal/rbd/rbd_healer.go, callNodeStageVolume).

// nbdMajor is the nbd driver's block major (include/uapi/linux/major.h).
const nbdMajor = 43

// ErrFilesystemFailed marks a volume whose NBD device answers but whose
// filesystem went to errors (shut down, or read-only after a journal
// abort) and could not be mounted afresh on the kept device: something
// still holds the failed superblock (a container's covered mount where the
// kernel cannot mount beneath, open files). Restarting the pods' containers
// releases it; the next run mounts the device afresh.
var ErrFilesystemFailed = errors.New("filesystem on the device failed")

// reattachWait bounds the wait for a re-attached device to answer.
const reattachWait = 10 * time.Second

// Reattach is tier 0 for a volume on an NBD device of a driver that
// re-attaches (kubelet.Driver.Reattach). It checks that the volume's own
// staging mount, below its staging path under the kubelet root, is on the
// device the caller found broken and that the device is an nbd device;
// then it reads the device (O_DIRECT, under the probe deadline). A device
// that answers is left as it is; one that does not gets a
// NodeStageVolume with volumeContext volumeHealerContext "true" through
// the driver's socket, after the driver answered NodeGetCapabilities.
// Then it checks the filesystem (mount table options, probe.WriteCheck):
// Healed means the device answers, the filesystem takes writes and the
// staging mount and publish targets answer a probe, each the same mount
// as before. A filesystem gone to errors is mounted afresh on the kept
// device (freshFilesystem); when that cannot be done the tier ends with
// ErrFilesystemFailed. A driver that does not answer, whose re-attach
// runs out of time, or whose device still does not answer after the
// driver answered ends it with ErrBackendUnavailable (which matches
// ErrDriverUnavailable too): wait, never escalate.
//
// Nothing is ever re-attached, unmounted or read that is not the volume's
// own: a device is only ever named by the driver (from its own record of
// the volume), and mountmedic acts only on a mount of the broken device at
// the volume's own staging path.
func (r *Repairer) Reattach(ctx context.Context, v *Volume) Outcome {
	return r.run(ctx, TierReattach, v, func(ctx context.Context, o *Outcome) {
		add := func(a Action) { o.Actions = append(o.Actions, a) }
		st, err := r.reattachTarget(v)
		if err != nil {
			path := ""
			if v != nil {
				path = v.Stage.StagingPath
			}
			add(Action{Op: opSkip, Path: path, Detail: "not re-attached", Err: err})
			o.Err = err
			return
		}
		dev := "/dev/" + st.device
		start := time.Now()
		sent := true
		if r.daemonGone(st.device) {
			// Known dead without I/O: a read would only wait out the
			// probe deadline on the held requests.
			add(Action{Op: opVerify, Path: dev, Detail: "device's daemon is gone (" + probe.ErrNBDDaemonGone.Error() + "): not read"})
			if err := r.sendReattach(ctx, v, dev, add); err != nil {
				o.Err = err
				return
			}
		} else if err := r.readDevice(ctx, dev); err == nil {
			add(Action{Op: opVerify, Path: dev, Took: time.Since(start), Detail: "device answers: nothing to re-attach"})
			sent = false
		} else {
			add(Action{Op: opVerify, Path: dev, Took: time.Since(start), Detail: "device does not answer: " + err.Error()})
			if err := r.sendReattach(ctx, v, dev, add); err != nil {
				o.Err = err
				return
			}
		}
		if sent {
			if r.cfg.DryRun {
				o.Err = actionsErr(o.Actions)
				return
			}
			start = time.Now()
			var rerr error
			for deadline := time.Now().Add(reattachWait); ; time.Sleep(100 * time.Millisecond) {
				began := time.Now()
				if rerr = r.readDevice(ctx, dev); rerr == nil || time.Now().After(deadline) || ctx.Err() != nil {
					if rerr == nil {
						r.deviceAnswered(st.device, began)
					}
					break
				}
			}
			a := Action{Op: opVerify, Path: dev, Took: time.Since(start), Detail: "device answers after the re-attach"}
			if rerr != nil {
				a.Detail, a.Err = "device still does not answer", fmt.Errorf("%s after the re-attach: %w", dev, rerr)
				if errors.Is(rerr, probe.ErrHung) {
					// The driver answered (ceph-csi answers OK while the
					// volume's rbd-nbd lives) and the device still does
					// not: its backend (the Ceph OSDs) does not. Wait for
					// it as for a driver that is down; never escalate.
					a.Detail = "device still does not answer: its backend is down"
					a.Err = &backendError{err: a.Err}
				}
				add(a)
				o.Err = a.Err
				return
			}
			add(a)
		}
		if r.cfg.DryRun {
			o.Err = actionsErr(o.Actions)
			return
		}
		if err := r.filesystemWrites(ctx, st); err != nil {
			if errors.Is(err, probe.ErrHung) || ctx.Err() != nil {
				// No answer is no proof of a failed filesystem (a frozen
				// one waits too): never take it down for that.
				a := Action{Op: opVerify, Path: st.mount.Path, Detail: "filesystem did not answer the write check: not mounted afresh", Err: err}
				add(a)
				o.Err = fmt.Errorf("volume %q of %s on %s: %w", v.VolumeHandle, v.Driver, dev, err)
				return
			}
			add(Action{Op: opVerify, Path: st.mount.Path, Detail: "filesystem refuses writes (" + err.Error() + "): mount the kept device afresh"})
			r.freshFilesystem(ctx, v, st, o)
			if !o.Healed {
				o.Err = fmt.Errorf("volume %q of %s on %s: %w: %w", v.VolumeHandle, v.Driver, dev, ErrFilesystemFailed, o.Err)
			}
			return
		}
		places := []place{hostPlace(st.mount.Path)}
		for _, p := range v.Pods {
			if p.Publish.TargetPath != "" {
				places = append(places, hostPlace(filepath.Clean(p.Publish.TargetPath)))
			}
		}
		r.conclude(ctx, o, places)
		if o.Healed {
			if after, err := r.hostTable(); err == nil {
				if top := after.top(st.mount.Path); top == nil || top.ID != st.mount.ID {
					o.Healed = false
					o.Err = fmt.Errorf("staging mount %d at %s changed during the re-attach", st.mount.ID, st.mount.Path)
				}
			}
		}
	})
}

// reattachStaging is the volume's staging mount on its NBD device.
type reattachStaging struct {
	mount  *probe.Mount
	device string // nbdN
	super  string
}

// reattachTarget finds the volume's own staging mount on the broken
// device, and refuses anything else.
func (r *Repairer) reattachTarget(v *Volume) (reattachStaging, error) {
	var st reattachStaging
	switch {
	case v == nil:
		return st, errors.New("re-attach: no volume given")
	case v.Stage.Block:
		return st, fmt.Errorf("volume %q of %s: %w", v.VolumeHandle, v.Driver, errBlockVolume)
	case v.Driver == "":
		return st, fmt.Errorf("volume %q: no CSI driver named: the agent resolves it from the PV", v.VolumeHandle)
	case v.Stage.StagingPath == "":
		return st, fmt.Errorf("volume %q of %s: no staging path: only a staged volume is re-attached", v.VolumeHandle, v.Driver)
	case v.Backend == nil || v.Backend.Kind != probe.BackendBlock || v.Backend.Dev.Major != nbdMajor:
		return st, fmt.Errorf("volume %q of %s: its backend is not an NBD device (major %d): nothing to re-attach", v.VolumeHandle, v.Driver, nbdMajor)
	}
	staging := filepath.Clean(v.Stage.StagingPath)
	if err := r.checkPlace(staging); err != nil {
		return st, fmt.Errorf("volume %q of %s: staging path refused: %w", v.VolumeHandle, v.Driver, err)
	}
	table, err := r.hostTable()
	if err != nil {
		return st, err
	}
	dev := v.Backend.Dev
	if b := table.byDev[dev]; b != nil {
		for _, m := range b.Mounts {
			if m.Target.Kind != kubelet.KindStaging || (m.Path != staging && filepath.Dir(m.Path) != staging) {
				continue
			}
			if top := table.top(m.Path); top != nil && top.ID == m.ID {
				st.mount, st.super = m, b.SuperOptions
				break
			}
		}
	}
	if st.mount == nil {
		return st, fmt.Errorf("volume %q of %s: no mount of device %s on top at its staging path %s: not the volume's own device, nothing re-attached",
			v.VolumeHandle, v.Driver, dev, staging)
	}
	sysfs := r.cfg.Probe.SysfsDir
	if sysfs == "" {
		sysfs = "/sys"
	}
	link, err := os.Readlink(filepath.Join(sysfs, "dev", "block", dev.String()))
	if err != nil {
		return st, fmt.Errorf("volume %q of %s: name block device %s: %w", v.VolumeHandle, v.Driver, dev, err)
	}
	name := filepath.Base(link)
	if n, ok := strings.CutPrefix(name, "nbd"); !ok || n == "" || strings.Trim(n, "0123456789") != "" {
		return st, fmt.Errorf("volume %q of %s: device %s is %s, not an nbd device", v.VolumeHandle, v.Driver, dev, name)
	}
	st.device = name
	return st, nil
}

// sendReattach asks the driver to re-attach the volume's device: its
// capabilities first (a driver that does not answer is left alone), then
// the stage request with the healer context.
func (r *Repairer) sendReattach(ctx context.Context, v *Volume, dev string, add func(Action)) error {
	start := time.Now()
	c, _, err := r.checkDriver(ctx, v.Driver)
	a := Action{Op: opCheckDriver, Path: v.Driver, Took: time.Since(start)}
	if err != nil {
		a.Err = fmt.Errorf("csi driver %s: %w", v.Driver, err)
		a.Detail = "driver does not answer: nothing re-attached"
		add(a)
		return a.Err
	}
	a.Detail = "endpoint " + c.Endpoint()
	add(a)
	req := kubelet.StageRequest(v.Stage)
	req.VolumeContext = maps.Clone(req.VolumeContext)
	if req.VolumeContext == nil {
		req.VolumeContext = map[string]string{}
	}
	req.VolumeContext[kubelet.ReattachContextKey] = "true"
	a = Action{Op: opStage, Path: v.Stage.StagingPath, DryRun: r.cfg.DryRun,
		Detail: "NodeStageVolume with " + kubelet.ReattachContextKey + "=true: re-attach " + dev + " of " + v.VolumeHandle}
	if r.cfg.DryRun {
		add(a)
		return nil
	}
	start = time.Now()
	err = c.NodeStageVolume(ctx, req)
	a.Took = time.Since(start)
	if err != nil {
		a.Err = fmt.Errorf("re-attach %s of volume %q: %w", dev, v.VolumeHandle, err)
		add(a)
		return a.Err
	}
	add(a)
	return nil
}

// nbdVerdicts is what the re-attach tier asks of a *probe.Prober: whether
// an nbd device's daemon is known dead without I/O, and that a read of the
// device answered (which ends that verdict).
type nbdVerdicts interface {
	NBDDaemonGone(dev string) bool
	NBDAnswered(dev string, start time.Time)
}

// daemonGone reports whether the prober knows the daemon of nbd device
// dev ("nbd0") dead without I/O.
func (r *Repairer) daemonGone(dev string) bool {
	g, ok := r.prober.(nbdVerdicts)
	return ok && g.NBDDaemonGone(dev)
}

// deviceAnswered tells the prober that a read of nbd device dev begun at
// start answered: the re-attached device is served, whatever its sysfs
// pid says, and the next probe cycle needs not hear it again first.
func (r *Repairer) deviceAnswered(dev string, start time.Time) {
	if g, ok := r.prober.(nbdVerdicts); ok {
		g.NBDAnswered(dev, start)
	}
}

// readDevice reads the first block of dev with O_DIRECT under the probe
// deadline. A read past it answers probe.ErrHung; its goroutine stays
// parked in the kernel until the device answers or fails the read (the
// kernel's dead-connection timeout bounds that), and later reads of the
// device wait on that one instead of parking more.
func (r *Repairer) readDevice(ctx context.Context, dev string) error {
	read := r.cfg.ProbeSys.ReadDevice
	if read == nil {
		read = probe.HostSyscalls().ReadDevice
	}
	return r.checks.run(ctx, "read "+dev, r.cfg.Probe.Timeout, func() error { return read(dev) })
}

// filesystemWrites says whether the staging mount's filesystem takes
// writes: its super options in the mount table, then probe.WriteCheck
// under the probe deadline.
func (r *Repairer) filesystemWrites(ctx context.Context, st reattachStaging) error {
	b := &probe.Backend{SuperOptions: st.super, Mounts: []*probe.Mount{st.mount}}
	if s, err := probe.TableState(b); s != probe.Unknown {
		return fmt.Errorf("%s: %w", s, err)
	}
	check := r.cfg.ProbeSys.WriteCheck
	if check == nil {
		check = probe.WriteCheck
	}
	return r.checks.run(ctx, "write check "+st.mount.Path, r.cfg.Probe.Timeout, func() error {
		if s, err := check(st.mount.Path); s != probe.Healthy {
			return fmt.Errorf("%s: %w", s, err)
		}
		return nil
	})
}

// IsNBD reports whether a backend is a filesystem on an nbd device
// (block major 43), the volumes the re-attach tier repairs.
func IsNBD(b *probe.Backend) bool {
	return b != nil && b.Kind == probe.BackendBlock && b.Dev.Major == nbdMajor
}
