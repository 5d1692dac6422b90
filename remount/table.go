package remount

import (
	"context"
	"path/filepath"
	"slices"
	"sync"

	"github.com/mountmedic/mountmedic/probe"
)

// hostTable is the kubelet mounts of our own mount table (probe's
// inventory of it, read at one moment), indexed by path: the mounts stacked
// on each path, bottom first, and the filesystems by device number.
type hostTable struct {
	stacks map[string][]*probe.Mount
	byDev  map[probe.Dev]*probe.Backend
}

// readHostTable reads <procDir>/thread-self/mountinfo (the calling thread's
// mount namespace: see inMountNamespace) and classifies it under root. It
// reads VFS data only: no mounted filesystem is asked.
func readHostTable(procDir, root string) (*hostTable, error) {
	inv, err := probe.ReadFile(filepath.Join(procDir, "thread-self", "mountinfo"), probe.Options{Root: root})
	if err != nil {
		return nil, err
	}
	return buildHostTable(inv), nil
}

// ownTable reports whether the shared reader t reads our own mount
// namespace's table, classified under root: only then are its mount IDs
// the ones our unmounts check.
func ownTable(t *probe.TableReader, procDir, root string) bool {
	if t == nil || filepath.Clean(t.Root()) != filepath.Clean(root) {
		return false
	}
	switch filepath.Clean(t.Path()) {
	case filepath.Join(procDir, "self", "mountinfo"), filepath.Join(procDir, "thread-self", "mountinfo"):
		return true
	}
	return false
}

// builtTable is the hostTable of the newest table read, built once for
// every repair that shares the read.
type builtTable struct {
	mu  sync.Mutex
	inv *probe.Inventory
	t   *hostTable
}

func (b *builtTable) of(inv *probe.Inventory) *hostTable {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.inv != inv {
		b.inv, b.t = inv, buildHostTable(inv)
	}
	return b.t
}

// hostTable reads our whole mount table: a read that began after the call,
// shared with the agent's loop and the repairs that ask at the same time
// (probe.TableReader).
func (r *Repairer) hostTable() (*hostTable, error) {
	inv, err := r.table.Read(context.Background())
	if err != nil {
		return nil, err
	}
	return r.built.of(inv), nil
}

func buildHostTable(inv *probe.Inventory) *hostTable {
	t := &hostTable{stacks: map[string][]*probe.Mount{}, byDev: map[probe.Dev]*probe.Backend{}}
	for _, b := range inv.Backends {
		t.byDev[b.Dev] = b
	}
	// A stack is a chain of mounts on one path, each the parent of the next.
	byID := make(map[int]*probe.Mount, len(inv.Mounts))
	atPath := map[string][]*probe.Mount{}
	for _, m := range inv.Mounts {
		byID[m.ID] = m
		atPath[m.Path] = append(atPath[m.Path], m)
	}
	for path, ms := range atPath {
		var bottom *probe.Mount
		for _, m := range ms {
			if p, ok := byID[m.ParentID]; !ok || p.Path != path || p.ID == m.ID {
				bottom = m
				break
			}
		}
		if bottom == nil { // a loop cannot happen; keep table order
			t.stacks[path] = ms
			continue
		}
		stack := []*probe.Mount{bottom}
		for len(stack) < len(ms) {
			i := slices.IndexFunc(ms, func(m *probe.Mount) bool { return m.ParentID == stack[len(stack)-1].ID && m != stack[len(stack)-1] })
			if i < 0 {
				break
			}
			stack = append(stack, ms[i])
		}
		t.stacks[path] = stack
	}
	return t
}

// fuse reports whether the filesystem dev is served by a FUSE daemon (fuse
// or fuseblk), whose connection can be aborted, while our table still holds
// a mount of it: connection numbers are reused once a connection ends.
func (t *hostTable) fuse(dev probe.Dev) bool {
	b := t.byDev[dev]
	return b != nil && len(b.Mounts) > 0 && isFUSEType(b.FSType)
}

// fuseMountOn returns the mount of the FUSE filesystem dev that is on top
// at one of paths (the volume's own places), by which AbortFUSE pins the
// connection; nil when there is none. dev comes from the caller's snapshot
// of the volume, and the kernel hands a device number out again as soon as
// its filesystem ends: by now dev may be another volume's filesystem,
// mounted at that volume's paths, whose busy connection an abort would cut
// (found in the e2e run: a hung volume's stale repair aborted the next
// volume's connection while its first pod wrote). Only a mount at the
// repaired volume's own paths is taken.
func (t *hostTable) fuseMountOn(dev probe.Dev, paths []string) *probe.Mount {
	if !t.fuse(dev) {
		return nil
	}
	for _, p := range paths {
		if top := t.top(p); top != nil && top.Dev == dev {
			return top
		}
	}
	return nil
}

// stack is the mounts on path, bottom first.
func (t *hostTable) stack(path string) []*probe.Mount { return t.stacks[filepath.Clean(path)] }

// top is the mount a lookup of path reaches, nil when path is no mount
// point.
func (t *hostTable) top(path string) *probe.Mount {
	s := t.stack(path)
	if len(s) == 0 {
		return nil
	}
	return s[len(s)-1]
}

// devSet is a set of device numbers: the dead filesystems of a volume.
type devSet map[probe.Dev]bool

func (d devSet) list() []probe.Dev {
	out := make([]probe.Dev, 0, len(d))
	for dev := range d {
		out = append(out, dev)
	}
	slices.SortFunc(out, func(a, b probe.Dev) int {
		if a.Major != b.Major {
			return int(a.Major) - int(b.Major)
		}
		return int(a.Minor) - int(b.Minor)
	})
	return out
}

// deadDevs are the device numbers of the volume's dead filesystem: its
// backend's and those of the pods' dead mounts. 0:0 (a publish target that
// lost its mount) is no filesystem.
func deadDevs(v *Volume) devSet {
	d := devSet{}
	add := func(dev probe.Dev) {
		if dev != (probe.Dev{}) {
			d[dev] = true
		}
	}
	if v.Backend != nil {
		add(v.Backend.Dev)
	}
	for _, p := range v.Pods {
		for _, m := range p.Dead {
			if m != nil {
				add(m.Dev)
			}
		}
	}
	return d
}

// deadTop returns the dead mounts on top of path, topmost first: the top
// and each one below it while they are on a dead device.
func (t *hostTable) deadTop(path string, dead devSet) []*probe.Mount {
	s := t.stack(path)
	var out []*probe.Mount
	for i := len(s) - 1; i >= 0 && dead[s[i].Dev]; i-- {
		out = append(out, s[i])
	}
	return out
}
