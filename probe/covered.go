package probe

import "github.com/moby/sys/mountinfo"

// CoveredIDs returns the IDs of the mounts of a parsed mount table that
// another mount sits on, on the same mount point: a lookup of the path
// reaches the one above. It reads the table only; for any table, the
// host's or a container's.
func CoveredIDs(infos []*mountinfo.Info) map[int]bool {
	pathOf := make(map[int]string, len(infos))
	for _, in := range infos {
		pathOf[in.ID] = in.Mountpoint
	}
	covered := make(map[int]bool)
	for _, in := range infos {
		if p, ok := pathOf[in.Parent]; ok && p == in.Mountpoint && in.Parent != in.ID {
			covered[in.Parent] = true
		}
	}
	return covered
}
