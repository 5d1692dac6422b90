package probe

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
)

// The nbd generic netlink family (include/uapi/linux/nbd-netlink.h) and
// the controller's attributes that name its multicast group
// (include/uapi/linux/genetlink.h).
const (
	genlCtrlID            = 0x10
	ctrlCmdGetFamily      = 3
	ctrlAttrFamilyID      = 1
	ctrlAttrFamilyName    = 2
	ctrlAttrMcastGroups   = 7
	ctrlAttrMcastGrpName  = 1
	ctrlAttrMcastGrpID    = 2
	nbdFamilyName         = "nbd"
	nbdMcastGroupName     = "nbd_mc_group"
	nbdCmdLinkDead        = 4
	nbdAttrIndex          = 1
	nbdWatchRetry         = 30 * time.Second
	nbdWatchIdlePoll      = 10 * time.Second
	solNetlink            = 270
	netlinkAddMembership  = 1
	netlinkNoENOBUFS      = 5
	initialNetNamespace   = "/proc/1/ns/net"
	nbdWatchReceiveBuffer = 64 << 10
)

// errNoNBDFamily: the kernel (or this network namespace) has no nbd
// generic netlink family.
var errNoNBDFamily = errors.New("no nbd generic netlink family (nbd module not loaded, or not the initial network namespace)")

// WatchNBD wakes the caller when the kernel reports an nbd device's
// connection dead, until ctx ends: it joins the nbd generic netlink
// family's multicast group, and on each NBD_CMD_LINK_DEAD
// (drivers/block/nbd.c nbd_dead_link_work, sent when a daemon's socket
// closes or an I/O timeout drops it) it records the device as dead for
// the next probe (which then says Disconnected without waiting on the
// device) and calls wake. The family is not network-namespaced: only a
// socket of the initial network namespace hears it, so where the process
// runs in another one (a pod without hostNetwork) the socket is opened in
// the namespace of /proc/1 (hostPID; needs CAP_SYS_ADMIN). Until the nbd
// module is loaded it only looks for it every 10 s; where the watch
// cannot open (no privilege, a kernel without the group) it says so once
// at V(2), tries again every 30 s, and the probe's check of the devices'
// daemons (sysfs pid) is all there is. It sleeps in poll(2) between
// events: no wakeups while nothing dies.
func (p *Prober) WatchNBD(ctx context.Context, wake func()) {
	logger := klog.FromContext(ctx)
	module := filepath.Join(p.cfg.SysfsDir, "module", "nbd")
	warned := false
	var failed time.Time
	for {
		// Nothing is opened before the nbd module is loaded (it loads
		// with the first map): asking the controller for a family it
		// lacks could make the kernel look for its module.
		if _, err := os.Stat(module); err == nil && time.Since(failed) >= nbdWatchRetry {
			w, err := openNBDWatch(initialNetNamespace)
			if err == nil {
				logger.V(2).Info("Watching the kernel's nbd link-dead events", "group", nbdMcastGroupName)
				err = w.run(ctx, func(index uint32) {
					dev := "nbd" + strconv.FormatUint(uint64(index), 10)
					p.nbd.linkDead(dev, time.Now())
					logger.V(2).Info("The kernel reports an nbd device's connection dead; probing now", "device", dev)
					wake()
				}, wake)
				w.close()
				if ctx.Err() != nil {
					return
				}
				logger.V(2).Info("The nbd link-dead watch stopped; opening it again", "err", err)
			} else if !warned {
				warned = true
				logger.V(2).Info("Cannot hear the kernel's nbd link-dead events: dead NBD daemons are found by the probe cycles' check of each device's daemon", "err", err)
			}
			failed = time.Now()
		}
		select {
		case <-ctx.Done():
			return
		case <-time.After(nbdWatchIdlePoll):
		}
	}
}

// nbdWatch is a netlink socket joined to the nbd multicast group, and the
// pipe that ends its poll.
type nbdWatch struct {
	fd, family int
	stop       [2]int
}

// openNBDWatch opens the watch in this process's network namespace, or,
// where the family is not there, in the one at netns.
func openNBDWatch(netns string) (*nbdWatch, error) {
	fd, err := genlSocket()
	if err != nil {
		return nil, err
	}
	w, err := joinNBD(fd)
	if errors.Is(err, errNoNBDFamily) && netns != "" {
		unix.Close(fd)
		if fd, err = genlSocketIn(netns); err != nil {
			return nil, fmt.Errorf("%w; in %s: %w", errNoNBDFamily, netns, err)
		}
		w, err = joinNBD(fd)
	}
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	if err := unix.Pipe2(w.stop[:], unix.O_CLOEXEC|unix.O_NONBLOCK); err != nil {
		unix.Close(fd)
		return nil, err
	}
	return w, nil
}

func genlSocket() (int, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_GENERIC)
	if err != nil {
		return -1, fmt.Errorf("open generic netlink: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("bind generic netlink: %w", err)
	}
	return fd, nil
}

// genlSocketIn opens a generic netlink socket in the network namespace at
// path: a socket stays in the namespace it was made in. It runs on a
// thread of its own, locked, that enters the namespace and comes back; a
// thread that cannot come back is never reused (it ends with its
// goroutine, still locked).
func genlSocketIn(path string) (int, error) {
	type res struct {
		fd  int
		err error
	}
	out := make(chan res, 1)
	go func() {
		runtime.LockOSThread()
		fd, back, err := func() (int, bool, error) {
			self, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
			if err != nil {
				return -1, true, err
			}
			defer unix.Close(self)
			target, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
			if err != nil {
				return -1, true, err
			}
			defer unix.Close(target)
			if err := unix.Setns(target, unix.CLONE_NEWNET); err != nil {
				return -1, true, fmt.Errorf("enter %s: %w", path, err)
			}
			fd, err := genlSocket()
			if err := unix.Setns(self, unix.CLONE_NEWNET); err != nil {
				if fd >= 0 {
					unix.Close(fd)
				}
				return -1, false, fmt.Errorf("come back from %s: %w", path, err)
			}
			return fd, true, err
		}()
		out <- res{fd, err}
		if back {
			runtime.UnlockOSThread()
		}
	}()
	r := <-out
	return r.fd, r.err
}

// joinNBD finds the nbd family and its multicast group and joins it.
func joinNBD(fd int) (*nbdWatch, error) {
	family, group, err := nbdFamily(fd)
	if err != nil {
		return nil, err
	}
	if err := unix.SetsockoptInt(fd, solNetlink, netlinkAddMembership, int(group)); err != nil {
		return nil, fmt.Errorf("join the nbd multicast group %d: %w", group, err)
	}
	_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, nbdWatchReceiveBuffer)
	return &nbdWatch{fd: fd, family: int(family), stop: [2]int{-1, -1}}, nil
}

// nbdFamily asks the generic netlink controller for the nbd family's ID
// and its multicast group's.
func nbdFamily(fd int) (family uint16, group uint32, err error) {
	name := append([]byte(nbdFamilyName), 0)
	attr := binary.NativeEndian.AppendUint16(nil, uint16(4+len(name)))
	attr = binary.NativeEndian.AppendUint16(attr, ctrlAttrFamilyName)
	attr = append(attr, name...)
	for len(attr)%4 != 0 {
		attr = append(attr, 0)
	}
	body := append([]byte{ctrlCmdGetFamily, 1, 0, 0}, attr...)
	msg := binary.NativeEndian.AppendUint32(nil, uint32(unix.NLMSG_HDRLEN+len(body)))
	msg = binary.NativeEndian.AppendUint16(msg, genlCtrlID)
	msg = binary.NativeEndian.AppendUint16(msg, unix.NLM_F_REQUEST)
	msg = binary.NativeEndian.AppendUint32(msg, 1)
	msg = binary.NativeEndian.AppendUint32(msg, 0)
	msg = append(msg, body...)
	if err := unix.Sendto(fd, msg, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return 0, 0, fmt.Errorf("ask for the nbd netlink family: %w", err)
	}
	buf := make([]byte, 16<<10)
	n, _, err := unix.Recvfrom(fd, buf, 0)
	if err != nil {
		return 0, 0, fmt.Errorf("read the nbd netlink family: %w", err)
	}
	return parseFamily(buf[:n])
}

// parseFamily reads the controller's answer to CTRL_CMD_GETFAMILY.
func parseFamily(b []byte) (family uint16, group uint32, err error) {
	if len(b) < unix.NLMSG_HDRLEN {
		return 0, 0, errors.New("short netlink answer")
	}
	typ := binary.NativeEndian.Uint16(b[4:])
	if typ == unix.NLMSG_ERROR {
		if len(b) >= unix.NLMSG_HDRLEN+4 {
			if code := int32(binary.NativeEndian.Uint32(b[unix.NLMSG_HDRLEN:])); code != 0 {
				if unix.Errno(-code) == unix.ENOENT {
					return 0, 0, errNoNBDFamily
				}
				return 0, 0, fmt.Errorf("nbd netlink family: %w", unix.Errno(-code))
			}
		}
		return 0, 0, errNoNBDFamily
	}
	l := int(binary.NativeEndian.Uint32(b))
	if l > len(b) || l < unix.NLMSG_HDRLEN+4 {
		return 0, 0, errors.New("malformed netlink answer")
	}
	for _, a := range netlinkAttrs(b[unix.NLMSG_HDRLEN+4 : l]) {
		switch a.typ {
		case ctrlAttrFamilyID:
			if len(a.data) >= 2 {
				family = binary.NativeEndian.Uint16(a.data)
			}
		case ctrlAttrMcastGroups:
			for _, g := range netlinkAttrs(a.data) {
				var name []byte
				var id uint32
				for _, f := range netlinkAttrs(g.data) {
					switch f.typ {
					case ctrlAttrMcastGrpName:
						name = bytes.TrimRight(f.data, "\x00")
					case ctrlAttrMcastGrpID:
						if len(f.data) >= 4 {
							id = binary.NativeEndian.Uint32(f.data)
						}
					}
				}
				if string(name) == nbdMcastGroupName {
					group = id
				}
			}
		}
	}
	if family == 0 {
		return 0, 0, errNoNBDFamily
	}
	if group == 0 {
		return 0, 0, fmt.Errorf("the nbd netlink family has no multicast group %q", nbdMcastGroupName)
	}
	return family, group, nil
}

type netlinkAttr struct {
	typ  uint16
	data []byte
}

// netlinkAttrs splits b into its attributes (the nested flag dropped).
func netlinkAttrs(b []byte) []netlinkAttr {
	var out []netlinkAttr
	for len(b) >= 4 {
		n := int(binary.NativeEndian.Uint16(b))
		if n < 4 || n > len(b) {
			break
		}
		out = append(out, netlinkAttr{typ: binary.NativeEndian.Uint16(b[2:]) &^ 0xc000, data: b[4:n]})
		n = (n + 3) &^ 3
		if n > len(b) {
			break
		}
		b = b[n:]
	}
	return out
}

// linkDeadIndexes returns the device indexes of the NBD_CMD_LINK_DEAD
// messages of family in b (one datagram).
func linkDeadIndexes(b []byte, family int) []uint32 {
	var out []uint32
	for len(b) >= unix.NLMSG_HDRLEN {
		l := int(binary.NativeEndian.Uint32(b))
		if l < unix.NLMSG_HDRLEN || l > len(b) {
			break
		}
		if int(binary.NativeEndian.Uint16(b[4:])) == family && l >= unix.NLMSG_HDRLEN+4 && b[unix.NLMSG_HDRLEN] == nbdCmdLinkDead {
			for _, a := range netlinkAttrs(b[unix.NLMSG_HDRLEN+4 : l]) {
				if a.typ == nbdAttrIndex && len(a.data) >= 4 {
					out = append(out, binary.NativeEndian.Uint32(a.data))
				}
			}
		}
		l = (l + 3) &^ 3
		if l > len(b) {
			break
		}
		b = b[l:]
	}
	return out
}

// run reads the group until ctx ends or the socket fails: dead is called
// for each link-dead device, lost when the kernel dropped messages (a
// full receive buffer: the probe cycle's own check runs then).
func (w *nbdWatch) run(ctx context.Context, dead func(index uint32), lost func()) error {
	stop := context.AfterFunc(ctx, func() { _, _ = unix.Write(w.stop[1], []byte{1}) })
	defer stop()
	buf := make([]byte, 16<<10)
	fds := []unix.PollFd{{Fd: int32(w.fd), Events: unix.POLLIN}, {Fd: int32(w.stop[0]), Events: unix.POLLIN}}
	for {
		fds[0].Revents, fds[1].Revents = 0, 0
		if _, err := unix.Poll(fds, -1); err != nil {
			if err == unix.EINTR {
				continue
			}
			return fmt.Errorf("poll the nbd netlink socket: %w", err)
		}
		if fds[1].Revents != 0 || ctx.Err() != nil {
			return ctx.Err()
		}
		n, from, err := unix.Recvfrom(w.fd, buf, unix.MSG_DONTWAIT)
		switch {
		case err == unix.EAGAIN || err == unix.EINTR:
			continue
		case err == unix.ENOBUFS:
			lost()
			continue
		case err != nil:
			return fmt.Errorf("read the nbd netlink socket: %w", err)
		}
		// Only the kernel (port 0) speaks for a device.
		if sa, ok := from.(*unix.SockaddrNetlink); !ok || sa.Pid != 0 {
			continue
		}
		for _, idx := range linkDeadIndexes(buf[:n], w.family) {
			dead(idx)
		}
	}
}

func (w *nbdWatch) close() {
	unix.Close(w.fd)
	for _, fd := range w.stop {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
}
