// Package failover is mountmedic's node failover duty: it moves pods with
// ReadWriteOnce (or ReadWriteOncePod) volumes off nodes that are confirmed
// dead, in under a minute with Kubernetes' default timings, and never off a
// node that is only cut off from the API server.
//
// Without it, a StatefulSet pod on a dead node stays Running (then
// Terminating) forever and its replacement is never created; a Deployment's
// replacement waits on "Multi-Attach error" until someone force-deletes the
// old pod, and then 6 more minutes until the attach/detach controller
// force-detaches the volume. KEP-2268's node.kubernetes.io/out-of-service
// taint ends both at once, but a person has to decide to apply it, and a
// tool that applies it to a node that is merely partitioned lets two nodes
// write one RWO volume.
//
// # Two halves, two commands
//
// Heartbeat (every node, in `mountmedic agent --failover`; Config): renews a
// Lease named after the node
// in the agent's namespace (label failover.mountmedic.io/heartbeat=node)
// every HeartbeatInterval plus up to 10% of jitter (10 s by default: no
// more writes than kubelet's node lease), advertising FenceAfter as
// leaseDurationSeconds. It writes the Lease with a client of its own
// (NewHeartbeatClient: its own rate limiter and connections, never queued
// behind the agent's other calls; deploy/apf.yaml gives those writes their
// own API Priority and Fairness level), owned by the Node (collected with
// it) and carrying the agent's peer address. Silence is measured on
// CLOCK_BOOTTIME, so that a suspend counts.
//
// If it has not renewed for FenceAfter, counted from the start of its last
// successful renewal, it runs a peer check (peer.go): it asks Peers other
// agents, over the pod network, whether they can renew. If every peer
// asked answers that it cannot, the API server is down or
// throttled for everyone: it holds (no fence) and asks again each
// interval; once a peer renews again, the promise runs anew from the last
// check that saw the outage. Otherwise (a peer renews, none answers, too
// few do, no peer key) the node fences itself: through the CRI it stops the
// containers of every pod the controller could fail over (and every pod it
// cannot rule out because a claim could not be read; every pod with a CSI
// mount if it never reached the API server), lazily unmounts their CSI
// publish targets and subPath binds, and keeps stopping what kubelet
// restarts. NodeFence reads which mounts a pod has from --host-table (the
// DaemonSet's /proc/1/mountinfo: the host's mount namespace) and unmounts
// them in the agent's own namespace, where the same mounts have other mount
// IDs: each is matched in the agent's /proc/thread-self/mountinfo by path,
// device and root and checked by that ID when its path is opened
// (remount.Unmounter.UnmountFromTable: below the kubelet root, no symlink,
// a mount on top that the table does not name is left alone). The unmount
// reaches the host through the kubelet root's Bidirectional propagation,
// and the fence reads --host-table again to prove it: a pod whose mounts
// are still there fails with an error naming the missing propagation. When a renewal succeeds again it lifts the fence and deletes the
// fenced pods still on the node that the policy fails over (UID
// precondition), so their controllers recreate them with fresh mounts rather
// than let them run on an unmounted directory; a fenced pod no controller
// owns (fenced only because the plan was not known) is never deleted: an
// error log asks the operator to restart it. Fenced(podUID) tells the agent's repair loop to keep its hands
// off a fenced pod's volumes. On a clean stop it releases the Lease (clears
// the holder), which withdraws the promise. Agents never judge other nodes
// and never campaign for a leader Lease.
//
// Controller (`mountmedic controller`, a Deployment of two replicas under
// their own ServiceAccount, deploy/controller/; ControllerConfig): the
// replicas elect one leader through the Lease LeaderLease. The leader
// watches the nodes in scope, kubelet's Leases and the heartbeat Leases
// through informers whose transforms keep only what it reads (stripNode,
// stripLease: a 14 kB Node becomes about 200 bytes), and judges a node in a
// work queue (one key per node, per-node backoff after a failed action)
// when one of those objects changes or when its silence could have become
// long enough: never in a pass over every node. A node is dead when
//
//   - kubelet: the Ready condition is not True, and neither the kubelet
//     Lease in kube-node-lease nor the Ready heartbeat has changed for
//     KubeletGrace (a kubelet that posts NotReady itself is alive);
//   - the mountmedic heartbeat: held (not released) and unchanged for
//     max(FenceAfter, its leaseDurationSeconds) + FenceMargin;
//   - optional signals: the cloud provider's
//     node.cloudprovider.kubernetes.io/shutdown taint stands in for the
//     heartbeat (TrustShutdownTaint, off by default: a hibernated node
//     carries it too); an out-of-service taint someone else applied makes
//     the controller stand aside (Kubernetes fails the node over, the
//     operator removes it).
//
// "Unchanged" is always measured by the leader's own clock from when it saw
// the last change, like kubelet's node lifecycle controller does: a
// Lease's renewTime is the writer's clock and is only compared for change.
// A leader that just took over has seen no change yet, so it waits a full
// window before it trusts any silence; so does a leader whose watches lost
// the API server and reached it again (sight: every informer's list and
// watch calls report whether they reached it; on the return every silence
// clock restarts, observer.restartAll), since what changed meanwhile is
// unknown, and an API server that restarts then serves from a watch cache
// that may lag for seconds.
//
// Right before it taints a node or deletes its pods, the leader reads the
// node, its kubelet Lease and its heartbeat Lease again with plain GETs
// (quorum reads) and acts only if they still say dead; the taint is a patch
// conditioned on the fresh resourceVersion. While at least StandDownShare
// of the judged nodes (and more than two), or all of them, are not Ready,
// it stands down (as kube's node lifecycle controller does in a disrupted
// zone): no node is failed over, an event on the leader Lease and the
// stand_down metric say so. A node it defers, for the stand-down or the
// MaxNodes cap, costs no API request.
//
// A confirmed-dead node with at least one eligible pod (owned by a
// controller other than a DaemonSet, not a static pod, using a bound
// ReadWriteOnce/ReadWriteOncePod claim whose PV is not local or hostPath,
// and selected by the namespace and StorageClass lists and the
// mountmedic.io/failover annotation) is failed over, at most MaxNodes at
// once (a node counts until no eligible pod is left on it):
//
//   - taint mode (default): the node gets
//     node.kubernetes.io/out-of-service=mountmedic:NoExecute. The taint
//     eviction controller deletes its pods, the attach/detach controller
//     detaches their volumes at once, and the controller force-deletes the
//     eligible ones as soon as they are terminating (DeletePods; the pod
//     garbage collector would within 20 s). Not earlier: the taint eviction
//     controller deletes pods by name, and would delete a StatefulSet's
//     replacement in place of the pod it meant.
//   - force-delete mode: the node gets the annotation
//     failover.mountmedic.io/failed-over-at; the eligible pods are
//     force-deleted and their VolumeAttachments on the node deleted, each
//     read and deleted by its name (csi-<sha256(volumeHandle + driver +
//     node)>, attachmentName), never listed. Only those pods move; the
//     attach/detach controller sees the deleted attachment at its next
//     state sync (1 minute by default), so this mode is slower.
//
// When the node is Ready again, the controller removes its own taint (value
// "mountmedic") or annotation, never anyone else's. Every mutation of a
// node is a merge patch conditioned on the resourceVersion it judged, and
// the leader checks it still leads before each one; a new leader finds the
// taint or annotation and repeats nothing. Dry run logs and records events
// ("[dry-run] ...") and the dry_run metric, and changes nothing (no taint,
// no deletion, no fence).
//
// Events (events.k8s.io/v1): FailedOver on the node and each pod,
// FailoverDeferred (the cap), FailoverHeld (why a NotReady node is not
// failed over), OutOfServiceByOperator, FailoverEnded, FailoverStandDown and
// FailoverStandDownOver (on the leader Lease). Metrics, on the registry the
// caller passes: mountmedic_failover_failovers_total{result},
// mountmedic_failover_death_to_action_seconds,
// mountmedic_failover_pod_deletions_total{result},
// mountmedic_failover_nodes_in_failover, mountmedic_failover_leader,
// mountmedic_failover_nodes_recovered_total, mountmedic_failover_nodes_judged,
// mountmedic_failover_nodes_not_ready, mountmedic_failover_stand_down,
// mountmedic_failover_stand_downs_total,
// mountmedic_failover_fresh_read_refusals_total,
// mountmedic_failover_watch_regained_total (controller);
// mountmedic_failover_heartbeat_renewals_total{result},
// mountmedic_failover_node_fenced, mountmedic_failover_fences_total,
// mountmedic_failover_heartbeat_last_success_timestamp_seconds (heartbeat).
//
// # Timeline with the defaults
//
// A node dies at t=0. Its agent stops renewing; kubelet's node lifecycle
// controller marks it NotReady at about 50 s (--node-monitor-grace-period);
// the heartbeat has then been silent longer than the fence window (30 s +
// 15 s) and kubelet longer than KubeletGrace (40 s): the leader taints it
// at once, the pods are force-deleted about a second later, and the
// replacements attach elsewhere. Measured: see BenchmarkNodeDeathToAttach.
//
// # What the fence window does not cover (residual risks)
//
//   - The agent is not running on a node that is partitioned (crash loop,
//     image pull failure, evicted, OOM-killed, SIGKILLed while partitioned):
//     nobody fences, and the controller fails the node over once the
//     heartbeat is silent. An agent that starts and cannot renew within two
//     HeartbeatIntervals fences at once, and one that stops without being
//     able to release its Lease while already silent fences before it
//     exits, which narrows this to an agent that stays down longer than
//     FenceMargin. Cover it with the agent's system-node-critical priority
//     and alerts on mountmedic_failover_heartbeat_renewals_total failures,
//     or restrict the duty (NodeSelector) to nodes where the agent is
//     healthy.
//   - Fencing needs the container runtime: a running container keeps its
//     own bind of the volume (private mount propagation) whatever is
//     unmounted on the host, so only stopping it through the CRI cuts it
//     off. If the runtime does not answer within FenceMargin, containers
//     may write past the window.
//   - Clock rate, not clock skew: both sides measure durations on their own
//     clocks (the heartbeat on CLOCK_BOOTTIME), so skew between nodes does
//     not matter; a node whose clock runs much slower than the leader's
//     fences later than promised. FenceMargin covers small rate errors; a
//     suspended node or paused VM that resumes after the window writes
//     until its agent notices (within a second of resuming; it decides the
//     fence before it renews).
//   - Without a peer key (PeerKeyFile), a control-plane outage longer than
//     FenceAfter fences every node's RWO pods, and lifting the fence
//     deletes those pods to restart them with fresh mounts. With it, a node
//     holds its fence only on the authenticated word of every peer it
//     asked; a node of a group cut off together from the API server and
//     from the rest holds only if all its peers were picked in the group
//     (f^Peers for a group holding a share f of the nodes; deploy/README.md
//     has the figures), and relies then on the controller standing down
//     when that many nodes look dead at once (StandDownShare, 0.2 by
//     default), and counting silence only from after its own outage.
//     Someone holding the peer key
//     answers only at the addresses it can answer at.
//   - kubelet restarts a fenced container onto the node's bare publish
//     directory (and creates its subPath directories there) until the
//     fence stops it again, up to a HeartbeatInterval later: what it writes
//     lands on the node's disk, never on the volume, and the writes
//     succeed, so the application believes them stored. They stay there,
//     and kubelet's teardown of the pod fails ("Unmounter.TearDownAt failed
//     to clean mount dir") until someone empties the directory: a deleted
//     pod stays Terminating (seen in the e2e fence scenario).
//   - Storage the pod reaches without its kubelet volume mounts (iSCSI or
//     NFS mounted inside the container, a database replica talking to the
//     storage over the network) is not fenced by unmounting; stopping the
//     containers is all the fence does for it.
//   - The out-of-service taint evicts every pod of the node that does not
//     tolerate it, not only the eligible ones (KEP-2268's semantics); use
//     force-delete mode to move only the eligible pods.
//
// failover imports probe and remount (for NodeFence) and client-go; probe
// and remount must not import it.
package failover
