package agent

import (
	"context"

	"github.com/go-logr/logr"
	"k8s.io/klog/v2"
)

// Secrets never reach a log line. client-go logs request and response
// bodies at -v=8 and above (rest.Request, through the request context's
// logger), which for a GET of a Secret is the Secret's data. The agent reads
// Secrets with quietBodies: the context's logger, capped below that level
// for that request only, so that no verbosity a user sets can dump one.

// bodyLogLevel is the verbosity at which client-go logs bodies.
const bodyLogLevel = 8

// quietBodies returns ctx with its logger capped below bodyLogLevel.
func quietBodies(ctx context.Context) context.Context {
	l := klog.FromContext(ctx)
	sink := l.GetSink()
	if sink == nil {
		return ctx
	}
	if cd, ok := sink.(logr.CallDepthLogSink); ok {
		sink = cd.WithCallDepth(1) // the frame of cappedSink's own call
	}
	return klog.NewContext(ctx, logr.New(&cappedSink{sink: sink, max: bodyLogLevel - 1}))
}

// cappedSink passes on the log lines of its sink up to verbosity max.
type cappedSink struct {
	sink logr.LogSink
	max  int
}

func (c *cappedSink) Init(info logr.RuntimeInfo) { c.sink.Init(info) }
func (c *cappedSink) Enabled(level int) bool     { return level <= c.max && c.sink.Enabled(level) }
func (c *cappedSink) Info(level int, msg string, kv ...any) {
	if level <= c.max {
		c.sink.Info(level, msg, kv...)
	}
}
func (c *cappedSink) Error(err error, msg string, kv ...any) { c.sink.Error(err, msg, kv...) }
func (c *cappedSink) WithValues(kv ...any) logr.LogSink {
	return &cappedSink{sink: c.sink.WithValues(kv...), max: c.max}
}
func (c *cappedSink) WithName(name string) logr.LogSink {
	return &cappedSink{sink: c.sink.WithName(name), max: c.max}
}

// WithCallDepth keeps the caller's file and line right.
func (c *cappedSink) WithCallDepth(depth int) logr.LogSink {
	if cd, ok := c.sink.(logr.CallDepthLogSink); ok {
		return &cappedSink{sink: cd.WithCallDepth(depth), max: c.max}
	}
	return c
}
