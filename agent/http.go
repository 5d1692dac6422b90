package agent

import (
	"fmt"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Handler serves /metrics, /healthz and /readyz.
func (a *Agent) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(a.metrics.reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		if err := a.healthy(time.Now()); err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		switch {
		case !a.synced():
			http.Error(w, "pod informer not synced", http.StatusServiceUnavailable)
		case !a.scanned.Load():
			http.Error(w, "first scan not done", http.StatusServiceUnavailable)
		default:
			fmt.Fprintln(w, "ok")
		}
	})
	return mux
}

// healthy fails when no probe cycle ended for a long while: the loop is
// wedged.
func (a *Agent) healthy(now time.Time) error {
	last := a.lastScan.Load()
	if last == 0 {
		return nil // starting
	}
	limit := max(time.Minute, 10*(a.cfg.ProbeInterval+a.cfg.ProbeTimeout))
	if age := now.Sub(time.Unix(0, last)); age > limit {
		return fmt.Errorf("no probe cycle for %s", age.Round(time.Second))
	}
	return nil
}
