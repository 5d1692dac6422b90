#!/usr/bin/env bash
# bench-ceph-fuse.sh: a real ceph-fuse CephFS volume in ceph-csi's layout,
# scanned by mountmedic healthy, with its daemon killed, and with its daemon
# stopped.
#
#   sudo scripts/bench-ceph-fuse.sh
#
# Brings up a throwaway Ceph with a CephFS (scripts/ceph-lab.sh) and, in a
# private mount namespace, stages a subvolume as ceph-csi's CephFS node
# plugin does with its fuse mounter: ceph-fuse on kubelet's staging path
# (<root>/plugins/kubernetes.io/csi/cephfs.csi.ceph.com/<sha256 of the
# volume handle>/globalmount, rooted at the subvolume's path), bound onto
# the pod's publish target, with kubelet's vol_data.json files beside both.
# Then runs the built `mountmedic scan --kubelet-root <root>`:
#   healthy    - the volume answers: Healthy, daemon node-plugin, exit 0;
#   kill -9    - ceph-fuse killed: Disconnected with ENOTCONN, exit 2;
#   re-staged  - a fresh ceph-fuse on the same paths: the scan's state is
#                printed, then the time until the file the killed client
#                wrote reads back (the MDS evicts the dead session), then
#                Healthy, exit 0;
#   SIGSTOP    - ceph-fuse stopped: Hung at the probe deadline, exit 2, and
#                the scan returns (a 60 s watchdog fails the run if not).
# Prints each scan's output and "ceph-fuse-bench:" figure lines; exits
# non-zero when a scan says anything else. Installs the Ceph packages when
# missing (scripts/deps.sh --ceph). Not in CI: about 15-40 s of Ceph start and 10 s of
# stop on a 2-core host besides the build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
	echo "bench-ceph-fuse.sh: run as root: Ceph's daemons and the mounts need it" >&2
	exit 1
fi
log() { printf 'ceph-fuse-bench: %s\n' "$*"; }
fail() {
	log "FAIL: $*"
	exit 1
}
now() { date +%s.%N; }
since() { echo "$(now) - $1" | bc; }

# The mounts live in a private mount namespace that ends with the run.
if [ -z "${CEPH_FUSE_BENCH_NS:-}" ]; then
	t=$(now)
	scripts/deps.sh --ceph
	log "scripts/deps.sh --ceph in $(since "$t") s"
	exec env CEPH_FUSE_BENCH_NS=1 unshare -m --propagation private "$0" "$@"
fi

OUT=$(mktemp -d /tmp/mm-cephfuse.XXXXXX)
export CEPH_LAB_DIR=$OUT/ceph
K=$OUT/kubelet
fusepid=
cleanup() {
	set +e
	[ -z "$fusepid" ] || kill -CONT "$fusepid" 2>/dev/null
	for m in $(grep -F " $K/" /proc/self/mountinfo | awk '{print $5}' | sort -r); do
		umount -l "$m"
	done
	[ -z "$fusepid" ] || kill -KILL "$fusepid" 2>/dev/null
	scripts/ceph-lab.sh stop
	rm -rf "$OUT"
}
trap cleanup EXIT
trap 'exit 143' TERM INT

t=$(now)
go build -o "$OUT/mountmedic" ./cmd/mountmedic
log "built mountmedic in $(since "$t") s"
t=$(now)
scripts/ceph-lab.sh start >/dev/null
log "ceph-lab.sh start (mon, mgr, osd, mds, cephfs) in $(since "$t") s"
export CEPH_CONF=$CEPH_LAB_DIR/ceph.conf

# A subvolume in ceph-csi's group "csi", created through the mgr's volumes
# module as ceph-csi's controller does.
uuid=$(cat /proc/sys/kernel/random/uuid)
sub=csi-vol-$uuid
ceph fs subvolumegroup create cephfs csi
ceph fs subvolume create cephfs "$sub" --group_name csi
rootpath=$(ceph fs subvolume getpath cephfs "$sub" --group_name csi)
driver=cephfs.csi.ceph.com
handle=0001-0009-rook-ceph-0000000000000001-$uuid
pv=pvc-$uuid
pod=$(cat /proc/sys/kernel/random/uuid)
hash=$(printf %s "$handle" | sha256sum | cut -d' ' -f1)
stage=$K/plugins/kubernetes.io/csi/$driver/$hash/globalmount
publish=$K/pods/$pod/volumes/kubernetes.io~csi/$pv/mount
mkdir -p "$stage" "$publish"
printf '{"driverName":"%s","volumeHandle":"%s"}\n' "$driver" "$handle" >"${stage%/globalmount}/vol_data.json"
printf '{"driverName":"%s","volumeHandle":"%s","specVolID":"%s","volumeLifecycleMode":"Persistent"}\n' \
	"$driver" "$handle" "$pv" >"${publish%/mount}/vol_data.json"

# stage_and_publish mounts the subvolume with ceph-fuse on the staging path
# and binds it onto the publish target, as NodeStageVolume and
# NodePublishVolume do.
stage_and_publish() {
	local t
	t=$(now)
	# The arguments of ceph-csi's fuse mounter (internal/cephfs/mounter/
	# fuse.go, mountFuse), less the keyfile: cephx is off in the lab.
	ceph-fuse "$stage" -m "127.0.0.1:${CEPH_LAB_PORT:-6789}" -c "$CEPH_CONF" -n client.admin \
		-r "$rootpath" -o nonempty --client_mds_namespace=cephfs 2>/dev/null
	mount --bind "$stage" "$publish"
	log "ceph-fuse staged and published in $(since "$t") s"
	fusepid=$(pgrep -f "^ceph-fuse $stage " | head -n1)
	[ -n "$fusepid" ] || fail "no ceph-fuse process for $stage"
}

# scan runs mountmedic scan over the lab root with a 60 s watchdog and
# prints its output; $rc and $took are its exit status and seconds.
scan() {
	local t
	t=$(now)
	set +e
	timeout 60 "$OUT/mountmedic" scan --kubelet-root "$K" --timeout 2s -o wide >"$OUT/scan.out" 2>&1
	rc=$?
	set -e
	took=$(since "$t")
	sed "s|$OUT|\$OUT|g" "$OUT/scan.out"
	[ "$rc" != 124 ] || fail "scan wedged: no answer in 60 s"
}

# expect checks that the staging and publish rows show state $1 and error $2.
expect() {
	local kind row
	for kind in staging publish; do
		row=$(grep -E "^[A-Za-z]+ +$kind " "$OUT/scan.out") || fail "no $kind row"
		[ "$(awk '{print $1}' <<<"$row")" = "$1" ] || fail "$kind is $(awk '{print $1}' <<<"$row"), want $1"
		grep -q -- "$2" <<<"$row" || fail "$kind row lacks $2"
		grep -q -- " node-plugin " <<<"$row" || fail "$kind row does not name the daemon node-plugin"
	done
}

stage_and_publish
echo acked >"$publish/acked" && sync "$publish/acked"
log "mountinfo: $(grep -F " $stage " /proc/self/mountinfo | sed "s|$OUT|\$OUT|g")"

log "--- healthy"
scan
[ "$rc" = 0 ] || fail "scan exit $rc, want 0"
expect Healthy fuse.ceph-fuse
log "healthy: exit $rc in $took s"

log "--- kill -9 ceph-fuse (pid $fusepid)"
kill -KILL "$fusepid"
while kill -0 "$fusepid" 2>/dev/null; do sleep 0.05; done
scan
[ "$rc" = 2 ] || fail "scan exit $rc, want 2"
expect Disconnected "transport endpoint is not connected"  # ENOTCONN
log "killed: exit $rc in $took s"

# Re-stage as NodeStageVolume and NodePublishVolume would: a fresh
# ceph-fuse on the same paths. The killed client's MDS session holds the
# capabilities it had (on the file it wrote) until the MDS evicts it.
umount -l "$publish" "$stage"
fusepid=
stage_and_publish
log "--- re-staged"
scan
log "re-staged: exit $rc in $took s"
t=$(now)
timeout 600 cat "$publish/acked" >/dev/null || fail "the file the killed client wrote is unreadable after 600 s"
log "re-staged: the file the killed client wrote read back after $(since "$t") s"
grep -o 'evicting unresponsive client.*' "$CEPH_LAB_DIR/mds.a.log" | sed 's/^/ceph-fuse-bench: mds: /' || true
scan
[ "$rc" = 0 ] || fail "scan exit $rc after the re-stage, want 0"
expect Healthy fuse.ceph-fuse

log "--- SIGSTOP ceph-fuse (pid $fusepid)"
kill -STOP "$fusepid"
scan
[ "$rc" = 2 ] || fail "scan exit $rc, want 2"
expect Hung 'probe did not return before its deadline'
log "stopped: exit $rc in $took s (probe deadline 2 s)"
kill -CONT "$fusepid"
t=$(now)
timeout 600 cat "$publish/acked" >/dev/null || fail "the volume does not answer 600 s after SIGCONT"
log "SIGCONT: the volume answers again after $(since "$t") s"
t=$(now)
umount "$publish" "$stage"
while kill -0 "$fusepid" 2>/dev/null; do sleep 0.05; done
fusepid=
scripts/ceph-lab.sh stop
log "unmounted and ceph-lab.sh stop in $(since "$t") s"
