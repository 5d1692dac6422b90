package probe

import (
	"fmt"
	"os"

	"github.com/moby/sys/mountinfo"
)

// SuperOptionsChanged reads the mount table at path again and reports
// whether the super options of one of inv's block-backed filesystems differ
// from those inv holds. A shutdown (ext4, xfs) or an aborted journal
// (emergency_ro) shows only there, and no mount table notification
// (POLLPRI) says super options changed: a caller that keeps an inventory
// between reads calls this each cycle and reads the whole table again when
// it reports a change. It touches nothing but the table (no vol_data.json,
// sysfs or pods directory, as a Live read does) and changes nothing in inv,
// whose backends a probe past its deadline may still be reading.
//
// With no block-backed filesystem in inv it reads nothing. A backend gone
// from the table is not a change here: an unmount wakes POLLPRI.
func SuperOptionsChanged(path string, inv *Inventory) (bool, error) {
	var want map[Dev]string
	for _, b := range inv.Backends {
		if b.Kind != BackendBlock {
			continue
		}
		if want == nil {
			want = make(map[Dev]string)
		}
		want[b.Dev] = b.SuperOptions
	}
	if want == nil {
		return false, nil
	}
	f, err := os.Open(path)
	if err != nil {
		return false, fmt.Errorf("read mount table: %w", err)
	}
	defer f.Close()
	changed := false
	_, err = mountinfo.GetMountsFromReader(f, func(in *mountinfo.Info) (skip, stop bool) {
		if in.Major < 0 || in.Minor < 0 {
			return true, false
		}
		if opts, ok := want[Dev{uint32(in.Major), uint32(in.Minor)}]; ok && in.VFSOptions != opts {
			changed = true
			return true, true
		}
		return true, false
	})
	if err != nil {
		return false, &TableError{Source: path, Err: err}
	}
	return changed, nil
}
