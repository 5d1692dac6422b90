// Package remount acts on broken pod volume mounts: on the mounts themselves
// and on the CSI node plugin's gRPC socket.
//
// remount owns:
//
//   - the CSI client side: finding a driver's node socket the way kubelet
//     does (registration sockets under <kubeletRoot>/plugins_registry, then
//     <kubeletRoot>/plugins/<driver>/csi.sock), and a CSIClient for the node
//     and identity services with per-call timeouts, a cached capability set
//     and a distinct, retryable ErrDriverUnavailable for a driver that is
//     down;
//   - the requests kubelet would send: VolumeRequest, built from plain
//     Kubernetes objects by BuildVolumeRequest, turned into
//     NodeStageVolumeRequest and NodePublishVolumeRequest by StageRequest and
//     PublishRequest, with the staging and publish paths kubelet uses;
//   - the node-side rungs of the repair ladder: lazily unmounting dead
//     mounts, re-staging and re-publishing through the driver, putting the
//     fresh mount into running containers; each reports what it did and can
//     run dry.
//
// remount knows no informers, listers or API clients: the caller resolves the
// objects (PV, PVC, pod, CSIDriver, VolumeAttachment, secrets) and passes them
// in. It must not import the agent package or k8s.io/client-go. Secrets pass
// through it but never reach a log line or a String method.
package remount
