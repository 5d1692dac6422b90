// Package remount acts on broken pod volume mounts: on the mounts themselves
// and on the CSI node plugin's gRPC socket.
//
// remount owns:
//
//   - the CSI client side: finding a driver's node socket the way kubelet
//     does (registration sockets under <kubeletRoot>/plugins_registry, then
//     <kubeletRoot>/plugins/<driver>/csi.sock), and a CSIClient for the
//     node service calls a repair makes (NodeGetCapabilities,
//     NodeStageVolume, NodePublishVolume) with per-call timeouts and a
//     distinct, retryable ErrDriverUnavailable for a driver that is down;
//   - the requests kubelet would send, which probe/kubelet builds from plain
//     Kubernetes objects (BuildVolumeRequest, StageRequest, PublishRequest,
//     with the staging and publish paths kubelet uses);
//   - the toolbox of mount-side steps: OpenSafe, Unmounter (lazy unmount,
//     FUSE abort), OverMounter, Swapper with PlanSwap and ProcessMounts,
//     FindHolders, CRIClient and Restarter; each reports what it did and can
//     run dry;
//   - the Repairer, which the agent calls through its own small interface:
//     the node-side rungs of the repair ladder for one broken CSI volume.
//
// # The Repairer
//
// Restage (tier 1) brings the volume back on the host. It reads our mount
// table, checks every path with OpenSafe (a path outside the kubelet root,
// or one that meets a symlink, is refused with an error naming it: a
// refused staging path leaves the volume alone, a refused publish target
// leaves that pod alone) and asks the driver whether it answers
// (NodeGetCapabilities, never from a cache) before it changes anything: with
// the driver down it returns ErrDriverUnavailable and every mount is as it
// was. Then it aborts the FUSE connection of a hung volume (the caller says
// Hung, or requests wait on the connection in fusectl; connection numbers
// are device numbers, which the kernel hands out again, so the connection
// is pinned through a descriptor of its mount and re-checked right before
// the abort: same mount, same device, requests still waiting), lazily
// unmounts,
// deepest path first and each only while it is the mount on top, the dead
// subPath binds, publish targets and staging mount, sends NodeStageVolume
// (when the driver stages) and NodePublishVolume per pod, and binds each
// subPath again from the fresh publish target as kubelet does. The unmount
// comes first because a real driver (k8s-csi-s3) answers NodeStage and
// NodePublish on a dead (ENOTCONN) path with OK and does nothing.
//
// For a pod whose containers see the volume through propagation
// (HostToContainer, Bidirectional) the dead publish target is not
// unmounted: the driver publishes the volume at a directory beside it
// (.mountmedic-publish, its own NodePublishVolume with the pod's read-only
// and mount flags), the fresh mount is bound over the dead target (raw
// mount(2) through O_PATH descriptors, never a stat of the target:
// OverMounter), and the directory beside is lazily unmounted and removed.
// The bind propagates into those containers at once; they go from the dead
// mount to the fresh one without ever showing an empty directory. Which
// containers propagate is read from their own mount tables (master:N or
// shared:N on their mount of the dead filesystem), so the agent passes no
// propagation setting.
//
// Healed means Restage probed the staging path, every publish target and
// those containers' views and all answered. Containers with private mounts
// and all subPaths still see the dead mount after it: they are LiveSwap's.
//
// LiveSwap (tier 2) does what Restage does while the host still has dead
// mounts, then, for each pod, plans a swap (PlanSwap) of every mount of the
// dead filesystem still in view in the pod's containers (private mounts,
// subPaths, and whatever the host repair did not reach) and carries it out
// (Swapper: a clone of the fresh publish target, or of its subPath
// directory, moved into the container's mount namespace in place of the
// dead mount, read-only and propagation kept). This is the in-place subPath
// repair. The swap enters only each container's own mount namespace (its
// process as the runtime reports it when a CRI endpoint is set, else the
// one its cgroup names), never a namespace a process of the pod made
// (unshare -Urm): a mount moved into a namespace is not locked, so there its
// user could remount a read-only volume read-write. A namespace that its
// process's user namespace does not own is refused, and so is a read-only
// target in a namespace owned by another user namespace than ours (a
// user-namespaced pod): the restart tier repairs those. Where the kernel
// refuses to mount beneath the dead mount, the clone is mounted over it,
// never after detaching it: an agent killed in between would leave the
// container writing into its root filesystem with nothing dead in view; a
// swap killed half-way leaves the dead mount on top, which the next run
// swaps again. Processes that still hold the dead filesystem (open files,
// working directories) are reported as actions: they keep failing. Healed
// means the host places and each container's view answer and no container
// shows the dead mount any more.
//
// Restart (tier 3) does what Restage does while the host still has dead
// mounts (which unmounts the dead subPath binds: kubelet reuses a subPath
// bind that is there; the fresh one bound again is safe to reuse), then
// stops the pod's containers that mount the volume through the CRI
// (Restarter) for kubelet to start them again. Healed means the runtime
// shows each of them running again (a new container or a higher attempt)
// within Config.RestartTimeout and its view of the volume answers; a
// container that does not come back is Healed false with an error saying
// the restart cannot be verified.
//
// Unmount lazily unmounts the dead mounts of pods being deleted (each dead
// mount of a stack, from the top down), aborting a hung connection first,
// so that kubelet can finish tearing them down. It leaves the staging mount
// to kubelet.
//
// Raw block volumes are not repaired in place: every tier returns
// ErrBlockVolume and the agent leaves them to eviction. In DryRun every
// tier resolves and checks its paths, asks the driver whether it answers
// and the runtime what runs, reads mount tables, and returns the same plan
// as actions marked DryRun; it mounts, unmounts, aborts, stages, publishes,
// swaps and stops nothing and never reports Healed.
//
// Every tier verifies by probing again: statfs, then
// statx(AT_STATX_FORCE_SYNC), under the probe deadline, at most one probe
// per path in flight (a probe of a hung path parks one thread, never more);
// never a plain stat, which a dead FUSE mount answers from its cache.
// Containers are probed in their own view: <mountPath> opened inside
// /proc/<pid>/root with openat2(RESOLVE_IN_ROOT|RESOLVE_NO_SYMLINKS) and
// the descriptor probed (fstatfs, statx), the open under the same deadline
// (probe.Prober.CheckIn), so that a symlink a container plants cannot lead
// the probe to a healthy place outside it.
// Every tier returns its actions: what it did, how long each step took and
// each step's error. Errors that mean "the driver is down, retry when it is
// back" match ErrDriverUnavailable (a driver that no registration names
// counts as down: it may be restarting, and so does one that accepts the
// connection and does not answer a call in time, NodeGetCapabilities or
// any other: the agent waits for it and never escalates).
//
// The Repairer keeps the endpoint it found for each driver and a CSI client
// per endpoint; when the driver does not answer there it finds the endpoint
// again (a restarted driver may register another socket), and a connection
// that failed while the driver was down is re-dialled at once instead of
// after gRPC's backoff, so the first call after the driver's return
// succeeds. Config.Parallel bounds the volumes repaired at once across all
// calls. Calls for the same volume must not overlap (the agent runs one
// repair per volume at a time).
//
// # Mount IDs belong to one mount namespace
//
// A mount copied into another mount namespace, or propagated there, is
// another mount with another ID: the host's /proc/1/mountinfo and the
// agent's own table name the same volume under different IDs. Every check
// "is the mount on top here still the one the table named" therefore
// compares IDs of one namespace, the caller's: the Repairer reads its own
// table through /proc/thread-self and passes the agent's dead mounts on by
// device, path and root only; UnmountMounts takes IDs of our own table;
// UnmountFromTable takes mounts of any table (the fence's --host-table) and
// finds each in our own table by path, device and root before it checks
// and unmounts it by our ID. An unmount in our namespace reaches the host
// only by propagation (the DaemonSet's Bidirectional kubelet root).
//
// # Finding container processes
//
// The cgroups first: one pass over /proc/<pid>/cgroup, shared by the
// repairs running at the same moment and reused for a second, finds every
// process of a pod by the UID in the first pod segment of its cgroup path
// (cgroupfs: .../pod<uid>/<containerID>, systemd: ...-pod<uid_>.slice/
// cri-containerd-<id>.scope) and each container's by the segment right
// after it: a pod<B> cgroup that a process of pod A made below its own
// names nothing, and a process whose hierarchies disagree is nobody's. It
// needs no runtime socket, works with any runtime and while the runtime is
// busy, and finds all containers of a pod at once. With a CRI endpoint the
// runtime's verbose ContainerStatus ("pid" in its info, a containerd and
// CRI-O convention) names each container's process (the one whose mount
// namespace a swap enters) over the cgroups; without one it is the lowest
// PID of the container's cgroup. The CRI is also the fallback for kubelets
// with cgroupsPerQOS: false, whose pods have no cgroup of their own.
// Entering a container's namespace needs hostPID either way.
//
// # What the lab shows on Linux 6.18
//
// Measured with lab containers (a process in its own mount namespace
// holding binds, as a runtime makes them) and kubelet's propagation (the
// kubelet root a shared mount; staging mount, publish targets and subPath
// binds one peer group):
//
//   - A lazy unmount on the host never takes a container's own bind of the
//     volume away: unmount propagation only reaches copies at the same
//     mount point under a parent that receives propagation, and a
//     container's volume bind hangs off its rootfs, which receives nothing.
//     No container is left looking at its bare rootfs directory (only one
//     that mounts a parent of the kubelet root with propagation would be).
//   - After unmounting staging and publish targets and staging afresh, the
//     fresh mounts form a new peer group: a HostToContainer container, a
//     slave of the old group, keeps the dead mount. Once every host member
//     of the old group is gone (staging, publish targets and subPath binds),
//     the container's bind turns private: nothing on the host reaches it
//     again, only a swap does.
//   - A mount placed on a still-attached dead member whose root is the
//     volume's root (the publish target, or the staging mount) propagates
//     to the other members there and to every slave: a HostToContainer
//     container reads the fresh volume at once, as a slave of the fresh
//     mount's group (a later repair reaches it the same way). It does not
//     reach subPath binds (their root is a subdirectory) or private
//     containers. mount(2) onto the dead or hung target returns at once.
//   - Go parks the main thread, instead of ending it, when a goroutine
//     exits locked to it, and /proc/self describes the main thread: a swap
//     that ran there would leave the process reading a container's mount
//     table as its own. Swapper never enters a namespace on the main thread,
//     and the Repairer reads its own table through /proc/thread-self.
//
// # What is weak
//
//   - Each repair of a pod with propagating containers leaves the dead
//     publish target below the fresh one. kubelet's NodeUnpublishVolume
//     removes only the top; the dead one left then makes kubelet's teardown
//     fail until Unmount (for terminating pods) removes it.
//   - Publish targets of several pods are peers: one pod's over-mount
//     propagates to another pod's kept target, which then shows the first
//     pod's publish (read-only and mount flags included) and is not
//     published again.
//   - A driver without STAGE_UNSTAGE that runs one FUSE daemon per publish
//     gets its daemon started for the directory beside the target; its later
//     NodeUnpublishVolume of the target may not find it. Only k8s-csi-s3
//     (which stages) was run.
//   - The restart tier was run against a stand-in runtime and kubelet (the
//     tests play them over a real CRI socket, on real mounts), not
//     containerd and kubelet.
//   - When the dead publish target is gone from the table and the caller's
//     dead mounts do not name it, its mountinfo root is taken to be the
//     volume's root ("/"), which a driver that publishes a subdirectory of
//     its staging mount would contradict.
//   - Holders are looked for among the pod's processes only, not on the
//     whole host; a container started within a second of a /proc snapshot
//     may be missed by a swap (it bound the fresh mount when it started).
//   - A broken mount on top of a path that the caller did not name as dead
//     is found by probing it, which costs the probe deadline when it hangs.
//   - A mount namespace a process of the pod made itself keeps the dead
//     mount (locked read-only where it was read-only): only a restart
//     reaches it. Read-only volumes of user-namespaced pods are never
//     swapped (restart). A container whose volume path meets a symlink
//     (even a runtime's own, /var/run -> /run) never verifies healed.
//   - A swap that fell back to mounting over the dead mount leaves it
//     covered in the container until the container ends.
//   - A hung FUSE connection is aborted only while a request waits on it
//     (the prober's own parked probe is one); without a CRI endpoint the
//     container's process is the lowest PID of its cgroup, which a
//     container process could only undercut across a PID wrap.
//
// remount knows no informers, listers or API clients: the caller resolves the
// objects (PV, PVC, pod, CSIDriver, VolumeAttachment, secrets) and passes them
// in. It must not import the agent package or k8s.io/client-go. Secrets pass
// through it but never reach a log line or a String method.
package remount
