#!/usr/bin/env bash
# tools.sh builds the external binaries the tests need and caches them outside the
# repository, keyed by version, so a second run on the same machine builds nothing.
#
#   scripts/tools.sh [all|kube|controlplane|s3|<binary>...] build what is missing
#   scripts/tools.sh list                                   show what is cached
#   scripts/tools.sh path                                   print the PATH line only
#
# Binaries land in $MOUNTMEDIC_CACHE/bin/<name>-<version>/<name> (default cache
# /var/cache/mountmedic); $MOUNTMEDIC_CACHE/bin/current/<name> links to the pinned
# version. Tests find them there, or in $MOUNTMEDIC_BIN when that is set.
# MOUNTMEDIC_JOBS (default 2) is how many build modules compile at the same time.
#
# Every binary is built from a small module under scripts/tools/<module>/ that only
# pins versions, so none of them enters the graph of the project's own go.mod.
set -euo pipefail

ETCD_VERSION=v3.6.16
KUBE_VERSION=v1.37.1
S3DRIVER_VERSION=v0.43.7
VERSITYGW_VERSION=v1.8.0
HELM_VERSION=v3.22.0
KWOK_VERSION=v0.8.0
GGCR_VERSION=v0.22.1

TOOLS_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/tools
CACHE=${MOUNTMEDIC_CACHE:-/var/cache/mountmedic}
BIN=$CACHE/bin
CURRENT=$BIN/current
LOGS=$CACHE/logs
JOBS=${MOUNTMEDIC_JOBS:-2}

# name|version|module dir|package
COMPONENTS=(
	"kube-apiserver|$KUBE_VERSION|kube|k8s.io/kubernetes/cmd/kube-apiserver"
	"kube-controller-manager|$KUBE_VERSION|kube|k8s.io/kubernetes/cmd/kube-controller-manager"
	"kube-scheduler|$KUBE_VERSION|kube|k8s.io/kubernetes/cmd/kube-scheduler"
	"kubelet|$KUBE_VERSION|kube|k8s.io/kubernetes/cmd/kubelet"
	"kubectl|$KUBE_VERSION|kube|k8s.io/kubernetes/cmd/kubectl"
	"etcd|$ETCD_VERSION|etcd|go.etcd.io/etcd/server/v3"
	"s3driver|$S3DRIVER_VERSION|s3driver|github.com/yandex-cloud/k8s-csi-s3/cmd/s3driver"
	"versitygw|$VERSITYGW_VERSION|versitygw|github.com/versity/versitygw/cmd/versitygw"
	"helm|$HELM_VERSION|helm|helm.sh/helm/v3/cmd/helm"
	"kwok|$KWOK_VERSION|kwok|sigs.k8s.io/kwok/cmd/kwok"
	# crane's `registry serve`: the OCI registry the chart is pushed to.
	"crane|$GGCR_VERSION|crane|github.com/google/go-containerregistry/cmd/crane"
)

log() { printf '%s tools: %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

field() { # field N "a|b|c|d"
	local IFS='|'
	# shellcheck disable=SC2206
	local parts=($2)
	printf '%s' "${parts[$1]}"
}

# module_of prints the module path of a package in COMPONENTS.
module_of() {
	case $1 in
	k8s.io/kubernetes/*) echo k8s.io/kubernetes ;;
	go.etcd.io/etcd/server/v3) echo go.etcd.io/etcd/server/v3 ;;
	github.com/yandex-cloud/k8s-csi-s3/*) echo github.com/yandex-cloud/k8s-csi-s3 ;;
	github.com/versity/versitygw/*) echo github.com/versity/versitygw ;;
	helm.sh/helm/v3/*) echo helm.sh/helm/v3 ;;
	sigs.k8s.io/kwok/*) echo sigs.k8s.io/kwok ;;
	github.com/google/go-containerregistry/*) echo github.com/google/go-containerregistry ;;
	*) die "no module known for $1" ;;
	esac
}

# select_components expands the arguments into component names, one a line.
select_components() {
	local arg c
	[ $# -gt 0 ] || set -- all
	for arg in "$@"; do
		case $arg in
		all) for c in "${COMPONENTS[@]}"; do field 0 "$c"; echo; done ;;
		kube) printf '%s\n' kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl ;;
		controlplane) printf '%s\n' etcd kube-apiserver kube-controller-manager kube-scheduler kubectl ;;
		s3 | csi) printf '%s\n' s3driver versitygw ;;
		*)
			for c in "${COMPONENTS[@]}"; do
				if [ "$(field 0 "$c")" = "$arg" ]; then echo "$arg"; continue 2; fi
			done
			die "unknown component $arg (want all, kube, controlplane, s3, or one of: $(for c in "${COMPONENTS[@]}"; do printf '%s ' "$(field 0 "$c")"; done))"
			;;
		esac
	done
}

entry() { # entry NAME prints its COMPONENTS line
	local c
	for c in "${COMPONENTS[@]}"; do
		if [ "$(field 0 "$c")" = "$1" ]; then echo "$c"; return; fi
	done
	die "unknown component $1"
}

cached_path() { echo "$BIN/$1-$2/$1"; }

# install_extras copies what a binary needs besides itself next to it, from
# its build module (DIR): kwok's node stages (kustomize/stage/node/ in its
# module zip; kwok does nothing to a node without stages). Tests read them
# from <binary's directory>/stages/.
install_extras() { # install_extras NAME VERSION DIR
	local out moddir
	case $1 in
	kwok)
		out=$(dirname "$(cached_path "$1" "$2")")/stages
		[ -f "$out/node-heartbeat-with-lease.yaml" ] && return 0
		moddir=$(cd "$3" && GOFLAGS=-mod=mod go list -m -f '{{.Dir}}' sigs.k8s.io/kwok) || return 1
		mkdir -p "$out"
		cp "$moddir/kustomize/stage/node/fast/node-initialize.yaml" \
			"$moddir/kustomize/stage/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml" "$out/"
		chmod 0644 "$out"/*.yaml
		;;
	esac
}

link_current() { # link_current NAME VERSION
	mkdir -p "$CURRENT"
	ln -sfn "../$1-$2/$1" "$CURRENT/$1"
}

# prepare_kube_module pins k8s.io/kubernetes and replaces each staging module that
# its go.mod points at ./staging/src/k8s.io/X with the published k8s.io/X v0.MINOR.PATCH.
# The list comes from the kubernetes go.mod in the module cache, not from this script.
prepare_kube_module() {
	local dir=$1 gomod staging line mod scratch
	staging=v0.${KUBE_VERSION#v1.}
	# Ask outside any module: the kubernetes graph does not load before the replaces exist.
	scratch=$(mktemp -d)
	gomod=$(cd "$scratch" && GOFLAGS= go mod download -json "k8s.io/kubernetes@$KUBE_VERSION" |
		sed -n 's/^[[:space:]]*"GoMod": "\(.*\)",\{0,1\}$/\1/p')
	rmdir "$scratch"
	[ -s "$gomod" ] || die "no go.mod for k8s.io/kubernetes@$KUBE_VERSION in the module cache"
	local edits=("-require=k8s.io/kubernetes@$KUBE_VERSION")
	while read -r line; do
		mod=${line%% *}
		edits+=("-replace=$mod=$mod@$staging")
	done < <(sed -n 's#^[[:space:]]*\(replace[[:space:]]\+\)\{0,1\}\(k8s\.io/[^[:space:]]*\)[[:space:]]*=>[[:space:]]*\./staging/src/.*#\2 x#p' "$gomod")
	[ ${#edits[@]} -gt 1 ] || die "found no staging replace directives in $gomod"
	(cd "$dir" && go mod edit "${edits[@]}")
}

# prepare_module makes sure the build module requires the pinned version and
# lists each package as a tool; called once per module build.
prepare_module() { # prepare_module DIR VERSION PACKAGE...
	local dir=$1 version=$2 mod pkg tools=()
	shift 2
	mkdir -p "$dir"
	if [ ! -f "$dir/go.mod" ]; then
		(cd "$dir" && go mod init "github.com/mountmedic/mountmedic/scripts/tools/$(basename "$dir")" >/dev/null 2>&1)
	fi
	mod=$(module_of "$1")
	if [ "$mod" = k8s.io/kubernetes ]; then
		prepare_kube_module "$dir"
	else
		(cd "$dir" && go mod edit -require="$mod@$version")
	fi
	for pkg in "$@"; do tools+=("-tool=$pkg"); done
	(cd "$dir" && go mod edit "${tools[@]}")
}

ldflags_for() { # ldflags_for NAME VERSION
	local flags="-s -w" v=$2 major minor p
	case $1 in
	kube-*|kubelet|kubectl)
		major=${v#v}; major=${major%%.*}
		minor=${v#v*.}; minor=${minor%%.*}
		for p in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
			flags+=" -X $p.gitVersion=$v -X $p.gitMajor=$major -X $p.gitMinor=$minor -X $p.gitTreeState=clean"
		done
		;;
	esac
	echo "$flags"
}

# build_module builds the wanted components of one build module: the module is
# prepared once and the missing ones are built by a single go build, so that
# packages they share (all of k8s.io/kubernetes for the kube binaries) compile
# once; go commands that share a go.mod must not run at the same time anyway.
build_module() {
	local name e version dir pkgs=() missing=() logf tmp out start took
	for name in "$@"; do
		e=$(entry "$name")
		version=$(field 1 "$e")
		if [ -x "$(cached_path "$name" "$version")" ]; then
			install_extras "$name" "$version" "$TOOLS_DIR/$(field 2 "$e")" || return 1
			link_current "$name" "$version"
			log "$name $version cached"
		else
			missing+=("$name")
		fi
	done
	[ ${#missing[@]} -gt 0 ] || return 0
	e=$(entry "${missing[0]}")
	version=$(field 1 "$e")
	dir=$TOOLS_DIR/$(field 2 "$e")
	for name in "${missing[@]}"; do pkgs+=("$(field 3 "$(entry "$name")")"); done
	mkdir -p "$LOGS" "$BIN"
	logf=$LOGS/$(field 2 "$e")-$version.log
	start=$(date +%s)
	log "${missing[*]} $version building (log $logf)"
	tmp=$(mktemp -d "$BIN/.build.XXXXXX")
	# -o DIR/ names each binary after its package's last element (etcd's
	# is go.etcd.io/etcd/server/v3: "server"), so one package is named here.
	out=$tmp/
	[ ${#missing[@]} -gt 1 ] || out=$tmp/${missing[0]}
	if ! (
		set -e
		prepare_module "$dir" "$version" "${pkgs[@]}"
		cd "$dir"
		CGO_ENABLED=0 GOFLAGS="${GOFLAGS:-} -mod=mod" \
			go build -trimpath -ldflags "$(ldflags_for "${missing[0]}" "$version")" -o "$out" "${pkgs[@]}"
	) >"$logf" 2>&1; then
		rm -rf "$tmp"
		tail -n 30 "$logf" >&2
		log "${missing[*]} $version FAILED after $(($(date +%s) - start))s"
		return 1
	fi
	took=$(($(date +%s) - start))
	for name in "${missing[@]}"; do
		version=$(field 1 "$(entry "$name")")
		mkdir -p "$(dirname "$(cached_path "$name" "$version")")"
		mv -f "$tmp/$name" "$(cached_path "$name" "$version")"
		install_extras "$name" "$version" "$dir" || { rm -rf "$tmp"; return 1; }
		link_current "$name" "$version"
		echo "$name $version ${took}s (with: ${missing[*]})" >>"$LOGS/timings"
	done
	rm -rf "$tmp"
	log "${missing[*]} $version built in ${took}s"
}

cmd_list() {
	local c name version out
	for c in "${COMPONENTS[@]}"; do
		name=$(field 0 "$c"); version=$(field 1 "$c"); out=$(cached_path "$name" "$version")
		if [ -x "$out" ]; then printf '%-24s %-9s %s\n' "$name" "$version" "$out"; else printf '%-24s %-9s missing\n' "$name" "$version"; fi
	done
}

main() {
	case ${1:-} in
	-h | --help | help) sed -n '2,16p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; return 0 ;;
	list) cmd_list; return 0 ;;
	path) echo "export PATH=$CURRENT:\$PATH"; return 0 ;;
	esac
	command -v go >/dev/null || die "go is not on PATH"

	local wanted names=() mods=() m name e rc=0 start
	wanted=$(select_components "$@" | awk '!seen[$0]++')
	start=$(date +%s)

	# Group the wanted components by build module, keeping COMPONENTS order.
	for e in "${COMPONENTS[@]}"; do
		m=$(field 2 "$e")
		case " ${mods[*]} " in *" $m "*) ;; *) mods+=("$m") ;; esac
	done
	local failed
	failed=$(mktemp)
	for m in "${mods[@]}"; do
		names=()
		for e in "${COMPONENTS[@]}"; do
			name=$(field 0 "$e")
			if [ "$(field 2 "$e")" = "$m" ] && grep -qx "$name" <<<"$wanted"; then names+=("$name"); fi
		done
		[ ${#names[@]} -gt 0 ] || continue
		while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
		{ build_module "${names[@]}" || echo "$m" >>"$failed"; } &
	done
	wait
	if [ -s "$failed" ]; then rc=1; log "failed build modules: $(tr '\n' ' ' <"$failed")"; fi
	rm -f "$failed"
	log "done in $(($(date +%s) - start))s"
	echo "export PATH=$CURRENT:\$PATH"
	return $rc
}

main "$@"
