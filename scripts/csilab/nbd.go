package csilab

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mountmedic/mountmedic/scripts/lab"
)

// The NBD mode: a block volume whose userspace daemon (nbdkit's file plugin
// over a Unix socket) can be killed, and the two ways a device comes back
// that rbd-nbd and nbd-client use. Map hands the kernel a connected socket
// over the nbd generic-netlink family, as `rbd-nbd map` does; Reattach gives
// the same /dev/nbdN a socket to a fresh daemon with NBD_CMD_RECONFIGURE, as
// `rbd-nbd attach --device` does (ceph doc/man/8/rbd-nbd.rst; ceph-csi's
// healer runs it at node-plugin start, internal/rbd/nodeserver.go). The
// device, the filesystem on it and every bind of it stay as they are.
// Kernel side: linux include/uapi/linux/nbd-netlink.h, drivers/block/nbd.c.
// These need the nbd driver: they run in the guest of scripts/guest.

// Generic netlink and nbd-netlink numbers.
const (
	genlIDCtrl            = 0x10
	ctrlCmdGetFamily      = 3
	ctrlAttrFamilyID      = 1
	ctrlAttrFamilyName    = 2
	nbdCmdConnect         = 1
	nbdCmdDisconnect      = 2
	nbdCmdReconfigure     = 3
	nbdAttrIndex          = 1
	nbdAttrSizeBytes      = 2
	nbdAttrBlockSizeBytes = 3
	nbdAttrTimeout        = 4
	nbdAttrServerFlags    = 5
	nbdAttrSockets        = 7
	nbdAttrDeadConnTmo    = 8
	nbdSockItem           = 1
	nbdSockFD             = 1
)

// NBD handshake numbers (the NBD protocol's fixed newstyle negotiation).
const (
	nbdMagic          = 0x4e42444d41474943 // "NBDMAGIC"
	nbdOptMagic       = 0x49484156454f5054 // "IHAVEOPT"
	nbdFlagFixedNew   = 1 << 0
	nbdFlagNoZeroes   = 1 << 1
	nbdOptExportName  = 1
	nbdDefaultBlkSize = 4096
)

// NBDDaemon is an nbdkit serving one image file over a Unix socket: the
// userspace half of an NBD volume, as rbd-nbd is for a Ceph image. The file
// outlives the daemon, as the RADOS objects outlive rbd-nbd.
type NBDDaemon struct {
	t      testing.TB
	Image  string
	Socket string
	cmd    *exec.Cmd
	exited chan struct{}
	// pid is a daemon that is not our child (rbd-nbd daemonizes): cmd
	// and exited are nil.
	pid int
}

// StartNBDDaemon starts nbdkit's file plugin on image, listening on socket
// (an old socket file is removed first: a killed nbdkit leaves it behind).
// The test's cleanup kills it.
func StartNBDDaemon(t testing.TB, image, socket string) *NBDDaemon {
	t.Helper()
	bin := lab.RequireBinary(t, "nbdkit")
	d, err := startNBDDaemon(bin, image, socket)
	if err != nil {
		t.Fatal(err)
	}
	d.t = t
	t.Cleanup(d.Kill)
	return d
}

// startNBDDaemon starts nbdkit and waits until it accepts connections (30 s
// at most); it may run off the test's goroutine.
func startNBDDaemon(bin, image, socket string) (*NBDDaemon, error) {
	_ = os.Remove(socket)
	// nbdkit writes its pidfile once it accepts connections: waiting for
	// it spares the daemon a probing connection.
	pidfile := socket + ".pid"
	_ = os.Remove(pidfile)
	d := &NBDDaemon{Image: image, Socket: socket, exited: make(chan struct{})}
	d.cmd = exec.Command(bin, "--foreground", "--exit-with-parent", "-P", pidfile, "-U", socket, "file", "file="+image)
	d.cmd.Stdout, d.cmd.Stderr = os.Stderr, os.Stderr
	d.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := lab.StartProcess(d.cmd); err != nil {
		return nil, fmt.Errorf("start nbdkit on %s: %w", image, err)
	}
	go func() { _ = d.cmd.Wait(); close(d.exited) }()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if raw, err := os.ReadFile(pidfile); err == nil && strings.TrimSpace(string(raw)) == strconv.Itoa(d.cmd.Process.Pid) {
			return d, nil
		}
		select {
		case <-d.exited:
			return nil, fmt.Errorf("nbdkit on %s exited before it listened on %s", image, socket)
		default:
		}
		if time.Now().After(deadline) {
			d.Kill()
			return nil, fmt.Errorf("nbdkit on %s never listened on %s", image, socket)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Pid is the daemon's process ID.
func (d *NBDDaemon) Pid() int {
	if d.cmd == nil {
		return d.pid
	}
	return d.cmd.Process.Pid
}

// Kill kills the daemon with SIGKILL, as a node-plugin crash does, and waits
// for it to be gone.
func (d *NBDDaemon) Kill() {
	if d.cmd == nil {
		_ = unix.Kill(d.pid, unix.SIGKILL)
		waitGone(d.pid, time.Minute)
		return
	}
	select {
	case <-d.exited:
		return
	default:
	}
	_ = d.cmd.Process.Kill()
	<-d.exited
}

// Stop stops the daemon with SIGSTOP (a hung daemon); Cont resumes it.
func (d *NBDDaemon) Stop() { _ = unix.Kill(d.Pid(), unix.SIGSTOP) }

// Cont resumes a stopped daemon.
func (d *NBDDaemon) Cont() { _ = unix.Kill(d.Pid(), unix.SIGCONT) }

// NBDOptions are the device settings Map gives the kernel.
type NBDOptions struct {
	// IOTimeout is the kernel's per-request timeout (NBD_ATTR_TIMEOUT);
	// 0 leaves the kernel's default (30 s).
	IOTimeout time.Duration
	// DeadConnTimeout is how long the kernel holds I/O of a device whose
	// connection died, waiting for a Reattach (rbd-nbd's --reattach-timeout,
	// 30 s by default there); 0 fails the I/O at once.
	DeadConnTimeout time.Duration
}

// dialNBD connects to the daemon's socket and negotiates the default export;
// it returns the connected socket (ready for the transmission phase) with
// the export's size and transmission flags.
func dialNBD(socket string) (*os.File, uint64, uint16, error) {
	c, err := net.DialTimeout("unix", socket, 10*time.Second)
	if err != nil {
		return nil, 0, 0, fmt.Errorf("connect to the nbd daemon at %s: %w", socket, err)
	}
	uc := c.(*net.UnixConn)
	defer uc.Close()
	_ = uc.SetDeadline(time.Now().Add(10 * time.Second))
	var hello struct {
		Magic, Opt uint64
		Flags      uint16
	}
	if err := binary.Read(uc, binary.BigEndian, &hello); err != nil {
		return nil, 0, 0, fmt.Errorf("read the nbd greeting: %w", err)
	}
	if hello.Magic != nbdMagic || hello.Opt != nbdOptMagic || hello.Flags&nbdFlagFixedNew == 0 {
		return nil, 0, 0, fmt.Errorf("nbd daemon at %s does not speak fixed newstyle (magic %#x, flags %#x)", socket, hello.Magic, hello.Flags)
	}
	clientFlags := uint32(nbdFlagFixedNew)
	if hello.Flags&nbdFlagNoZeroes != 0 {
		clientFlags |= nbdFlagNoZeroes
	}
	// NBD_OPT_EXPORT_NAME with the default (empty) name.
	var req []byte
	req = binary.BigEndian.AppendUint32(req, clientFlags)
	req = binary.BigEndian.AppendUint64(req, nbdOptMagic)
	req = binary.BigEndian.AppendUint32(req, nbdOptExportName)
	req = binary.BigEndian.AppendUint32(req, 0)
	if _, err := uc.Write(req); err != nil {
		return nil, 0, 0, fmt.Errorf("send the nbd export option: %w", err)
	}
	var export struct {
		Size  uint64
		Flags uint16
	}
	if err := binary.Read(uc, binary.BigEndian, &export); err != nil {
		return nil, 0, 0, fmt.Errorf("read the nbd export: %w", err)
	}
	if clientFlags&nbdFlagNoZeroes == 0 {
		if _, err := io.CopyN(io.Discard, uc, 124); err != nil {
			return nil, 0, 0, fmt.Errorf("read the nbd export padding: %w", err)
		}
	}
	_ = uc.SetDeadline(time.Time{})
	f, err := uc.File() // a dup in blocking mode, for the kernel
	if err != nil {
		return nil, 0, 0, err
	}
	return f, export.Size, export.Flags, nil
}

// NBDMap connects a fresh /dev/nbdN (the kernel picks N) to the daemon and
// returns N.
func NBDMap(socket string, opts NBDOptions) (int, error) {
	sock, size, flags, err := dialNBD(socket)
	if err != nil {
		return -1, err
	}
	defer sock.Close()
	attrs := []nlAttr{
		{typ: nbdAttrSizeBytes, data: u64(size)},
		{typ: nbdAttrBlockSizeBytes, data: u64(nbdDefaultBlkSize)},
		{typ: nbdAttrServerFlags, data: u64(uint64(flags))},
		sockets(sock),
	}
	if opts.IOTimeout > 0 {
		attrs = append(attrs, nlAttr{typ: nbdAttrTimeout, data: u64(uint64(opts.IOTimeout / time.Second))})
	}
	if opts.DeadConnTimeout > 0 {
		attrs = append(attrs, nlAttr{typ: nbdAttrDeadConnTmo, data: u64(uint64(opts.DeadConnTimeout / time.Second))})
	}
	reply, err := nbdNetlink(nbdCmdConnect, attrs)
	if err != nil {
		return -1, fmt.Errorf("nbd connect: %w", err)
	}
	for _, a := range reply {
		if a.typ == nbdAttrIndex && len(a.data) >= 4 {
			return int(binary.NativeEndian.Uint32(a.data)), nil
		}
	}
	return -1, errors.New("nbd connect: the kernel answered without a device index")
}

// NBDReattach gives /dev/nbd<index>, whose connection died, a socket to the
// daemon now listening on socket (NBD_CMD_RECONFIGURE). The kernel takes the
// socket only in place of a dead connection (drivers/block/nbd.c,
// nbd_reconnect_socket).
func NBDReattach(index int, socket string) error {
	sock, _, _, err := dialNBD(socket)
	if err != nil {
		return err
	}
	defer sock.Close()
	_, err = nbdNetlink(nbdCmdReconfigure, []nlAttr{{typ: nbdAttrIndex, data: u32(uint32(index))}, sockets(sock)})
	if err != nil {
		return fmt.Errorf("nbd reattach /dev/nbd%d: %w", index, err)
	}
	return nil
}

// NBDUnmap disconnects /dev/nbd<index>.
func NBDUnmap(index int) error {
	if _, err := nbdNetlink(nbdCmdDisconnect, []nlAttr{{typ: nbdAttrIndex, data: u32(uint32(index))}}); err != nil {
		return fmt.Errorf("nbd disconnect /dev/nbd%d: %w", index, err)
	}
	return nil
}

// NBDDaemonPID is what sysfs says of /dev/nbd<index>'s daemon (the "pid"
// file: the process that configured it; absent on a netlink device after
// its connection is gone), 0 when none.
func NBDDaemonPID(index int) int {
	raw, err := os.ReadFile(filepath.Join("/sys/block", "nbd"+strconv.Itoa(index), "pid"))
	if err != nil {
		return 0
	}
	n, _ := strconv.Atoi(strings.TrimSpace(string(raw)))
	return n
}

type nlAttr struct {
	typ    uint16
	data   []byte
	nested []nlAttr
}

func u32(v uint32) []byte { return binary.NativeEndian.AppendUint32(nil, v) }
func u64(v uint64) []byte { return binary.NativeEndian.AppendUint64(nil, v) }

func sockets(f *os.File) nlAttr {
	return nlAttr{typ: nbdAttrSockets, nested: []nlAttr{
		{typ: nbdSockItem, nested: []nlAttr{{typ: nbdSockFD, data: u32(uint32(f.Fd()))}}},
	}}
}

func encodeAttrs(attrs []nlAttr) []byte {
	var out []byte
	for _, a := range attrs {
		payload := a.data
		if a.nested != nil {
			payload = encodeAttrs(a.nested)
		}
		n := 4 + len(payload)
		out = binary.NativeEndian.AppendUint16(out, uint16(n))
		out = binary.NativeEndian.AppendUint16(out, a.typ)
		out = append(out, payload...)
		for len(out)%4 != 0 {
			out = append(out, 0)
		}
	}
	return out
}

func decodeAttrs(b []byte) []nlAttr {
	var out []nlAttr
	for len(b) >= 4 {
		n := int(binary.NativeEndian.Uint16(b))
		if n < 4 || n > len(b) {
			break
		}
		// A copy: the caller reuses its receive buffer.
		out = append(out, nlAttr{typ: binary.NativeEndian.Uint16(b[2:]) &^ 0xc000, data: bytes.Clone(b[4:n])})
		n = (n + 3) &^ 3
		if n > len(b) {
			break
		}
		b = b[n:]
	}
	return out
}

// genlRequest sends one generic netlink request and returns the attributes
// of its answer (nil for a bare acknowledgement).
func genlRequest(fd int, family uint16, cmd uint8, attrs []nlAttr) ([]nlAttr, error) {
	body := append([]byte{cmd, 1, 0, 0}, encodeAttrs(attrs)...)
	msg := make([]byte, unix.NLMSG_HDRLEN, unix.NLMSG_HDRLEN+len(body))
	binary.NativeEndian.PutUint32(msg[0:], uint32(unix.NLMSG_HDRLEN+len(body)))
	binary.NativeEndian.PutUint16(msg[4:], family)
	binary.NativeEndian.PutUint16(msg[6:], unix.NLM_F_REQUEST|unix.NLM_F_ACK)
	binary.NativeEndian.PutUint32(msg[8:], 1)
	msg = append(msg, body...)
	if err := unix.Sendto(fd, msg, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return nil, fmt.Errorf("send netlink request: %w", err)
	}
	var reply []nlAttr
	buf := make([]byte, 1<<16)
	for {
		n, _, err := unix.Recvfrom(fd, buf, 0)
		if err != nil {
			return nil, fmt.Errorf("read netlink answer: %w", err)
		}
		msgs, err := syscall.ParseNetlinkMessage(buf[:n])
		if err != nil {
			return nil, fmt.Errorf("parse netlink answer: %w", err)
		}
		for _, m := range msgs {
			switch m.Header.Type {
			case unix.NLMSG_ERROR:
				if len(m.Data) < 4 {
					return nil, errors.New("short netlink error message")
				}
				if code := int32(binary.NativeEndian.Uint32(m.Data)); code != 0 {
					return nil, unix.Errno(-code)
				}
				return reply, nil
			case unix.NLMSG_DONE:
				return reply, nil
			default:
				if len(m.Data) >= 4 {
					reply = append(reply, decodeAttrs(m.Data[4:])...)
				}
			}
		}
	}
}

// nbdNetlink sends one command to the kernel's nbd netlink family.
func nbdNetlink(cmd uint8, attrs []nlAttr) ([]nlAttr, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_GENERIC)
	if err != nil {
		return nil, fmt.Errorf("open generic netlink: %w", err)
	}
	defer unix.Close(fd)
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return nil, fmt.Errorf("bind generic netlink: %w", err)
	}
	fam, err := genlRequest(fd, genlIDCtrl, ctrlCmdGetFamily,
		[]nlAttr{{typ: ctrlAttrFamilyName, data: []byte("nbd\x00")}})
	if err != nil {
		return nil, fmt.Errorf("find the nbd netlink family (is the nbd module loaded?): %w", err)
	}
	var id uint16
	for _, a := range fam {
		if a.typ == ctrlAttrFamilyID && len(a.data) >= 2 {
			id = binary.NativeEndian.Uint16(a.data)
		}
	}
	if id == 0 {
		return nil, errors.New("the kernel has no nbd netlink family")
	}
	return genlRequest(fd, id, cmd, attrs)
}
