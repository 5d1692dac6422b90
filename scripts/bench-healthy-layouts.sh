#!/usr/bin/env bash
# bench-healthy-layouts.sh: healthy volumes of every catalogued layout under
# the running agent, for SOAK (default 10m), and the actions it took.
#
#   sudo scripts/bench-healthy-layouts.sh [SOAK]
#
# It runs agent's TestHealthyLayoutsUnderRunningAgent (a real kube-apiserver,
# the real k8s-csi-s3 node plugin with s3fs, rclone daemons in a mount pod, an
# app sidecar and a publish-only node plugin, a ceph-csi RBD layout, ceph-csi
# CephFS with a real ceph-fuse) with the
# agent's shipped configuration and an acting repairer, and prints what it
# counted from the agent's metrics, the API server's events and the mount
# table: repairs of any tier, guards and evictions; events; kubelet mounts
# gone (unmounts) or added (stages, publishes). CI runs the same test for 30 s
# (scripts/test.sh runs the agent package).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
	echo "bench-healthy-layouts.sh: run as root: the lab mounts need it" >&2
	exit 1
fi
soak=${1:-10m}
tools_env=$(scripts/tools.sh path)
eval "$tools_env"
export MOUNTMEDIC_REQUIRE_ROOT=1
report=$(mktemp)
trap 'rm -f "$report"' EXIT
log=${LOG:-/tmp/mountmedic-bench-healthy.log}
if ! MOUNTMEDIC_HEALTHY_SOAK=$soak MOUNTMEDIC_HEALTHY_REPORT=$report \
	go test -count=1 -timeout 90m -run '^TestHealthyLayoutsUnderRunningAgent$' -v ./agent >"$log" 2>&1; then
	grep -E 'layouts_agent_root_test.go|--- FAIL' "$log" >&2 || true
	echo "bench-healthy-layouts.sh: the run failed (whole log: $log)" >&2
	exit 1
fi
grep -E 'layouts_agent_root_test.go' "$log" | sed 's/^ *//'
echo "healthy-layouts figures: $(cat "$report")"
