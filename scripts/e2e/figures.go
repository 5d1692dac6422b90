package e2e

import (
	"fmt"
	"io"
	"math"
	"sort"
	"strings"
	"sync"
	"time"
)

// Figures collects what the scenarios measure, run after run, and prints
// them as a table: per scenario and figure the number of runs, p50, p99
// (nearest rank: with fewer than 100 runs, p99 is the worst run), min and
// max. A figure that did not happen in a run (a heal that never came) is
// recorded as a miss and counted apart.
type Figures struct {
	mu     sync.Mutex
	order  []string
	values map[string][]float64
	misses map[string]int
	units  map[string]string
}

// NewFigures returns an empty collection.
func NewFigures() *Figures {
	return &Figures{values: map[string][]float64{}, misses: map[string]int{}, units: map[string]string{}}
}

func (f *Figures) key(scenario, figure, unit string) string {
	k := scenario + "\x00" + figure
	if _, ok := f.units[k]; !ok {
		f.order = append(f.order, k)
		f.units[k] = unit
	}
	return k
}

// Duration records one run's duration of figure in scenario.
func (f *Figures) Duration(scenario, figure string, d time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	k := f.key(scenario, figure, "s")
	f.values[k] = append(f.values[k], d.Seconds())
}

// Value records one run's value of figure in scenario, in unit.
func (f *Figures) Value(scenario, figure, unit string, v float64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	k := f.key(scenario, figure, unit)
	f.values[k] = append(f.values[k], v)
}

// Miss records a run in which figure never happened (within its bound).
func (f *Figures) Miss(scenario, figure, unit string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.misses[f.key(scenario, figure, unit)]++
}

// Print writes the table in Markdown, between marker lines the bench
// script cuts it out by.
func (f *Figures) Print(w io.Writer) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.order) == 0 {
		return
	}
	fmt.Fprintln(w, "--- e2e figures ---")
	fmt.Fprintln(w, "| scenario | figure | runs | p50 | p99 | min | max | missed |")
	fmt.Fprintln(w, "|---|---|---|---|---|---|---|---|")
	for _, k := range f.order {
		scenario, figure, _ := strings.Cut(k, "\x00")
		vs := append([]float64(nil), f.values[k]...)
		sort.Float64s(vs)
		unit := f.units[k]
		cell := func(v float64) string { return format(v, unit) }
		if len(vs) == 0 {
			fmt.Fprintf(w, "| %s | %s | %d | - | - | - | - | %d |\n", scenario, figure, f.misses[k], f.misses[k])
			continue
		}
		fmt.Fprintf(w, "| %s | %s | %d | %s | %s | %s | %s | %d |\n", scenario, figure, len(vs)+f.misses[k],
			cell(Percentile(vs, 50)), cell(Percentile(vs, 99)), cell(vs[0]), cell(vs[len(vs)-1]), f.misses[k])
	}
	fmt.Fprintln(w, "--- end e2e figures ---")
}

// Percentile is the nearest-rank percentile p of sorted values.
func Percentile(sorted []float64, p float64) float64 {
	if len(sorted) == 0 {
		return math.NaN()
	}
	i := int(math.Ceil(p/100*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func format(v float64, unit string) string {
	switch unit {
	case "s":
		return fmt.Sprintf("%.2f s", v)
	case "MiB":
		return fmt.Sprintf("%.1f MiB", v)
	case "%":
		return fmt.Sprintf("%.2f %%", v)
	default:
		if v == math.Trunc(v) {
			return fmt.Sprintf("%.0f%s", v, unit)
		}
		return fmt.Sprintf("%.2f%s", v, unit)
	}
}
