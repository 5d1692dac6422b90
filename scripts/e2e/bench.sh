#!/usr/bin/env bash
# bench.sh measures mountmedic end to end on a real node built on this
# machine, side by side with the naive way, and prints the figures that
# BENCHMARKS.md reports: per scenario, fault -> detected and driver back ->
# healed (p50, p99, min, max over RUNS runs); for a hung daemon also from
# the workload's first blocked read (the read's own start, from its log)
# to detected and to healed; the steady-state CPU and RSS of the agent's
# pod, and naive.sh (findmnt + stat with a timeout + delete the pod)
# through the same plugin crash.
#
#   sudo scripts/e2e/bench.sh                 # every scenario, 5 runs each
#   sudo RUNS=10 RUN='TestE2E/^(harness|live|hung)$' scripts/e2e/bench.sh
#
# RUNS: runs per scenario (default 5). RUN: go test -run pattern (default
# every scenario). OUT: full log (default /tmp/mountmedic-bench.log).
# Needs what scripts/test.sh needs (root, /dev/fuse, the Debian packages of
# scripts/deps.sh, the binaries of scripts/tools.sh); it installs and builds
# what is missing.
set -euo pipefail
case ${1:-} in
-h | --help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
"") ;;
*) echo "bench.sh: no arguments (settings are RUNS, RUN, OUT; see --help)" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/../.."
if [ "$(id -u)" != 0 ]; then
	echo "bench.sh: run as root: the node mounts, runs containers and a CSI driver" >&2
	exit 1
fi
runs=${RUNS:-5}
out=${OUT:-/tmp/mountmedic-bench.log}
scripts/deps.sh
tools_env=$(scripts/tools.sh all)
eval "$tools_env"

echo "machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), kernel $(uname -r)"
echo "commit: $(git rev-parse --short HEAD)$(git diff --quiet 2>/dev/null || echo ' (dirty tree)'), $(go env GOVERSION), kubelet $(kubelet --version 2>/dev/null | awk '{print $2}'), containerd $(containerd --version | awk '{print $3}')"
echo "runs per scenario: $runs"
start=$(date +%s)
status=0
MOUNTMEDIC_E2E_RUNS=$runs MOUNTMEDIC_REQUIRE_ROOT=1 \
	go test -count=1 -timeout 180m -v -run "${RUN:-TestE2E}" ./scripts/e2e >"$out" 2>&1 || status=$?
grep -E '^\s*--- (PASS|FAIL)' "$out" || true
sed -n '/^--- e2e figures ---$/,/^--- end e2e figures ---$/p' "$out" | sed '1d;$d'
echo "took $(($(date +%s) - start)) s; full log: $out"
exit $status
