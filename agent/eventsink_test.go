package agent

import (
	"context"
	"errors"
	"testing"

	authenticationv1 "k8s.io/api/authentication/v1"
	eventsv1 "k8s.io/api/events/v1"

	"github.com/mountmedic/mountmedic/agent/kubeclient"
)

// recordingSink keeps the events written to it.
type recordingSink struct{ got []*eventsv1.Event }

func (s *recordingSink) Create(_ context.Context, ev *eventsv1.Event) (*eventsv1.Event, error) {
	s.got = append(s.got, ev)
	return ev, nil
}

func (s *recordingSink) Update(_ context.Context, ev *eventsv1.Event) (*eventsv1.Event, error) {
	s.got = append(s.got, ev)
	return ev, nil
}

func (s *recordingSink) Patch(_ context.Context, ev *eventsv1.Event, _ []byte) (*eventsv1.Event, error) {
	return ev, nil
}

func TestNodeEventSinkNamesTheNode(t *testing.T) {
	inner := &recordingSink{}
	sink := kubeclient.NodeEventSink{EventSink: inner, Node: "node-a"}
	ev := &eventsv1.Event{ReportingController: ReportingController, ReportingInstance: ReportingController + "-mountmedic-x7k2p"}
	if _, err := sink.Create(context.Background(), ev); err != nil {
		t.Fatal(err)
	}
	if _, err := sink.Update(context.Background(), ev); err != nil {
		t.Fatal(err)
	}
	for i, got := range inner.got {
		if got.ReportingInstance != "node-a" {
			t.Errorf("event %d written with reportingInstance %q, want node-a", i, got.ReportingInstance)
		}
	}
	if ev.ReportingInstance != ReportingController+"-mountmedic-x7k2p" {
		t.Errorf("the recorder's event was changed: reportingInstance %q", ev.ReportingInstance)
	}
}

func TestJudgeServiceAccount(t *testing.T) {
	sa := ServiceAccountPrefix + "mountmedic:mountmedic"
	for name, tc := range map[string]struct {
		user  string
		extra map[string]authenticationv1.ExtraValue
		ok    bool
	}{
		"bound to node-a":  {sa, map[string]authenticationv1.ExtraValue{NodeNameExtra: {"node-a"}}, true},
		"bound to node-b":  {sa, map[string]authenticationv1.ExtraValue{NodeNameExtra: {"node-b"}}, false},
		"names no node":    {sa, nil, false},
		"names two nodes":  {sa, map[string]authenticationv1.ExtraValue{NodeNameExtra: {"node-a", "node-b"}}, false},
		"a node, not a SA": {NodeUser("node-a"), map[string]authenticationv1.ExtraValue{NodeNameExtra: {"node-a"}}, false},
	} {
		err := judgeServiceAccount(authenticationv1.UserInfo{Username: tc.user, Extra: tc.extra}, "node-a")
		if (err == nil) != tc.ok || (err != nil && !errors.Is(err, ErrNotNodeBound)) {
			t.Errorf("%s: judgeServiceAccount = %v, want ok %v (else ErrNotNodeBound)", name, err, tc.ok)
		}
	}
}
