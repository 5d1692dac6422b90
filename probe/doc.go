// Package probe maps a host mount table to the kubelet's pod volumes and
// checks their health.
//
// probe owns three things:
//
//   - Mount: each mount point with what kubelet.Classify says it is (CSI
//     publish target, CSI staging mount, subPath bind, raw block device,
//     another volume plugin), the pod UID, volume, container, index and
//     driver it names, and its vol_data.json.
//   - Inventory: a mount table (the host's, or a captured file) turned into a
//     graph linked by device numbers and mountinfo roots, never by path
//     strings: subPath bind -> publish target -> staging mount -> backend (a
//     FUSE connection, a block device and its loop backing file or NBD
//     daemon). A table is anyone's text: ReadTable reads only a regular file
//     (procfs included), streams it under a size cap, and refuses a bad
//     line, a duplicate mount ID, a cycle of parents or a malformed device
//     with an error naming the file and the line (of a live procfs table,
//     which can list a freed ID again for the mount that took it during the
//     read, the last line of the ID is kept). The parser is our own
//     rather than github.com/moby/sys/mountinfo's, which reads numbers it
//     cannot parse as 0, gives no line numbers and returns every entry at
//     once; FuzzParse holds ours to mountinfo's, line by line, on every
//     table ours takes, and mountinfo's Info stays the entry type.
//   - Prober: the health of each backend, probed once per cycle with statfs
//     and statx(AT_STATX_FORCE_SYNC) (a plain stat answers from the attribute
//     cache after a FUSE daemon died), super options and ext4 error counters,
//     and derived to every bind that shares the backend. At most one probe is
//     in flight per backend; a probe whose call is past its deadline marks the
//     backend Hung and no new probe starts for it until the old one returns,
//     so a wedged filesystem costs one parked OS thread, never a growing pile
//     of them. A cycle starts every probe at once and waits at most one
//     deadline (and a quarter) for all of them together; a probe still within
//     its deadline then is pending, judged by the next cycle.
//
// Kubelet's conventions (its paths both ways, and the CSI requests it builds
// from API objects) live in probe/kubelet, the one place a change in
// kubelet's layout is made.
//
// probe must not import a Kubernetes client, the remount package or the agent
// package: it takes a mount table in and gives data out. API types reach it
// only as data, through probe/kubelet.
package probe
