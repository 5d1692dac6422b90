// Package coldpages gives the kernel back the resident pages of the
// process's own executable that the process no longer uses.
//
// A Go binary's code and read-only data are mapped from its file. Start-up
// touches far more of them than a long-running process uses afterwards
// (client-go's scheme registration walks every API type it links; flag and
// command set-up; the first API calls), and every page a process touched
// stays mapped, counted in its resident set, for as long as the process
// lives. Measured on mountmedic's idle agent: 30 MiB of its 35 MiB RSS were
// such pages; 35 s after they were given back, 12 MiB were mapped
// again.
//
// Release tells the kernel so: MADV_COLD puts those pages on the inactive
// list, where reclaim takes them first (a mapped executable page that was
// used is otherwise kept: reclaim activates it instead), and
// MADV_DONTNEED drops them from the process's page tables. They stay in
// the page cache: a page used again is mapped back by a minor fault,
// without a read from disk unless the kernel had reclaimed it. Only
// private read-only mappings of the executable file that hold no private
// copy of a page (smaps Anonymous 0 kB) are advised: MADV_DONTNEED on a
// page the process or its loader wrote (a relocated read-only segment of a
// position-independent binary) would lose that write, so such a mapping is
// skipped.
//
// coldpages imports nothing of mountmedic.
package coldpages

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
)

// Mapping is one mapping of a process, as /proc/<pid>/smaps lists it.
type Mapping struct {
	Start, End uint64
	Perms      string // "r-xp"
	Major      uint32 // device of the mapped file
	Minor      uint32
	Inode      uint64
	Path       string
	Rss        int64 // bytes resident
	Anonymous  int64 // bytes of private copies (written pages)
}

// cold reports whether m may be advised: private, readable, not writable,
// and with no private copy of a page.
func (m Mapping) cold() bool {
	return len(m.Perms) == 4 && m.Perms[0] == 'r' && m.Perms[1] == '-' && m.Perms[3] == 'p' && m.Anonymous == 0 && m.End > m.Start
}

// of reports whether m maps the file st describes.
func (m Mapping) of(st *unix.Stat_t) bool {
	return m.Inode == st.Ino && m.Major == unix.Major(st.Dev) && m.Minor == unix.Minor(st.Dev)
}

// Log logs what the nth Release of a process did: its first at V(2), the
// later ones at V(4), a failure at V(0) as an Info (a kernel without
// MADV_COLD or MADV_DONTNEED is no bug).
func Log(logger klog.Logger, n int, res Result, err error) {
	if err != nil {
		logger.Info("Cannot give back the pages of the executable the process no longer uses", "err", err)
		return
	}
	v := 4
	if n == 0 {
		v = 2
	}
	logger.V(v).Info("Gave back the pages of the executable the process no longer uses (mapped again when used)",
		"mappings", res.Advised, "skipped", res.Skipped, "residentBytes", res.Resident)
}

// ParseSmaps reads the mappings of a /proc/<pid>/smaps file.
func ParseSmaps(r io.Reader) ([]Mapping, error) {
	var out []Mapping
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	line := 0
	for sc.Scan() {
		line++
		text := sc.Text()
		if m, ok, err := header(text); err != nil {
			return nil, fmt.Errorf("smaps line %d: %w", line, err)
		} else if ok {
			out = append(out, m)
			continue
		}
		if len(out) == 0 {
			continue
		}
		key, val, ok := strings.Cut(text, ":")
		if !ok {
			continue
		}
		var dst *int64
		switch key {
		case "Rss":
			dst = &out[len(out)-1].Rss
		case "Anonymous":
			dst = &out[len(out)-1].Anonymous
		default:
			continue
		}
		f := strings.Fields(val)
		if len(f) != 2 || f[1] != "kB" {
			return nil, fmt.Errorf("smaps line %d: %s: want \"<n> kB\", got %q", line, key, val)
		}
		n, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("smaps line %d: %s: %w", line, key, err)
		}
		*dst = n * 1024
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	return out, nil
}

// header parses a mapping's first line ("start-end perms offset dev inode
// [path]"); ok is false for a line of another kind (a "Key: value" line).
func header(text string) (Mapping, bool, error) {
	var m Mapping
	rng, rest, ok := strings.Cut(text, " ")
	if !ok {
		return m, false, nil
	}
	lo, hi, ok := strings.Cut(rng, "-")
	if !ok || strings.HasSuffix(lo, ":") {
		return m, false, nil
	}
	start, err1 := strconv.ParseUint(lo, 16, 64)
	end, err2 := strconv.ParseUint(hi, 16, 64)
	if err1 != nil || err2 != nil {
		return m, false, nil // "VmFlags: ..." and the like never parse as a range
	}
	f := strings.Fields(rest)
	if len(f) < 4 {
		return m, false, fmt.Errorf("mapping %q: want perms, offset, device and inode", text)
	}
	maj, min, ok := strings.Cut(f[2], ":")
	if !ok {
		return m, false, fmt.Errorf("mapping %q: device %q is not major:minor", text, f[2])
	}
	ma, err1 := strconv.ParseUint(maj, 16, 32)
	mi, err2 := strconv.ParseUint(min, 16, 32)
	ino, err3 := strconv.ParseUint(f[3], 10, 64)
	if err := errors.Join(err1, err2, err3); err != nil {
		return m, false, fmt.Errorf("mapping %q: %w", text, err)
	}
	m = Mapping{Start: start, End: end, Perms: f[0], Major: uint32(ma), Minor: uint32(mi), Inode: ino}
	// The path is what follows the inode, spaces and all.
	for range 4 {
		rest = strings.TrimLeft(rest, " ")
		if i := strings.IndexByte(rest, ' '); i >= 0 {
			rest = rest[i:]
		} else {
			rest = ""
		}
	}
	m.Path = strings.TrimLeft(rest, " ")
	return m, true, nil
}

// Result says what one Release did.
type Result struct {
	// Advised are the executable's mappings given back, Skipped those
	// left (written pages, or writable).
	Advised, Skipped int
	// Resident is the resident size of the advised mappings before, in
	// bytes.
	Resident int64
}

// Release advises the kernel that the resident pages of the process's own
// executable file that it no longer uses are cold (see the package doc).
// Pages the process uses again are mapped back by minor faults.
func Release() (Result, error) {
	return releaseFile("/proc/self/exe")
}

// releaseFile advises the private read-only mappings of the file at path
// (by device and inode) that hold no written page.
func releaseFile(path string) (Result, error) {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return Result{}, fmt.Errorf("stat %s: %w", path, err)
	}
	data, err := os.ReadFile("/proc/self/smaps")
	if err != nil {
		return Result{}, err
	}
	maps, err := ParseSmaps(bytes.NewReader(data))
	if err != nil {
		return Result{}, fmt.Errorf("/proc/self/smaps: %w", err)
	}
	var res Result
	var errs []error
	for _, m := range maps {
		if !m.of(&st) {
			continue
		}
		if !m.cold() {
			res.Skipped++
			continue
		}
		// MADV_COLD is 5.4's; without it the pages are still dropped
		// from the page tables.
		_ = madvise(m.Start, m.End-m.Start, unix.MADV_COLD)
		if err := madvise(m.Start, m.End-m.Start, unix.MADV_DONTNEED); err != nil {
			errs = append(errs, fmt.Errorf("madvise %x-%x %s: %w", m.Start, m.End, m.Perms, err))
			continue
		}
		res.Advised++
		res.Resident += m.Rss
	}
	return res, errors.Join(errs...)
}

// Every calls Release after first, then every interval, until ctx ends,
// and passes each outcome to report.
func Every(ctx context.Context, first, interval time.Duration, report func(Result, error)) {
	t := time.NewTimer(first)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			report(Release())
			t.Reset(interval)
		}
	}
}

// madvise advises on the range [addr, addr+length) of this process, given
// by address: the mappings are the executable's, never Go memory.
func madvise(addr, length uint64, advice int) error {
	_, _, e := unix.Syscall(unix.SYS_MADVISE, uintptr(addr), uintptr(length), uintptr(advice))
	if e != 0 {
		return e
	}
	return nil
}
