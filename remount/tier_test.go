package remount

import (
	"slices"
	"strings"
	"testing"
)

// The names are the --tiers flag's words and the repairs_total metric's
// label values (dashboards and alerts query them): they must not change.
func TestTierNames(t *testing.T) {
	want := []string{"reattach", "restage", "liveswap", "restart", "evict", "unmount", "delete", "force-delete"}
	if got := NewTierSet(AllTiers()...).Names(); !slices.Equal(got, want) {
		t.Fatalf("every tier's name = %v, want %v", got, want)
	}
	for _, tier := range AllTiers() {
		got, err := parseTier(tier.String())
		if err != nil || got != tier {
			t.Errorf("parseTier(%q) = %v, %v; want %v", tier, got, err, tier)
		}
	}
	if s := Tier(numTiers).String(); s != "tier(8)" {
		t.Errorf("Tier(8).String() = %q, want tier(8)", s)
	}
}

func TestParseTierSet(t *testing.T) {
	for name, tc := range map[string]struct {
		in      []string
		want    []Tier
		badName string
	}{
		"ladder order whatever the input": {in: []string{"evict", " restage", "liveswap"}, want: []Tier{TierRestage, TierLiveSwap, TierEvict}},
		"empty words skipped":             {in: []string{"", "unmount", ""}, want: []Tier{TierUnmount}},
		"none":                            {in: nil},
		"typo named":                      {in: []string{"restage", "evcit"}, badName: `"evcit"`},
	} {
		t.Run(name, func(t *testing.T) {
			got, err := ParseTierSet(tc.in)
			if tc.badName != "" {
				if err == nil || !strings.Contains(err.Error(), tc.badName) || !strings.Contains(err.Error(), "force-delete") {
					t.Fatalf("ParseTierSet(%q) error = %v, want it to name %s and the valid tiers", tc.in, err, tc.badName)
				}
				return
			}
			if err != nil {
				t.Fatalf("ParseTierSet(%q): %v", tc.in, err)
			}
			if !slices.Equal(got.Tiers(), tc.want) {
				t.Errorf("ParseTierSet(%q) = %v, want %v", tc.in, got.Tiers(), tc.want)
			}
			for _, tier := range AllTiers() {
				if got.Has(tier) != slices.Contains(tc.want, tier) {
					t.Errorf("ParseTierSet(%q).Has(%s) = %v", tc.in, tier, got.Has(tier))
				}
			}
		})
	}
	s := NewTierSet(TierRestage).With(TierEvict, true).With(TierRestage, false)
	if !slices.Equal(s.Tiers(), []Tier{TierEvict}) {
		t.Errorf("With: %v, want [evict]", s.Tiers())
	}
}
