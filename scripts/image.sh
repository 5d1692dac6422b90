#!/usr/bin/env bash
# image.sh builds the mountmedic container image with buildah, without a
# registry and without a daemon (see the Dockerfile header for why).
#
#   scripts/image.sh [--version V] [--name NAME] [--archive FILE [--format F]] [--no-verify] [--rm]
#                    [--chart DIR [--chart-only]]
#
#   --version V    image tag and main.version (default: $VERSION, else
#                  `git describe --tags --always --dirty`, else dev)
#   --name NAME    image name (default mountmedic); the image is NAME:V
#   --archive FILE also write the image to FILE, to load it elsewhere:
#                    ctr -n k8s.io images import FILE      (containerd, kubelet's namespace)
#                    podman load -i FILE / docker load -i FILE
#   --format F     docker-archive (default) or oci-archive; either way the image
#                  inside is named docker.io/library/NAME:V, which is what a
#                  pod's "image: NAME:V" resolves to
#   --no-verify    skip running `/mountmedic version` inside the built image
#   --rm           remove the image from buildah's storage at the end (after
#                  the verification and the archive): a build check leaves
#                  nothing behind
#   --chart DIR    also package the Helm chart (deploy/chart/mountmedic) into
#                  DIR as mountmedic-<chart version>.tgz: appVersion V (so the
#                  chart's default image is NAME:V, the version `mountmedic
#                  version` prints), chart version V without a leading v
#                  (SemVer; a V that is no version number gives 0.0.0-V)
#   --chart-only   package the chart and build no image (needs neither root
#                  nor buildah)
#
# Environment: GOARCH (default: the host's), STORAGE_DRIVER (buildah storage
# driver; default overlay when the kernel has it and the storage root is not
# itself on overlayfs, else vfs; a storage root keeps the driver it was first
# used with), STORAGE_ROOT (buildah --root; default buildah's own, usually
# /var/lib/containers/storage), ISOLATION (for the verification run; default
# chroot, which needs no OCI runtime), SOURCE_DATE_EPOCH (image and label time;
# default the last commit's time, so a rebuild of the same commit gives the
# same labels).
#
# Prints the image reference, its size and, with --archive, the archive path.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf 'image: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

name=mountmedic
version=${VERSION:-}
archive=
format=docker-archive
verify=1
remove=0
chartdir=
chartonly=0
while [ $# -gt 0 ]; do
	case $1 in
	--version) version=${2:?--version needs a value}; shift 2 ;;
	--version=*) version=${1#*=}; shift ;;
	--name) name=${2:?--name needs a value}; shift 2 ;;
	--name=*) name=${1#*=}; shift ;;
	--archive) archive=${2:?--archive needs a file}; shift 2 ;;
	--archive=*) archive=${1#*=}; shift ;;
	--format) format=${2:?--format needs a value}; shift 2 ;;
	--format=*) format=${1#*=}; shift ;;
	--no-verify) verify=0; shift ;;
	--rm) remove=1; shift ;;
	--chart) chartdir=${2:?--chart needs a directory}; shift 2 ;;
	--chart=*) chartdir=${1#*=}; shift ;;
	--chart-only) chartonly=1; shift ;;
	-h | --help) sed -n '2,38p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
	*) die "unknown argument $1 (see scripts/image.sh --help)" ;;
	esac
done
case $format in
docker-archive | oci-archive) ;;
*) die "--format $format: want docker-archive or oci-archive" ;;
esac

[ "$chartonly" = 0 ] || [ -n "$chartdir" ] || die "--chart-only needs --chart DIR"

if [ -z "$version" ]; then
	version=$(git describe --tags --always --dirty 2>/dev/null || echo dev)
fi

# package_chart writes the chart with this version into $chartdir.
package_chart() {
	local helm chartver
	helm=$(command -v helm || true)
	if [ -z "$helm" ]; then helm=${MOUNTMEDIC_CACHE:-/var/cache/mountmedic}/bin/current/helm; fi
	[ -x "$helm" ] || die "helm is not on PATH nor in the tools cache (scripts/tools.sh helm)"
	chartver=${version#v}
	if ! printf '%s' "$chartver" | grep -Eq '^[0-9]+\.[0-9]+\.[0-9]+(-[0-9A-Za-z.-]+)?(\+[0-9A-Za-z.-]+)?$'; then
		chartver=0.0.0-$(printf '%s' "$version" | tr -c '0-9A-Za-z.-' '-')
	fi
	mkdir -p "$chartdir"
	"$helm" package deploy/chart/mountmedic --version "$chartver" --app-version "$version" --destination "$chartdir" >/dev/null
	echo "chart $chartdir/mountmedic-$chartver.tgz (version $chartver, appVersion $version)"
}
if [ "$chartonly" = 1 ]; then
	package_chart
	exit 0
fi

command -v go >/dev/null || die "go is not on PATH"
command -v buildah >/dev/null || die "buildah is not installed (apt-get install buildah)"
[ "$(id -u)" = 0 ] || die "run as root: buildah's rootless mode needs subuid ranges this script does not set up"

# A tag is [A-Za-z0-9_.-]{1,128} and does not start with . or -.
tag=$(printf '%s' "$version" | tr -c 'A-Za-z0-9_.-' '-' | cut -c1-128)
case $tag in [.-]*) tag=v$tag ;; esac
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
epoch=${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}
created=$(date -u -d "@$epoch" +%Y-%m-%dT%H:%M:%SZ)
arch=${GOARCH:-$(go env GOARCH)}
ref=$name:$tag

# Storage driver: overlay needs kernel support and a graph root that is not
# on overlayfs itself (a build inside a container); vfs always works, slower.
driver=${STORAGE_DRIVER:-}
if [ -z "$driver" ]; then
	graphroot=${STORAGE_ROOT:-/var/lib/containers/storage}
	mkdir -p "$graphroot"
	if grep -qw overlay /proc/filesystems && [ "$(stat -f -c %T "$graphroot")" != overlayfs ]; then
		driver=overlay
	else
		driver=vfs
	fi
fi
storage=(--storage-driver "$driver")
if [ -n "${STORAGE_ROOT:-}" ]; then storage+=(--root "$STORAGE_ROOT" --runroot "$STORAGE_ROOT/run"); fi
bah() { buildah "${storage[@]}" "$@"; }

ctx=$(mktemp -d "${TMPDIR:-/tmp}/mountmedic-image.XXXXXX")
cleanup() {
	if [ -n "${container:-}" ]; then bah rm "$container" >/dev/null 2>&1 || true; fi
	rm -rf "$ctx"
}
trap cleanup EXIT

log "building $ref (go $(go env GOVERSION), linux/$arch, storage $driver)"
# -buildvcs=auto: stamp vcs.revision (printed by `mountmedic version`) from a
# git checkout even where GOFLAGS turns stamping off; no error outside one.
CGO_ENABLED=0 GOOS=linux GOARCH=$arch go build -trimpath -buildvcs=auto \
	-ldflags "-s -w -X main.version=$version" \
	-o "$ctx/mountmedic" ./cmd/mountmedic
# The image has no libc: refuse a binary that would need one.
if command -v file >/dev/null && ! file "$ctx/mountmedic" | grep -q 'statically linked'; then
	die "$ctx/mountmedic is not statically linked: $(file -b "$ctx/mountmedic")"
fi

bah bud --quiet \
	--file Dockerfile \
	--platform "linux/$arch" \
	--timestamp "$epoch" \
	--build-arg "VERSION=$version" \
	--build-arg "REVISION=$revision" \
	--build-arg "CREATED=$created" \
	--tag "$ref" \
	"$ctx" >/dev/null

if [ "$verify" = 1 ]; then
	container=$(bah from --quiet --pull-never "$ref")
	out=$(bah run --isolation "${ISOLATION:-chroot}" "$container" -- /mountmedic version)
	bah rm "$container" >/dev/null
	container=
	case $out in
	"mountmedic $version "*) log "verified: $out" ;;
	*) die "/mountmedic version in $ref printed \"$out\", want \"mountmedic $version ...\"" ;;
	esac
fi

size=$(bah images --noheading --format '{{.Size}}' "$ref")
echo "image $ref ($size, storage driver $driver)"

if [ -n "$archive" ]; then
	mkdir -p "$(dirname "$archive")"
	rm -f "$archive"
	# Name the image in the archive by its full reference: ctr keeps an OCI
	# archive's name as written, and kubelet looks a pod's "NAME:V" up as
	# docker.io/library/NAME:V.
	case ${name%%/*} in
	*.* | *:* | localhost) full=$ref ;;
	*) if [ "$name" = "${name#*/}" ]; then full=docker.io/library/$ref; else full=docker.io/$ref; fi ;;
	esac
	bah push --quiet "$ref" "$format:$archive:$full" >/dev/null
	echo "archive $archive ($format, $full, $(du -h "$archive" | cut -f1)); load it with: ctr -n k8s.io images import $archive"
fi

if [ -n "$chartdir" ]; then package_chart; fi

if [ "$remove" = 1 ]; then
	bah rmi "$ref" >/dev/null
	echo "removed $ref from buildah's storage"
fi
