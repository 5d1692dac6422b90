//go:build !race

package remount

const raceEnabled = false
