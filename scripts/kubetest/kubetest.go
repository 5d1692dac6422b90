// Package kubetest starts a real Kubernetes control plane (etcd, kube-apiserver and,
// when asked, kube-controller-manager and kube-scheduler) on loopback ports for
// integration tests.
//
// The binaries come from lab.BinDir: $MOUNTMEDIC_BIN, else the cache that
// scripts/tools.sh fills ($MOUNTMEDIC_CACHE/bin/current, default
// /var/cache/mountmedic). When one is missing the test is skipped with the command
// that builds it, unless MOUNTMEDIC_REQUIRE_ROOT=1 (CI), where it fails instead
// (lab.RequireTool).
//
// This package is test support: it is imported from _test.go files only and must not
// be imported by the agent.
package kubetest

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/mountmedic/mountmedic/scripts/lab"
)

// DefaultControllers are the kube-controller-manager controllers most tests need:
// PodDisruptionBudget status, garbage collection, namespace deletion and the
// default ServiceAccount of each namespace.
var DefaultControllers = []string{"disruption", "garbagecollector", "namespace", "serviceaccount", "serviceaccount-token"}

// Options configure Start. The zero value starts etcd and kube-apiserver only.
type Options struct {
	// Controllers, when not empty, starts kube-controller-manager with
	// --controllers set to this list and --leader-elect=false.
	Controllers []string
	// Scheduler starts kube-scheduler (leader election off), for tests whose
	// pods a real kubelet runs.
	Scheduler bool
	// ControllerManagerArgs are appended to kube-controller-manager's
	// generated flags.
	ControllerManagerArgs []string
	// APIServerArgs are appended to kube-apiserver's generated flags.
	APIServerArgs []string
	// EtcdDataDir, when set, is where etcd keeps its data (e.g. under
	// /dev/shm, for scale tests); the default is under Dir.
	EtcdDataDir string
}

// startTimeout bounds the wait for every component to be ready.
const startTimeout = time.Minute

// Cluster is a running control plane. Start registers its teardown with t.Cleanup.
type Cluster struct {
	// Config authenticates as an admin (a client certificate in system:masters).
	Config *rest.Config
	// Client is a clientset for Config.
	Client kubernetes.Interface
	// Kubeconfig is the path of a kubeconfig file for the admin.
	Kubeconfig string
	// Server is the apiserver URL, EtcdURL the etcd client URL.
	Server, EtcdURL string
	// Dir holds the cluster's certificates, etcd data and logs (logs/<component>.log).
	Dir string
	// BinDir is where the binaries were found.
	BinDir string

	t     testing.TB
	pki   *pki
	procs []*lab.Process // in start order
	// api is kube-apiserver's index in procs, apiBin and apiArgs how to
	// start it again (RestartAPIServer).
	api      int
	apiBin   string
	apiArgs  []string
	restarts int
	// detach, for a cluster a broker runs (Attach), hands it back.
	detach func()
}

// Start starts etcd and kube-apiserver (and kube-controller-manager when
// opts.Controllers is set), waits until the apiserver is ready and returns the
// cluster. Everything is stopped when the test ends.
//
// With $MOUNTMEDIC_KUBETEST_BROKER set (EnvBroker) it starts nothing here:
// it asks that broker for a cluster of its own and attaches to it (Attach).
func Start(t testing.TB, opts Options) *Cluster {
	t.Helper()
	if addr := os.Getenv(EnvBroker); addr != "" {
		return Attach(t, addr, opts)
	}
	bins := make(map[string]string)
	for _, name := range components(opts) {
		bins[name] = lab.RequireTool(t, name)
	}

	dir := t.TempDir() // created before the cleanup below, so removed after it
	c := &Cluster{Dir: dir, BinDir: lab.BinDir(), t: t}
	t.Cleanup(c.stop)
	if err := c.start(bins, opts); err != nil {
		t.Fatalf("start control plane: %v", err)
	}
	return c
}

// components are the programs a cluster of opts runs.
func components(opts Options) []string {
	names := []string{"etcd", "kube-apiserver"}
	if len(opts.Controllers) > 0 {
		names = append(names, "kube-controller-manager")
	}
	if opts.Scheduler {
		names = append(names, "kube-scheduler")
	}
	return names
}

func (c *Cluster) start(bins map[string]string, opts Options) error {
	logDir := filepath.Join(c.Dir, "logs")
	if err := os.MkdirAll(logDir, 0o755); err != nil {
		return fmt.Errorf("create log dir: %w", err)
	}
	var err error
	if c.pki, err = newPKI(c.Dir); err != nil {
		return err
	}
	ports, err := lab.FreePorts(5)
	if err != nil {
		return err
	}
	etcdPort, peerPort, apiPort, kcmPort, schedPort := ports[0], ports[1], ports[2], ports[3], ports[4]
	c.EtcdURL = fmt.Sprintf("http://127.0.0.1:%d", etcdPort)
	peerURL := fmt.Sprintf("http://127.0.0.1:%d", peerPort)
	c.Server = fmt.Sprintf("https://127.0.0.1:%d", apiPort)

	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()

	etcdDir := filepath.Join(c.Dir, "etcd")
	if opts.EtcdDataDir != "" {
		etcdDir = opts.EtcdDataDir
	}
	etcd, err := c.run("etcd", bins["etcd"], []string{
		"--name=kubetest",
		"--data-dir=" + etcdDir,
		"--listen-client-urls=" + c.EtcdURL,
		"--advertise-client-urls=" + c.EtcdURL,
		"--listen-peer-urls=" + peerURL,
		"--initial-advertise-peer-urls=" + peerURL,
		"--initial-cluster=kubetest=" + peerURL,
		"--unsafe-no-fsync",
		"--log-level=warn",
	}, logDir)
	if err != nil {
		return err
	}
	if err := waitHTTP(ctx, etcd, http.DefaultClient, c.EtcdURL+"/health"); err != nil {
		return err
	}

	apiArgs := []string{
		"--etcd-servers=" + c.EtcdURL,
		"--bind-address=127.0.0.1",
		"--advertise-address=127.0.0.1",
		"--secure-port=" + strconv.Itoa(apiPort),
		"--cert-dir=" + filepath.Join(c.Dir, "apiserver-certs"),
		"--tls-cert-file=" + c.pki.servingCertFile,
		"--tls-private-key-file=" + c.pki.servingKeyFile,
		"--client-ca-file=" + c.pki.caFile,
		"--authorization-mode=Node,RBAC",
		// With the Node authorizer, what makes a node identity
		// (system:node:<name> in system:nodes) a node's own: it may write
		// only its own Node and Lease, evict and delete only pods bound
		// to it, mint tokens only bound to them (NodeCredentials).
		"--enable-admission-plugins=NodeRestriction",
		"--service-account-issuer=https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file=" + c.pki.saPubFile,
		"--service-account-signing-key-file=" + c.pki.saKeyFile,
		"--service-cluster-ip-range=10.0.0.0/24",
		"--endpoint-reconciler-type=none",
		"--kubelet-preferred-address-types=InternalIP",
		"--allow-privileged=true",
		"--profiling=false",
	}
	apiArgs = append(apiArgs, opts.APIServerArgs...)
	c.apiBin, c.apiArgs, c.api = bins["kube-apiserver"], apiArgs, len(c.procs)
	api, err := c.run("kube-apiserver", bins["kube-apiserver"], apiArgs, logDir)
	if err != nil {
		return err
	}

	c.Config = &rest.Config{
		Host: c.Server,
		TLSClientConfig: rest.TLSClientConfig{
			CAData:   c.pki.caCert,
			CertData: c.pki.adminCert,
			KeyData:  c.pki.adminKey,
		},
		QPS:   200,
		Burst: 400,
	}
	if c.Client, err = kubernetes.NewForConfig(c.Config); err != nil {
		return fmt.Errorf("create admin client: %w", err)
	}
	if c.Kubeconfig, err = c.writeKubeconfig(); err != nil {
		return err
	}
	httpClient, err := rest.HTTPClientFor(c.Config)
	if err != nil {
		return fmt.Errorf("create admin http client: %w", err)
	}
	if err := waitHTTP(ctx, api, httpClient, c.Server+"/readyz"); err != nil {
		return err
	}

	// Its serving certificates are self-signed in cert-dir; /healthz is open to anyone.
	insecure := &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}}
	if opts.Scheduler {
		schedArgs := []string{
			"--kubeconfig=" + c.Kubeconfig,
			"--leader-elect=false",
			"--bind-address=127.0.0.1",
			"--secure-port=" + strconv.Itoa(schedPort),
			"--cert-dir=" + filepath.Join(c.Dir, "scheduler-certs"),
			"--profiling=false",
		}
		sched, err := c.run("kube-scheduler", bins["kube-scheduler"], schedArgs, logDir)
		if err != nil {
			return err
		}
		if err := waitHTTP(ctx, sched, insecure, fmt.Sprintf("https://127.0.0.1:%d/healthz", schedPort)); err != nil {
			return err
		}
	}
	if len(opts.Controllers) == 0 {
		return nil
	}
	kcmArgs := []string{
		"--kubeconfig=" + c.Kubeconfig,
		"--controllers=" + strings.Join(opts.Controllers, ","),
		"--leader-elect=false",
		"--bind-address=127.0.0.1",
		"--secure-port=" + strconv.Itoa(kcmPort),
		"--cert-dir=" + filepath.Join(c.Dir, "controller-manager-certs"),
		"--service-account-private-key-file=" + c.pki.saKeyFile,
		"--root-ca-file=" + c.pki.caFile,
		"--profiling=false",
	}
	kcm, err := c.run("kube-controller-manager", bins["kube-controller-manager"], append(kcmArgs, opts.ControllerManagerArgs...), logDir)
	if err != nil {
		return err
	}
	return waitHTTP(ctx, kcm, insecure, fmt.Sprintf("https://127.0.0.1:%d/healthz", kcmPort))
}

// run starts bin with args in its own process group (stopping it reaches its
// children), its output in logDir/name.log; it dies with the test binary
// (lab.RunProcess).
func (c *Cluster) run(name, bin string, args []string, logDir string) (*lab.Process, error) {
	cmd := exec.Command(bin, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	p, err := lab.RunProcess(name, cmd, filepath.Join(logDir, name+".log"))
	if err != nil {
		return nil, err
	}
	c.procs = append(c.procs, p)
	return p, nil
}

// waitHTTP polls url until it answers 200, p exits, or ctx ends.
func waitHTTP(ctx context.Context, p *lab.Process, client *http.Client, url string) error {
	var last error
	err := wait.PollUntilContextCancel(ctx, 100*time.Millisecond, true, func(ctx context.Context) (bool, error) {
		if p.Exited() {
			return false, p.ExitError()
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return false, fmt.Errorf("build request for %s: %w", url, err)
		}
		resp, err := client.Do(req)
		if err != nil {
			last = err
			return false, nil
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			last = fmt.Errorf("%s answered %s", url, resp.Status)
			return false, nil
		}
		return true, nil
	})
	if err != nil && p.Exited() {
		return p.ExitError()
	}
	if err != nil {
		return fmt.Errorf("wait for %s (%s): %w (last: %v)\n%s", p.Name, url, err, last, p.Tail(20))
	}
	return nil
}

func (c *Cluster) writeKubeconfig() (string, error) {
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["kubetest"] = &clientcmdapi.Cluster{Server: c.Server, CertificateAuthorityData: c.pki.caCert}
	cfg.AuthInfos["admin"] = &clientcmdapi.AuthInfo{ClientCertificateData: c.pki.adminCert, ClientKeyData: c.pki.adminKey}
	cfg.Contexts["kubetest"] = &clientcmdapi.Context{Cluster: "kubetest", AuthInfo: "admin"}
	cfg.CurrentContext = "kubetest"
	path := filepath.Join(c.Dir, "kubeconfig")
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		return "", fmt.Errorf("write kubeconfig: %w", err)
	}
	return path, nil
}

// stop ends the components in reverse start order; on failure it logs their tails.
func (c *Cluster) stop() {
	if c.detach != nil {
		c.detach()
		return
	}
	if c.t.Failed() {
		for _, p := range c.procs {
			c.t.Logf("last lines of %s (%s):\n%s", p.Name, p.Log, p.Tail(15))
		}
	}
	for i := len(c.procs) - 1; i >= 0; i-- {
		c.procs[i].Stop(10 * time.Second)
	}
}

// StopAPIServer stops kube-apiserver (SIGTERM, SIGKILL after 10 s), as an
// outage or an upgrade does: every client's requests and watches fail until
// StartAPIServer. etcd and the other components keep running.
func (c *Cluster) StopAPIServer() {
	if c.detach != nil {
		c.t.Fatal("StopAPIServer on a cluster a broker runs: run the test where it starts its own (unset " + EnvBroker + ")")
	}
	c.procs[c.api].Stop(10 * time.Second)
}

// StartAPIServer starts kube-apiserver again with the same flags, on the
// same port, and waits until it is ready. Its log is
// logs/kube-apiserver-<n>.log for the n-th restart.
func (c *Cluster) StartAPIServer() error {
	if c.detach != nil {
		return errors.New("StartAPIServer on a cluster a broker runs: run the test where it starts its own (unset " + EnvBroker + ")")
	}
	c.restarts++
	name := fmt.Sprintf("kube-apiserver-%d", c.restarts)
	// At niceness 10: a starting kube-apiserver takes both cores of a
	// small lab machine for seconds, and the agents the tests run beside
	// it (whose peer checks have deadlines) would starve; on a cluster it
	// starts on a machine of its own.
	cmd := exec.Command("nice", append([]string{"-n", "10", c.apiBin}, c.apiArgs...)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	p, err := lab.RunProcess(name, cmd, filepath.Join(c.Dir, "logs", name+".log"))
	if err != nil {
		return err
	}
	c.procs[c.api] = p
	httpClient, err := rest.HTTPClientFor(c.Config)
	if err != nil {
		return fmt.Errorf("create admin http client: %w", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	return waitHTTP(ctx, p, httpClient, c.Server+"/readyz")
}

// ImpersonateConfig returns a copy of the admin config that acts as user with
// groups (through impersonation, so RBAC judges user and groups, not the admin).
func (c *Cluster) ImpersonateConfig(user string, groups ...string) *rest.Config {
	cfg := rest.CopyConfig(c.Config)
	cfg.Impersonate = rest.ImpersonationConfig{UserName: user, Groups: groups}
	return cfg
}

// NodeGroup is the group of every node identity.
const NodeGroup = "system:nodes"

// NodeUser is the user name of node's identity.
func NodeUser(node string) string { return "system:node:" + node }

// ClientCredentials mints a client certificate and key (PEM) for user in
// groups, signed by the cluster's CA and valid for a day.
func (c *Cluster) ClientCredentials(t testing.TB, user string, groups ...string) (cert, key []byte) {
	t.Helper()
	cert, key, err := c.pki.clientCert(user, groups)
	if err != nil {
		t.Fatalf("issue a client certificate for %s: %v", user, err)
	}
	return cert, key
}

// NodeCredentials mints the client certificate and key (PEM) of node's own
// identity, system:node:<node> in group system:nodes: what a kubelet holds
// after TLS bootstrap or kubeadm join. Under the Node authorizer and
// NodeRestriction it reaches only that node's objects.
func (c *Cluster) NodeCredentials(t testing.TB, node string) (cert, key []byte) {
	t.Helper()
	return c.ClientCredentials(t, NodeUser(node), NodeGroup)
}

// NodeConfig returns a config that authenticates as node (NodeCredentials).
func (c *Cluster) NodeConfig(t testing.TB, node string) *rest.Config {
	t.Helper()
	cert, key := c.NodeCredentials(t, node)
	return &rest.Config{
		Host:            c.Server,
		TLSClientConfig: rest.TLSClientConfig{CAData: c.pki.caCert, CertData: cert, KeyData: key},
		QPS:             c.Config.QPS,
		Burst:           c.Config.Burst,
	}
}

// KubeletClientFile is where a kubelet keeps its rotating client certificate
// and key (one PEM file) under its root directory, and where kubeadm's
// kubelet.conf points.
const KubeletClientFile = "pki/kubelet-client-current.pem"

// WriteNodeKubeconfig writes node's credentials as kubeadm lays them out on a
// node: the certificate and key in one PEM file, kubeletRoot/KubeletClientFile,
// and a kubeconfig at path that names that file (not its data, so that a
// client reloads it when kubelet rotates it). server "" is the API server
// itself; another address (a proxy) goes in the kubeconfig instead.
func (c *Cluster) WriteNodeKubeconfig(t testing.TB, path, kubeletRoot, node, server string) {
	t.Helper()
	cert, key := c.NodeCredentials(t, node)
	pemFile := filepath.Join(kubeletRoot, KubeletClientFile)
	if err := os.MkdirAll(filepath.Dir(pemFile), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(pemFile, append(cert, key...), 0o600); err != nil {
		t.Fatalf("write node client certificate: %v", err)
	}
	if server == "" {
		server = c.Server
	}
	cfg := clientcmdapi.NewConfig()
	cfg.Clusters["default-cluster"] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: c.pki.caCert}
	cfg.AuthInfos["default-auth"] = &clientcmdapi.AuthInfo{ClientCertificate: pemFile, ClientKey: pemFile}
	cfg.Contexts["default-context"] = &clientcmdapi.Context{Cluster: "default-cluster", AuthInfo: "default-auth"}
	cfg.CurrentContext = "default-context"
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := clientcmd.WriteToFile(*cfg, path); err != nil {
		t.Fatalf("write node kubeconfig: %v", err)
	}
}

// PodTokenConfig returns a config that authenticates with a token of pod's
// ServiceAccount bound to pod (TokenRequest with a boundObjectRef, one
// hour), as kubelet projects one into every pod. The API server adds the
// pod's node to a pod-bound token: its user carries the extra
// authentication.kubernetes.io/node-name, which admission policies can
// match. The pod must exist.
func (c *Cluster) PodTokenConfig(t testing.TB, pod *corev1.Pod) *rest.Config {
	t.Helper()
	sa := pod.Spec.ServiceAccountName
	if sa == "" {
		sa = "default"
	}
	seconds := int64(3600)
	tr, err := c.Client.CoreV1().ServiceAccounts(pod.Namespace).CreateToken(context.Background(), sa, &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{
			ExpirationSeconds: &seconds,
			BoundObjectRef:    &authenticationv1.BoundObjectReference{APIVersion: "v1", Kind: "Pod", Name: pod.Name, UID: pod.UID},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("request a token of %s/%s bound to pod %s: %v", pod.Namespace, sa, pod.Name, err)
	}
	return &rest.Config{
		Host:            c.Server,
		BearerToken:     tr.Status.Token,
		TLSClientConfig: rest.TLSClientConfig{CAData: c.pki.caCert},
		QPS:             c.Config.QPS,
		Burst:           c.Config.Burst,
	}
}

// ServiceAccountConfig returns a config that authenticates with a real token of the
// ServiceAccount namespace/name (TokenRequest API, one hour), creating the account if
// it does not exist. It carries no client certificate, so RBAC sees only the account.
func (c *Cluster) ServiceAccountConfig(t testing.TB, namespace, name string) *rest.Config {
	t.Helper()
	ctx := context.Background()
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name}}
	if _, err := c.Client.CoreV1().ServiceAccounts(namespace).Create(ctx, sa, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatalf("create service account %s/%s: %v", namespace, name, err)
	}
	seconds := int64(3600)
	tr, err := c.Client.CoreV1().ServiceAccounts(namespace).CreateToken(ctx, name, &authenticationv1.TokenRequest{
		Spec: authenticationv1.TokenRequestSpec{ExpirationSeconds: &seconds},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("request token for service account %s/%s: %v", namespace, name, err)
	}
	return &rest.Config{
		Host:            c.Server,
		BearerToken:     tr.Status.Token,
		TLSClientConfig: rest.TLSClientConfig{CAData: c.pki.caCert},
		QPS:             c.Config.QPS,
		Burst:           c.Config.Burst,
	}
}

// CreateNamespace creates a namespace and its "default" ServiceAccount (which the
// ServiceAccount admission plugin wants before it admits a pod) when no
// controller-manager has made it yet.
func (c *Cluster) CreateNamespace(t testing.TB, name string) *corev1.Namespace {
	t.Helper()
	ctx := context.Background()
	ns, err := c.Client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create namespace %s: %v", name, err)
	}
	sa := &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Namespace: name, Name: "default"}}
	if _, err := c.Client.CoreV1().ServiceAccounts(name).Create(ctx, sa, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatalf("create default service account in %s: %v", name, err)
	}
	return ns
}

// Kubectl runs kubectl against the cluster as the admin and returns its combined output.
func (c *Cluster) Kubectl(args ...string) (string, error) {
	bin := filepath.Join(c.BinDir, "kubectl")
	if _, err := os.Stat(bin); err != nil {
		return "", fmt.Errorf("kubectl not found (build it with scripts/tools.sh kubectl): %w", err)
	}
	cmd := exec.Command(bin, append([]string{"--kubeconfig=" + c.Kubeconfig}, args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		var exit *exec.ExitError
		if errors.As(err, &exit) {
			return string(out), fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
		}
		return string(out), fmt.Errorf("kubectl %s: %w", strings.Join(args, " "), err)
	}
	return string(out), nil
}
