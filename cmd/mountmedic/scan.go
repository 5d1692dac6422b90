package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"github.com/spf13/cobra"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/mountmedic/mountmedic/agent"
	"github.com/mountmedic/mountmedic/probe"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

type scanFlags struct {
	capture   string // --mountinfo: an offline capture
	hostTable string // --host-table: the live table to read and probe
	output    string
	maxSize   string // --max-table-size, a quantity such as 32Mi
	opts      probe.Options
	cfg       probe.Config
}

func newScanCommand() *cobra.Command {
	f := scanFlags{cfg: probe.DefaultConfig()}
	cmd := &cobra.Command{
		Use:   "scan",
		Short: "List kubelet volume mounts and their health, once (dry-run, needs no cluster)",
		Long: `scan reads a mount table, finds kubelet's volume mounts under the kubelet root,
links subPath binds, publish targets and staging mounts to the filesystem that
serves them, and reports the health of each.

With the live table (default) it probes each backend once with statfs and
statx(AT_STATX_FORCE_SYNC), bounded by --timeout: a hung mount is reported as
Hung, never waited for. With --mountinfo FILE it analyses a captured table
(cat /proc/self/mountinfo > FILE) offline and touches no path: states then come
from the table alone (shutdown, emergency_ro, deleted subPath roots), the rest
is Unknown.

Only a regular file (or a procfs table) is read, at most --max-table-size
bytes of it: a FIFO, a device or a directory is refused. Text from the table
is escaped in every output format (\012 for a newline in a path, \033 for
ESC, \u202e for a bidi override), so that a hostile path can neither forge a
row nor drive the terminal.

Exit status: 0 nothing broken, 1 the scan failed, 2 at least one mount is
broken, 130 or 143 stopped by SIGINT or SIGTERM.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runScan(cmd, f)
		},
	}
	fl := cmd.Flags()
	fl.StringVar(&f.capture, "mountinfo", "", "analyse this captured mountinfo file offline instead of probing this host")
	fl.StringVar(&f.hostTable, "host-table", "/proc/self/mountinfo", "live mount table to read and probe (/proc/1/mountinfo with hostPID)")
	fl.StringVarP(&f.output, "output", "o", "table", "output format: table, wide or json")
	fl.StringVar(&f.opts.Root, "kubelet-root", probe.DefaultKubeletRoot, "kubelet root directory (kubelet --root-dir)")
	fl.StringVar(&f.maxSize, "max-table-size", resource.NewQuantity(probe.DefaultMaxTableSize, resource.BinarySI).String(),
		"read at most this much of a mount table (a quantity: 32Mi, 200M)")
	fl.DurationVar(&f.cfg.Timeout, "timeout", f.cfg.Timeout, "deadline of each probe; past it a mount is Hung")
	fl.IntVar(&f.cfg.Parallel, "parallel", f.cfg.Parallel, "probes run at once")
	fl.BoolVar(&f.cfg.ReadDevice, "read-device", f.cfg.ReadDevice, "read one block (O_DIRECT) of block-backed volumes' devices")
	return cmd
}

func runScan(cmd *cobra.Command, f scanFlags) error {
	switch f.output {
	case "table", "wide", "json":
	default:
		return fmt.Errorf("unknown --output %q: use table, wide or json", f.output)
	}
	if f.cfg.Timeout <= 0 {
		return fmt.Errorf("--timeout %s: must be positive", f.cfg.Timeout)
	}
	if f.cfg.Parallel <= 0 {
		return fmt.Errorf("--parallel %d: must be at least 1", f.cfg.Parallel)
	}
	if err := probe.CheckKubeletRoot(f.opts.Root, f.capture == ""); err != nil {
		return fmt.Errorf("--kubelet-root: %w", err)
	}
	q, err := resource.ParseQuantity(f.maxSize)
	if err != nil || q.Value() <= 0 {
		return fmt.Errorf("--max-table-size %q: give a positive size such as 32Mi or 200M", f.maxSize)
	}
	f.opts.MaxSize = q.Value()
	if f.capture != "" && cmd.Flags().Changed("host-table") {
		return fmt.Errorf("--mountinfo and --host-table both given: use one")
	}
	inv, rep, err := scanTable(cmd.Context(), f)
	if err != nil {
		if errors.Is(err, probe.ErrTableTooLarge) {
			return fmt.Errorf("%w: raise --max-table-size if the table is real", err)
		}
		return err
	}
	// A root the user named must exist; kubelet's default missing is a
	// host without kubelet, told plainly below.
	if err := checkRootFound(inv, f.capture == "" && cmd.Flags().Changed("kubelet-root")); err != nil {
		return err
	}
	out := cmd.OutOrStdout()
	if f.output == "json" {
		err = writeJSON(out, inv, rep, f.capture != "")
	} else {
		err = writeTable(out, inv, rep, f.output == "wide", f.capture != "")
	}
	if err != nil {
		return err
	}
	if len(rep.Broken()) > 0 {
		return exitCodeError{exitBroken}
	}
	return nil
}

// checkRootFound fails a scan that checked nothing because it looked in
// the wrong place: a live kubelet root given that does not exist on this host,
// or a table with no mount under the root but pod volume mounts under
// another directory (kubelet run with another --root-dir: /data/kubelet,
// microk8s', k0s', RKE's). Its error names the flag and what to give it.
func checkRootFound(inv *probe.Inventory, live bool) error {
	hint := ""
	if len(inv.OtherRoots) > 0 {
		hint = fmt.Sprintf("; %s has kubelet pod volume mounts under %s: give --kubelet-root %s",
			printable(inv.Source), printable(strings.Join(inv.OtherRoots, ", ")), printable(inv.OtherRoots[0]))
	}
	if live {
		if _, err := os.Stat(inv.Root); errors.Is(err, fs.ErrNotExist) {
			if hint == "" {
				hint = ": give kubelet's --root-dir"
			}
			return fmt.Errorf("--kubelet-root %s does not exist on this host%s", printable(inv.Root), hint)
		}
	}
	if len(inv.Mounts) == 0 && len(inv.Unmounted) == 0 && hint != "" {
		return fmt.Errorf("no kubelet volume mounts under --kubelet-root %s%s", printable(inv.Root), hint)
	}
	return nil
}

// scanTable reads the table and probes it (or assesses a capture) on its
// own goroutine, and returns as soon as ctx ends: a read from a slow file or
// a probe of a hung mount can block in the kernel beyond any cancellation,
// and must not keep scan from exiting on SIGINT or SIGTERM.
func scanTable(ctx context.Context, f scanFlags) (*probe.Inventory, *probe.Report, error) {
	type result struct {
		inv *probe.Inventory
		rep *probe.Report
		err error
	}
	done := make(chan result, 1)
	go func() {
		var r result
		if f.capture != "" {
			if r.inv, r.err = probe.ReadTable(ctx, f.capture, f.opts); r.err == nil {
				r.rep = probe.Assess(r.inv)
			}
		} else {
			f.opts.Live = true
			f.opts.DriverStages = askDriverStages(ctx, f.opts.Root)
			if r.inv, r.err = probe.ReadTable(ctx, f.hostTable, f.opts); r.err == nil {
				r.rep = probe.NewProber(f.cfg).Probe(ctx, r.inv)
			}
		}
		done <- r
	}()
	select {
	case r := <-done:
		if ctx.Err() != nil {
			// Cut short: the report may hold probes the context ended.
			return nil, nil, context.Cause(ctx)
		}
		return r.inv, r.rep, r.err
	case <-ctx.Done():
		return nil, nil, context.Cause(ctx)
	}
}

// askDriverStages asks a CSI driver, through its socket under the kubelet
// root, whether it stages volumes (NodeGetCapabilities), once per driver and
// for at most driverAskTimeout: a driver that does not answer is not known.
func askDriverStages(ctx context.Context, root string) func(string) (bool, bool) {
	if root == "" {
		root = probe.DefaultKubeletRoot
	}
	caps := agent.DialDriverCaps(root)
	type answer struct{ stages, known bool }
	asked := make(map[string]answer)
	return func(driver string) (bool, bool) {
		if a, ok := asked[driver]; ok {
			return a.stages, a.known
		}
		cctx, cancel := context.WithTimeout(ctx, driverAskTimeout)
		defer cancel()
		c, err := caps(cctx, driver)
		a := answer{stages: c.StageUnstage, known: err == nil}
		asked[driver] = a
		return a.stages, a.known
	}
}

// driverAskTimeout bounds scan's NodeGetCapabilities call to each driver.
const driverAskTimeout = 2 * time.Second

// scanRow is one mount in scan's JSON output.
type scanRow struct {
	Path         string         `json:"path"`
	Target       kubelet.Target `json:"target"`
	Driver       string         `json:"driver,omitempty"`
	VolumeHandle string         `json:"volumeHandle,omitempty"`
	From         string         `json:"from,omitempty"`
	Dev          string         `json:"dev,omitempty"`
	Root         string         `json:"root,omitempty"`
	FSType       string         `json:"fsType,omitempty"`
	Backend      string         `json:"backend,omitempty"`
	// Source is this mount's own source: mounts of one NFSv4 superblock
	// show each its export.
	Source string `json:"source,omitempty"`
	// Daemon is where the daemon serving the volume lives, from the
	// driver catalogue (docs/drivers.md); omitted when not catalogued.
	Daemon       string      `json:"daemon,omitempty"`
	State        probe.State `json:"state"`
	Error        string      `json:"error,omitempty"`
	ProbeSeconds float64     `json:"probeSeconds"`
}

type scanDoc struct {
	Source      string `json:"source"`
	KubeletRoot string `json:"kubeletRoot"`
	Offline     bool   `json:"offline"`
	TableMounts int    `json:"tableMounts"`
	Backends    int    `json:"backends"`
	Broken      int    `json:"broken"`
	// Strays are mount points in staging directories that no driver's
	// layout puts there: left alone.
	Strays []probe.Stray `json:"strays,omitempty"`
	// StagingUnknown are the drivers, not in the catalogue, that did not
	// say whether they stage: a lost staging mount of theirs is not
	// reported.
	StagingUnknown []string  `json:"stagingUnknown,omitempty"`
	Mounts         []scanRow `json:"mounts"` // written one at a time by writeJSON
}

// rowMaker makes scan rows, describing each backend once: a thousand
// mounts of one filesystem share its text.
type rowMaker struct {
	backends map[*probe.Backend][2]string // description, device
}

func (rm *rowMaker) row(r probe.Result) scanRow {
	m := r.Mount
	row := scanRow{Path: m.Path, Target: m.Target, Driver: m.Driver, VolumeHandle: m.VolumeHandle,
		Root: m.Root, FSType: m.FSType, Source: m.Source, State: r.State, ProbeSeconds: r.Took.Seconds()}
	if d := m.Daemon(); d != kubelet.DaemonUnknown {
		row.Daemon = d.String()
	}
	if m.From != nil {
		row.From = m.From.Path
	}
	if b := m.Backend; b != nil {
		if rm.backends == nil {
			rm.backends = make(map[*probe.Backend][2]string)
		}
		text, ok := rm.backends[b]
		if !ok {
			text = [2]string{describeBackend(b), b.Dev.String()}
			rm.backends[b] = text
		}
		row.Backend = text[0]
		if (b.Kind == probe.BackendNetwork || b.Kind == probe.BackendOther) && m.Source != b.Source {
			// One superblock, many exports (NFSv4): each mount its own.
			row.Backend = b.FSType + " " + m.Source
		}
		if m.Dev == b.Dev {
			row.Dev = text[1]
		} else {
			row.Dev = m.Dev.String()
		}
	}
	if r.Err != nil {
		row.Error = r.Err.Error()
	}
	return row
}

// writeJSON writes the scanDoc of the report, as encoding/json would
// indent it, one mount at a time: a table of a hundred thousand mounts is
// never held twice in memory.
func writeJSON(w io.Writer, inv *probe.Inventory, rep *probe.Report, offline bool) error {
	head := scanDoc{Source: inv.Source, KubeletRoot: inv.Root, Offline: offline, TableMounts: inv.Total,
		Backends: len(inv.Backends), Broken: len(rep.Broken()), Strays: inv.Strays, StagingUnknown: inv.StagingUnknown}
	data, err := json.MarshalIndent(head, "", "  ")
	if err != nil {
		return err
	}
	// Everything but the empty mounts list and the closing brace.
	data = bytes.TrimSuffix(data, []byte("\n  \"mounts\": null\n}"))
	bw := bufio.NewWriterSize(w, 64<<10)
	bw.Write(jsonSafe(data))
	if len(rep.Mounts) == 0 {
		bw.WriteString("\n  \"mounts\": []\n}\n")
		return bw.Flush()
	}
	bw.WriteString("\n  \"mounts\": [\n")
	var (
		row bytes.Buffer // one encoder and buffer for every row
		rm  rowMaker
	)
	enc := json.NewEncoder(&row)
	enc.SetIndent("    ", "  ")
	order := treeOrder(inv, rep)
	for i, k := range order {
		row.Reset()
		if err := enc.Encode(rm.row(rep.Mounts[k])); err != nil {
			return err
		}
		bw.WriteString("    ")
		bw.Write(jsonSafe(bytes.TrimSuffix(row.Bytes(), []byte("\n"))))
		if i < len(rep.Mounts)-1 {
			bw.WriteByte(',')
		}
		bw.WriteByte('\n')
	}
	bw.WriteString("  ]\n}\n")
	return bw.Flush()
}

// describeBackend says what serves a mount: "fuse conn 45", "ext4 on loop0
// <- /img (fuse conn 44)".
func describeBackend(b *probe.Backend) string {
	var s string
	switch b.Kind {
	case probe.BackendFUSE:
		s = fmt.Sprintf("%s conn %d", b.FSType, b.Conn)
	case probe.BackendBlock:
		s = b.FSType
		if b.Device != "" {
			s += " on " + b.Device
		} else {
			s += " on " + b.Source
		}
		if b.Backing != "" {
			s += " <- " + b.Backing
		}
		if b.Lower != nil {
			s += fmt.Sprintf(" (%s)", describeBackend(b.Lower))
		}
		if b.DaemonPID != 0 {
			s += fmt.Sprintf(" (daemon pid %d)", b.DaemonPID)
		}
	default:
		s = b.FSType + " " + b.Source
	}
	return s
}

// writeTable writes the report as an aligned table: a header, one row per
// mount, then a summary. Columns are as wide as their widest cell plus two
// spaces (text/tabwriter's layout), measured in a first pass over the
// report, so that no row is held in memory: a table of a hundred thousand
// mounts costs what its report costs.
func writeTable(w io.Writer, inv *probe.Inventory, rep *probe.Report, wide, offline bool) error {
	broken := len(rep.Broken())
	if len(rep.Mounts) == 0 {
		_, err := fmt.Fprintf(w, "no kubelet volume mounts under %s in %s (%d mounts read): nothing to check\n",
			printable(inv.Root), printable(inv.Source), inv.Total)
		if err == nil {
			err = writeStrays(w, inv)
		}
		return err
	}
	header := []string{"STATE", "KIND", "POD", "VOLUME", "DRIVER", "DAEMON", "BACKEND", "DEV", "PROBE", "ERROR"}
	if wide {
		header = append(header, "PATH", "FROM")
	}
	widths := make([]int, len(header))
	measure := func(cells []string) {
		for i, c := range cells {
			widths[i] = max(widths[i], utf8.RuneCountInString(c))
		}
	}
	measure(header)
	cells := make([]string, 0, len(header))
	var rm rowMaker
	order := treeOrder(inv, rep)
	for _, k := range order {
		cells = rm.tableCells(cells[:0], rep.Mounts[k], wide, offline)
		measure(cells)
	}
	bw := bufio.NewWriterSize(w, 64<<10)
	writeRow := func(cells []string) {
		for i, c := range cells {
			bw.WriteString(c)
			if i < len(cells)-1 {
				for pad := widths[i] - utf8.RuneCountInString(c) + 2; pad > 0; pad-- {
					bw.WriteByte(' ')
				}
			}
		}
		bw.WriteByte('\n')
	}
	writeRow(header)
	for _, k := range order {
		cells = rm.tableCells(cells[:0], rep.Mounts[k], wide, offline)
		writeRow(cells)
	}
	mode := "probed"
	if offline {
		mode = "offline: states from the table only, no path touched"
	}
	fmt.Fprintf(bw, "\n%d kubelet mounts on %d backends under %s, %d mounts in %s (%s); %d broken\n",
		len(rep.Mounts), len(inv.Backends), printable(inv.Root), inv.Total, printable(inv.Source), mode, broken)
	if err := writeStrays(bw, inv); err != nil {
		return err
	}
	writeStagingNotes(bw, inv, offline)
	return bw.Flush()
}

// writeStagingNotes says where scan cannot know whether a staging mount is
// gone: a driver not in the catalogue that did not say whether it stages
// (live), and every publish target with no staging mount in a captured
// table, which holds neither kubelet's globalmount directories nor the
// drivers' capabilities.
func writeStagingNotes(w io.Writer, inv *probe.Inventory, offline bool) {
	if len(inv.StagingUnknown) > 0 {
		fmt.Fprintf(w, "not known whether a staging mount is gone: CSI drivers %s are not in the catalogue and did not answer NodeGetCapabilities, so a bare globalmount of theirs is not reported\n",
			printable(strings.Join(inv.StagingUnknown, ", ")))
	}
	if !offline {
		return
	}
	n := 0
	for _, m := range inv.Mounts {
		if m.Target.Kind == kubelet.KindPublish && m.From == nil {
			n++
		}
	}
	if n > 0 {
		fmt.Fprintf(w, "not known whether a staging mount is gone: %d publish targets have no staging mount in the table, and a captured table holds neither kubelet's globalmount directories nor the drivers' capabilities; run scan live on the node\n", n)
	}
}

// writeStrays names the mount points in staging directories that no
// driver's layout puts there, which scan and the agent leave alone.
func writeStrays(w io.Writer, inv *probe.Inventory) error {
	if len(inv.Strays) == 0 {
		return nil
	}
	if _, err := fmt.Fprintf(w, "%d mounts in staging directories are not staging mounts, left alone (not probed, never repaired):\n", len(inv.Strays)); err != nil {
		return err
	}
	for _, s := range inv.Strays {
		if _, err := fmt.Fprintf(w, "  %s: %s\n", printable(s.Path), printable(s.Why)); err != nil {
			return err
		}
	}
	return nil
}

// tableCells appends the cells of one mount's row to cells, each escaped:
// one row per line whatever the table holds.
func (rm *rowMaker) tableCells(cells []string, res probe.Result, wide, offline bool) []string {
	r := rm.row(res)
	vol := r.Target.Volume
	switch r.Target.Kind {
	case kubelet.KindSubPath:
		vol = vol + " [" + r.Target.Container + "/" + strconv.Itoa(r.Target.Index) + "]"
	case kubelet.KindStaging:
		vol = r.Target.PV
		if vol == "" {
			vol = short(r.Target.HandleHash, 12)
		}
		if vol == "" {
			vol = r.Target.Volume // an in-tree plugin's device mount
		}
	case kubelet.KindBlock:
		if vol == "" {
			vol = r.Target.PV
		}
	}
	took := "-"
	if !offline && r.ProbeSeconds > 0 {
		took = time.Duration(r.ProbeSeconds * float64(time.Second)).Round(time.Microsecond).String()
	}
	cells = append(cells, r.State.String(), r.Target.Kind.String(), orDash(r.Target.PodUID), orDash(vol),
		orDash(r.Driver), orDash(r.Daemon), orDash(r.Backend), orDash(r.Dev), took, orDash(r.Error))
	if wide {
		cells = append(cells, r.Path, orDash(r.From))
	}
	for i, c := range cells {
		cells[i] = printable(c)
	}
	return cells
}

// treeOrder lists the indexes of rep.Mounts as a person reads a volume:
// by backend (the filesystem that serves it), its staging mounts first,
// then each pod's publish target followed by that pod's subPath binds;
// mounts without a backend (publish targets that lost their mount) last.
func treeOrder(inv *probe.Inventory, rep *probe.Report) []int {
	bidx := make(map[*probe.Backend]int, len(inv.Backends))
	for i, b := range inv.Backends {
		bidx[b] = i
	}
	rank := func(k kubelet.Kind) int {
		switch k {
		case kubelet.KindStaging:
			return 0
		case kubelet.KindPublish, kubelet.KindPluginVolume, kubelet.KindBlock:
			return 1
		}
		return 2
	}
	type key struct {
		backend, staging int
		pod              string
		kind             int
	}
	keys := make([]key, len(rep.Mounts))
	order := make([]int, len(rep.Mounts))
	for i, r := range rep.Mounts {
		m := r.Mount
		k := key{backend: len(inv.Backends), staging: 1, pod: m.Target.PodUID, kind: rank(m.Target.Kind)}
		if b, ok := bidx[m.Backend]; ok && m.Backend != nil {
			k.backend = b
		}
		if m.Target.Kind == kubelet.KindStaging {
			k.staging = 0
		}
		keys[i], order[i] = k, i
	}
	sort.SliceStable(order, func(a, b int) bool {
		x, y := keys[order[a]], keys[order[b]]
		switch {
		case x.backend != y.backend:
			return x.backend < y.backend
		case x.staging != y.staging:
			return x.staging < y.staging
		case x.pod != y.pod:
			return x.pod < y.pod
		}
		return x.kind < y.kind
	})
	return order
}

func short(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

// sizeValue is a flag of a byte count given as a quantity (32Mi, 200M).
type sizeValue int64

func (s *sizeValue) String() string {
	return resource.NewQuantity(int64(*s), resource.BinarySI).String()
}

func (s *sizeValue) Set(v string) error {
	q, err := resource.ParseQuantity(v)
	if err != nil || q.Value() <= 0 {
		return fmt.Errorf("give a positive size such as 32Mi or 200M")
	}
	*s = sizeValue(q.Value())
	return nil
}

func (s *sizeValue) Type() string { return "quantity" }
