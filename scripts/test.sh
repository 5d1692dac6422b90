#!/usr/bin/env bash
# The project's test command (README "Set-up"; .ci/run calls it): installs
# what the tests need, then runs gofmt, go vet, every test with -race — unit
# tests, root tests with real mounts in a private mount namespace, tests
# against a real kube-apiserver and a real CSI driver — and the fuzz targets
# briefly. A test that would skip for want of root, /dev/fuse or a tool fails
# here instead (MOUNTMEDIC_REQUIRE_ROOT=1).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
	echo "test.sh: run as root (sudo scripts/test.sh): the mount and driver tests need it" >&2
	exit 1
fi
scripts/deps.sh
# tools.sh builds what is missing and prints the PATH line; a failed build
# must stop the run (an eval of a failed command substitution would not).
tools_env=$(scripts/tools.sh all)
eval "$tools_env"
# Debian's 6.1 kernel for the guest lab (scripts/guest), unpacked into the
# cache once per version.
kernel_env=$(scripts/guest/kernel.sh)
eval "$kernel_env"
export MOUNTMEDIC_REQUIRE_ROOT=1

unformatted=$(gofmt -l $(git ls-files '*.go' 2>/dev/null || find . -name '*.go'))
if [ -n "$unformatted" ]; then
	echo "gofmt would change: $unformatted" >&2
	exit 1
fi
go vet ./...
go vet -tags guest ./probe ./remount ./agent
# The failover availability tests (an API server outage with every peer
# endpoint flooded: no node may fence) judge peers by their answers within
# the shipped 2 s peer timeout; beside the other test binaries under -race,
# a 2-core machine misses those answers and the nodes fence, safely but
# wrongly for the claim. They run after, alone and without -race; the same
# code is raced by the other heartbeat and peer tests.
availability='TestPeerCheckFlooded|TestHeartbeat/api_server_stopped'
go test -race -count=1 -timeout 30m -skip "$availability" $(go list ./... | grep -v -e /scripts/e2e$ -e /scripts/scale$ -e /scripts/guest$) 2>&1 | tee /tmp/mountmedic-test.log
if ! go test -count=1 -timeout 10m -run "$availability" -v ./agent/failover 2>&1 | tee /tmp/mountmedic-availability.log | grep -E '^(=== RUN|--- |\s+--- |ok|FAIL|PASS)|_test\.go:'; then
	echo "--- the availability tests failed (whole log: /tmp/mountmedic-availability.log):"
	grep -v '^=== RUN' /tmp/mountmedic-availability.log | tail -n 200
	exit 1
fi
# The failover duty at cluster size (scripts/scale: kwok nodes, 100 real
# heartbeats, the real controller, on the real etcd + kube-apiserver), alone
# and without the race detector: its heartbeats keep scaled-down timings
# (a 10 s fence window) that a machine busy with the other test binaries
# under -race would starve. Its packages' logic is raced in their own tests.
go test -count=1 -timeout 20m ./scripts/scale 2>&1 | tee /tmp/mountmedic-scale.log
# The end-to-end run on a real node (scripts/e2e: etcd, kube-apiserver,
# controller-manager, scheduler, containerd, kubelet, the k8s-csi-s3 plugin
# and mountmedic as its DaemonSet), alone: it measures heal times. It builds
# the container image with scripts/image.sh (buildah, from the Dockerfile; no
# daemon, no registry), which runs `mountmedic version` inside it, and runs
# that image as the DaemonSet. After TestE2E (kubeadm's node layout),
# TestK3s runs the agent from the k3s profile on a node laid out as k3s does.
# The run's lines are filtered here; when it fails, what the failing
# scenarios said (their messages carry the agent's log) is printed too.
if ! go test -race -count=1 -timeout 25m -v ./scripts/e2e 2>&1 | tee /tmp/mountmedic-e2e.log | grep -E '^(=== RUN|--- |\s+--- |\||ok|FAIL|PASS)|e2e figures'; then
	echo "--- the e2e run failed; its test messages (whole log: /tmp/mountmedic-e2e.log):"
	grep -v -E '^(=== RUN|\||--- (PASS|SKIP)|\s+--- (PASS|SKIP))' /tmp/mountmedic-e2e.log | tail -n 400
	exit 1
fi
# The guest lab (scripts/guest), alone and without the race detector: it
# boots Debian's 6.1 kernel under qemu (software emulation) and runs the
# probe, remount and agent root tests there, NBD included, which the host
# kernel cannot run (the agent's API servers run on the host, about 3 min),
# and the real rbd-nbd on a Ceph lab on the host (TestRBDInGuest: remount's
# re-attach tier, then the whole agent; about 7 min). About 16 min.
if ! go test -count=1 -timeout 30m -v ./scripts/guest 2>&1 | tee /tmp/mountmedic-guest.log | grep -E '^(=== RUN|--- |\s+--- |ok|FAIL|PASS)|guest figures|(nbd|rbd) (facts|figures)|left out'; then
	echo "--- the guest run failed (whole log: /tmp/mountmedic-guest.log):"
	tail -n 200 /tmp/mountmedic-guest.log
	exit 1
fi
# A count, not a duration: go1.26's fuzz coordinator can fail a duration
# budget with "context deadline exceeded" and no crasher on a loaded machine
# (golang/go#75804, fixed in go1.27). A count ends when the workers have run
# that many inputs, so only a real crasher (or a build error) fails the step.
for target in ./probe:FuzzParse ./probe/kubelet:FuzzClassify; do
	go test -run '^$' -fuzz "^${target#*:}\$" -fuzztime "${FUZZTIME:-200000x}" "${target%%:*}"
done
