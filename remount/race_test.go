//go:build race

package remount

// raceEnabled: the race detector's shadow memory makes RSS figures its own.
const raceEnabled = true
