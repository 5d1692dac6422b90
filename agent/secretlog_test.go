package agent

import (
	"bytes"
	"context"
	"encoding/hex"
	"flag"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/scripts/kubetest"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// syncBuffer is a buffer klog can write to from several goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// undump decodes the hex dumps in klog's output (client-go dumps binary
// bodies, such as protobuf, that way): the bytes of each dump, joined.
func undump(logs string) string {
	var b strings.Builder
	for _, l := range strings.Split(logs, "\n") {
		l = strings.TrimSpace(l)
		f := strings.Fields(l)
		if len(f) < 2 || len(f[0]) != 8 || strings.Trim(f[0], "0123456789abcdef") != "" {
			if b.Len() > 0 && !strings.HasSuffix(b.String(), "\n") {
				b.WriteString("\n")
			}
			continue
		}
		for _, h := range f[1:] {
			if len(h) != 2 {
				break
			}
			v, err := hex.DecodeString(h)
			if err != nil {
				break
			}
			b.Write(v)
		}
	}
	return b.String()
}

// TestSecretNeverLogged: at -v=10, where client-go logs every request and
// response body, the agent's read of a Secret from the real kube-apiserver
// leaves none of the Secret's values in the log (a ConfigMap read the same
// way shows that bodies are logged).
func TestSecretNeverLogged(t *testing.T) {
	lab.RequireRoot(t)
	c := kubetest.Start(t, kubetest.Options{})
	c.CreateNamespace(t, "apps")
	ctx := context.Background()
	const secretValue, shown = "s3cr3t-value-never-logged", "configmap-value-logged"
	if _, err := c.Client.CoreV1().Secrets("apps").Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: "apps", Name: "creds"},
		StringData: map[string]string{"key": secretValue},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Client.CoreV1().ConfigMaps("apps").Create(ctx, &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Namespace: "apps", Name: "plain"},
		Data:       map[string]string{"key": shown},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}

	fs := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(fs)
	set := func(name, value string) {
		t.Helper()
		if err := fs.Set(name, value); err != nil {
			t.Fatal(err)
		}
	}
	var out syncBuffer
	set("logtostderr", "false")
	set("alsologtostderr", "false")
	set("stderrthreshold", "FATAL")
	set("v", "10")
	klog.SetOutput(&out)
	defer func() {
		set("v", "0")
		set("logtostderr", "true")
		klog.SetOutput(nil)
	}()

	k := &kube{client: c.Client, timeout: 10 * time.Second}
	s, err := k.secret(ctx, "apps", "creds")
	if err != nil {
		t.Fatal(err)
	}
	if string(s.Data["key"]) != secretValue {
		t.Fatalf("read the secret %q", s.Data["key"])
	}
	if _, err := c.Client.CoreV1().ConfigMaps("apps").Get(ctx, "plain", metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	}
	klog.Flush()
	logs := out.String() + "\n" + undump(out.String())
	if !strings.Contains(logs, shown) {
		t.Fatalf("the ConfigMap's body is not in the -v=10 log: bodies are not logged, the test cannot tell (%d bytes)\n%.3000s", len(logs), logs)
	}
	if strings.Contains(logs, secretValue) || strings.Contains(logs, "czNjcjN0LXZhbHVlLW5ldmVyLWxvZ2dlZA") {
		t.Errorf("the Secret's value is in the -v=10 log")
	}
}
