package lab

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// FreePorts returns n distinct TCP ports on 127.0.0.1 that nothing listens
// on and that no other caller of FreePorts on this machine, in this process
// or another, gets while this process lives.
//
// Two rules make a port handed out here safe until its server binds it:
//
//   - It comes from below the kernel's ephemeral range
//     (net.ipv4.ip_local_port_range). A port inside it can become the source
//     port of any outgoing connection, of any process, between this check and
//     the server's bind; that is how TestFailover failed when the agent and
//     agent/failover tests (each with its own etcd and kube-apiserver making
//     hundreds of connections) ran side by side: a component could not bind.
//   - It is reserved across processes by an exclusive flock on a file named
//     after it under os.TempDir()/mountmedic-ports, held until the process
//     exits, so two test binaries running at once never pick the same port.
func FreePorts(n int) ([]int, error) {
	lo, hi := portRange()
	ports := make([]int, 0, n)
	for tries := 0; len(ports) < n; tries++ {
		if tries > 50*n+1000 {
			return nil, fmt.Errorf("find %d free ports in %d-%d: only %d after %d tries", n, lo, hi, len(ports), tries)
		}
		port := lo + rand.IntN(hi-lo)
		ok, err := reservePort(port)
		if err != nil {
			return nil, err
		}
		if ok {
			ports = append(ports, port)
		}
	}
	return ports, nil
}

// portRange is the range FreePorts picks from: [10000, the ephemeral range's
// low end), at most [10000, 32768).
func portRange() (lo, hi int) {
	lo, hi = 10000, 32768
	b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range")
	if err != nil {
		return lo, hi
	}
	f := strings.Fields(string(b))
	if len(f) != 2 {
		return lo, hi
	}
	if eph, err := strconv.Atoi(f[0]); err == nil && eph > lo+1000 && eph < hi {
		hi = eph
	}
	return lo, hi
}

var (
	portMu    sync.Mutex
	portLocks = map[int]*os.File{} // held until the process exits
)

// reservePort takes port's lock file and checks that nothing listens on it;
// it reports false when another caller holds it or it is in use.
func reservePort(port int) (bool, error) {
	portMu.Lock()
	defer portMu.Unlock()
	if _, ok := portLocks[port]; ok {
		return false, nil
	}
	dir := filepath.Join(os.TempDir(), "mountmedic-ports")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return false, fmt.Errorf("reserve a port: %w", err)
	}
	f, err := os.OpenFile(filepath.Join(dir, strconv.Itoa(port)), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return false, fmt.Errorf("reserve a port: %w", err)
	}
	if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		f.Close()
		if errors.Is(err, unix.EWOULDBLOCK) {
			return false, nil
		}
		return false, fmt.Errorf("reserve port %d: flock: %w", port, err)
	}
	l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
	if err != nil {
		// In use by something that does not take our locks.
		f.Close()
		return false, nil
	}
	l.Close()
	portLocks[port] = f
	return true, nil
}

// FreePortRange is FreePorts for n consecutive ports: it returns the first
// of n ports, each free and reserved as FreePorts reserves them, for a
// server that takes a port range (Ceph's ms_bind_port_min/max).
func FreePortRange(n int) (int, error) {
	lo, hi := portRange()
	for tries := 0; tries < 200; tries++ {
		base := lo + rand.IntN(hi-lo-n)
		ok := true
		for p := base; p < base+n && ok; p++ {
			var err error
			if ok, err = reservePort(p); err != nil {
				return 0, err
			}
		}
		if ok {
			return base, nil
		}
	}
	return 0, fmt.Errorf("find %d consecutive free ports in %d-%d: none after 200 tries", n, lo, hi)
}
