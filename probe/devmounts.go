package probe

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"hash/maphash"

	"github.com/moby/sys/mountinfo"
)

// DefaultMaxDevMounts is how many mounts of the asked devices ReadDevMounts
// keeps at most. A container shows a volume through a few mounts (the
// volume, its subPaths); a table with more was stacked on purpose.
const DefaultMaxDevMounts = 4096

// ErrTooManyMounts is a mount table with more mounts of the asked devices
// than ReadDevMounts keeps.
var ErrTooManyMounts = errors.New("more mounts of the devices than the cap")

// DevMounts are the mounts of some devices in one mount table, in table
// order, and which of them another mount covers (sits on the same mount
// point right above).
type DevMounts struct {
	Mounts  []*mountinfo.Info
	Covered map[int]bool
}

// ReadDevMounts streams the mount table at path, a /proc/<pid>/mountinfo
// whose size a pod may choose (a user-namespaced pod's root can stack
// thousands of mounts), and keeps only the mounts of the devices devs: its
// memory is bounded by maxKept entries (DefaultMaxDevMounts when 0 or less)
// and 16 bytes per line for the covered check, and it reads at most
// maxSize bytes (DefaultMaxTableSize when 0 or less). Past either cap it
// fails with ErrTableTooLarge or ErrTooManyMounts and keeps nothing. Only a
// regular file or a procfs file is read (see ReadTable).
func ReadDevMounts(ctx context.Context, path string, devs map[Dev]bool, maxSize int64, maxKept int) (*DevMounts, error) {
	if maxSize <= 0 {
		maxSize = DefaultMaxTableSize
	}
	if maxKept <= 0 {
		maxKept = DefaultMaxDevMounts
	}
	f, size, _, err := openTable(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if size > maxSize {
		return nil, &TableError{Source: path, Err: fmt.Errorf("%w: the file has %d bytes, the cap is %d", ErrTableTooLarge, size, maxSize)}
	}
	// Every line's mount ID, parent ID and a hash of its (escaped) mount
	// point: enough to tell which kept mount another one covers, whatever
	// the order of the lines.
	type edge struct {
		id, parent int32
		mp         uint64
	}
	seed := maphash.MakeSeed()
	var edges []edge
	out := &DevMounts{Covered: map[int]bool{}}
	var keptMP []uint64
	sc := bufio.NewScanner(&capReader{ctx: ctx, r: f, left: maxSize, limit: maxSize})
	sc.Buffer(make([]byte, 0, 64<<10), maxLineSize)
	line := 0
	for sc.Scan() {
		line++
		text := sc.Bytes()
		if len(text) == 0 {
			continue
		}
		r, err := parseLine(text)
		if err != nil {
			return nil, &TableError{Source: path, Line: line, Text: string(text), Err: err}
		}
		h := maphash.Bytes(seed, r.mountpoint)
		edges = append(edges, edge{id: r.id, parent: r.parent, mp: h})
		if !devs[Dev{Major: r.major, Minor: r.minor}] {
			continue
		}
		if len(out.Mounts) >= maxKept {
			return nil, &TableError{Source: path, Err: fmt.Errorf("%w: more than %d mounts of %s", ErrTooManyMounts, maxKept, devList(devs))}
		}
		out.Mounts = append(out.Mounts, r.info(""))
		keptMP = append(keptMP, h)
	}
	if err := sc.Err(); err != nil {
		switch {
		case errors.Is(err, bufio.ErrTooLong):
			return nil, &TableError{Source: path, Line: line + 1, Err: fmt.Errorf("line longer than %d bytes", maxLineSize)}
		case errors.Is(err, ErrTableTooLarge):
			return nil, &TableError{Source: path, Err: err}
		case ctx.Err() != nil:
			return nil, fmt.Errorf("read mount table %s: %w", path, err)
		}
		return nil, &TableError{Source: path, Line: line + 1, Err: err}
	}
	if len(out.Mounts) == 0 {
		return out, nil
	}
	kept := make(map[int32]uint64, len(out.Mounts))
	for i, m := range out.Mounts {
		kept[int32(m.ID)] = keptMP[i]
	}
	for _, e := range edges {
		if mp, ok := kept[e.parent]; ok && e.parent != e.id && mp == e.mp {
			out.Covered[int(e.parent)] = true
		}
	}
	return out, nil
}

func devList(devs map[Dev]bool) string {
	s := ""
	for d := range devs {
		if s != "" {
			s += ", "
		}
		s += d.String()
	}
	return "device " + s
}
