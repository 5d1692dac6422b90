package failover

import "github.com/mountmedic/mountmedic/agent/kubeclient"

// NodeReportingController is the reportingController of the events the
// heartbeat writes about its own node: the agent's (agent.ReportingController),
// so that deploy/agent-events-policy.yaml admits them only from that node's
// identity and `mountmedic status` shows them as the node's own.
// ReportingController (the controller's) is admitted only from the
// controller's ServiceAccount (deploy/controller/failover-events-policy.yaml).
const NodeReportingController = kubeclient.AgentReportingController
