package failover

import (
	"context"

	eventsv1 "k8s.io/api/events/v1"
	"k8s.io/client-go/tools/events"
)

// NodeReportingController is the reportingController of the events the
// heartbeat writes about its own node: the agent's (agent.ReportingController),
// so that deploy/agent-events-policy.yaml admits them only from that node's
// identity and `mountmedic status` shows them as the node's own.
// ReportingController (the controller's) is admitted only from the
// controller's ServiceAccount (deploy/controller/failover-events-policy.yaml).
const NodeReportingController = "mountmedic.io/agent"

// nodeEventSink writes the heartbeat's events with ReportingInstance set to
// its node's name, which the agents' events policy requires (client-go's
// recorder would name the pod). Patches (an event's series) carry only the
// series and pass through.
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
