package agent_test

import (
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"

	"github.com/mountmedic/mountmedic/agent"
	"github.com/mountmedic/mountmedic/remount"
	"github.com/mountmedic/mountmedic/scripts/csilab"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// BenchmarkAgentSteadyState runs the real mountmedic binary (`mountmedic
// agent`, default flags) as the mountmedic ServiceAccount over a lab node
// with n healthy FUSE volumes, each its own FUSE connection (one lab
// daemon serves them all) with a staging mount, a publish bind and a
// subPath bind, and a pod in the API. Each iteration samples 10 s of
// steady state and reports the agent process's CPU (percent of one core),
// its RSS, and its API requests per minute as a proxy in front of the API
// server counts them. With MOUNTMEDIC_BENCH_HEAP=<dir> the binary is built
// with -tags pprof, a CPU profile of its first sampled window is written to
// <dir>/cpu-<n>.pprof and a heap profile to <dir>/heap-<n>.pprof at the
// end. MOUNTMEDIC_BENCH_AGENT_ARGS adds flags
// to the agent's command line.
//
//	go test -run '^$' -bench AgentSteadyState -benchtime 2x ./agent
func BenchmarkAgentSteadyState(b *testing.B) {
	lab.RequireRoot(b)
	heapDir := os.Getenv("MOUNTMEDIC_BENCH_HEAP")
	bin := buildAgent(b, heapDir != "")
	for _, n := range []int{200, 1000} {
		b.Run("volumes="+strconv.Itoa(n), func(b *testing.B) {
			e := newEnv(b, nil)
			vols := make([]*volume, n)
			stagings := make([]string, n)
			for i := range n {
				vols[i] = e.createVolume("v"+strconv.Itoa(i), nil)
				stagings[i] = vols[i].staging
			}
			fs := lab.StartFaultFSMany(b, stagings)
			if err := os.Mkdir(filepath.Join(fs.BackingDir(), "sub"), 0o755); err != nil {
				b.Fatal(err)
			}
			for i, v := range vols {
				pod := e.createPod("v"+strconv.Itoa(i), v, podOptions{subPath: "sub"})
				pub := e.kubelet.Publish(string(pod.UID), v.pv.Name, labDriver, v.handle, v.staging, false)
				e.kubelet.SubPath(string(pod.UID), v.pv.Name, "app", 1, filepath.Join(pub, "sub"))
			}
			var pprofAddr string
			if heapDir != "" {
				pprofAddr = freeAddr(b)
			}
			p := startAgentProcess(b, e, bin, "MOUNTMEDIC_PPROF_ADDR="+pprofAddr)
			time.Sleep(5 * time.Second) // warm-up: first scan, informer sync
			// and the PVs read ahead, 5 a second: steady state is when
			// the agent has sent nothing for 2 s.
			settle := time.Duration(n/5+60) * time.Second
			for deadline, last := time.Now().Add(settle), int64(-1); ; {
				r := p.requests.Load()
				if r == last {
					break
				}
				if time.Now().After(deadline) {
					b.Fatalf("the agent still sends requests %s after its warm-up (%d so far)", settle, r)
				}
				last = r
				time.Sleep(2 * time.Second)
			}
			b.ResetTimer()
			var cpu, reqs float64
			var rss, anon int
			const window = 10 * time.Second
			for i := 0; i < b.N; i++ {
				c0, r0 := procCPU(b, p.pid), p.requests.Load()
				if heapDir != "" && i == 0 {
					saveURL(b, fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", pprofAddr, int(window.Seconds())), filepath.Join(heapDir, "cpu-"+strconv.Itoa(n)+".pprof"))
				} else {
					time.Sleep(window)
				}
				cpu += (procCPU(b, p.pid) - c0).Seconds()
				reqs += float64(p.requests.Load() - r0)
				if r := procRSS(b, p.pid); r > rss {
					// The binary's pages (file) apart from the heap and
					// stacks (anonymous), at the peak.
					rss, anon = r, procStatus(b, p.pid, "RssAnon")
				}
			}
			b.StopTimer()
			secs := window.Seconds() * float64(b.N)
			b.ReportMetric(100*cpu/secs, "cpu-%")
			b.ReportMetric(float64(rss)/1024, "rss-MiB")
			b.ReportMetric(float64(anon)/1024, "rss-anon-MiB")
			b.ReportMetric(reqs/secs*60, "api-req/min")
			if broken := p.metric(b, "mountmedic_stale_mounts"); broken != 0 {
				b.Fatalf("%v stale mounts reported on a healthy node", broken)
			}
			if heapDir != "" {
				saveURL(b, "http://"+pprofAddr+"/debug/pprof/heap", filepath.Join(heapDir, "heap-"+strconv.Itoa(n)+".pprof"))
			}
		})
	}
}

// freeAddr is a free loopback TCP address.
func freeAddr(b *testing.B) string {
	b.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// saveURL writes the body of a GET of url to path.
func saveURL(b *testing.B, url, path string) {
	b.Helper()
	resp, err := http.Get(url)
	if err != nil {
		b.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		b.Fatal(err)
	}
	if err := os.WriteFile(path, body, 0o644); err != nil {
		b.Fatal(err)
	}
	b.Logf("profile of the agent: %s", path)
}

// buildAgent builds cmd/mountmedic into a temporary directory (with the
// pprof build tag when profiled).
func buildAgent(b *testing.B, profiled bool) string {
	b.Helper()
	bin := filepath.Join(b.TempDir(), "mountmedic")
	args := []string{"build", "-o", bin}
	if profiled {
		args = append(args, "-tags", "pprof")
	}
	cmd := exec.Command("go", append(args, "../cmd/mountmedic")...)
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		b.Fatalf("go build ./cmd/mountmedic: %v\n%s", err, out)
	}
	return bin
}

type agentProcess struct {
	pid      int
	metrics  string
	requests atomic.Int64
}

// startAgentProcess runs `mountmedic agent` with its default flags for the
// lab node, with the node's credentials (the proxy adds them), through a
// request-counting proxy to the API server; env is added to its environment.
func startAgentProcess(b *testing.B, e *env, bin string, env ...string) *agentProcess {
	b.Helper()
	p := &agentProcess{}
	target, err := url.Parse(e.agentConfig.Host)
	if err != nil {
		b.Fatal(err)
	}
	transport, err := rest.TransportFor(e.agentConfig)
	if err != nil {
		b.Fatal(err)
	}
	proxy := httputil.NewSingleHostReverseProxy(target)
	proxy.Transport = transport
	proxy.FlushInterval = -1 // watches stream
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p.requests.Add(1)
		proxy.ServeHTTP(w, r)
	})}
	go srv.Serve(ln)
	b.Cleanup(func() { srv.Close() })

	kc := clientcmdapi.NewConfig()
	kc.Clusters["lab"] = &clientcmdapi.Cluster{Server: "http://" + ln.Addr().String()}
	kc.Contexts["lab"] = &clientcmdapi.Context{Cluster: "lab", AuthInfo: "proxy"}
	kc.AuthInfos["proxy"] = &clientcmdapi.AuthInfo{}
	kc.CurrentContext = "lab"
	kubeconfig := filepath.Join(b.TempDir(), "kubeconfig")
	if err := clientcmd.WriteToFile(*kc, kubeconfig); err != nil {
		b.Fatal(err)
	}
	mln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	p.metrics = mln.Addr().String()
	mln.Close()

	// MOUNTMEDIC_BENCH_AGENT_ARGS adds flags, for an A/B of one setting
	// (for example --stall-poll=0).
	args := append([]string{"agent", "--node-kubeconfig", kubeconfig, "--node-name", e.node,
		"--kubelet-root", e.kubelet.Root(), "--metrics-addr", p.metrics}, strings.Fields(os.Getenv("MOUNTMEDIC_BENCH_AGENT_ARGS"))...)
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), env...)
	logf, err := os.Create(filepath.Join(b.TempDir(), "agent.log"))
	if err != nil {
		b.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		b.Fatalf("start %s: %v", bin, err)
	}
	p.pid = cmd.Process.Pid
	b.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		logf.Close()
	})
	deadline := time.Now().Add(time.Minute)
	for {
		resp, err := http.Get("http://" + p.metrics + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return p
			}
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(logf.Name())
			b.Fatalf("agent not ready within a minute: %v\n%s", err, log)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// metric sums every sample of the metric name.
func (p *agentProcess) metric(b *testing.B, name string) float64 {
	b.Helper()
	resp, err := http.Get("http://" + p.metrics + "/metrics")
	if err != nil {
		b.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		b.Fatal(err)
	}
	sum := 0.0
	for _, line := range strings.Split(string(body), "\n") {
		if !strings.HasPrefix(line, name+"{") && !strings.HasPrefix(line, name+" ") {
			continue
		}
		f := strings.Fields(line)
		v, _ := strconv.ParseFloat(f[len(f)-1], 64)
		sum += v
	}
	return sum
}

// procCPU is the user+system CPU time of pid.
func procCPU(b *testing.B, pid int) time.Duration {
	b.Helper()
	raw, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		b.Fatal(err)
	}
	// Fields after the command name, which is in parentheses.
	s := string(raw)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	utime, _ := strconv.ParseInt(f[11], 10, 64)
	stime, _ := strconv.ParseInt(f[12], 10, 64)
	const hz = 100 // USER_HZ
	return time.Duration(utime+stime) * time.Second / hz
}

// procRSS is the resident set of pid in KiB.
func procRSS(b *testing.B, pid int) int {
	return procStatus(b, pid, "VmRSS")
}

// procStatus is a kB field of /proc/<pid>/status (VmRSS, RssAnon,
// RssFile...).
func procStatus(b *testing.B, pid int, field string) int {
	b.Helper()
	raw, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		b.Fatal(err)
	}
	for _, line := range strings.Split(string(raw), "\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			n, _ := strconv.Atoi(strings.Fields(v)[0])
			return n
		}
	}
	return 0
}

// BenchmarkAgentHeal measures, at the agent's default settings and with the
// real k8s-csi-s3 driver, what a user sees when the node plugin is killed
// with its whole process tree and its DaemonSet brings it back one second
// later (the peers' measurement): kill -> the agent counts the volume broken
// (detect), plugin back -> the file reads again inside the container through
// its private mount (back-to-healed), and kill -> healed. One volume, a
// pod with a private and a HostToContainer container and a subPath.
//
//	go test -run '^$' -bench AgentHeal -benchtime 10x ./agent
func BenchmarkAgentHeal(b *testing.B) {
	d := newDriverEnv(b)
	s := d.newVolume("bench")
	cfg := agent.DefaultConfig()
	cfg.NodeName, cfg.KubeletRoot, cfg.MetricsAddr = d.node, d.kubelet.Root(), ""
	a := d.startAgent(cfg, d.withRepairer(cfg, remount.Config{}, agent.Deps{}))
	inContainer := s.private.Path("/data/data.txt")
	var detect, backHealed, killHealed []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		killed := time.Now()
		d.drv.Kill()
		restarted := make(chan time.Time, 1)
		go func() {
			time.Sleep(time.Second)
			if err := d.drv.Restart(); err != nil {
				panic(err)
			}
			restarted <- time.Now()
		}()
		var seen time.Time
		for seen.IsZero() {
			if n, _ := a.metric(`mountmedic_stale_mounts{driver="` + csilab.DriverName + `",kind="publish",state="Disconnected"}`); n > 0 {
				seen = time.Now()
			}
			time.Sleep(5 * time.Millisecond)
		}
		var healed time.Time
		deadline := time.Now().Add(2 * time.Minute)
		for healed.IsZero() {
			if got, err := os.ReadFile(inContainer); err == nil && string(got) == "data of bench" {
				healed = time.Now()
				break
			}
			if time.Now().After(deadline) {
				b.Fatalf("run %d: not healed within 2 minutes", i+1)
			}
			time.Sleep(5 * time.Millisecond)
		}
		back := <-restarted
		if seen.After(healed) {
			seen = healed // healed before the probe saw it: the driver's return woke the agent first
		}
		detect = append(detect, seen.Sub(killed))
		backHealed = append(backHealed, max(0, healed.Sub(back)))
		killHealed = append(killHealed, healed.Sub(killed))
		time.Sleep(3 * time.Second) // let the episode end before the next kill
	}
	b.StopTimer()
	for name, ds := range map[string][]time.Duration{"detect": detect, "back-to-healed": backHealed, "kill-to-healed": killHealed} {
		slices.Sort(ds)
		b.ReportMetric(quantile(ds, 0.5).Seconds(), name+"-p50-s")
		b.ReportMetric(quantile(ds, 0.99).Seconds(), name+"-p99-s")
	}
}

// quantile is the q-quantile of sorted ds (nearest rank).
func quantile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	i := int(math.Ceil(q*float64(len(ds)))) - 1
	return ds[max(0, min(i, len(ds)-1))]
}

// BenchmarkAgentHungHeal measures hung -> healed at the agent's defaults
// (2 s probe interval and deadline) with the real k8s-csi-s3 driver, as the
// e2e hung scenario does: the volume's s3fs is stopped (SIGSTOP) while the
// private container reads its file; the agent finds the probe past its
// deadline, aborts the FUSE connection (the container's blocked read
// returns: aborted), re-stages and swaps the fresh mount into the container
// (it reads the file again: healed). Each run waits a random part of a probe
// interval before the hang, so that the hang falls anywhere in the cycle.
//
//	go test -run '^$' -bench AgentHungHeal -benchtime 20x ./agent
func BenchmarkAgentHungHeal(b *testing.B) {
	d := newDriverEnv(b)
	s := d.newVolume("hung")
	cfg := agent.DefaultConfig()
	cfg.NodeName, cfg.KubeletRoot, cfg.MetricsAddr = d.node, d.kubelet.Root(), ""
	d.startAgent(cfg, d.withRepairer(cfg, remount.Config{}, agent.Deps{}))
	inContainer := s.private.Path("/data/data.txt")
	var aborted, healed []time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		time.Sleep(time.Duration(rand.Int64N(int64(cfg.ProbeInterval))))
		pid := s3fsPid(b, "hung")
		if err := unix.Kill(pid, unix.SIGSTOP); err != nil {
			b.Fatal(err)
		}
		hung := time.Now()
		var abortedAt, healedAt time.Time
		deadline := hung.Add(2 * time.Minute)
		for healedAt.IsZero() {
			done := make(chan error, 1)
			go func() {
				got, err := os.ReadFile(inContainer)
				if err == nil && string(got) != "data of hung" {
					err = fmt.Errorf("read %q", got)
				}
				done <- err
			}()
			select {
			case err := <-done:
				if err == nil {
					healedAt = time.Now()
				} else if abortedAt.IsZero() {
					abortedAt = time.Now()
				}
			case <-time.After(time.Until(deadline)):
				b.Fatalf("run %d: the container's read still blocked 2 minutes after the hang", i+1)
			}
			time.Sleep(5 * time.Millisecond)
		}
		if abortedAt.IsZero() {
			abortedAt = healedAt
		}
		_ = unix.Kill(pid, unix.SIGKILL)
		aborted = append(aborted, abortedAt.Sub(hung))
		healed = append(healed, healedAt.Sub(hung))
		b.Logf("run %d: aborted %.2fs, healed %.2fs after the hang", i+1, abortedAt.Sub(hung).Seconds(), healedAt.Sub(hung).Seconds())
		time.Sleep(3 * time.Second) // let the episode end before the next hang
	}
	b.StopTimer()
	for name, ds := range map[string][]time.Duration{"hang-to-aborted": aborted, "hang-to-healed": healed} {
		slices.Sort(ds)
		b.ReportMetric(quantile(ds, 0.5).Seconds(), name+"-p50-s")
		b.ReportMetric(quantile(ds, 0.99).Seconds(), name+"-p99-s")
	}
}

// s3fsPid finds the running (not stopped) s3fs process that serves the
// lab volume named name (its bucket path ends in /name).
func s3fsPid(b testing.TB, name string) int {
	b.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ents, _ := os.ReadDir("/proc")
		for _, e := range ents {
			pid, err := strconv.Atoi(e.Name())
			if err != nil {
				continue
			}
			cmd, err := os.ReadFile("/proc/" + e.Name() + "/cmdline")
			if err != nil {
				continue
			}
			args := strings.Split(string(cmd), "\x00")
			// s3fs splits its bucket:/path argument in place: match either.
			if len(args) < 2 || filepath.Base(args[0]) != "s3fs" ||
				!slices.ContainsFunc(args[1:3], func(a string) bool { return a == "/"+name || strings.HasSuffix(a, ":/"+name) }) {
				continue
			}
			st, err := os.ReadFile("/proc/" + e.Name() + "/stat")
			if err != nil {
				continue
			}
			s := string(st)
			if f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:]); len(f) > 0 && f[0] != "T" && f[0] != "Z" {
				return pid
			}
		}
		if time.Now().After(deadline) {
			b.Fatalf("no running s3fs for volume %s", name)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
