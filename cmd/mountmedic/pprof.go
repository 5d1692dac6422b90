//go:build pprof

// Profiling build (go build -tags pprof): serves net/http/pprof on the
// loopback address in $MOUNTMEDIC_PPROF_ADDR, so that the heap of the real
// binary can be profiled in the lab (agent's BenchmarkAgentSteadyState with
// MOUNTMEDIC_BENCH_HEAP). Release builds never include it.

package main

import (
	"net"
	"net/http"
	_ "net/http/pprof"
	"os"
)

func init() {
	addr := os.Getenv("MOUNTMEDIC_PPROF_ADDR")
	if addr == "" {
		return
	}
	host, _, err := net.SplitHostPort(addr)
	if err != nil || !net.ParseIP(host).IsLoopback() {
		return // loopback only
	}
	go func() { _ = http.ListenAndServe(addr, nil) }()
}
