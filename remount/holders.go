package remount

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/mountmedic/mountmedic/probe"
	"golang.org/x/sys/unix"
)

// HoldKind says how a process holds a mount.
type HoldKind string

const (
	// HoldCwd is a working directory on the mount.
	HoldCwd HoldKind = "cwd"
	// HoldRoot is a root directory (chroot) on the mount.
	HoldRoot HoldKind = "root"
	// HoldFD is an open file descriptor on the mount.
	HoldFD HoldKind = "fd"
	// HoldMap is a memory mapping of a file of the filesystem.
	HoldMap HoldKind = "mmap"
)

// Holder is a process that still uses a dead filesystem: it keeps the
// filesystem (and a detached mount of it) alive, and its calls there keep
// failing after a repair.
type Holder struct {
	Pid  int
	Comm string
	Kind HoldKind
	// FD is the descriptor number of a HoldFD.
	FD int
	// MountID is the mount held (HoldCwd, HoldRoot, HoldFD).
	MountID int
	// Path is the link's target as /proc shows it, or the mapped file.
	Path string
}

func (h Holder) String() string {
	s := fmt.Sprintf("pid %d (%s) %s", h.Pid, h.Comm, h.Kind)
	if h.Kind == HoldFD {
		s += " " + strconv.Itoa(h.FD)
	}
	return s + " " + h.Path
}

// FindHolders reports the processes under procDir ("/proc" when empty) that
// hold the filesystem with device number dev: a working directory, root or
// open descriptor on one of its mounts, or a mapping of one of its files.
// A mount is one of the filesystem's when the process's own mountinfo shows
// it with that device number, or when its ID is among mountIDs (mounts the
// caller detached, which no mountinfo shows any more). Mappings are matched
// by device number directly.
//
// It is read-only and never touches the dead filesystem: mountinfo, maps and
// fdinfo are VFS data; a working directory or root is opened O_PATH through
// its /proc link (a jump to the held path, no lookup in the filesystem, no
// open call) only to read the descriptor's mnt_id; nothing is stat'ed. The
// calling process itself is left out.
func FindHolders(ctx context.Context, procDir string, dev probe.Dev, mountIDs ...int) ([]Holder, error) {
	return findHolders(ctx, procDir, nil, dev, mountIDs...)
}

// findHolders is FindHolders over the processes pids, or every process when
// pids is nil.
func findHolders(ctx context.Context, procDir string, pids []int, dev probe.Dev, mountIDs ...int) ([]Holder, error) {
	if procDir == "" {
		procDir = "/proc"
	}
	var names []string
	if pids == nil {
		entries, err := os.ReadDir(procDir)
		if err != nil {
			return nil, fmt.Errorf("list processes: %w", err)
		}
		for _, e := range entries {
			names = append(names, e.Name())
		}
	} else {
		for _, pid := range pids {
			names = append(names, strconv.Itoa(pid))
		}
	}
	self, _ := os.Readlink(filepath.Join(procDir, "self"))
	extra := make(map[int]bool, len(mountIDs))
	for _, id := range mountIDs {
		extra[id] = true
	}
	byNS := make(map[string]map[int]bool) // mount IDs of dev per namespace
	var out []Holder
	for _, name := range names {
		if err := ctx.Err(); err != nil {
			return out, fmt.Errorf("find holders of %s: %w", dev, err)
		}
		pid, err := strconv.Atoi(name)
		if err != nil || pid <= 0 || name == self {
			continue
		}
		proc := filepath.Join(procDir, name)
		ns, err := os.Readlink(filepath.Join(proc, "ns", "mnt"))
		if err != nil {
			continue // exited, or not ours to read
		}
		ids, ok := byNS[ns]
		if !ok {
			ids = make(map[int]bool)
			if mounts, err := ProcessMounts(procDir, pid, dev); err == nil {
				for _, m := range mounts {
					ids[m.ID] = true
				}
			}
			byNS[ns] = ids
		}
		held := func(id int) bool { return ids[id] || extra[id] }
		comm := readComm(proc)
		var hs []Holder
		if len(ids) > 0 || len(extra) > 0 {
			hs = append(hs, linkHolders(proc, held)...)
			hs = append(hs, fdHolders(proc, held)...)
		}
		hs = append(hs, mapHolders(proc, dev)...)
		for i := range hs {
			hs[i].Pid, hs[i].Comm = pid, comm
		}
		out = append(out, hs...)
	}
	return out, nil
}

func readComm(proc string) string {
	b, err := os.ReadFile(filepath.Join(proc, "comm"))
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// linkHolders checks the cwd and root links.
func linkHolders(proc string, held func(int) bool) []Holder {
	var out []Holder
	for _, k := range []HoldKind{HoldCwd, HoldRoot} {
		link := filepath.Join(proc, string(k))
		fd, err := unix.Open(link, unix.O_PATH|unix.O_CLOEXEC, 0)
		if err != nil {
			continue
		}
		id, err := fdMountID(fd)
		unix.Close(fd)
		if err != nil || !held(id) {
			continue
		}
		target, _ := os.Readlink(link)
		out = append(out, Holder{Kind: k, MountID: id, Path: target})
	}
	return out
}

// fdHolders checks each open descriptor's fdinfo.
func fdHolders(proc string, held func(int) bool) []Holder {
	entries, err := os.ReadDir(filepath.Join(proc, "fdinfo"))
	if err != nil {
		return nil
	}
	var out []Holder
	for _, e := range entries {
		n, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		id, err := fdinfoMountID(filepath.Join(proc, "fdinfo", e.Name()))
		if err != nil || !held(id) {
			continue
		}
		target, _ := os.Readlink(filepath.Join(proc, "fd", e.Name()))
		out = append(out, Holder{Kind: HoldFD, FD: n, MountID: id, Path: target})
	}
	return out
}

// mapHolders reads /proc/<pid>/maps for mappings of files on dev.
func mapHolders(proc string, dev probe.Dev) []Holder {
	data, err := os.ReadFile(filepath.Join(proc, "maps"))
	if err != nil {
		return nil
	}
	return parseMaps(data, dev)
}

func parseMaps(data []byte, dev probe.Dev) []Holder {
	want := fmt.Sprintf("%02x:%02x", dev.Major, dev.Minor)
	var out []Holder
	var seen []string
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		// address perms offset dev inode [path]
		f := strings.Fields(sc.Text())
		if len(f) < 6 || !sameDevField(f[3], want) || f[4] == "0" {
			continue
		}
		p := strings.Join(f[5:], " ")
		if slices.Contains(seen, p) {
			continue
		}
		seen = append(seen, p)
		out = append(out, Holder{Kind: HoldMap, Path: p})
	}
	return out
}

// sameDevField compares a maps dev field ("00:2f", hex) with want, allowing
// wider fields for large device numbers.
func sameDevField(field, want string) bool {
	if field == want {
		return true
	}
	ma, mi, ok := strings.Cut(field, ":")
	wa, wi, _ := strings.Cut(want, ":")
	if !ok {
		return false
	}
	a, err1 := strconv.ParseUint(ma, 16, 32)
	b, err2 := strconv.ParseUint(mi, 16, 32)
	c, _ := strconv.ParseUint(wa, 16, 32)
	d, _ := strconv.ParseUint(wi, 16, 32)
	return err1 == nil && err2 == nil && a == c && b == d
}
