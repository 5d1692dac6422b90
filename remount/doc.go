// Package remount acts on broken pod volume mounts: on the mounts themselves
// and on the CSI node plugin's gRPC socket.
//
// It owns:
//
//   - the CSI client side: finding a driver's node socket the way kubelet
//     does (plugins_registry, then plugins/<driver>/csi.sock), the node
//     calls a repair makes (NodeGetCapabilities, NodeStageVolume,
//     NodePublishVolume) with per-call timeouts, and ErrDriverUnavailable,
//     which means "retry when the driver is back", never "escalate";
//   - the mount-side steps, each reporting what it did and able to run dry:
//     safe path opening below the kubelet root (no symlink followed), lazy
//     unmount and FUSE abort (Unmounter), over-mounts, swaps into container
//     mount namespaces, the CRI client (DialCRI) and container restarts;
//   - the Repairer: the node-side rungs of the ladder for one broken CSI
//     volume (Restage, LiveSwap, Restart; Unmount for terminating pods),
//     each verified by probing again, and Tier and TierSet, the one name of
//     every rung from the --tiers flag to the metric label.
//
// The requests kubelet would send are built by probe/kubelet. How each tier
// works, how container processes are found and what is weak:
// docs/remount.md; the kernel facts it rests on: docs/kernel-facts.md.
//
// remount knows no informers, listers or API clients: the caller resolves the
// objects and passes them in. It must not import the agent package or
// k8s.io/client-go. Secrets pass through it but never reach a log line or a
// String method.
package remount
