package agent

import (
	"context"

	eventsv1 "k8s.io/api/events/v1"
	"k8s.io/client-go/tools/events"
)

// nodeEventSink writes the agent's events with ReportingInstance set to
// its node's name. client-go's recorder names the instance after the
// host name (the pod's name, unless hostNetwork); the admission policy
// deploy/agent-events-policy.yaml admits an event whose reportingController
// is ReportingController only from the identity of the node its
// reportingInstance names, which is what lets `kubectl mountmedic` tell
// the agent's own events from anyone else's. Patches (an event's series)
// carry only the series and pass through.
type nodeEventSink struct {
	events.EventSink
	node string
}

func (s nodeEventSink) Create(ctx context.Context, ev *eventsv1.Event) (*eventsv1.Event, error) {
	ev = ev.DeepCopy()
	ev.ReportingInstance = s.node
	return s.EventSink.Create(ctx, ev)
}

func (s nodeEventSink) Update(ctx context.Context, ev *eventsv1.Event) (*eventsv1.Event, error) {
	ev = ev.DeepCopy()
	ev.ReportingInstance = s.node
	return s.EventSink.Update(ctx, ev)
}
