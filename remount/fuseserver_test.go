package remount

import (
	"context"
	"os"
	"testing"
)

func TestFdinfoConn(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   string
		want uint32
		ok   bool
	}{
		{"dev fuse", "pos:\t0\nflags:\t02100002\nmnt_id:\t58\nino:\t90\nfuse_connection:\t40\n", 40, true},
		{"fuseblk", "pos:\t0\nfuse_connection:\t7340032\n", 7 << 20, true},
		{"not fuse", "pos:\t0\nflags:\t02\nmnt_id:\t26\nino:\t5\n", 0, false},
		{"garbled", "fuse_connection:\tforty\n", 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := fdinfoConn([]byte(tc.in))
			if got != tc.want || ok != tc.ok {
				t.Errorf("fdinfoConn(%q) = %d, %t; want %d, %t", tc.in, got, ok, tc.want, tc.ok)
			}
		})
	}
}

// BenchmarkFindServers measures one search of the host's processes for
// the servers of a connection no process serves: every descriptor link of
// every process is read once (the cost of each abort).
func BenchmarkFindServers(b *testing.B) {
	if os.Geteuid() != 0 {
		b.Skip("reads every process's descriptors: needs root")
	}
	u := &Unmounter{}
	procs, fds := 0, 0
	if ents, err := os.ReadDir("/proc"); err == nil {
		for _, e := range ents {
			if n, err := os.ReadDir("/proc/" + e.Name() + "/fd"); err == nil {
				procs++
				fds += len(n)
			}
		}
	}
	for b.Loop() {
		ss, _ := u.findServers(context.Background(), 1<<19)
		closeServers(ss)
	}
	b.ReportMetric(float64(procs), "procs")
	b.ReportMetric(float64(fds), "fds")
}
