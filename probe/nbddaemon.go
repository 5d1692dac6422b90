package probe

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"time"
)

// NBDMajor is the block major of nbd devices (include/uapi/linux/major.h).
const NBDMajor = 43

// ErrNBDDaemonGone is the error of an nbd device whose connection is known
// dead without any I/O: the kernel said so (NBD_CMD_LINK_DEAD), or the
// process that configured the device, seen alive before, is gone. The
// kernel holds or fails the device's I/O until a daemon is re-attached.
var ErrNBDDaemonGone = errors.New("the nbd device's daemon is gone")

// nbdDaemons finds dead NBD daemons without I/O. For each nbd device it
// keeps what it knows of the device's current connection:
//
//   - the process the kernel names in /sys/block/nbdN/pid (the caller of
//     the connect: rbd-nbd itself, which serves the device too), judged
//     only once it was seen alive: its thread group and start time are
//     kept then, and a later look that finds the group gone, a zombie, or
//     another process under the number (a start time that differs) says
//     the daemon died. A number never seen alive (a mapper that exits once
//     connected, as nbd-client does, or a device connected before the
//     agent started) is never judged;
//   - a NBD_CMD_LINK_DEAD event for the device (WatchNBD): the kernel's
//     own word that a connection died.
//
// Either verdict holds until a read of the device that started after it
// answers (answered): the device was re-attached (NBD_CMD_RECONFIGURE does
// not change the sysfs pid, which then names the dead daemon for good) or
// another connection serves it. The process number is not judged again
// until the sysfs file names another number.
type nbdDaemons struct {
	sysfs, proc string
	// enabled: the process sees the host's PID numbers (the sysfs pid is
	// a number of the initial PID namespace).
	enabled bool

	mu   sync.Mutex
	devs map[string]*nbdConn
}

// nbdConn is what is known of one nbd device's connection.
type nbdConn struct {
	// pid is the sysfs pid the record is for; tgid and start identify
	// its thread group, seen alive (seen) or never (unknown).
	pid, tgid int
	start     uint64
	seen      bool
	unknown   bool
	// retired: the device answered after pid was found gone; pid is not
	// judged again.
	retired bool
	// deadAt is when the connection was first known dead (zero: not);
	// why says how.
	deadAt time.Time
	why    string
}

func newNBDDaemons(sysfs, proc string) *nbdDaemons {
	return &nbdDaemons{sysfs: sysfs, proc: proc, enabled: initialPIDNamespace(proc), devs: map[string]*nbdConn{}}
}

// initialPIDNamespace reports whether this process lives in the initial
// PID namespace (NSpid lists one number, Linux 4.1), so that /proc names
// processes by the numbers sysfs gives. Without hostPID a container's
// /proc would name its own processes by those numbers.
func initialPIDNamespace(proc string) bool {
	raw, err := os.ReadFile(filepath.Join(proc, "self", "status"))
	if err != nil {
		return false
	}
	for line := range bytes.Lines(raw) {
		if rest, ok := bytes.CutPrefix(line, []byte("NSpid:")); ok {
			return len(bytes.Fields(rest)) == 1
		}
	}
	return false
}

// gone reports whether device dev's (e.g. "nbd0") connection is known
// dead, with the reason, at now.
func (d *nbdDaemons) gone(dev string, now time.Time) (bool, string) {
	pid := d.sysfsPID(dev)
	d.mu.Lock()
	defer d.mu.Unlock()
	c := d.devs[dev]
	if pid <= 0 {
		// Not connected (no pid file, or 0): nothing to judge, and a
		// link-dead verdict ends with the connection.
		delete(d.devs, dev)
		return false, ""
	}
	if c == nil || c.pid != pid {
		keep := nbdConn{pid: pid}
		if c != nil && !c.deadAt.IsZero() && c.pid == 0 {
			// A link-dead event came before the first look.
			keep.deadAt, keep.why = c.deadAt, c.why
		}
		c = &keep
		d.devs[dev] = c
	}
	if !c.deadAt.IsZero() {
		return true, c.why
	}
	if !d.enabled || c.retired || c.unknown {
		return false, ""
	}
	p, err := readProcStat(d.proc, pid)
	if !c.seen {
		if err != nil || p.dead() {
			c.unknown = true
			return false, ""
		}
		if c.tgid, err = readTgid(d.proc, pid); err != nil {
			c.unknown = true
			return false, ""
		}
		if c.tgid != pid {
			if p, err = readProcStat(d.proc, c.tgid); err != nil || p.dead() {
				c.unknown = true
				return false, ""
			}
		}
		c.seen, c.start = true, p.start
		return false, ""
	}
	g, err := readProcStat(d.proc, c.tgid)
	switch {
	case err != nil:
		c.why = fmt.Sprintf("its configuring process %d is gone", c.tgid)
	case g.start != c.start:
		c.why = fmt.Sprintf("its configuring process %d is gone (the number now names a process started later)", c.tgid)
	case g.dead():
		c.why = fmt.Sprintf("its configuring process %d is a zombie", c.tgid)
	default:
		return false, ""
	}
	c.deadAt = now
	return true, c.why
}

// linkDead records the kernel's NBD_CMD_LINK_DEAD for device dev at now.
func (d *nbdDaemons) linkDead(dev string, now time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	c := d.devs[dev]
	if c == nil {
		c = &nbdConn{}
		d.devs[dev] = c
	}
	if c.deadAt.IsZero() {
		c.deadAt, c.why = now, "the kernel reported its connection dead (NBD_CMD_LINK_DEAD)"
	}
}

// answered records a read of device dev that began at start and answered:
// a verdict older than the read is over.
func (d *nbdDaemons) answered(dev string, start time.Time) {
	d.mu.Lock()
	defer d.mu.Unlock()
	c := d.devs[dev]
	if c == nil || c.deadAt.IsZero() || start.Before(c.deadAt) {
		return
	}
	c.deadAt, c.why = time.Time{}, ""
	c.retired = c.seen
}

// sysfsPID reads /sys/block/<dev>/pid: 0 when absent or unreadable.
func (d *nbdDaemons) sysfsPID(dev string) int {
	raw, err := os.ReadFile(filepath.Join(d.sysfs, "block", dev, "pid"))
	if err != nil {
		return 0
	}
	n, err := strconv.Atoi(string(bytes.TrimSpace(raw)))
	if err != nil {
		return 0
	}
	return n
}

// procStat is what the checks need of /proc/<pid>/stat.
type procStat struct {
	state   byte
	threads int
	start   uint64
}

// dead: a zombie or dead task whose threads are all gone (a group leader
// that exited before its other threads shows Z while they run).
func (p procStat) dead() bool {
	return (p.state == 'Z' || p.state == 'X') && p.threads <= 1
}

// readProcStat reads the state (field 3), num_threads (20) and starttime
// (22) of /proc/<pid>/stat. The command name (field 2) may hold any byte:
// the fields are counted from its last ')'.
func readProcStat(proc string, pid int) (procStat, error) {
	raw, err := os.ReadFile(filepath.Join(proc, strconv.Itoa(pid), "stat"))
	if err != nil {
		return procStat{}, err
	}
	return parseProcStat(raw)
}

func parseProcStat(raw []byte) (procStat, error) {
	i := bytes.LastIndexByte(raw, ')')
	if i < 0 {
		return procStat{}, errors.New("proc stat: no command name")
	}
	f := bytes.Fields(raw[i+1:])
	// f[0] is field 3 (state); field n is f[n-3].
	if len(f) < 20 || len(f[0]) != 1 {
		return procStat{}, fmt.Errorf("proc stat: %d fields after the command name, want at least 20", len(f))
	}
	threads, err := strconv.Atoi(string(f[17]))
	if err != nil {
		return procStat{}, fmt.Errorf("proc stat num_threads: %w", err)
	}
	start, err := strconv.ParseUint(string(f[19]), 10, 64)
	if err != nil {
		return procStat{}, fmt.Errorf("proc stat starttime: %w", err)
	}
	return procStat{state: f[0][0], threads: threads, start: start}, nil
}

// readTgid reads the thread group of task pid (the sysfs pid is the
// connecting thread's number, which is the process's when its main thread
// connected).
func readTgid(proc string, pid int) (int, error) {
	raw, err := os.ReadFile(filepath.Join(proc, strconv.Itoa(pid), "status"))
	if err != nil {
		return 0, err
	}
	for line := range bytes.Lines(raw) {
		if rest, ok := bytes.CutPrefix(line, []byte("Tgid:")); ok {
			return strconv.Atoi(string(bytes.TrimSpace(rest)))
		}
	}
	return 0, errors.New("proc status: no Tgid")
}

// nbdGone is why the nbd device of backend b is known dead at now ("" when
// it is not, or b is no filesystem on an nbd device). Only with
// Config.ReadDevice: a device read is what ends a verdict once the device
// was re-attached.
func (p *Prober) nbdGone(b *Backend, now time.Time) string {
	if !p.cfg.ReadDevice || b.Kind != BackendBlock || b.Dev.Major != NBDMajor || b.Device == "" {
		return ""
	}
	if dead, why := p.nbd.gone(b.Device, now); dead {
		return why
	}
	return ""
}

// nbdGrace is how long a cycle waits for the probe of an nbd device whose
// daemon is known dead: long enough to hear a re-attached device answer,
// far below a deadline.
func (p *Prober) nbdGrace() time.Duration { return min(p.cfg.Timeout/4, 250*time.Millisecond) }

// NBDDaemonGone reports whether device dev's ("nbd0") connection is known
// dead without I/O (see Probe): for a repair that would otherwise wait a
// deadline on a read of the device to learn it.
func (p *Prober) NBDDaemonGone(dev string) bool {
	if !p.cfg.ReadDevice {
		return false
	}
	dead, _ := p.nbd.gone(dev, time.Now())
	return dead
}

// NBDAnswered records that a read of device dev ("nbd0") begun at start
// answered, as a probe's own read does: a verdict older than the read is
// over (for a repair that read the device after re-attaching it).
func (p *Prober) NBDAnswered(dev string, start time.Time) { p.nbd.answered(dev, start) }
