package status

import (
	"testing"

	"github.com/mountmedic/mountmedic/agent"
	"github.com/mountmedic/mountmedic/agent/failover"
)

// TestReportingControllers: the failover heartbeat's events about its own
// node are the agent's (held to that node by EventsPolicy, shown in the
// node's drill-down); the failover controller's are its own (held to its
// ServiceAccount by FailoverEventsPolicy).
func TestReportingControllers(t *testing.T) {
	if failover.NodeReportingController != agent.ReportingController {
		t.Errorf("failover.NodeReportingController = %q, want agent.ReportingController %q", failover.NodeReportingController, agent.ReportingController)
	}
	if failover.ReportingController == agent.ReportingController {
		t.Errorf("failover.ReportingController = %q, the agent's: the controller's events must be told from the agents'", failover.ReportingController)
	}
}
