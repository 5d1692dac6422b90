// Package scale measures the failover duty on a real API server with
// thousands of simulated nodes: kwok (sigs.k8s.io/kwok, built by
// scripts/tools.sh kwok) keeps N Node objects Ready and renews their
// kubelet Leases in kube-node-lease as kubelet does; at least 100 of them
// run a real failover heartbeat (failover.NewHeartbeat, each with its own
// clients, behind its own TCP proxy so that one can be cut off alone); the
// real failover controller runs in a process of its own (the test binary
// re-executed), so that its memory is its own; kube-controller-manager runs
// the node lifecycle and taint eviction controllers, as in a cluster.
//
// Every request is counted by the API server's own audit log (Metadata
// level), by user agent: mountmedic-heartbeat/<node>,
// mountmedic-candidate/<node> (an agent campaigning for the leader Lease,
// as every agent does on main), mountmedic-controller, kwok,
// kube-controller-manager, and the harness itself.
//
// A node's kubelet dies when the harness relabels its Node out of kwok's
// selector (no more status) and freezes its kubelet Lease (the renew time
// kept, the Lease passed to a holder that never renews): kwok does not
// always stop renewing a relabelled node (see env.freezeLease).
//
// The test (go test ./scripts/scale) runs the cases in order on one
// cluster and asserts behaviour only (what was tainted, fenced, deleted,
// and in which order), never a duration: steady state, one node dies, one
// node is partitioned alone, the API server stops for twice the fence
// window, 20% of the nodes die at once. With MOUNTMEDIC_SCALE_REPORT=FILE
// it writes the figures (requests/s by identity, controller memory, taint
// latencies) as a Markdown table; bench.sh runs it at a chosen size and
// prints that table. Sizes and timings:
//
//	MOUNTMEDIC_SCALE_NODES       kwok nodes (default 300)
//	MOUNTMEDIC_SCALE_HEARTBEATS  nodes with a real heartbeat (default 100)
//	MOUNTMEDIC_SCALE_TIME        time factor on Kubernetes' and mountmedic's
//	                             default periods (default 0.2: kubelet's 40 s
//	                             lease becomes 8 s, renewed every 2 s; the
//	                             heartbeat's 5 s becomes 1 s)
//
//	MOUNTMEDIC_SCALE_LOGS        a directory to copy the cluster's logs into
//	                             (etcd, kube-apiserver, kcm, kwok, the
//	                             controller, the agents)
//
// Scaling time down by a factor keeps every per-node rate in the same
// ratio (kubelet lease writes to heartbeat writes) and makes each rate
// 1/factor higher, so CI runs a few hundred nodes in a few minutes; the
// report gives rates per node at real timings (multiplied back by the
// factor). bench.sh uses factor 0.5 unless told otherwise. The fence margin
// does not go below the stop grace + 5 s (the duty's validation), so at
// small factors the fence window is a little longer than scaled.
//
// The seam to the code under test is seam_test.go: startController and
// startAgent, the only two places that know how mountmedic is wired.
package scale
