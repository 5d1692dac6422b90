// Package kubelet holds kubelet's conventions, in one place, for every
// package that needs them:
//
//   - paths, both ways: where kubelet stages (StagingPath: the hex SHA-256
//     of the volume handle, or LegacyStagingPath), publishes (TargetPath),
//     binds a subPath (SubPathTarget) and maps a block volume, and Classify,
//     which says what a mount point under the kubelet root is (Target);
//   - names: the VolumeAttachment name (AttachmentName), the claim of a pod
//     volume (ClaimName);
//   - the CSI requests kubelet builds from Pod, PVC, PV, CSIDriver and
//     VolumeAttachment (BuildVolumeRequest, StageRequest, PublishRequest),
//     secrets redacted when logged.
//
// Each function cites the kubelet source it follows (pkg/volume/csi). It
// does no I/O: it takes objects and paths and gives paths and requests.
//
// kubelet must not import a Kubernetes client, nor probe, remount, agent or
// cmd: it is below all of them (scripts/layout checks it).
package kubelet
