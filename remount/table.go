package remount

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/moby/sys/mountinfo"
	"github.com/mountmedic/mountmedic/probe"
)

// hostMount is one mount of our own mount table below the kubelet root.
type hostMount struct {
	ID, Parent int
	Dev        probe.Dev
	Root       string
	Path       string
	FSType     string
	Optional   string
	Target     probe.Target
}

func (m *hostMount) fuse() bool {
	base, _, _ := strings.Cut(m.FSType, ".")
	return base == "fuse" || base == "fuseblk"
}

// hostTable is the part of our mount table below the kubelet root, read at
// one moment: mounts stacked on each path (bottom first) and by device.
type hostTable struct {
	stacks map[string][]*hostMount
	byDev  map[probe.Dev][]*hostMount
}

// readHostTable reads <procDir>/self/mountinfo and keeps the mounts strictly
// below root. It reads VFS data only: no mounted filesystem is asked.
func readHostTable(procDir, root string) (*hostTable, error) {
	p := filepath.Join(procDir, "thread-self", "mountinfo")
	data, err := os.ReadFile(p)
	if err != nil {
		return nil, fmt.Errorf("read mount table: %w", err)
	}
	infos, err := mountinfo.GetMountsFromReader(bytes.NewReader(data), func(in *mountinfo.Info) (skip, stop bool) {
		return !probe.Under(root, in.Mountpoint), false
	})
	if err != nil {
		return nil, fmt.Errorf("parse %s: %w", p, err)
	}
	return buildHostTable(root, infos), nil
}

func buildHostTable(root string, infos []*mountinfo.Info) *hostTable {
	t := &hostTable{stacks: map[string][]*hostMount{}, byDev: map[probe.Dev][]*hostMount{}}
	byID := make(map[int]*hostMount, len(infos))
	var order []*hostMount
	for _, in := range infos {
		m := &hostMount{ID: in.ID, Parent: in.Parent, Dev: probe.Dev{Major: uint32(in.Major), Minor: uint32(in.Minor)},
			Root: in.Root, Path: in.Mountpoint, FSType: in.FSType, Optional: in.Optional}
		m.Target, _ = probe.Classify(root, in.Mountpoint)
		byID[m.ID] = m
		order = append(order, m)
		t.byDev[m.Dev] = append(t.byDev[m.Dev], m)
	}
	// A stack is a chain of mounts on one path, each the parent of the next.
	atPath := map[string][]*hostMount{}
	for _, m := range order {
		atPath[m.Path] = append(atPath[m.Path], m)
	}
	for path, ms := range atPath {
		var bottom *hostMount
		for _, m := range ms {
			if p, ok := byID[m.Parent]; !ok || p.Path != path || p.ID == m.ID {
				bottom = m
				break
			}
		}
		if bottom == nil { // a loop cannot happen; keep table order
			t.stacks[path] = ms
			continue
		}
		stack := []*hostMount{bottom}
		for len(stack) < len(ms) {
			i := slices.IndexFunc(ms, func(m *hostMount) bool { return m.Parent == stack[len(stack)-1].ID && m != stack[len(stack)-1] })
			if i < 0 {
				break
			}
			stack = append(stack, ms[i])
		}
		t.stacks[path] = stack
	}
	return t
}

// stack is the mounts on path, bottom first.
func (t *hostTable) stack(path string) []*hostMount { return t.stacks[filepath.Clean(path)] }

// top is the mount a lookup of path reaches, nil when path is no mount
// point.
func (t *hostTable) top(path string) *hostMount {
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
func (t *hostTable) deadTop(path string, dead devSet) []*hostMount {
	s := t.stack(path)
	var out []*hostMount
	for i := len(s) - 1; i >= 0 && dead[s[i].Dev]; i-- {
		out = append(out, s[i])
	}
	return out
}
