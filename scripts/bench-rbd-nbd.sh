#!/usr/bin/env bash
# bench-rbd-nbd.sh: the real rbd-nbd on a real Ceph, healed by mountmedic's
# re-attach tier, in the guest of scripts/guest (Debian's 6.1 kernel under
# qemu; the host kernel has no nbd driver).
#
#   sudo scripts/bench-rbd-nbd.sh            # VOLUMES=5 KILLS=5 RUNS=2
#
# Each run is scripts/guest's TestRBDInGuest: the Ceph lab on the host's
# 127.0.0.1 (scripts/ceph-lab.sh: mon, mgr, OSD, MDS; a pool "lab" for RBD),
# the guest on qemu's user-mode network with scripts/guest/fwd forwarding
# the lab's ports, and in it remount's rbd tests (remount/rbd_guest_root_test.go)
# with the lab NBD driver's rbd mode (ceph-csi's rbd-nbd map and attach):
#   rbd-nbd killed KILLS times with the plugin up -> the container's reader
#     reads its fsync'd data and writes again (p50, max);
#   the node plugin restarted with VOLUMES volumes (every rbd-nbd gone) ->
#     all readers read and write again, mountmedic's re-attach tier beside
#     ceph-csi's own healer at plugin start alone.
# The first run is cold (a Ceph lab made afresh, a guest booted afresh, the
# test binary built), the next ones warm. Prints the "guest figures" and
# "rbd figures" lines of each run and the load; exits non-zero when a run
# fails. About 8-11 min a run on a 2-core host. CI runs TestRBDInGuest's
# default set instead (rbd-nbd killed once and the OSD paused, under the
# re-attach tier alone and under the whole agent: about 6 min); the plugin
# restart with several volumes is this script's.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
	echo "bench-rbd-nbd.sh: run as root: Ceph's daemons, qemu's guest and its mounts need it" >&2
	exit 1
fi
eval "$(scripts/tools.sh path)"
runs=${RUNS:-2}
for i in $(seq "$runs"); do
	kind=warm
	[ "$i" = 1 ] && kind=cold
	echo "rbd-nbd-bench: run $i ($kind), load: $(cut -d' ' -f1-3 /proc/loadavg)"
	log=$(mktemp /tmp/mountmedic-rbd-bench.XXXXXX)
	start=$(date +%s.%N)
	if ! MOUNTMEDIC_RBD_RUN='^TestRBD(DaemonKilled|PluginRestart)$' MOUNTMEDIC_RBD_AGENT_RUN=none MOUNTMEDIC_RBD_VOLUMES=${VOLUMES:-5} MOUNTMEDIC_RBD_KILLS=${KILLS:-5} \
		go test -count=1 -timeout 40m -run '^TestRBDInGuest$' -v ./scripts/guest >"$log" 2>&1; then
		tail -n 100 "$log"
		echo "rbd-nbd-bench: run $i failed (whole log: $log)"
		exit 1
	fi
	grep -E 'guest figures|rbd figures|--- (PASS|FAIL)' "$log" | sed 's/^ *//'
	echo "rbd-nbd-bench: run $i ($kind): $(echo "$(date +%s.%N) - $start" | bc) s in all, load after: $(cut -d' ' -f1-3 /proc/loadavg)"
	rm -f "$log"
done
