package main

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/mountmedic/mountmedic/probe"
)

type scanFlags struct {
	capture   string // --mountinfo: an offline capture
	hostTable string // --host-table: the live table to read and probe
	output    string
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

Exit status: 0 nothing broken, 1 the scan failed, 2 at least one mount is broken.`,
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
	var (
		inv *probe.Inventory
		rep *probe.Report
		err error
	)
	if f.capture != "" {
		if cmd.Flags().Changed("host-table") {
			return fmt.Errorf("--mountinfo and --host-table both given: use one")
		}
		inv, err = probe.ReadFile(f.capture, f.opts)
		if err != nil {
			return err
		}
		rep = probe.Assess(inv)
	} else {
		f.opts.Live = true
		inv, err = probe.ReadFile(f.hostTable, f.opts)
		if err != nil {
			return err
		}
		rep = probe.NewProber(f.cfg).Probe(cmd.Context(), inv)
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

// scanRow is one mount in scan's JSON output.
type scanRow struct {
	Path         string       `json:"path"`
	Target       probe.Target `json:"target"`
	Driver       string       `json:"driver,omitempty"`
	VolumeHandle string       `json:"volumeHandle,omitempty"`
	From         string       `json:"from,omitempty"`
	Dev          string       `json:"dev,omitempty"`
	Root         string       `json:"root,omitempty"`
	FSType       string       `json:"fsType,omitempty"`
	Backend      string       `json:"backend,omitempty"`
	State        probe.State  `json:"state"`
	Error        string       `json:"error,omitempty"`
	ProbeSeconds float64      `json:"probeSeconds"`
}

type scanDoc struct {
	Source      string    `json:"source"`
	KubeletRoot string    `json:"kubeletRoot"`
	Offline     bool      `json:"offline"`
	TableMounts int       `json:"tableMounts"`
	Backends    int       `json:"backends"`
	Broken      int       `json:"broken"`
	Mounts      []scanRow `json:"mounts"`
}

func rows(rep *probe.Report) []scanRow {
	out := make([]scanRow, 0, len(rep.Mounts))
	for _, r := range rep.Mounts {
		m := r.Mount
		row := scanRow{Path: m.Path, Target: m.Target, Driver: m.Driver, VolumeHandle: m.VolumeHandle,
			Root: m.Root, FSType: m.FSType, State: r.State, ProbeSeconds: r.Took.Seconds()}
		if m.From != nil {
			row.From = m.From.Path
		}
		if m.Backend != nil {
			row.Dev = m.Dev.String()
			row.Backend = describeBackend(m.Backend)
		}
		if r.Err != nil {
			row.Error = r.Err.Error()
		}
		out = append(out, row)
	}
	return out
}

func writeJSON(w io.Writer, inv *probe.Inventory, rep *probe.Report, offline bool) error {
	doc := scanDoc{Source: inv.Source, KubeletRoot: inv.Root, Offline: offline, TableMounts: inv.Total,
		Backends: len(inv.Backends), Broken: len(rep.Broken()), Mounts: rows(rep)}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(doc)
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

func writeTable(w io.Writer, inv *probe.Inventory, rep *probe.Report, wide, offline bool) error {
	broken := len(rep.Broken())
	if len(rep.Mounts) == 0 {
		_, err := fmt.Fprintf(w, "no kubelet volume mounts under %s in %s (%d mounts read): nothing to check\n",
			inv.Root, inv.Source, inv.Total)
		return err
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	header := "STATE\tKIND\tPOD\tVOLUME\tDRIVER\tBACKEND\tDEV\tPROBE\tERROR"
	if wide {
		header += "\tPATH\tFROM"
	}
	fmt.Fprintln(tw, header)
	for _, r := range rows(rep) {
		vol := r.Target.Volume
		switch r.Target.Kind {
		case probe.KindSubPath:
			vol = fmt.Sprintf("%s [%s/%d]", vol, r.Target.Container, r.Target.Index)
		case probe.KindStaging:
			vol = r.Target.PV
			if vol == "" {
				vol = short(r.Target.HandleHash, 12)
			}
		case probe.KindBlock:
			if vol == "" {
				vol = r.Target.PV
			}
		}
		took := "-"
		if !offline && r.ProbeSeconds > 0 {
			took = time.Duration(r.ProbeSeconds * float64(time.Second)).Round(time.Microsecond).String()
		}
		line := strings.Join([]string{r.State.String(), r.Target.Kind.String(), orDash(r.Target.PodUID), orDash(vol),
			orDash(r.Driver), orDash(r.Backend), orDash(r.Dev), took, orDash(r.Error)}, "\t")
		if wide {
			line += "\t" + r.Path + "\t" + orDash(r.From)
		}
		fmt.Fprintln(tw, line)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	mode := "probed"
	if offline {
		mode = "offline: states from the table only, no path touched"
	}
	_, err := fmt.Fprintf(w, "\n%d kubelet mounts on %d backends under %s, %d mounts in %s (%s); %d broken\n",
		len(rep.Mounts), len(inv.Backends), inv.Root, inv.Total, inv.Source, mode, broken)
	return err
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
