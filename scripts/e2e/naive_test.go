package e2e_test

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/mountmedic/mountmedic/scripts/e2e"
	"github.com/mountmedic/mountmedic/scripts/lab"
)

// naiveBound is how long the naive way gets to heal after the plugin is
// back.
const naiveBound = time.Minute

// naive is a running naive.sh.
type naive struct {
	cmd      *exec.Cmd
	done     chan struct{}
	stopOnce sync.Once

	mu      sync.Mutex
	deletes []naiveDelete
}

type naiveDelete struct {
	at  time.Time
	pod string
}

// startNaive runs scripts/e2e/naive.sh as a user would: as root on the
// node (the test's mount namespace sees the node's mounts), with kubectl.
func (e *env) startNaive(t *testing.T) *naive {
	t.Helper()
	cmd := exec.Command("/bin/sh", "naive.sh")
	cmd.Env = append(os.Environ(),
		"KUBECONFIG="+e.c.Kubeconfig,
		"KUBECTL="+filepath.Join(e.c.BinDir, "kubectl"),
		"KUBELET_ROOT="+e2e.KubeletRoot,
		"INTERVAL=5", "STAT_TIMEOUT=5")
	cmd.Stderr = os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	// Pdeathsig fires when the forking thread exits: lab.StartProcess forks
	// from a thread that lives as long as the test binary.
	if err := lab.StartProcess(cmd); err != nil {
		t.Fatalf("start naive.sh: %v", err)
	}
	n := &naive{cmd: cmd, done: make(chan struct{})}
	go func() {
		defer close(n.done)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			f := strings.Fields(sc.Text())
			if len(f) < 3 || f[1] != "deleted" {
				continue
			}
			sec, err := strconv.ParseFloat(f[0], 64)
			if err != nil {
				continue
			}
			n.mu.Lock()
			n.deletes = append(n.deletes, naiveDelete{at: time.Unix(0, int64(sec*1e9)), pod: f[2]})
			n.mu.Unlock()
		}
	}()
	t.Cleanup(n.stop)
	return n
}

// stop kills the script and its children, once: after Wait has reaped the
// script, its process group ID may belong to someone else.
func (n *naive) stop() {
	n.stopOnce.Do(func() {
		_ = syscall.Kill(-n.cmd.Process.Pid, syscall.SIGKILL)
		<-n.done
		_ = n.cmd.Wait()
	})
}

// cpu is the CPU time the script and its reaped children used.
func (n *naive) cpu() (time.Duration, error) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", n.cmd.Process.Pid))
	if err != nil {
		return 0, err
	}
	// Fields after the command name in parentheses: utime is the 14th field
	// of the line, stime, cutime, cstime follow.
	f := strings.Fields(string(data[strings.LastIndexByte(string(data), ')')+2:]))
	var ticks int64
	for _, i := range []int{11, 12, 13, 14} {
		v, err := strconv.ParseInt(f[i], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("parse /proc/%d/stat: %w", n.cmd.Process.Pid, err)
		}
		ticks += v
	}
	return time.Duration(ticks) * time.Second / 100, nil // USER_HZ
}

func (n *naive) deleted() []naiveDelete {
	n.mu.Lock()
	defer n.mu.Unlock()
	return append([]naiveDelete(nil), n.deletes...)
}

// naiveScenario: the same plugin crash as the live scenario, healed the way
// a user scripts it (naive.sh) while the agent only watches. The replacement
// pod binds the dead staging mount again: the script deletes pod after pod
// and the application does not read its files again.
func naiveScenario(t *testing.T, e *env, ns string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	w := e.workload(t, ctx, ns)
	pod := w.pod(t, ctx)
	script := e.startNaive(t)

	o := e.crash(t, ctx, w, pod, pluginDown)
	var healedAt time.Time
	_ = wait.PollUntilContextTimeout(ctx, 500*time.Millisecond, naiveBound, true, func(ctx context.Context) (bool, error) {
		pods, err := w.Pods(ctx)
		if err != nil {
			return false, nil
		}
		for i := range pods {
			lines, _ := w.Log(&pods[i], true)
			for _, l := range lines {
				if l.Text == "ok" && l.Time.After(o.bad) {
					healedAt = l.Time
					return true, nil
				}
			}
		}
		return false, nil
	})
	script.stop()
	dels := script.deleted()
	pods := map[string]bool{}
	for _, d := range dels {
		pods[d.pod] = true
	}
	if len(dels) > 0 {
		e.figs.Duration("naive", "fault -> first pod deletion", dels[0].at.Sub(o.start))
	} else {
		e.figs.Miss("naive", "fault -> first pod deletion", "s")
	}
	e.figs.Value("naive", fmt.Sprintf("pods deleted in %s", naiveBound), "", float64(len(pods)))
	if healedAt.IsZero() {
		e.figs.Miss("naive", "driver back -> healed", "s")
		t.Logf("naive: not healed %s after the plugin came back; %d deletions of %d pods; %s", naiveBound, len(dels), len(pods), w.Describe(ctx))
		return
	}
	e.figs.Duration("naive", "driver back -> healed", healedAt.Sub(o.back))
	t.Logf("naive: healed %s after the plugin came back", healedAt.Sub(o.back).Round(time.Millisecond))
}

// steadyScenario measures what the agent costs with nothing broken: CPU and
// resident memory of the agent's process over a window, from its own
// process metrics; and, over the same kind of window, the naive script.
func steadyScenario(t *testing.T, e *env, ns string) {
	const window = 30 * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	e.workload(t, ctx, ns)
	// A node at rest: the agent gives back the pages of its binary that
	// the earlier scenarios' repairs touched a minute after its last run
	// (--release-code-interval); measure after that.
	time.Sleep(65 * time.Second)
	m0, err := e.agent.Metrics(ctx)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	var rss float64
	for time.Since(start) < window {
		time.Sleep(5 * time.Second)
		m, err := e.agent.Metrics(ctx)
		if err != nil {
			t.Fatal(err)
		}
		rss = max(rss, e2e.Sum(m, "process_resident_memory_bytes"))
	}
	m1, err := e.agent.Metrics(ctx)
	if err != nil {
		t.Fatal(err)
	}
	took := time.Since(start)
	cpu := e2e.Sum(m1, "process_cpu_seconds_total") - e2e.Sum(m0, "process_cpu_seconds_total")
	mounts := e2e.Sum(m1, "mountmedic_kubelet_mounts")
	e.figs.Value("steady", "agent CPU (one core = 100 %)", "%", 100*cpu/took.Seconds())
	e.figs.Value("steady", "agent RSS (max)", "MiB", rss/(1<<20))
	e.figs.Value("steady", "kubelet mounts watched", "", mounts)
	t.Logf("agent: %.3f s CPU in %s, RSS %.1f MiB, %v kubelet mounts", cpu, took.Round(time.Millisecond), rss/(1<<20), mounts)

	script := e.startNaive(t)
	c0, err := script.cpu()
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(window)
	c1, err := script.cpu()
	if err != nil {
		t.Fatal(err)
	}
	e.figs.Value("steady", "naive.sh CPU (one core = 100 %)", "%", 100*(c1-c0).Seconds()/window.Seconds())
	if len(script.deleted()) > 0 {
		t.Errorf("naive.sh deleted pods with nothing broken: %v", script.deleted())
	}
}
