#!/usr/bin/env bash
# ceph-lab.sh: a throwaway single-node Ceph with a CephFS on 127.0.0.1, for
# tests that need a real Ceph daemon to mount from (ceph-fuse, the kernel
# client).
#
#   CEPH_LAB_DIR=/tmp/cephlab scripts/ceph-lab.sh start
#   CEPH_CONF=/tmp/cephlab/ceph.conf ceph-fuse --client_fs=cephfs /mnt/x
#   CEPH_LAB_DIR=/tmp/cephlab scripts/ceph-lab.sh stop
#
# start: one mon, one mgr, one BlueStore OSD on a sparse file, one MDS, and
# a file system "cephfs" (pools cephfs_metadata and cephfs_data, size 1),
# cephx off, every daemon's state, log, pid and admin socket under
# $CEPH_LAB_DIR (which must be empty or absent); no systemd, and nothing
# is mounted. Prints the seconds it took and the conf clients use.
# stop: stops the daemons (SIGTERM, SIGKILL after 10 s) and removes
# $CEPH_LAB_DIR. Needs root (the OSD and MDS want their own ports and the
# packages' defaults); the packages are ceph-mon ceph-mgr ceph-osd
# ceph-mds ceph-common (scripts/deps.sh).
#
# RBD: scripts/csilab's Ceph.RBDPool adds a pool "lab" (`rbd pool init`)
# for rbd-nbd in the guest of scripts/guest, which reaches every daemon
# through scripts/guest/fwd (the maps name 127.0.0.1 addresses).
#
# CEPH_LAB_PORT (6789) is the mon's port and CEPH_LAB_PORTS (6800-6899)
# the range the other daemons bind in: change both to run two labs at once.
set -euo pipefail

D=${CEPH_LAB_DIR:?CEPH_LAB_DIR must name the directory for the lab Ceph state (created on start, removed on stop)}
case $D in /*) ;; *) D=$PWD/$D ;; esac
port=${CEPH_LAB_PORT:-6789}
ports=${CEPH_LAB_PORTS:-6800-6899}
marker=$D/.ceph-lab
log() { printf 'ceph-lab: %s\n' "$*" >&2; }
die() {
	log "$*"
	exit 1
}
now() { date +%s.%N; }

# ceph runs the ceph CLI, again when it lost a race of its own: it can send
# its first request (get_command_descriptions) before the mon's map reached
# it, with a zero fsid; the mon refuses it ("wrong fsid" in mon.a.log) and
# the CLI stops with EPERM "problem getting command descriptions" before it
# sends the command it was given. About 1 call in 20 while the lab starts.
ceph() {
	local i rc err
	for i in 1 2 3 4 5; do
		rc=0
		err=$(command ceph "$@" 2>&1 >&3) || rc=$?
		if ((rc != 0)) && ((i < 5)) && [[ $err == *"problem getting command descriptions"* ]]; then
			sleep 0.2
			continue
		fi
		[ -z "$err" ] || printf '%s\n' "$err" >&2
		return "$rc"
	done
} 3>&1

# daemons lists the lab's daemons in the order they stop.
daemons=(mds.a osd.0 mgr.x mon.a)

# stop_daemons stops the lab's daemons and leaves their state and logs.
stop_daemons() {
	local n pid end
	# One at a time, in order: a daemon shutting down tells the mon.
	for n in "${daemons[@]}"; do
		[ -s "$D/run/$n.pid" ] || continue
		pid=$(cat "$D/run/$n.pid")
		# Only a process of this lab: its command line names this conf.
		tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "-c $D/ceph.conf" || continue
		kill -CONT "$pid" 2>/dev/null || true
		kill -TERM "$pid" 2>/dev/null || true
		end=$((SECONDS + 10))
		while kill -0 "$pid" 2>/dev/null && ((SECONDS < end)); do sleep 0.1; done
		[ -z "${CEPH_LAB_DEBUG:-}" ] || log "$n stopped at $(date +%T.%N)"
		if kill -0 "$pid" 2>/dev/null; then
			log "$n (pid $pid) did not stop on SIGTERM in 10 s: SIGKILL"
			kill -KILL "$pid" 2>/dev/null || true
			while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done
		fi
	done
}

stop() {
	[ -d "$D" ] || return 0
	[ -e "$marker" ] || die "$D was not made by ceph-lab.sh start (no $marker): not touching it"
	stop_daemons
	rm -rf "$D"
}

start() {
	local c
	for c in ceph-mon ceph-mgr ceph-osd ceph-mds ceph monmaptool; do
		command -v "$c" >/dev/null || die "$c not found: install ceph-mon ceph-mgr ceph-osd ceph-mds ceph-common (scripts/deps.sh)"
	done
	if [ -e "$D" ] && [ -n "$(ls -A "$D")" ]; then
		die "$D is not empty: stop the lab there first (CEPH_LAB_DIR=$D $0 stop) or name another directory"
	fi
	if (echo >"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
		die "127.0.0.1:$port is in use: set CEPH_LAB_PORT (and CEPH_LAB_PORTS) to free ports"
	fi
	mkdir -p "$D/run" "$D/mon.a" "$D/mgr.x" "$D/osd.0" "$D/mds.a"
	: >"$marker"
	local t fsid
	t=$(now)
	fsid=$(cat /proc/sys/kernel/random/uuid)
	cat >"$D/ceph.conf" <<EOC
[global]
fsid = $fsid
mon host = v1:127.0.0.1:$port
mon initial members = a
auth cluster required = none
auth service required = none
auth client required = none
ms bind ipv6 = false
ms bind msgr2 = false
public addr = 127.0.0.1
cluster addr = 127.0.0.1
ms bind port min = ${ports%-*}
ms bind port max = ${ports#*-}
run dir = $D/run
pid file = $D/run/\$name.pid
log file = $D/\$name.log
admin socket = $D/run/\$name.asok
mon data = $D/mon.\$id
mgr data = $D/mgr.\$id
osd data = $D/osd.\$id
mds data = $D/mds.\$id
osd pool default size = 1
osd pool default min size = 1
osd pool default pg autoscale mode = off
osd crush chooseleaf type = 0
mon allow pool size one = true
mon warn on pool no redundancy = false
osd objectstore = bluestore
bluestore block create = true
bluestore block size = 2147483648
bluestore fsck on mkfs = false
osd memory target = 939524096
# The OSD's own crush and class updates at boot can reach the mon before its monmap
# and fail ('wrong fsid'); start places it in the crush map instead.
osd crush update on start = false
osd class update on start = false
[client]
# Per process, as the admin socket: two clients of one name (ceph-fuse
# mounts of two volumes) must not fight over one pid file.
pid file = $D/run/\$name.\$pid.pid
admin socket = $D/run/\$name.\$pid.asok
log file = $D/\$name.\$pid.log
EOC
	export CEPH_CONF=$D/ceph.conf
	ok=0
	trap '[ "$ok" = 1 ] || { stop_daemons; log "start failed: daemons stopped, logs kept in $D (remove it with $0 stop)"; }' EXIT
	monmaptool --create --clobber --fsid "$fsid" --addv a "[v1:127.0.0.1:$port]" "$D/monmap" >/dev/null
	ceph-mon -c "$D/ceph.conf" --mkfs -i a --monmap "$D/monmap" >/dev/null
	ceph-mon -c "$D/ceph.conf" -i a 2>>"$D/start.log"
	ceph-mgr -c "$D/ceph.conf" -i x 2>>"$D/start.log"
	# Wait until the mon just started answers a command.
	local i
	for i in $(seq 150); do
		ceph osd ls >/dev/null 2>&1 && break
		((i < 150)) || die "the mon answered no command in 30 s: see $D/mon.a.log"
		sleep 0.2
	done
	local uuid id
	uuid=$(cat /proc/sys/kernel/random/uuid)
	id=$(ceph osd new "$uuid")
	[ "$id" = 0 ] || die "ceph osd new gave id $id, want 0"
	ceph osd crush add osd.0 1.0 root=default host=lab >/dev/null 2>&1
	ceph-osd -c "$D/ceph.conf" -i 0 --mkfs --osd-uuid "$uuid" >"$D/osd.0.mkfs.log" 2>&1
	ceph-osd -c "$D/ceph.conf" -i 0 2>>"$D/start.log"
	ceph-mds -c "$D/ceph.conf" -i a >>"$D/start.log" 2>&1
	ceph osd pool create cephfs_metadata 8 8 >/dev/null 2>&1
	ceph osd pool create cephfs_data 8 8 >/dev/null 2>&1
	ceph fs new cephfs cephfs_metadata cephfs_data >/dev/null 2>&1
	for i in $(seq 300); do
		# Ready: the MDS serves the file system and every placement group
		# is active, so the first client write does not wait for peering.
		if ceph mds stat 2>/dev/null | grep -q 'up:active' &&
			ceph pg stat 2>/dev/null | grep -Eq '^([0-9]+) pgs: \1 active'; then
			break
		fi
		((i < 300)) || die "CephFS not ready after 60 s: see $D/mds.a.log and $D/osd.0.log"
		sleep 0.2
	done
	# The mgr's volumes module serves `ceph fs subvolume...` (ceph-csi's
	# CephFS provisioning, and the tests'): wait until it answers.
	for i in $(seq 120); do
		timeout 10 ceph fs subvolumegroup ls cephfs >/dev/null 2>&1 && break
		((i < 120)) || die "the mgr's volumes module answered no command in 60 s: see $D/mgr.x.log"
		sleep 0.5
	done
	ok=1
	log "ceph ready (mon, mgr, osd, mds, cephfs) in $(echo "$(now) - $t" | bc) s"
	echo "CEPH_CONF=$D/ceph.conf"
}

case ${1:-} in
start) start ;;
stop) stop ;;
*) die "usage: CEPH_LAB_DIR=DIR $0 start|stop" ;;
esac
