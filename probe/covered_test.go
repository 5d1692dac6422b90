package probe

import (
	"maps"
	"slices"
	"testing"

	"github.com/moby/sys/mountinfo"
)

func TestCoveredIDs(t *testing.T) {
	infos := []*mountinfo.Info{
		{ID: 1, Parent: 0, Mountpoint: "/"},
		{ID: 2, Parent: 1, Mountpoint: "/a"},
		{ID: 3, Parent: 2, Mountpoint: "/a"},   // covers 2
		{ID: 4, Parent: 3, Mountpoint: "/a"},   // covers 3
		{ID: 5, Parent: 4, Mountpoint: "/a/b"}, // below, covers nothing
		{ID: 6, Parent: 6, Mountpoint: "/c"},   // its own parent (a namespace root)
		{ID: 7, Parent: 99, Mountpoint: "/d"},  // parent outside the table
	}
	got := slices.Sorted(maps.Keys(CoveredIDs(infos)))
	if want := []int{2, 3}; !slices.Equal(got, want) {
		t.Errorf("CoveredIDs = %v, want %v", got, want)
	}
}
