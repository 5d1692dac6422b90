// Package failover is mountmedic's node failover duty: it moves pods with
// ReadWriteOnce (or ReadWriteOncePod) volumes off nodes that are confirmed
// dead, in under a minute with Kubernetes' default timings, and never off a
// node that is only cut off from the API server.
//
// Two halves, two commands:
//
//   - Heartbeat (every node, `mountmedic agent --failover`; Config): renews
//     a Lease named after the node with a client of its own, and fences the
//     node (NodeFence: stops its failover-eligible containers through the
//     CRI and unmounts their volumes) once it has been silent for
//     FenceAfter, unless every peer it asks (peer.go) says the API server
//     is down for all. Agents never judge other nodes.
//   - Controller (`mountmedic controller`, a Deployment; ControllerConfig):
//     the elected leader judges nodes from informers in a work queue, and
//     fails over a node only when kubelet and the heartbeat have both been
//     silent long enough by its own clock, re-read with quorum GETs right
//     before it acts; it stands down when too many nodes look dead at once.
//     It applies the out-of-service taint (or force-deletes pods and their
//     VolumeAttachments), at most MaxNodes at once, and undoes only its own.
//
// The design, the timeline with the defaults, the events and metrics, and
// the residual risks: docs/failover.md.
//
// failover imports probe, probe/kubelet, remount (for NodeFence) and
// client-go; probe and remount must not import it, nor it cmd.
package failover
