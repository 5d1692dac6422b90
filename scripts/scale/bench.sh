#!/usr/bin/env bash
# bench.sh runs the scale test at a chosen size and prints its figures (a
# Markdown section for BENCHMARKS.md).
#
#   scripts/scale/bench.sh [NODES [TIME_FACTOR [HEARTBEATS]]]
#
# NODES       kwok nodes (default 1000)
# TIME_FACTOR multiplies Kubernetes' and mountmedic's default periods
#             (default 0.5: kubelet's node lease renewed every 5 s, the
#             heartbeat every 2.5 s); per-node rates are reported at real
#             timings (factor 1) as well
# HEARTBEATS  nodes with a real failover heartbeat (default 100)
#
# Needs kwok, etcd, kube-apiserver, kube-controller-manager and kubectl from
# scripts/tools.sh (scripts/tools.sh kwok controlplane). The cluster's logs
# are kept in $MOUNTMEDIC_SCALE_LOGS when that is set.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
nodes=${1:-1000}
factor=${2:-0.5}
heartbeats=${3:-100}
report=$(mktemp)
trap 'rm -f "$report"' EXIT
start=$(date +%s)
if ! MOUNTMEDIC_SCALE_NODES=$nodes MOUNTMEDIC_SCALE_TIME=$factor MOUNTMEDIC_SCALE_HEARTBEATS=$heartbeats \
	MOUNTMEDIC_SCALE_REPORT=$report MOUNTMEDIC_REQUIRE_ROOT=1 \
	go test -count=1 -timeout 60m -run '^TestScale$' . >"$report.log" 2>&1; then
	grep -v '^\s*[IWE][0-9]\{4\} \|^\s*{' "$report.log" | tail -40 >&2
	echo "bench.sh: the scale test failed (full output: $report.log)" >&2
	cat "$report" 2>/dev/null
	exit 1
fi
rm -f "$report.log"
cat "$report"
echo
echo "(scripts/scale/bench.sh $nodes $factor $heartbeats: $(($(date +%s) - start)) s on $(nproc) cores, $(date -u +%Y-%m-%d))"
