package kubeclient

import (
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"testing"

	"k8s.io/client-go/rest"
)

// groupCall is a call of a clientset's API group method, such as
// .CoreV1() or .AuthenticationV1().
var groupCall = regexp.MustCompile(`\.([A-Z][A-Za-z]*V[0-9]+(?:(?:alpha|beta)[0-9]+)?)\(\)`)

// TestClientsetHasEveryGroupTheCommandsCall reads the non-test Go code the
// mountmedic binary is built from (agent, cmd, probe, remount) for calls of
// an API group's method and checks that Clientset has each of its own: one
// it lacks would panic in the real agent (the embedded interface is nil),
// while tests, which mostly use kubernetes.NewForConfig, pass.
func TestClientsetHasEveryGroupTheCommandsCall(t *testing.T) {
	var zero Clientset
	v := reflect.ValueOf(&zero)
	seen := 0
	for _, dir := range []string{"../../agent", "../../cmd", "../../probe", "../../remount"} {
		err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
			if err != nil || d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
				return err
			}
			src, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			for _, m := range groupCall.FindAllSubmatch(src, -1) {
				name := string(m[1])
				seen++
				meth := v.MethodByName(name)
				if !meth.IsValid() {
					continue // not a clientset method (another type's)
				}
				if !calls(meth) {
					t.Errorf("%s calls %s(), which Clientset does not have: add the group to kubeclient", path, name)
				}
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	if seen < 10 {
		t.Fatalf("found only %d API group calls: is the walk reading the right directories?", seen)
	}
}

// calls reports whether meth returns without a panic on a zero Clientset:
// its own methods return a nil client, the embedded (nil) interface's
// panic.
func calls(meth reflect.Value) (ok bool) {
	defer func() {
		if recover() != nil {
			ok = false
		}
	}()
	meth.Call(nil)
	return true
}

// TestNewSharesOneRateLimiter: every group's client of a Clientset draws on
// one token bucket of QPS and Burst, as kubernetes.NewForConfig's do, so
// --kube-api-qps bounds the agent's requests in all, not per group.
func TestNewSharesOneRateLimiter(t *testing.T) {
	cs, err := New(&rest.Config{Host: "https://127.0.0.1:1", QPS: 5, Burst: 10})
	if err != nil {
		t.Fatal(err)
	}
	core := cs.core.RESTClient().GetRateLimiter()
	for name, rl := range map[string]any{
		"storage":        cs.storage.RESTClient().GetRateLimiter(),
		"policy":         cs.policy.RESTClient().GetRateLimiter(),
		"events":         cs.events.RESTClient().GetRateLimiter(),
		"coordination":   cs.coordination.RESTClient().GetRateLimiter(),
		"authentication": cs.authn.RESTClient().GetRateLimiter(),
		"authorization":  cs.authz.RESTClient().GetRateLimiter(),
	} {
		if core == nil || rl != any(core) {
			t.Errorf("%s's rate limiter is not core's: each group would get its own QPS", name)
		}
	}
	if _, err := New(&rest.Config{Host: "https://127.0.0.1:1", QPS: 5}); err == nil {
		t.Error("New with QPS and no Burst: no error")
	}
}
