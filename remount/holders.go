package remount

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/mountmedic/mountmedic/probe"
	"golang.org/x/sys/unix"
)

// holdKind says how a process holds a mount.
type holdKind string

const (
	// holdCwd is a working directory on the mount.
	holdCwd holdKind = "cwd"
	// holdRoot is a root directory (chroot) on the mount.
	holdRoot holdKind = "root"
	// holdFD is an open file descriptor on the mount.
	holdFD holdKind = "fd"
	// holdMap is a memory mapping of a file of the filesystem.
	holdMap holdKind = "mmap"
)

// holder is a process that still uses a dead filesystem: it keeps the
// filesystem (and a detached mount of it) alive, and its calls there keep
// failing after a repair.
type holder struct {
	Pid  int
	Comm string
	Kind holdKind
	// Dev is the device number of the filesystem held.
	Dev probe.Dev
	// FD is the descriptor number of a holdFD.
	FD int
	// MountID is the mount held (holdCwd, holdRoot, holdFD).
	MountID int
	// Path is the link's target as /proc shows it, or the mapped file.
	Path string
}

func (h holder) String() string {
	s := fmt.Sprintf("pid %d (%s) %s", h.Pid, h.Comm, h.Kind)
	if h.Kind == holdFD {
		s += " " + strconv.Itoa(h.FD)
	}
	return s + " " + h.Path
}

// holdersOf reports the processes under procDir ("/proc" when empty) that
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
func holdersOf(ctx context.Context, procDir string, dev probe.Dev, mountIDs ...int) ([]holder, error) {
	detached := make(map[int]probe.Dev, len(mountIDs))
	for _, id := range mountIDs {
		detached[id] = dev
	}
	return findHolders(ctx, procDir, nil, []probe.Dev{dev}, detached)
}

// findHolders is holdersOf over the processes pids (every process when
// pids is nil) and the filesystems devs, in one pass: each holder is
// reported once, with the device of the mount it holds. detached maps the
// IDs of mounts no mountinfo shows any more to their device.
func findHolders(ctx context.Context, procDir string, pids []int, devs []probe.Dev, detached map[int]probe.Dev) ([]holder, error) {
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
	want := make(devSet, len(devs))
	for _, d := range devs {
		want[d] = true
	}
	byNS := make(map[string]map[int]probe.Dev) // mount IDs of devs per namespace
	var out []holder
	for _, name := range names {
		if err := ctx.Err(); err != nil {
			return out, fmt.Errorf("find holders of %v: %w", devs, err)
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
			ids = make(map[int]probe.Dev)
			if mounts, err := processMounts(procDir, pid, devs...); err == nil {
				for _, m := range mounts {
					ids[m.ID] = m.Dev
				}
			}
			byNS[ns] = ids
		}
		held := func(id int) (probe.Dev, bool) {
			if d, ok := ids[id]; ok {
				return d, true
			}
			d, ok := detached[id]
			return d, ok
		}
		comm := readComm(proc)
		var hs []holder
		if len(ids) > 0 || len(detached) > 0 {
			hs = append(hs, linkHolders(proc, held)...)
			hs = append(hs, fdHolders(proc, held)...)
		}
		hs = append(hs, mapHolders(proc, want)...)
		for i := range hs {
			hs[i].Pid, hs[i].Comm = pid, comm
		}
		out = append(out, hs...)
	}
	return out, nil
}

func readComm(proc string) string {
	b, err := readProcHead(filepath.Join(proc, "comm"), 64)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// linkHolders checks the cwd and root links.
func linkHolders(proc string, held func(int) (probe.Dev, bool)) []holder {
	var out []holder
	for _, k := range []holdKind{holdCwd, holdRoot} {
		link := filepath.Join(proc, string(k))
		fd, err := unix.Open(link, unix.O_PATH|unix.O_CLOEXEC, 0)
		if err != nil {
			continue
		}
		id, err := fdMountID(fd)
		unix.Close(fd)
		if err != nil {
			continue
		}
		dev, ok := held(id)
		if !ok {
			continue
		}
		target, _ := os.Readlink(link)
		out = append(out, holder{Kind: k, Dev: dev, MountID: id, Path: target})
	}
	return out
}

// fdHolders checks each open descriptor's fdinfo.
func fdHolders(proc string, held func(int) (probe.Dev, bool)) []holder {
	entries, err := os.ReadDir(filepath.Join(proc, "fdinfo"))
	if err != nil {
		return nil
	}
	var out []holder
	for _, e := range entries {
		n, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		id, err := fdinfoMountID(filepath.Join(proc, "fdinfo", e.Name()))
		if err != nil {
			continue
		}
		dev, ok := held(id)
		if !ok {
			continue
		}
		target, _ := os.Readlink(filepath.Join(proc, "fd", e.Name()))
		out = append(out, holder{Kind: holdFD, Dev: dev, FD: n, MountID: id, Path: target})
	}
	return out
}

// mapHolders reads /proc/<pid>/maps for mappings of files on devs,
// streamed: a process has up to vm.max_map_count mappings.
func mapHolders(proc string, devs devSet) []holder {
	f, err := os.Open(filepath.Join(proc, "maps"))
	if err != nil {
		return nil
	}
	defer f.Close()
	return parseMaps(f, devs)
}

// parseMaps lists the files mapped from the filesystems devs, each once.
func parseMaps(r io.Reader, devs devSet) []holder {
	type key struct {
		dev  probe.Dev
		path string
	}
	var out []holder
	seen := map[key]bool{}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		// address perms offset dev inode [path]
		f := strings.Fields(sc.Text())
		if len(f) < 6 || f[4] == "0" {
			continue
		}
		dev, ok := mapsDev(f[3])
		if !ok || !devs[dev] {
			continue
		}
		k := key{dev, strings.Join(f[5:], " ")}
		if seen[k] {
			continue
		}
		seen[k] = true
		out = append(out, holder{Kind: holdMap, Dev: dev, Path: k.path})
	}
	return out
}

// mapsDev reads a maps dev field ("00:2f": hex major and minor, wider for
// large device numbers).
func mapsDev(field string) (probe.Dev, bool) {
	ma, mi, ok := strings.Cut(field, ":")
	if !ok {
		return probe.Dev{}, false
	}
	a, err1 := strconv.ParseUint(ma, 16, 32)
	b, err2 := strconv.ParseUint(mi, 16, 32)
	return probe.Dev{Major: uint32(a), Minor: uint32(b)}, err1 == nil && err2 == nil
}
