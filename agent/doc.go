// Package agent is mountmedic's long-running node process: it keeps the
// node's mount table classified, probes every kubelet volume mount, decides
// when and how a dead one is repaired, and reports what it saw and did.
//
// agent owns:
//
//   - the Kubernetes side, with the node's own identity (the kubelet's
//     credentials, NewNodeClient; the Node authorizer and NodeRestriction
//     confine it to this node's objects): a pod informer scoped to this
//     node (field selector spec.nodeName), a LIST of the same pods shared
//     by the repair runs of a burst (their fresh read), the PVs of the
//     node's CSI volumes read ahead of any repair, GETs of the
//     PersistentVolumeClaims, CSIDrivers and VolumeAttachments a repair
//     needs (kept in a small bounded cache), Secrets fetched for one repair
//     and dropped after it, evictions through the Eviction API, and
//     events.k8s.io events;
//   - the loop: the inventory refreshed when the mount table changes
//     (poll(2) POLLPRI on the table) and on every resync, a probe cycle every
//     probe interval, strikes and per-volume backoff, a re-stage attempt as
//     soon as a CSI driver's socket appears again (inotify on the kubelet's
//     plugins_registry and plugins/<driver> directories);
//   - the repair ladder (remount.Tier: re-stage, live swap, container
//     restart, eviction)
//     with node budgets, owner rules and the opt-out annotation
//     mountmedic.io/repair: "false" on a pod or its PVC;
//   - the metrics registry and the /metrics, /healthz and /readyz endpoints.
//
// The mount-side actions are remount's, reached through the consumer-side
// repairer interface; agent never touches a mount itself. probe and remount
// must not import agent.
//
// What a repair reads from the API server and when, how it behaves while
// the API server is unreachable, and across restarts: docs/agent.md.
package agent
