package scale

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"os"
	"sort"
	"strings"
	"sync"
	"time"
)

// auditLog tails the API server's audit log and keeps one small record per
// request: the API server's own count of who asked what.
type auditLog struct {
	mu   sync.Mutex
	recs []auditRec
	bad  int
}

type auditRec struct {
	at    time.Time
	class string // who: heartbeat, candidate, controller, kwok, kcm, harness, other
	who   string // the user agent's first element
	what  string // verb resource[/subresource] [namespace]
}

// auditEvent is the part of an audit.k8s.io/v1 Event the harness reads.
type auditEvent struct {
	Verb      string `json:"verb"`
	UserAgent string `json:"userAgent"`
	User      struct {
		Username string `json:"username"`
	} `json:"user"`
	ObjectRef *struct {
		Resource    string `json:"resource"`
		Subresource string `json:"subresource"`
		Namespace   string `json:"namespace"`
	} `json:"objectRef"`
	Received time.Time `json:"requestReceivedTimestamp"`
}

// classOf names who made a request from its user agent.
func classOf(ua string) (class, who string) {
	who, _, _ = strings.Cut(ua, " ")
	switch {
	case strings.HasPrefix(ua, "mountmedic-heartbeat/"):
		return "heartbeat", who
	case strings.HasPrefix(ua, "mountmedic-candidate/"):
		return "candidate", who
	case strings.HasPrefix(ua, "mountmedic-controller"):
		return "controller", who
	case strings.HasPrefix(ua, "kwok"):
		return "kwok", who
	case strings.HasPrefix(ua, "kube-controller-manager"):
		return "kcm", who
	case strings.HasPrefix(ua, harnessUA), strings.HasPrefix(ua, "kubectl"):
		return "harness", who
	}
	return "other", who
}

func tailAudit(ctx context.Context, path string) *auditLog {
	a := &auditLog{}
	go func() {
		var f *os.File
		for f == nil {
			var err error
			if f, err = os.Open(path); err != nil {
				select {
				case <-ctx.Done():
					return
				case <-time.After(200 * time.Millisecond):
				}
			}
		}
		defer f.Close()
		r := bufio.NewReaderSize(f, 1<<20)
		var partial []byte
		for {
			line, err := r.ReadBytes('\n')
			if len(line) > 0 {
				partial = append(partial, line...)
			}
			if err == nil {
				a.add(partial)
				partial = partial[:0]
				continue
			}
			if err != io.EOF {
				return
			}
			select {
			case <-ctx.Done():
				return
			case <-time.After(200 * time.Millisecond):
			}
		}
	}()
	return a
}

func (a *auditLog) add(line []byte) {
	var ev auditEvent
	if err := json.Unmarshal(line, &ev); err != nil {
		a.mu.Lock()
		a.bad++
		a.mu.Unlock()
		return
	}
	class, who := classOf(ev.UserAgent)
	what := ev.Verb
	if ev.ObjectRef != nil {
		what += " " + ev.ObjectRef.Resource
		if ev.ObjectRef.Subresource != "" {
			what += "/" + ev.ObjectRef.Subresource
		}
		if ev.ObjectRef.Namespace != "" {
			what += " (" + ev.ObjectRef.Namespace + ")"
		}
	}
	a.mu.Lock()
	a.recs = append(a.recs, auditRec{at: ev.Received, class: class, who: who, what: what})
	a.mu.Unlock()
}

// waitCaughtUp waits until the log holds a request received after t (the
// audit backend writes in batches).
func (a *auditLog) waitCaughtUp(ctx context.Context, t time.Time) {
	for ctx.Err() == nil {
		a.mu.Lock()
		n := len(a.recs)
		ok := n > 0 && a.recs[n-1].at.After(t)
		a.mu.Unlock()
		if ok {
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// usage is what the log holds for a time window.
type usage struct {
	seconds float64
	byClass map[string]int
	byWhat  map[string]map[string]int // class -> what -> count
	whos    map[string]map[string]bool
}

func (a *auditLog) window(from, to time.Time) usage {
	u := usage{seconds: to.Sub(from).Seconds(), byClass: map[string]int{}, byWhat: map[string]map[string]int{}, whos: map[string]map[string]bool{}}
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, r := range a.recs {
		if r.at.Before(from) || !r.at.Before(to) {
			continue
		}
		u.byClass[r.class]++
		if u.byWhat[r.class] == nil {
			u.byWhat[r.class] = map[string]int{}
			u.whos[r.class] = map[string]bool{}
		}
		u.byWhat[r.class][r.what]++
		u.whos[r.class][r.who] = true
	}
	return u
}

// rate is class's requests per second in the window.
func (u usage) rate(class string) float64 { return float64(u.byClass[class]) / u.seconds }

// rateOf is class's requests per second of one kind.
func (u usage) rateOf(class, what string) float64 { return float64(u.byWhat[class][what]) / u.seconds }

// count is how many requests of one kind class made.
func (u usage) count(class, what string) int { return u.byWhat[class][what] }

// kinds lists class's kinds of request, most frequent first.
func (u usage) kinds(class string) []string {
	var out []string
	for w := range u.byWhat[class] {
		out = append(out, w)
	}
	sort.Slice(out, func(i, j int) bool {
		a, b := u.byWhat[class][out[i]], u.byWhat[class][out[j]]
		if a != b {
			return a > b
		}
		return out[i] < out[j]
	})
	return out
}
