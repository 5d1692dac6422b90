package agent_test

import (
	"context"
	"net/url"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/rest"

	"github.com/mountmedic/mountmedic/agent"
	"github.com/mountmedic/mountmedic/agent/kubeclient"
	"github.com/mountmedic/mountmedic/scripts/kubetest"
	"github.com/mountmedic/mountmedic/scripts/lab"

	"github.com/mountmedic/mountmedic/remount"
)

// TestAgentKeepsWorkingWithoutAPIServer cuts the agent off from the API
// server: detection, metrics and /healthz go on, the eviction waits (the
// claim, which may opt out, cannot be read), and once the API server is
// reachable again the eviction happens and the buffered event arrives.
func TestAgentKeepsWorkingWithoutAPIServer(t *testing.T) {
	e := newEnv(t, kubetest.DefaultControllers)
	ctx := context.Background()
	labels := map[string]string{"app": "cut"}
	v := e.createVolume("cut", nil)
	pod := e.createPod("cut-0", v, podOptions{owner: e.replicaSet("cut", labels), labels: labels})
	fs := lab.StartFaultFS(t, v.staging)
	e.kubelet.Publish(string(pod.UID), v.pv.Name, labDriver, v.handle, v.staging, false)

	u, err := url.Parse(e.agentConfig.Host)
	if err != nil {
		t.Fatal(err)
	}
	proxy := lab.StartTCPProxy(t, u.Host)
	cfgREST := rest.CopyConfig(e.agentConfig)
	cfgREST.Host = "https://" + proxy.Addr()
	cfgREST.Timeout = 2 * time.Second
	client, err := kubeclient.New(cfgREST)
	if err != nil {
		t.Fatal(err)
	}
	cfg := e.config()
	cfg.Tiers = remount.NewTierSet(remount.TierEvict)
	cfg.APITimeout = time.Second
	a := e.startAgent(cfg, agent.Deps{Client: client})

	proxy.Cut()
	fs.Kill()
	e.waitFor("the dead volume in the metrics while the API server is cut off", func() (bool, error) {
		n, _ := a.metric(`mountmedic_stale_mounts{driver="` + labDriver + `",kind="publish",state="Disconnected"}`)
		return n == 1, nil
	})
	if r := a.get("/healthz"); r.code != 200 {
		t.Errorf("/healthz while the API server is unreachable = %d %q, want 200: probing goes on", r.code, r.body)
	}
	// Many probe cycles: the repair needs the claim (which may opt out)
	// and the Eviction API, so it waits; nothing is evicted blindly.
	time.Sleep(3 * time.Second)
	p, err := e.admin.CoreV1().Pods(testNamespace).Get(ctx, pod.Name, metav1.GetOptions{})
	if err != nil || p.DeletionTimestamp != nil {
		t.Fatalf("pod evicted while the agent was cut off (err %v)", err)
	}

	proxy.Restore()
	e.waitFor("the eviction once the API server is back", func() (bool, error) {
		p, err := e.admin.CoreV1().Pods(testNamespace).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil {
			return false, err
		}
		return p.DeletionTimestamp != nil, nil
	})
	e.waitEvent(pod.UID, string(agent.ReasonVolumeBroken), "Disconnected")
	e.waitEvent(pod.UID, string(agent.ReasonEvicting), "evicted the pod")
}
