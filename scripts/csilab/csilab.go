// Package csilab runs a real CSI node plugin with FUSE volumes for root tests: the
// k8s-csi-s3 driver (s3driver, mounting with Debian's s3fs) against a versitygw S3
// server on a loopback port.
//
// The driver runs as PID 1 of a new PID namespace. s3fs daemonizes with setsid, so
// only the namespace holds the plugin and its FUSE daemons together: killing PID 1
// kills them all, as a node-plugin crash does, and leaves the mounts dead
// (ENOTCONN). The driver shares the caller's mount namespace; tests run it inside
// the private mount namespace of scripts/lab (lab.Main, lab.RequireRoot).
//
// s3driver and versitygw come from lab.BinDir ($MOUNTMEDIC_BIN, else
// $MOUNTMEDIC_CACHE/bin/current, default /var/cache/mountmedic), as scripts/tools.sh
// builds them; s3fs comes from PATH (scripts/deps.sh). Missing binaries skip the
// test, or fail it when MOUNTMEDIC_REQUIRE_ROOT=1 (lab.RequireTool,
// lab.RequireBinary).
//
// It also serves the layouts of other catalogued drivers (LayoutDriver,
// StartVolumeIDDirProxy) and ceph-csi's CephFS node plugin with Debian's
// ceph-fuse against a throwaway Ceph that scripts/ceph-lab.sh starts once
// per test binary (SharedCeph, CephFSDriver).
//
// This package is test support, imported from _test.go files only.
package csilab
