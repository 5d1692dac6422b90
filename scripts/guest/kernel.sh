#!/usr/bin/env bash
# kernel.sh caches the guest kernel of scripts/guest: Debian's linux-image
# package (the one linux-image-amd64 points at, 6.1 on bookworm), unpacked
# with dpkg-deb into $MOUNTMEDIC_CACHE/guest/<package>_<version>/ (default
# cache /var/cache/mountmedic), so the host's /boot and /lib/modules stay as
# they are and no initramfs is generated. A second run downloads nothing.
#
#   scripts/guest/kernel.sh        cache the kernel if missing, print its line
#   scripts/guest/kernel.sh path   print the line only (fails when not cached)
#
# The line printed is `export MOUNTMEDIC_GUEST_KERNEL=<dir>`; <dir> holds
# boot/vmlinuz-<release> and lib/modules/<release>/. The guest tests find the
# kernel there, or through $CACHE/guest/current when the variable is unset.
set -euo pipefail

META=${MOUNTMEDIC_GUEST_KERNEL_PACKAGE:-linux-image-amd64}
CACHE=${MOUNTMEDIC_CACHE:-/var/cache/mountmedic}
GUEST=$CACHE/guest

log() { printf '%s kernel: %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

if [ "${1:-}" = path ]; then
	[ -e "$GUEST/current/boot" ] || die "no guest kernel in $GUEST: run scripts/guest/kernel.sh"
	echo "export MOUNTMEDIC_GUEST_KERNEL=$(readlink -f "$GUEST/current")"
	exit 0
fi

# The versioned package the metapackage depends on, and its candidate version.
pkg=$(apt-cache depends "$META" 2>/dev/null | sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*\)$/\1/p' | head -n1)
if [ -z "$pkg" ]; then
	apt-get update -qq
	pkg=$(apt-cache depends "$META" | sed -n 's/^ *Depends: \(linux-image-[0-9][^ ]*\)$/\1/p' | head -n1)
fi
[ -n "$pkg" ] || die "apt knows no kernel package behind $META"
version=$(apt-cache policy "$pkg" | sed -n 's/^ *Candidate: //p')
[ -n "$version" ] && [ "$version" != "(none)" ] || die "apt has no candidate version of $pkg"
dir=$GUEST/${pkg}_$version
if [ ! -e "$dir/boot" ]; then
	start=$(date +%s)
	tmp=$(mktemp -d "$GUEST.tmp.XXXXXX" 2>/dev/null || { mkdir -p "$GUEST" && mktemp -d "$GUEST.tmp.XXXXXX"; })
	trap 'rm -rf "$tmp"' EXIT
	chmod 0755 "$tmp" # apt-get download runs as _apt and must write here
	(cd "$tmp" && apt-get download -qq "$pkg=$version") || die "apt-get download $pkg=$version failed"
	mkdir -p "$tmp/root"
	dpkg-deb -x "$tmp"/*.deb "$tmp/root"
	release=${pkg#linux-image-}
	[ -f "$tmp/root/boot/vmlinuz-$release" ] || die "$pkg has no boot/vmlinuz-$release"
	# depmod writes modules.dep and friends; the package leaves that to its postinst.
	depmod -b "$tmp/root" "$release"
	mkdir -p "$dir"
	mv "$tmp/root/boot" "$tmp/root/lib" "$dir/"
	log "$pkg $version cached in $dir in $(($(date +%s) - start))s"
fi
ln -sfn "$(basename "$dir")" "$GUEST/current"
echo "export MOUNTMEDIC_GUEST_KERNEL=$dir"
