#!/bin/sh
# naive.sh is what a cluster admin scripts without mountmedic, run on the node
# as root: every INTERVAL seconds, list kubelet's CSI publish mounts with
# findmnt, stat each with a timeout, and delete the pod of a mount that does
# not answer, so that its controller makes a new one. The e2e benchmark runs
# it side by side with mountmedic (scripts/e2e/bench.sh).
#
#   INTERVAL=5 STAT_TIMEOUT=5 KUBECONFIG=... scripts/e2e/naive.sh
#
# Each deletion prints "<unix time> deleted <namespace>/<pod> <mount>".
set -u
interval=${INTERVAL:-5}
stat_timeout=${STAT_TIMEOUT:-5}
root=${KUBELET_ROOT:-/var/lib/kubelet}
kubectl=${KUBECTL:-kubectl}

while :; do
	findmnt -rn -o TARGET | grep "^$root/pods/[^/]*/volumes/kubernetes.io~csi/[^/]*/mount\$" |
		while read -r target; do
			if timeout "$stat_timeout" stat "$target" >/dev/null 2>&1; then
				continue
			fi
			uid=${target#"$root"/pods/}
			uid=${uid%%/*}
			pod=$("$kubectl" get pods -A -o jsonpath="{range .items[?(@.metadata.uid==\"$uid\")]}{.metadata.namespace}/{.metadata.name}{end}")
			[ -n "$pod" ] || continue
			if "$kubectl" delete pod -n "${pod%/*}" "${pod#*/}" --wait=false >/dev/null; then
				echo "$(date +%s.%N) deleted $pod $target"
			fi
		done
	sleep "$interval"
done
