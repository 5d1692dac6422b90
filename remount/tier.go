package remount

import (
	"fmt"
	"strconv"
	"strings"
)

// Tier is a rung of the repair ladder, or one of the repairs beside it: the
// one name of a repair from the --tiers flag through the ladder, events and
// logs to the repairs_total metric label. Ladder order, least disruptive
// first. Reattach, Restage, LiveSwap, Restart and Unmount run here
// (Repairer); Evict, Delete and ForceDelete are the agent's: they need the
// API server.
type Tier int

const (
	// TierReattach gives an NBD volume's kept /dev/nbdN a fresh daemon
	// through the driver (ceph-csi's healer NodeStageVolume), so device,
	// mounts and containers' binds stay; for NBD volumes of drivers that
	// can do it (Repairer.Reattach).
	TierReattach Tier = iota
	// TierRestage aborts a hung FUSE connection, lazily unmounts the dead
	// subPath binds, publish targets and staging mount, and sends
	// NodeStageVolume and NodePublishVolume through the driver's socket.
	// With HostToContainer propagation it reaches running containers.
	TierRestage
	// TierLiveSwap puts the fresh mount (or its subPath directory) into each
	// running container's mount namespace in place of the dead one.
	TierLiveSwap
	// TierRestart stops the pod's containers through the CRI so kubelet
	// starts them again on the fresh mount (dead subPath binds unmounted
	// first so kubelet binds them again).
	TierRestart
	// TierEvict evicts the pod through the Eviction API (PodDisruptionBudgets
	// respected), only when a controller of an allowed kind owns it: the
	// last rung.
	TierEvict
	// TierUnmount is no rung: it lazily unmounts the dead mounts of pods
	// being deleted, so that kubelet can finish tearing them down.
	TierUnmount
	// TierDelete (opt-in) deletes the pod with a UID precondition when
	// eviction is off or failed for another reason than a budget.
	TierDelete
	// TierForceDelete (opt-in) deletes a pod stuck terminating on a dead
	// mount with grace period 0.
	TierForceDelete

	numTiers = iota
)

var tierNames = [numTiers]string{"reattach", "restage", "liveswap", "restart", "evict", "unmount", "delete", "force-delete"}

// String is the tier's name, as --tiers takes it and metrics label it.
func (t Tier) String() string {
	if t >= 0 && int(t) < numTiers {
		return tierNames[t]
	}
	return "tier(" + strconv.Itoa(int(t)) + ")"
}

// AllTiers lists every tier, in ladder order.
func AllTiers() []Tier {
	out := make([]Tier, numTiers)
	for i := range out {
		out[i] = Tier(i)
	}
	return out
}

// parseTier reads a tier from its name.
func parseTier(name string) (Tier, error) {
	for i, n := range tierNames {
		if n == name {
			return Tier(i), nil
		}
	}
	return 0, fmt.Errorf("unknown tier %q: use %s", name, strings.Join(tierNames[:], ", "))
}

// TierSet is a set of tiers: those enabled.
type TierSet uint32

// NewTierSet is the set of ts.
func NewTierSet(ts ...Tier) TierSet {
	var s TierSet
	for _, t := range ts {
		s |= 1 << uint(t)
	}
	return s
}

// ParseTierSet reads a set from tier names (--tiers); empty names are
// skipped.
func ParseTierSet(names []string) (TierSet, error) {
	var s TierSet
	for _, n := range names {
		n = strings.TrimSpace(n)
		if n == "" {
			continue
		}
		t, err := parseTier(n)
		if err != nil {
			return 0, err
		}
		s |= NewTierSet(t)
	}
	return s, nil
}

// Has reports whether t is in the set.
func (s TierSet) Has(t Tier) bool { return t >= 0 && int(t) < numTiers && s&(1<<uint(t)) != 0 }

// With is the set with t added (on) or removed.
func (s TierSet) With(t Tier, on bool) TierSet {
	if on {
		return s | NewTierSet(t)
	}
	return s &^ NewTierSet(t)
}

// Tiers lists the set's tiers in ladder order.
func (s TierSet) Tiers() []Tier {
	var out []Tier
	for _, t := range AllTiers() {
		if s.Has(t) {
			out = append(out, t)
		}
	}
	return out
}

// Names lists the set's tier names in ladder order.
func (s TierSet) Names() []string {
	var out []string
	for _, t := range s.Tiers() {
		out = append(out, t.String())
	}
	return out
}
