package probe

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"slices"
	"strconv"
	"strings"

	"github.com/moby/sys/mountinfo"
	"golang.org/x/sys/unix"
)

// DefaultMaxTableSize is how many bytes of a mount table ReadTable reads at
// most unless Options.MaxSize says otherwise: 32 MiB. The kernel allows
// 100,000 mounts per mount namespace by default (fs.mount-max,
// sysctl_mount_max in fs/namespace.c); at kubelet's long paths (about 285
// bytes a line in a busy node's table: pods' subPath binds, CSI targets,
// overlay roots) that is about 27 MiB. A file larger than the cap is
// refused before a byte is read, a procfs table (whose size is unknown)
// stops at it; a node that raised fs.mount-max passes a larger cap.
const DefaultMaxTableSize int64 = 32 << 20

// maxLineSize bounds one line of a mount table: two escaped PATH_MAX paths,
// a source and the options fit many times over.
const maxLineSize = 1 << 20

// ErrTableTooLarge is a mount table larger than the size cap
// (Options.MaxSize).
var ErrTableTooLarge = errors.New("larger than the size cap")

// ErrNotTable is a path that is not a regular file (or a procfs file): a
// FIFO, a device, a directory, a socket. Reading one could block for good or
// never end.
var ErrNotTable = errors.New("not a regular file")

func (o Options) maxSize() int64 {
	if o.MaxSize <= 0 {
		return DefaultMaxTableSize
	}
	return o.MaxSize
}

// ReadFile reads and classifies a mount table from a file: a captured
// mountinfo, or /proc/<pid>/mountinfo for a live one. See ReadTable.
func ReadFile(path string, opts Options) (*Inventory, error) {
	return ReadTable(context.Background(), path, opts)
}

// ReadTable reads and classifies the mount table at path, on the calling
// goroutine (so /proc/thread-self names the caller's thread). Only a regular
// file is read, procfs included: a FIFO, a device, a directory or a socket
// gives an error naming it (ErrNotTable), without blocking on it. The table
// is streamed line by line, never held whole in memory; past
// Options.MaxSize bytes it is refused (ErrTableTooLarge). Between reads it
// checks ctx, and returns its error once it is done. A table whose lines do
// not parse, that holds a mount ID twice or whose parent IDs form a cycle
// gives a *TableError naming the file and the line. A live procfs table is
// not refused for an ID listed twice: a read that spans mounts and
// unmounts lists a freed ID again for the mount that took it, and the last
// line is kept (tableBuilder.supersede); it is read up to three times
// before a cycle counts.
func ReadTable(ctx context.Context, path string, opts Options) (*Inventory, error) {
	for attempt := 0; ; attempt++ {
		inv, procfs, err := readTableOnce(ctx, path, opts)
		var ie *idError
		if procfs && attempt < 2 && errors.As(err, &ie) {
			continue
		}
		return inv, err
	}
}

func readTableOnce(ctx context.Context, path string, opts Options) (*Inventory, bool, error) {
	f, size, procfs, err := openTable(path)
	if err != nil {
		return nil, false, err
	}
	defer f.Close()
	limit := opts.maxSize()
	if size > limit {
		return nil, procfs, &TableError{Source: path, Err: fmt.Errorf("%w: the file has %d bytes, the cap is %d", ErrTableTooLarge, size, limit)}
	}
	inv, err := read(ctx, f, path, limit, opts, procfs)
	return inv, procfs, err
}

// openTable opens path for reading if it is a regular file, and says its
// size and whether it lives on procfs (whose files say size 0). It looks
// before it opens, so a FIFO is never opened (an open blocks until a writer
// comes), and checks again on the open descriptor.
func openTable(path string) (f *os.File, size int64, procfs bool, err error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, 0, false, fmt.Errorf("read mount table: %w", err)
	}
	if !fi.Mode().IsRegular() {
		return nil, 0, false, notTable(path, fi.Mode())
	}
	// O_NONBLOCK: should the path have become a FIFO since the look, the
	// open does not wait for a writer; the check below refuses it.
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, 0, false, fmt.Errorf("read mount table: %w", &os.PathError{Op: "open", Path: path, Err: err})
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, 0, false, fmt.Errorf("read mount table: %w", &os.PathError{Op: "fstat", Path: path, Err: err})
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		unix.Close(fd)
		return nil, 0, false, &TableError{Source: path, Err: fmt.Errorf("%w: it changed while being opened; give a regular file", ErrNotTable)}
	}
	var sfs unix.Statfs_t
	if err := unix.Fstatfs(fd, &sfs); err == nil && sfs.Type == unix.PROC_SUPER_MAGIC {
		procfs = true
	}
	// Blocking reads from here: a regular file never waits for data.
	if err := unix.SetNonblock(fd, false); err != nil {
		unix.Close(fd)
		return nil, 0, false, fmt.Errorf("read mount table: %w", &os.PathError{Op: "fcntl", Path: path, Err: err})
	}
	return os.NewFile(uintptr(fd), path), st.Size, procfs, nil
}

func notTable(path string, mode fs.FileMode) error {
	what := "not a regular file"
	switch {
	case mode.IsDir():
		what = "a directory"
	case mode&fs.ModeNamedPipe != 0:
		what = "a named pipe (FIFO)"
	case mode&fs.ModeSocket != 0:
		what = "a socket"
	case mode&fs.ModeCharDevice != 0:
		what = "a character device"
	case mode&fs.ModeDevice != 0:
		what = "a block device"
	}
	return &TableError{Source: path, Err: fmt.Errorf("%w: %s; give a regular file (a capture made with `cat /proc/self/mountinfo > FILE`) or /proc/<pid>/mountinfo", ErrNotTable, what)}
}

// Parse classifies the mountinfo text data; source names it in errors. It
// checks the table as ReadTable does, without a size cap.
func Parse(data []byte, source string, opts Options) (*Inventory, error) {
	return read(context.Background(), bytes.NewReader(data), source, -1, opts, false)
}

// capReader reads at most limit bytes (none when limit < 0) and checks a
// context before each read.
type capReader struct {
	ctx   context.Context
	r     io.Reader
	left  int64
	limit int64
}

func (c *capReader) Read(p []byte) (int, error) {
	if err := c.ctx.Err(); err != nil {
		return 0, err
	}
	if c.limit < 0 {
		return c.r.Read(p)
	}
	if c.left < 0 {
		return 0, fmt.Errorf("%w: more than %d bytes", ErrTableTooLarge, c.limit)
	}
	// Read one byte past the cap to tell "exactly at the cap" from "over".
	// Compared as len(p)-1 > left, never left+1: a cap of math.MaxInt64
	// would wrap to a negative bound.
	if int64(len(p))-1 > c.left {
		p = p[:c.left+1]
	}
	n, err := c.r.Read(p)
	c.left -= int64(n)
	if c.left < 0 {
		return n, fmt.Errorf("%w: more than %d bytes", ErrTableTooLarge, c.limit)
	}
	return n, err
}

// read streams a mount table from r through the line parser into a
// tableBuilder and classifies what it kept.
func read(ctx context.Context, r io.Reader, source string, limit int64, opts Options, procfs bool) (*Inventory, error) {
	b := newTableBuilder(opts)
	sc := bufio.NewScanner(&capReader{ctx: ctx, r: r, left: limit, limit: limit})
	sc.Buffer(make([]byte, 0, 64<<10), maxLineSize)
	line, blankLine := 0, 0 // blankLine: the first empty line
	for sc.Scan() {
		line++
		text := sc.Bytes()
		if len(bytes.TrimSpace(text)) == 0 {
			if blankLine == 0 {
				blankLine = line
			}
			continue
		}
		if blankLine != 0 {
			return nil, &TableError{Source: source, Line: blankLine, Err: errors.New("empty line")}
		}
		raw, err := parseLine(text)
		if err != nil {
			return nil, &TableError{Source: source, Line: line, Text: string(text), Err: err}
		}
		b.add(line, &raw)
	}
	if err := sc.Err(); err != nil {
		switch {
		case errors.Is(err, bufio.ErrTooLong):
			return nil, &TableError{Source: source, Line: line + 1, Err: fmt.Errorf("line longer than %d bytes", maxLineSize)}
		case errors.Is(err, ErrTableTooLarge):
			return nil, &TableError{Source: source, Err: err}
		case ctx.Err() != nil:
			return nil, fmt.Errorf("read mount table %s: %w", source, err)
		}
		return nil, &TableError{Source: source, Line: line + 1, Err: err}
	}
	if b.total == 0 {
		return nil, &TableError{Source: source, Err: errors.New("empty mount table")}
	}
	if blankLine != 0 {
		return nil, &TableError{Source: source, Line: blankLine, Err: errors.New("empty line")}
	}
	err := b.checkIDs()
	if err != nil && procfs && b.supersede() {
		err = b.checkIDs()
	}
	if err != nil {
		return nil, &TableError{Source: source, Line: err.line, Err: err}
	}
	inv := build(b.kept, b.total, source, opts)
	inv.OtherRoots = b.otherRoots
	return inv, nil
}

// rawLine is one mountinfo line split into its fields, which point into the
// line (still escaped); numbers are parsed.
type rawLine struct {
	line         []byte
	id, parent   int32
	major, minor uint32
	root         []byte
	mountpoint   []byte
	options      []byte
	optional     []byte
	fsType       []byte
	source       []byte
	superOptions []byte
}

// parseLine splits a line of /proc/<pid>/mountinfo (proc(5)):
//
//	36 35 98:0 /mnt1 /mnt2 rw,noatime master:1 - ext3 /dev/root rw,errors=continue
//	(1)(2)(3)   (4)   (5)      (6)      (7)   (8) (9)   (10)         (11)
//
// Six fields, zero or more optional fields, a "-", three fields, each
// separated by one space. The kernel escapes space, tab, newline and
// backslash in paths as \ooo; an escape that is not three octal digits up to
// \377 is an error. Mount IDs are positive decimal numbers below 2^31, the
// parent ID a decimal number, the device decimal major:minor.
func parseLine(line []byte) (rawLine, error) {
	r := rawLine{line: line}
	if n := bytes.Count(line, []byte{' '}) + 1; n < 10 {
		return r, fmt.Errorf("not enough fields (%d): want at least 10", n)
	}
	var f [6][]byte
	rest := line
	for i := range f {
		var ok bool
		f[i], rest, ok = bytes.Cut(rest, []byte{' '})
		if !ok {
			return r, fmt.Errorf("not enough fields (%d): want at least 10", i+1)
		}
	}
	id, ok := decimal(f[0], 1<<31-1)
	if !ok || id == 0 {
		return r, fmt.Errorf("mount ID %q: want a positive decimal number", f[0])
	}
	parent, ok := decimal(f[1], 1<<31-1)
	if !ok {
		return r, fmt.Errorf("parent ID %q: want a decimal number", f[1])
	}
	r.id, r.parent = int32(id), int32(parent)
	maj, min, ok := bytes.Cut(f[2], []byte{':'})
	major, ok1 := decimal(maj, 1<<32-1)
	minor, ok2 := decimal(min, 1<<32-1)
	if !ok || !ok1 || !ok2 {
		return r, fmt.Errorf("device %q: want major:minor in decimal, such as 0:52 or 259:1", f[2])
	}
	r.major, r.minor = uint32(major), uint32(minor)
	r.root, r.mountpoint, r.options = f[3], f[4], f[5]
	// Optional fields end at a field "-"; three fields follow it.
	optStart := rest
	n := 0
	for {
		field, after, ok := bytes.Cut(rest, []byte{' '})
		if !ok {
			return r, errors.New("missing the - separator before the file system type")
		}
		if string(field) == "-" {
			r.optional = optStart[:len(optStart)-len(rest)]
			r.optional = bytes.TrimSuffix(r.optional, []byte{' '})
			rest = after
			break
		}
		n++
		rest = after
	}
	var tail [3][]byte
	for i := range tail {
		var ok bool
		tail[i], rest, ok = bytes.Cut(rest, []byte{' '})
		if ok != (i < 2) {
			if ok {
				return r, errors.New("more than three fields after the - separator")
			}
			return r, fmt.Errorf("not enough fields (%d after the - separator): want file system type, source and super options", i+1)
		}
	}
	r.fsType, r.source, r.superOptions = tail[0], tail[1], tail[2]
	for _, f := range [...]struct {
		name string
		v    []byte
	}{{"root", r.root}, {"mount point", r.mountpoint}, {"options", r.options},
		{"file system type", r.fsType}, {"source", r.source}, {"super options", r.superOptions}} {
		if len(f.v) == 0 {
			return r, fmt.Errorf("empty %s field (two spaces in a row?)", f.name)
		}
	}
	if r.mountpoint[0] != '/' {
		return r, fmt.Errorf("mount point %q: want an absolute path", r.mountpoint)
	}
	for _, v := range [][]byte{r.root, r.mountpoint, r.fsType, r.source} {
		if err := checkEscapes(v); err != nil {
			return r, err
		}
	}
	return r, nil
}

// decimal parses the unsigned decimal number b, at most max; no sign, no
// space, at least one digit.
func decimal(b []byte, max uint64) (uint64, bool) {
	if len(b) == 0 || len(b) > 20 {
		return 0, false
	}
	var n uint64
	for _, c := range b {
		if c < '0' || c > '9' {
			return 0, false
		}
		n = n*10 + uint64(c-'0')
		if n > max {
			return 0, false
		}
	}
	return n, true
}

// checkEscapes reports a backslash in s not followed by three octal digits
// of a value up to \377.
func checkEscapes(s []byte) error {
	for i := 0; i < len(s); i++ {
		if s[i] != '\\' {
			continue
		}
		if i+3 >= len(s) {
			return fmt.Errorf("bad escape %q in %q: want \\ and three octal digits", s[i:], s)
		}
		if s[i+1] < '0' || s[i+1] > '3' || s[i+2] < '0' || s[i+2] > '7' || s[i+3] < '0' || s[i+3] > '7' {
			return fmt.Errorf("bad escape %q in %q: want \\ and three octal digits up to \\377", s[i:i+4], s)
		}
		i += 3
	}
	return nil
}

// unescapeTo appends s with its \ooo escapes decoded to dst. s passed
// checkEscapes.
func unescapeTo(dst, s []byte) []byte {
	for i := 0; i < len(s); i++ {
		if s[i] != '\\' {
			dst = append(dst, s[i])
			continue
		}
		dst = append(dst, (s[i+1]-'0')<<6|(s[i+2]-'0')<<3|(s[i+3]-'0'))
		i += 3
	}
	return dst
}

// info makes the mountinfo.Info of a parsed line. Fields without an escape
// share one copy of the line (one allocation per kept mount, not seven);
// mountpoint is the unescaped mount point, or "" to decode it here.
func (r *rawLine) info(mountpoint string) *mountinfo.Info {
	text := string(r.line)
	field := func(f []byte, escaped bool) string {
		if escaped && bytes.IndexByte(f, '\\') >= 0 {
			return string(unescapeTo(make([]byte, 0, len(f)), f))
		}
		// f is a subslice of r.line: its offset is the difference of the
		// capacities, both running to the end of the same array.
		off := cap(r.line) - cap(f)
		return text[off : off+len(f)]
	}
	if mountpoint == "" {
		mountpoint = field(r.mountpoint, true)
	}
	var optional string
	if len(r.optional) > 0 {
		optional = field(r.optional, false)
	}
	return &mountinfo.Info{
		ID: int(r.id), Parent: int(r.parent), Major: int(r.major), Minor: int(r.minor),
		Root: field(r.root, true), Mountpoint: mountpoint, Options: field(r.options, false),
		Optional: optional, FSType: field(r.fsType, true), Source: field(r.source, true),
		VFSOptions: field(r.superOptions, false),
	}
}

// idLine is a mount ID, its parent's and the line that gave them: 12 bytes
// per mount of the table, all that is kept of a mount outside the kubelet
// root.
type idLine struct {
	id, parent, line int32
}

// tableBuilder keeps what classification needs of a streamed table: every
// mount's IDs, and the whole entry of kubelet mounts (of every mount on a
// live table, whose loop backing files may lie anywhere).
type tableBuilder struct {
	prefix []byte // the kubelet root and a slash
	all    bool
	// otherRoots are directories outside the kubelet root that hold
	// kubelet pod volume mounts (<dir>/pods/<uid>/volumes/...): the root
	// of a kubelet run with another --root-dir, for a hint.
	otherRoots []string
	ids        []idLine
	kept       []*mountinfo.Info
	total      int
	buf        []byte
}

func newTableBuilder(opts Options) *tableBuilder {
	return &tableBuilder{prefix: []byte(strings.TrimSuffix(opts.root(), "/") + "/"), all: opts.Live}
}

func (b *tableBuilder) add(line int, r *rawLine) {
	b.total++
	b.ids = append(b.ids, idLine{id: r.id, parent: r.parent, line: int32(min(line, 1<<31-1))})
	b.buf = unescapeTo(b.buf[:0], r.mountpoint)
	under := bytes.HasPrefix(b.buf, b.prefix)
	if b.all || under {
		b.kept = append(b.kept, r.info(""))
	}
	if !under && len(b.otherRoots) < maxOtherRoots {
		if root, ok := podVolumesRoot(b.buf); ok && !slices.Contains(b.otherRoots, root) {
			b.otherRoots = append(b.otherRoots, root)
		}
	}
}

// maxOtherRoots bounds the other kubelet roots a table read names.
const maxOtherRoots = 4

// podVolumesRoot returns <dir> of a mount point
// <dir>/pods/<uid>/{volumes,volume-subpaths}/..., the layout of a kubelet
// root, by path segments.
func podVolumesRoot(mp []byte) (string, bool) {
	const pods = "/pods/"
	for off := 0; ; {
		i := bytes.Index(mp[off:], []byte(pods))
		if i < 0 {
			return "", false
		}
		i += off
		rest := mp[i+len(pods):]
		uid, after, ok := bytes.Cut(rest, []byte("/"))
		if ok && len(uid) > 0 && i > 0 &&
			(bytes.HasPrefix(after, []byte("volumes/")) || bytes.HasPrefix(after, []byte("volume-subpaths/"))) {
			return string(mp[:i]), true
		}
		off = i + 1
	}
}

// supersede keeps, of each mount ID the table lists more than once, only
// its last line, and says whether it dropped any. It is for a live procfs
// table only: the kernel gives a freed mount ID to the next mount at once,
// and one read of a big table while mounts churn (a node repairing a
// thousand volumes) lists a mount unmounted after its line was read, then,
// later in the same read, the new mount that took its ID (new mounts come
// after the old ones, in the order of their never-reused IDs). What a read
// that spans changes says of a mount is checked again when it is acted on
// (the repairs pin a mount by its ID before they touch it); refusing it
// failed 80 reads in 100 of a 1,500-mount table with two mounts churning.
// A file keeps the error: a table captured at once cannot list an ID twice.
// b.ids must be sorted by ID, then line (checkIDs sorts them).
func (b *tableBuilder) supersede() bool {
	ids := b.ids[:0]
	for i, x := range b.ids {
		if i+1 < len(b.ids) && b.ids[i+1].id == x.id {
			continue // a later line has the ID
		}
		ids = append(ids, x)
	}
	dropped := len(b.ids) - len(ids)
	if dropped == 0 {
		return false
	}
	b.ids = ids
	b.total -= dropped
	// kept is in line order: of each ID keep the last entry.
	left := make(map[int]int, len(b.kept))
	for _, m := range b.kept {
		left[m.ID]++
	}
	kept := b.kept[:0]
	for _, m := range b.kept {
		if left[m.ID]--; left[m.ID] == 0 {
			kept = append(kept, m)
		}
	}
	clear(b.kept[len(kept):])
	b.kept = kept
	return true
}

// idError is a table whose mount IDs do not form a tree: an ID twice, or a
// cycle of parents.
type idError struct {
	line int
	msg  string
}

func (e *idError) Error() string { return e.msg }

// checkIDs finds a mount ID given twice and a cycle of parent IDs (a mount
// that is its own parent is the root of its namespace, not a cycle). Each
// error names the line of the table it found.
func (b *tableBuilder) checkIDs() *idError {
	ids := b.ids
	slices.SortFunc(ids, func(x, y idLine) int {
		if x.id != y.id {
			return int(x.id) - int(y.id)
		}
		return int(x.line) - int(y.line)
	})
	var dup *idError
	for i := 1; i < len(ids); i++ {
		if ids[i].id == ids[i-1].id && (dup == nil || int(ids[i].line) < dup.line) {
			dup = &idError{line: int(ids[i].line),
				msg: fmt.Sprintf("mount ID %d again (first on line %d): IDs are unique in a table", ids[i].id, ids[i-1].line)}
		}
	}
	if dup != nil {
		return dup
	}
	find := func(id int32) int {
		i, ok := slices.BinarySearchFunc(ids, id, func(x idLine, id int32) int { return int(x.id) - int(id) })
		if !ok {
			return -1
		}
		return i
	}
	const (
		unseen = iota
		onPath
		done
	)
	state := make([]uint8, len(ids))
	var path []int
	for i := range ids {
		path = path[:0]
		j := i
		for j >= 0 && state[j] == unseen {
			state[j] = onPath
			path = append(path, j)
			if ids[j].parent == ids[j].id {
				break
			}
			k := find(ids[j].parent)
			if k >= 0 && state[k] == onPath {
				return cycleError(ids, path[slices.Index(path, k):])
			}
			j = k
		}
		for _, p := range path {
			state[p] = done
		}
	}
	return nil
}

func cycleError(ids []idLine, cycle []int) *idError {
	first := cycle[0]
	for _, c := range cycle {
		if ids[c].line < ids[first].line {
			first = c
		}
	}
	var chain []string
	for _, c := range cycle {
		if len(chain) == 8 {
			chain = append(chain, "...")
			break
		}
		chain = append(chain, strconv.Itoa(int(ids[c].id)))
	}
	chain = append(chain, strconv.Itoa(int(ids[cycle[0]].id)))
	return &idError{line: int(ids[first].line),
		msg: fmt.Sprintf("parent IDs form a cycle (%s): every mount's parents lead to the root mount", strings.Join(chain, " -> "))}
}
