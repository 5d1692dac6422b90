#!/usr/bin/env bash
# plugin.sh builds the kubectl plugin kubectl-mountmedic as krew installs
# it: one archive per platform (kubectl-mountmedic at its root) and the krew manifest naming each archive's URL and sha256.
#
#   scripts/plugin.sh --version V --out DIR [--url-base URL] [--platforms "linux/amd64 ..."]
#
#   --version V     the plugin's version (main.version and the manifest's
#                   spec.version; krew wants it to start with v)
#   --out DIR       writes DIR/kubectl-mountmedic_V_<os>_<arch>.tar.gz and
#                   DIR/mountmedic.yaml (the krew manifest)
#   --url-base URL  where the archives will be served from (default the
#                   GitHub release of V); the manifest's uri is
#                   URL/<archive name>
#   --platforms P   os/arch pairs (default linux/amd64 linux/arm64
#                   darwin/amd64 darwin/arm64)
#
# Install from the output without publishing anything:
#   kubectl krew install --manifest=DIR/mountmedic.yaml --archive=DIR/kubectl-mountmedic_V_linux_amd64.tar.gz
set -euo pipefail
cd "$(dirname "$0")/.."

die() { printf 'plugin: error: %s\n' "$*" >&2; exit 1; }

version=
out=
urlbase=
platforms="linux/amd64 linux/arm64 darwin/amd64 darwin/arm64"
while [ $# -gt 0 ]; do
	case $1 in
	--version) version=${2:?--version needs a value}; shift 2 ;;
	--out) out=${2:?--out needs a directory}; shift 2 ;;
	--url-base) urlbase=${2:?--url-base needs a URL}; shift 2 ;;
	--platforms) platforms=${2:?--platforms needs a list}; shift 2 ;;
	*) die "unknown argument $1 (see the header of $0)" ;;
	esac
done
[ -n "$version" ] || die "--version is required (e.g. --version v0.1.0)"
case $version in v*) ;; *) die "--version $version: krew wants a version starting with v (v0.1.0)" ;; esac
[ -n "$out" ] || die "--out is required"
urlbase=${urlbase:-https://github.com/mountmedic/mountmedic/releases/download/$version}
mkdir -p "$out"
out=$(cd "$out" && pwd)

manifest=$out/mountmedic.yaml
cat >"$manifest" <<YAML
apiVersion: krew.googlecontainertools.github.com/v1alpha2
kind: Plugin
metadata:
  name: mountmedic
spec:
  version: $version
  homepage: https://github.com/mountmedic/mountmedic
  shortDescription: Show pod volume mounts mountmedic found broken and repaired
  description: |
    Reads what the mountmedic agents leave in the API server: per node, the
    pod volume mounts their PodVolumeMountsBroken condition counts broken,
    the last repair, and the failover state; "kubectl mountmedic node NODE"
    shows one node's pods, volumes and what its agent did, from events an
    admission policy vouches were written by that node's agent. Read-only;
    the ClusterRole mountmedic-viewer is enough.
  platforms:
YAML
for p in $platforms; do
	os=${p%/*} arch=${p#*/}
	work=$(mktemp -d)
	CGO_ENABLED=0 GOOS=$os GOARCH=$arch go build -trimpath -ldflags "-s -w -X main.version=$version" \
		-o "$work/kubectl-mountmedic" ./cmd/kubectl-mountmedic
	archive=kubectl-mountmedic_${version}_${os}_${arch}.tar.gz
	tar -C "$work" --owner=0 --group=0 --numeric-owner --mtime=@0 -czf "$out/$archive" kubectl-mountmedic
	rm -rf "$work"
	sum=$(sha256sum "$out/$archive" | cut -d' ' -f1)
	cat >>"$manifest" <<YAML
    - selector:
        matchLabels:
          os: $os
          arch: $arch
      uri: $urlbase/$archive
      sha256: $sum
      bin: kubectl-mountmedic
      files:
        - from: kubectl-mountmedic
          to: .
YAML
	printf '%s\n' "$out/$archive"
done
printf '%s\n' "$manifest"
