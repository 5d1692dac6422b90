package deploy_test

import (
	"encoding/json"
	"fmt"
	"html"
	"math"
	"net/http"
	"net/url"
	"os"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/common/model"
)

// previewFile is the dashboard picture docs/alerts.md shows: the dashboard's
// layout drawn from the live test's Prometheus, by renderPreview below, not
// by Grafana (which cannot be installed on these machines).
const previewFile = "grafana/preview.svg"

// Grid geometry of the picture: Grafana's 24 columns and 30 px rows.
const (
	colWidth  = 50
	rowHeight = 30
)

var palette = []string{"#7eb26d", "#eab839", "#6ed0e0", "#ef843c", "#e24d42", "#1f78c1", "#ba43a9", "#705da0", "#508642", "#cca300"}

// queryRange evaluates expr over [start, end] every step.
func (s *promServer) queryRange(expr string, start, end time.Time, step time.Duration) (model.Matrix, error) {
	v := url.Values{"query": {expr}, "start": {fmt.Sprint(start.Unix())}, "end": {fmt.Sprint(end.Unix())}, "step": {step.String()}}
	resp, err := http.Get(s.url + "/api/v1/query_range?" + v.Encode())
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	var r struct {
		Status, Error string
		Data          struct {
			Result model.Matrix `json:"result"`
		} `json:"data"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&r); err != nil {
		return nil, err
	}
	if r.Status != "success" {
		return nil, fmt.Errorf("query_range %s: %s", expr, r.Error)
	}
	return r.Data.Result, nil
}

var legendLabel = regexp.MustCompile(`\{\{\s*(\w+)\s*\}\}`)

func legend(format string, m model.Metric) string {
	if format == "" {
		return m.String()
	}
	return legendLabel.ReplaceAllStringFunc(format, func(s string) string {
		return string(m[model.LabelName(legendLabel.FindStringSubmatch(s)[1])])
	})
}

// renderPreview draws the dashboard as an SVG from prom's data over
// [start, end], with every variable at All (the lab node and the
// simulated node that dies) and rate windows of rate.
func renderPreview(t *testing.T, prom *promServer, start, end time.Time, rate string) []byte {
	t.Helper()
	d, _ := loadDashboard(t)
	subst := strings.NewReplacer(`$__rate_interval`, rate, `$__range`, fmt.Sprintf("%ds", int(end.Sub(start).Seconds())),
		`$node`, ".*", `$driver`, ".*", `$job`, labJob)
	step := max(end.Sub(start)/120, time.Second)
	maxY := 0
	for _, p := range d.Panels {
		maxY = max(maxY, p.GridPos.Y+p.GridPos.H)
	}
	width, height := 24*colWidth, maxY*rowHeight+40
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="11">`+"\n", width, height)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="#111217"/>`+"\n")
	fmt.Fprintf(&b, `<text x="8" y="24" fill="#d8d9da" font-size="16">%s — nodes %s and %s, %s to %s UTC (fault lab, preview drawn from Prometheus data, not by Grafana)</text>`+"\n",
		html.EscapeString(d.Title), labNode, simNodeName, start.UTC().Format("15:04:05"), end.UTC().Format("15:04:05"))
	for _, p := range d.Panels {
		x, y := p.GridPos.X*colWidth, p.GridPos.Y*rowHeight+40
		w, h := p.GridPos.W*colWidth, p.GridPos.H*rowHeight
		if p.Type == "row" {
			fmt.Fprintf(&b, `<text x="%d" y="%d" fill="#d8d9da" font-size="14" font-weight="bold">%s</text>`+"\n", x+6, y+20, html.EscapeString(p.Title))
			continue
		}
		fmt.Fprintf(&b, `<rect x="%d" y="%d" width="%d" height="%d" fill="#181b1f" stroke="#2c3235"/>`+"\n", x+3, y+3, w-6, h-6)
		fmt.Fprintf(&b, `<text x="%d" y="%d" fill="#d8d9da" font-weight="bold">%s</text>`+"\n", x+10, y+18, html.EscapeString(p.Title))
		switch p.Type {
		case "stat":
			var vals []string
			for _, tg := range p.Targets {
				v, err := prom.query(subst.Replace(tg.Expr), end)
				switch {
				case err != nil:
					t.Errorf("preview %s: %v", p.Title, err)
				case len(v) == 0:
					vals = append(vals, "0")
				default:
					vals = append(vals, strconv.FormatFloat(math.Round(float64(v[0].Value)), 'f', 0, 64))
				}
			}
			fmt.Fprintf(&b, `<text x="%d" y="%d" fill="#73bf69" font-size="30" text-anchor="middle">%s</text>`+"\n", x+w/2, y+h/2+20, strings.Join(vals, " / "))
		case "table":
			ty := y + 36
			for _, tg := range p.Targets {
				v, err := prom.query(subst.Replace(tg.Expr), end)
				if err != nil {
					t.Errorf("preview %s: %v", p.Title, err)
				}
				for _, s := range v {
					if ty > y+h-10 {
						break
					}
					var cells []string
					for _, name := range []string{"node", "driver", "kind", "state", "version", "goversion"} {
						if val, ok := s.Metric[model.LabelName(name)]; ok {
							cells = append(cells, name+"="+string(val))
						}
					}
					fmt.Fprintf(&b, `<text x="%d" y="%d" fill="#ccccdc">%s    %g</text>`+"\n", x+12, ty, html.EscapeString(strings.Join(cells, "   ")), float64(s.Value))
					ty += 15
				}
			}
		case "timeseries":
			type line struct {
				name string
				pts  []model.SamplePair
			}
			var lines []line
			for _, tg := range p.Targets {
				m, err := prom.queryRange(subst.Replace(tg.Expr), start, end, step)
				if err != nil {
					t.Errorf("preview %s: %v", p.Title, err)
				}
				for _, s := range m {
					lines = append(lines, line{legend(tg.LegendFormat, s.Metric), s.Values})
				}
			}
			slices.SortFunc(lines, func(a, b line) int { return strings.Compare(a.name, b.name) })
			top := 0.0
			for _, l := range lines {
				for _, p := range l.pts {
					if v := float64(p.Value); !math.IsNaN(v) && !math.IsInf(v, 0) {
						top = max(top, v)
					}
				}
			}
			if top == 0 {
				top = 1
			}
			legendW := w * 2 / 5
			px, py, pw, ph := x+40, y+28, w-legendW-50, h-44
			fmt.Fprintf(&b, `<text x="%d" y="%d" fill="#8e8e8e" text-anchor="end">%.3g</text><text x="%d" y="%d" fill="#8e8e8e" text-anchor="end">0</text>`+"\n", px-4, py+8, top, px-4, py+ph)
			fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="#2c3235"/>`+"\n", px, py+ph, px+pw, py+ph)
			span := end.Sub(start).Seconds()
			for i, l := range lines {
				color := palette[i%len(palette)]
				var pts []string
				for _, p := range l.pts {
					v := float64(p.Value)
					if math.IsNaN(v) || math.IsInf(v, 0) {
						continue
					}
					sx := float64(px) + float64(pw)*(p.Timestamp.Time().Sub(start).Seconds()/span)
					sy := float64(py+ph) - float64(ph)*(v/top)
					pts = append(pts, fmt.Sprintf("%.1f,%.1f", sx, sy))
				}
				if len(pts) > 0 {
					fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" stroke-width="1.5" points="%s"/>`+"\n", color, strings.Join(pts, " "))
				}
				if ly := py + 10 + i*13; ly < y+h-8 {
					fmt.Fprintf(&b, `<rect x="%d" y="%d" width="10" height="3" fill="%s"/><text x="%d" y="%d" fill="#ccccdc">%s</text>`+"\n",
						x+w-legendW, ly-4, color, x+w-legendW+14, ly, html.EscapeString(truncate(l.name, legendW/6)))
				}
			}
		}
	}
	b.WriteString("</svg>\n")
	return []byte(b.String())
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:max(n-1, 0)] + "…"
}

// writePreview renders the picture into previewFile. The live test calls it
// with -update only: the picture checks nothing that liveQueries does not
// (every query it draws is evaluated there).
func writePreview(t *testing.T, prom *promServer, start, end time.Time) {
	t.Helper()
	if err := os.WriteFile(previewFile, renderPreview(t, prom, start, end, "10s"), 0o644); err != nil {
		t.Fatal(err)
	}
}
