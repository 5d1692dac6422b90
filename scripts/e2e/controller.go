package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"
	"time"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/mountmedic/mountmedic/scripts/kubetest"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// Controller is `mountmedic controller`, the failover duty's cluster side,
// running as a process of this machine under the ServiceAccount and RBAC of
// deploy/controller/ (the e2e node has no CNI plugin: a Deployment's pod
// would not start; the DaemonSet runs with hostNetwork instead).
type Controller struct {
	p *lab.Process
	// MetricsAddr serves its /metrics and /healthz.
	MetricsAddr string

	t                    testing.TB
	bin, kubeconfig, dir string
	runs                 int
}

// StartController applies deploy/controller's ServiceAccount and RBAC,
// builds the command from this checkout and starts `mountmedic controller`
// with the Deployment's defaults and args; it stops with the test.
func StartController(t testing.TB, c *kubetest.Cluster, args ...string) (*Controller, error) {
	deploy, err := filepath.Abs(filepath.Join("..", "..", "deploy", "controller"))
	if err != nil {
		return nil, err
	}
	for _, f := range []string{"serviceaccount.yaml", "rbac.yaml"} {
		if out, err := c.Kubectl("apply", "-f", filepath.Join(deploy, f)); err != nil {
			return nil, fmt.Errorf("apply deploy/controller/%s: %w\n%s", f, err, out)
		}
	}
	dir := t.TempDir()
	bin := filepath.Join(dir, "mountmedic")
	build := exec.Command("go", "build", "-o", bin, "./cmd/mountmedic")
	build.Dir = filepath.Join("..", "..")
	if out, err := build.CombinedOutput(); err != nil {
		return nil, fmt.Errorf("go build ./cmd/mountmedic: %w\n%s", err, out)
	}
	rc := c.ServiceAccountConfig(t, AgentNamespace, "mountmedic-controller")
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["e2e"] = &clientcmdapi.Cluster{Server: rc.Host, CertificateAuthorityData: rc.CAData}
	cfg.AuthInfos["controller"] = &clientcmdapi.AuthInfo{Token: rc.BearerToken}
	cfg.Contexts["e2e"] = &clientcmdapi.Context{Cluster: "e2e", AuthInfo: "controller"}
	cfg.CurrentContext = "e2e"
	kubeconfig := filepath.Join(dir, "kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, kubeconfig); err != nil {
		return nil, err
	}
	ports, err := lab.FreePorts(1)
	if err != nil {
		return nil, err
	}
	ctl := &Controller{MetricsAddr: "127.0.0.1:" + strconv.Itoa(ports[0]), t: t, bin: bin, kubeconfig: kubeconfig, dir: dir}
	if err := ctl.start(args); err != nil {
		return nil, err
	}
	t.Cleanup(func() { ctl.p.Stop(10 * time.Second) })
	return ctl, nil
}

// Restart stops the controller (it releases its leader Lease) and starts
// it again, built once, with args instead of the first start's.
func (c *Controller) Restart(args ...string) error {
	c.p.Stop(10 * time.Second)
	return c.start(args)
}

func (c *Controller) start(args []string) error {
	c.runs++
	cmd := exec.Command(c.bin, append([]string{"controller", "--kubeconfig=" + c.kubeconfig, "--metrics-addr=" + c.MetricsAddr, "-v=2"}, args...)...)
	cmd.Env = append(os.Environ(), "POD_NAMESPACE="+AgentNamespace, "POD_NAME=mountmedic-controller-e2e")
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	p, err := lab.RunProcess("mountmedic controller", cmd, filepath.Join(c.dir, fmt.Sprintf("controller-%d.log", c.runs)))
	if err != nil {
		return err
	}
	c.p = p
	return p.WaitDial("tcp", c.MetricsAddr, time.Minute)
}

// LogTail is the last n lines of the controller's log.
func (c *Controller) LogTail(n int) string { return c.p.Tail(n) }
