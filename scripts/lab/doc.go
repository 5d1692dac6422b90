// Package lab is the fault lab of mountmedic's root tests: real mounts and
// real daemons that fail the way node volumes fail, in a private mount
// namespace so that nothing outlives the test binary.
//
// It is test support, used from _test.go files only. Of mountmedic it imports
// only probe/kubelet (kubelet's layout, which its kubelet trees follow), so
// that probe, remount and agent tests can all use it.
//
// A package that uses the lab calls Main from its TestMain:
//
//	func TestMain(m *testing.M) { lab.Main(m) }
//
// As root, Main re-executes the test binary in a new mount namespace (the
// whole tree recursively private, the child killed with its parent) and
// mounts fusectl there. Each root test starts with RequireRoot, which skips
// when it cannot run (not root, no /dev/fuse, no private namespace), or fails
// when MOUNTMEDIC_REQUIRE_ROOT=1 (CI), so CI never passes by skipping.
// RequireBinary does the same for external programs.
//
// The lab's daemons are copies of the test binary that Main recognises by an
// environment variable and runs instead of the tests:
//
//   - StartFaultFS: a go-fuse loopback filesystem (fstype fuse.faultfs) whose
//     requests can be made to answer an errno, to block in the handler (a
//     hung daemon) or whose daemon can be killed; Abort writes the fusectl
//     abort file of its connection.
//   - StartContainer: a process in its own mount namespace with private or
//     slave propagation, holding bind mounts of host paths as a container
//     runtime makes them at container start; WithReadOnly makes binds
//     read-only, WithChroot roots it in its directory (so that
//     /proc/<pid>/root and its mountinfo show container paths), and
//     WithPodCgroup puts it in a cgroup named as kubelet names a pod
//     container's (.../kubepods/besteffort/pod<uid>/<containerID>).
//
// NewExt4 and NewExt4On make an ext4 filesystem on an autoclear loop device;
// with the backing file on a FaultFS it is the NBD-like case. NewKubelet lays
// out a kubelet root with staging, publish, subPath, emptyDir and block
// volume mounts at the paths kubelet uses (PreparePublish lays out a publish
// path for a real CSI driver to publish to).
//
// What the lab's own tests observe on kernel 6.18 (each is asserted in
// lab_test.go unless marked "logged"):
//
//   - FaultFS killed: statfs and statx(AT_STATX_FORCE_SYNC) answer ENOTCONN,
//     on the root and on files; the mount stays in mountinfo.
//   - FaultFS hung: statfs and statx(FORCE_SYNC) block in the kernel. After
//     Abort the blocked calls return ECONNABORTED and new ones ENOTCONN;
//     after Release they complete normally.
//   - FaultFS errno: statfs, statx, open and read answer the injected errno.
//     statx asking for STATX_BTIME on an open file makes the kernel send
//     FUSE_STATX rather than GETATTR; the lab injects the fault there too
//     (the errno test fails without it).
//   - ext4 after Shutdown: file reads and creates answer EIO; stat and statfs
//     succeed; super options read "rw,shutdown"; errors_count stays 0
//     (logged).
//   - NBD-like, daemon killed: reads of cached data and stat/statfs still
//     succeed. The first fsync answers EIO (the journal aborts); the next
//     create answers EROFS, the super options read "rw,emergency_ro" (still
//     "rw": look for emergency_ro, not ro) and errors_count becomes 1.
//   - NBD-like, daemon hung: fsync blocks while statfs of the ext4 answers.
//     After Abort the fsync answers EIO, but the super options stay "rw" and
//     errors_count 0 (logged): only I/O shows the failure until the journal
//     next commits.
package lab
