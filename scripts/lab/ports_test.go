package lab

import (
	"net"
	"os"
	"path/filepath"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"
)

func TestFreePortsDistinctAndOutsideEphemeral(t *testing.T) {
	lo, hi := portRange()
	seen := map[int]bool{}
	for range 3 {
		ports, err := FreePorts(50)
		if err != nil {
			t.Fatalf("FreePorts(50): %v", err)
		}
		for _, p := range ports {
			if p < lo || p >= hi {
				t.Errorf("FreePorts gave %d, want it in [%d, %d) (below the ephemeral range)", p, lo, hi)
			}
			if seen[p] {
				t.Errorf("FreePorts gave %d twice", p)
			}
			seen[p] = true
		}
	}
	// A port handed out is free: a server can bind it.
	for p := range seen {
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
		if err != nil {
			t.Errorf("listen on handed-out port %d: %v", p, err)
			continue
		}
		l.Close()
		break
	}
}

// Another process's reservation is a lock on the port's file through
// another open file description: reservePort must refuse that port, and a
// port something listens on.
func TestReservePortRefusesHeldAndBusy(t *testing.T) {
	lo, hi := portRange()
	dir := filepath.Join(os.TempDir(), "mountmedic-ports")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	// Hold the lock of the first port no running test holds, as another
	// process would.
	var f *os.File
	held := 0
	for p := lo; p < hi && f == nil; p++ {
		if _, taken := portLocks[p]; taken {
			continue
		}
		g, err := os.OpenFile(filepath.Join(dir, strconv.Itoa(p)), os.O_CREATE|os.O_RDWR, 0o644)
		if err != nil {
			t.Fatal(err)
		}
		if unix.Flock(int(g.Fd()), unix.LOCK_EX|unix.LOCK_NB) != nil {
			g.Close()
			continue
		}
		f, held = g, p
	}
	if f == nil {
		t.Fatalf("no port lock to hold in [%d, %d)", lo, hi)
	}
	defer f.Close()
	if ok, err := reservePort(held); ok || err != nil {
		t.Errorf("reservePort(%d) with its lock held elsewhere = %v, %v; want false, nil", held, ok, err)
	}
	unix.Flock(int(f.Fd()), unix.LOCK_UN)

	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	busy := l.Addr().(*net.TCPAddr).Port
	if ok, err := reservePort(busy); ok || err != nil {
		t.Errorf("reservePort(%d) with a listener on it = %v, %v; want false, nil", busy, ok, err)
	}
}
