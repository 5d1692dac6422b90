package agent

import (
	"runtime"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/mountmedic/mountmedic/probe"

	"github.com/mountmedic/mountmedic/probe/kubelet"

	"github.com/mountmedic/mountmedic/remount"
)

// Repair results, as mountmedic_repairs_total labels them.
const (
	resultSuccess           = "success"
	resultFailure           = "failure"
	resultDriverUnavailable = "driver_unavailable"
	// resultBackendUnavailable: the driver answered, the volume's
	// backend did not (remount.ErrBackendUnavailable).
	resultBackendUnavailable = "backend_unavailable"
	resultDryRun             = "dry_run"
)

// Eviction results, as mountmedic_evictions_total labels them.
const (
	evictEvicted      = "evicted"
	evictBlockedByPDB = "blocked_by_pdb"
	evictFailed       = "failed"
	evictNoController = "no_controller"
	evictDryRun       = "dry_run"
)

// metricTiers are the repairs_total tier label values.
var metricTiers = []remount.Tier{remount.TierRestage, remount.TierLiveSwap, remount.TierRestart, remount.TierEvict, remount.TierUnmount}

// metricKinds are the kubelet mount kinds, as probe names them.
var metricKinds = []kubelet.Kind{kubelet.KindPublish, kubelet.KindStaging, kubelet.KindSubPath, kubelet.KindBlock, kubelet.KindPluginVolume}

// metrics are the agent's collectors, in a private registry. No label names
// a pod, a path or a volume.
type metrics struct {
	reg *prometheus.Registry

	staleMounts   *prometheus.GaugeVec
	kubeletMounts *prometheus.GaugeVec
	tableMounts   prometheus.Gauge
	probes        *prometheus.CounterVec
	probeDuration prometheus.Histogram
	hungProbes    prometheus.Gauge
	repairs       *prometheus.CounterVec
	guards        *prometheus.CounterVec
	repairSeconds *prometheus.HistogramVec
	evictions     *prometheus.CounterVec
	lastScan      prometheus.Gauge
	scanDuration  prometheus.Histogram
	driverUp      *prometheus.GaugeVec
	buildInfo     *prometheus.GaugeVec

	// seen are the (driver, kind) pairs of stale_mounts kept at 0 once seen.
	seen map[[2]string]bool
}

// newMetrics registers the agent's collectors on reg (a new private
// registry when nil).
func newMetrics(version string, reg *prometheus.Registry) *metrics {
	if reg == nil {
		reg = prometheus.NewRegistry()
	}
	m := &metrics{
		reg: reg,
		staleMounts: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "mountmedic_stale_mounts",
			Help: "Kubelet volume mounts in a broken state, by CSI driver (or volume plugin), mount kind and state.",
		}, []string{"driver", "kind", "state"}),
		kubeletMounts: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "mountmedic_kubelet_mounts",
			Help: "Kubelet volume mounts in the mount table, by kind.",
		}, []string{"kind"}),
		tableMounts: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "mountmedic_mount_table_mounts",
			Help: "Mounts in the whole mount table.",
		}),
		probes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mountmedic_probes_total",
			Help: "Backend probes, by the state they found.",
		}, []string{"state"}),
		probeDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "mountmedic_probe_duration_seconds",
			Help:    "Time one backend probe took (probes past their deadline are not observed).",
			Buckets: []float64{0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5},
		}),
		hungProbes: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "mountmedic_hung_probes",
			Help: "Probes still blocked in a syscall past their deadline, each holding an OS thread.",
		}),
		repairs: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mountmedic_repairs_total",
			Help: "Repair attempts, by tier and result.",
		}, []string{"tier", "result"}),
		guards: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mountmedic_guards_total",
			Help: "Guards mounted over publish targets that lost their mount, by result.",
		}, []string{"result"}),
		repairSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "mountmedic_repair_duration_seconds",
			Help:    "Time one repair tier took.",
			Buckets: []float64{0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60},
		}, []string{"tier"}),
		evictions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "mountmedic_evictions_total",
			Help: "Pod evictions asked for, by result.",
		}, []string{"result"}),
		lastScan: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "mountmedic_last_scan_timestamp_seconds",
			Help: "Unix time the last probe cycle ended.",
		}),
		scanDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "mountmedic_scan_duration_seconds",
			Help:    "Time one probe cycle took: mount table read (when it changed) and every backend probed.",
			Buckets: []float64{0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10},
		}),
		driverUp: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "mountmedic_driver_up",
			Help: "1 when the CSI driver's node plugin answered, 0 when it is down, for drivers with volumes on this node.",
		}, []string{"driver"}),
		buildInfo: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "mountmedic_build_info",
			Help: "Always 1; labelled with the mountmedic version and the Go version it was built with.",
		}, []string{"version", "goversion"}),
		seen: make(map[[2]string]bool),
	}
	m.reg.MustRegister(m.staleMounts, m.kubeletMounts, m.tableMounts, m.probes, m.probeDuration, m.hungProbes,
		m.repairs, m.guards, m.repairSeconds, m.evictions, m.lastScan, m.scanDuration, m.driverUp, m.buildInfo,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))

	m.buildInfo.WithLabelValues(version, runtime.Version()).Set(1)
	for _, s := range probe.States() {
		m.probes.WithLabelValues(s.String())
	}
	for _, k := range metricKinds {
		m.kubeletMounts.WithLabelValues(k.String())
	}
	for _, t := range metricTiers {
		m.repairSeconds.WithLabelValues(t.String())
		for _, r := range []string{resultSuccess, resultFailure, resultDriverUnavailable, resultDryRun} {
			m.repairs.WithLabelValues(t.String(), r)
		}
	}
	for _, r := range []string{evictEvicted, evictBlockedByPDB, evictFailed, evictNoController, evictDryRun} {
		m.evictions.WithLabelValues(r)
	}
	return m
}

// driverLabel is the driver label of a mount: its CSI driver, else its
// volume plugin, else "unknown".
func driverLabel(m *probe.Mount) string {
	switch {
	case m.Driver != "":
		return m.Driver
	case m.Target.Plugin != "" && m.Target.Plugin != kubelet.CSIPluginDir:
		return m.Target.Plugin
	}
	return "unknown"
}

// observeScan records one probe cycle.
func (m *metrics) observeScan(inv *probe.Inventory, rep *probe.Report, took time.Duration, end time.Time) {
	m.tableMounts.Set(float64(inv.Total))
	kinds := make(map[string]int)
	for _, mt := range inv.Mounts {
		kinds[mt.Target.Kind.String()]++
	}
	for _, k := range metricKinds {
		m.kubeletMounts.WithLabelValues(k.String()).Set(float64(kinds[k.String()]))
	}

	for _, r := range rep.Backends {
		m.probes.WithLabelValues(r.State.String()).Inc()
		if r.State != probe.Hung && r.State != probe.Unknown && r.Took > 0 {
			m.probeDuration.Observe(r.Took.Seconds())
		}
	}
	m.hungProbes.Set(float64(rep.InFlight - rep.Pending))

	counts := make(map[[3]string]int)
	for _, r := range rep.Mounts {
		pair := [2]string{driverLabel(r.Mount), r.Mount.Target.Kind.String()}
		if !m.seen[pair] {
			m.seen[pair] = true
		}
		if r.State.Broken() {
			counts[[3]string{pair[0], pair[1], r.State.String()}]++
		}
	}
	for pair := range m.seen {
		for _, s := range probe.States() {
			if !s.Broken() {
				continue
			}
			m.staleMounts.WithLabelValues(pair[0], pair[1], s.String()).Set(float64(counts[[3]string{pair[0], pair[1], s.String()}]))
		}
	}
	m.scanDuration.Observe(took.Seconds())
	m.lastScan.Set(float64(end.UnixNano()) / 1e9)
}

func (m *metrics) repair(tier remount.Tier, result string, took time.Duration) {
	m.repairs.WithLabelValues(tier.String(), result).Inc()
	if result != resultDryRun {
		m.repairSeconds.WithLabelValues(tier.String()).Observe(took.Seconds())
	}
}

func (m *metrics) setDriverUp(driver string, up bool) {
	v := 0.0
	if up {
		v = 1
	}
	m.driverUp.WithLabelValues(driver).Set(v)
}
