package kubeclient

import (
	"context"

	eventsv1 "k8s.io/api/events/v1"
	"k8s.io/client-go/tools/events"
)

// AgentReportingController is the reportingController of the agent's
// events, the heartbeat's included.
const AgentReportingController = "mountmedic.io/agent"

// NodeEventSink writes events with ReportingInstance set to the node's
// name. client-go's recorder names the instance after the host name (the
// pod's name, unless hostNetwork); the admission policy
// deploy/agent-events-policy.yaml admits an event of
// AgentReportingController only from the identity of the node its
// reportingInstance names, which is what lets `kubectl mountmedic` tell
// the agent's own events from anyone else's. Patches (an event's series)
// carry only the series and pass through.
type NodeEventSink struct {
	events.EventSink
	Node string
}

func (s NodeEventSink) Create(ctx context.Context, ev *eventsv1.Event) (*eventsv1.Event, error) {
	ev = ev.DeepCopy()
	ev.ReportingInstance = s.Node
	return s.EventSink.Create(ctx, ev)
}

func (s NodeEventSink) Update(ctx context.Context, ev *eventsv1.Event) (*eventsv1.Event, error) {
	ev = ev.DeepCopy()
	ev.ReportingInstance = s.Node
	return s.EventSink.Update(ctx, ev)
}
