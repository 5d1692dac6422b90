#!/usr/bin/env bash
# Installs the Debian packages the tests use: the FUSE clients and tools the
# fault lab drives, the real CSI driver's s3fs and rclone, sshfs with sftp-server (no
# sshd) for the lab's layout drivers, Prometheus/promtool for the
# metrics checks, containerd/runc and busybox-static for the e2e node, buildah
# for the image, the Ceph daemons, ceph-fuse and bc of scripts/ceph-lab.sh
# (the agent's CephFS tests, scripts/bench-ceph-fuse.sh), and rbd-nbd for the
# guest's rbd tests (scripts/guest's TestRBDInGuest, scripts/bench-rbd-nbd.sh). --ceph is accepted
# and changes nothing. Installs nothing that is already there.
set -euo pipefail
pkgs=(s3fs rclone sshfs openssh-sftp-server fuse3 e2fsprogs util-linux prometheus buildah containerd runc busybox-static qemu-system-x86 nbdkit nbd-client
	ceph-mon ceph-mgr ceph-osd ceph-mds ceph-fuse ceph-common rbd-nbd bc)
case ${1:-} in
--ceph | "") ;;
*)
	echo "usage: $0 [--ceph]" >&2
	exit 2
	;;
esac
missing=()
for p in "${pkgs[@]}"; do
	dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if ((${#missing[@]})); then
	echo "deps: installing ${missing[*]}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq
	apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
