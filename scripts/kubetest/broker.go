package kubetest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/mountmedic/mountmedic/scripts/lab"
)

// EnvBroker names the broker (host:port) Start asks for clusters instead of
// starting them itself: set for a test binary in the guest of
// scripts/guest, whose emulated CPU would take the control plane's start
// and running away from the tests, by the host test that boots the guest.
const EnvBroker = "MOUNTMEDIC_KUBETEST_BROKER"

// Broker starts a cluster for each test binary that asks, on this machine
// at full speed, with its files in a directory the asking side can read:
// a guest of scripts/guest sees the host's files read-only, its run
// directory read-write.
type Broker struct {
	// Addr is where it listens, on 127.0.0.1 (the guest reaches it at
	// 10.0.2.2, qemu's user-mode network's address of the host's loopback).
	Addr string

	t        testing.TB
	dir      string
	mu       sync.Mutex
	clusters map[int]*Cluster
	next     int
	// Started are the start times of the clusters it ran, for the figures.
	Started []time.Duration
}

// attachAnswer is the broker's answer to POST /clusters (the Options in
// JSON): it names the cluster's directory
// and API server; DELETE /clusters/<id> stops it.
type attachAnswer struct {
	ID     int    `json:"id"`
	Dir    string `json:"dir"`
	Server string `json:"server"`
	Error  string `json:"error,omitempty"`
}

// Serve runs a broker until the test ends; the clusters it starts keep
// their files under dir and stop when asked or when the test ends.
func Serve(t testing.TB, dir string) *Broker {
	t.Helper()
	for _, name := range components(Options{Controllers: DefaultControllers, Scheduler: true}) {
		if p := filepath.Join(lab.BinDir(), name); !isFile(p) {
			t.Fatalf("the cluster broker needs %s: build it with scripts/tools.sh %s", p, name)
		}
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	b := &Broker{Addr: l.Addr().String(), t: t, dir: dir, clusters: map[int]*Cluster{}}
	srv := &http.Server{Handler: b}
	go srv.Serve(l)
	t.Cleanup(func() {
		srv.Close()
		b.mu.Lock()
		defer b.mu.Unlock()
		for id, c := range b.clusters {
			c.stop()
			delete(b.clusters, id)
		}
	})
	return b
}

func (b *Broker) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch {
	case r.Method == http.MethodPost && r.URL.Path == "/clusters":
		var opts Options
		if err := json.NewDecoder(r.Body).Decode(&opts); err != nil {
			http.Error(w, "decode the options: "+err.Error(), http.StatusBadRequest)
			return
		}
		ans := b.start(opts)
		if ans.Error != "" {
			w.WriteHeader(http.StatusInternalServerError)
		}
		_ = json.NewEncoder(w).Encode(ans)
	case r.Method == http.MethodDelete:
		id, err := strconv.Atoi(filepath.Base(r.URL.Path))
		if err != nil {
			http.Error(w, "no cluster "+r.URL.Path, http.StatusNotFound)
			return
		}
		b.mu.Lock()
		c := b.clusters[id]
		delete(b.clusters, id)
		b.mu.Unlock()
		if c != nil {
			c.stop()
		}
	default:
		http.Error(w, "POST /clusters or DELETE /clusters/<id>", http.StatusNotFound)
	}
}

func (b *Broker) start(opts Options) attachAnswer {
	opts.EtcdDataDir = ""
	b.mu.Lock()
	b.next++
	id := b.next
	b.mu.Unlock()
	dir := filepath.Join(b.dir, strconv.Itoa(id))
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return attachAnswer{Error: err.Error()}
	}
	bins := make(map[string]string)
	for _, name := range components(opts) {
		bins[name] = filepath.Join(lab.BinDir(), name)
	}
	c := &Cluster{Dir: dir, BinDir: lab.BinDir(), t: b.t}
	began := time.Now()
	if err := c.start(bins, opts); err != nil {
		c.stop()
		return attachAnswer{Error: fmt.Sprintf("start control plane: %v", err)}
	}
	b.mu.Lock()
	b.clusters[id] = c
	b.Started = append(b.Started, time.Since(began))
	b.mu.Unlock()
	return attachAnswer{ID: id, Dir: dir, Server: c.Server}
}

func isFile(p string) bool {
	fi, err := os.Stat(p)
	return err == nil && fi.Mode().IsRegular()
}

// Attach asks the broker at addr for a cluster of opts and returns it: the
// same clients as Start's, its files read from the directory the broker
// names, its API server's port on this side's 127.0.0.1 forwarded to the
// broker's host (so the server's address, its certificate and every
// kubeconfig are those of the host). The cluster stops when the test ends.
// StopAPIServer and StartAPIServer are the host's only.
func Attach(t testing.TB, addr string, opts Options) *Cluster {
	t.Helper()
	body, err := json.Marshal(opts)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.Post("http://"+addr+"/clusters", "application/json", bytes.NewReader(body))
	if err != nil {
		t.Fatalf("ask the cluster broker %s (%s) for a cluster: %v", addr, EnvBroker, err)
	}
	raw, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	var ans attachAnswer
	if err := json.Unmarshal(raw, &ans); err != nil || ans.Error != "" {
		t.Fatalf("the cluster broker %s answered %s: %s (%v)", addr, resp.Status, raw, err)
	}
	c := &Cluster{Dir: ans.Dir, BinDir: lab.BinDir(), Server: ans.Server, t: t,
		Kubeconfig: filepath.Join(ans.Dir, "kubeconfig")}
	c.detach = func() {
		req, _ := http.NewRequest(http.MethodDelete, "http://"+addr+"/clusters/"+strconv.Itoa(ans.ID), nil)
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
	}
	t.Cleanup(c.stop)
	if c.pki, err = loadPKI(ans.Dir); err != nil {
		t.Fatalf("read the cluster's key material: %v", err)
	}
	u, err := url.Parse(ans.Server)
	if err != nil {
		t.Fatalf("the broker's API server %q: %v", ans.Server, err)
	}
	host, _, _ := net.SplitHostPort(addr)
	if ip := net.ParseIP(host); ip == nil || !ip.IsLoopback() {
		// A broker on this machine's loopback runs the server right here.
		l, err := net.Listen("tcp", u.Host)
		if err != nil {
			t.Fatalf("forward the API server's address %s here: %v", u.Host, err)
		}
		t.Cleanup(func() { l.Close() })
		go forward(l, net.JoinHostPort(host, u.Port()))
	}
	c.Config = &rest.Config{
		Host:            c.Server,
		TLSClientConfig: rest.TLSClientConfig{CAData: c.pki.caCert, CertData: c.pki.adminCert, KeyData: c.pki.adminKey},
		QPS:             200,
		Burst:           400,
	}
	if c.Client, err = kubernetes.NewForConfig(c.Config); err != nil {
		t.Fatalf("create admin client: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	if _, err := c.Client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx); err != nil {
		t.Fatalf("the broker's API server %s through %s: %v", ans.Server, host, err)
	}
	return c
}

// forward copies each connection l accepts to target and back.
func forward(l net.Listener, target string) {
	for {
		conn, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer conn.Close()
			up, err := net.Dial("tcp", target)
			if err != nil {
				return
			}
			defer up.Close()
			go func() { _, _ = io.Copy(up, conn); up.(*net.TCPConn).CloseWrite() }()
			_, _ = io.Copy(conn, up)
		}()
	}
}
