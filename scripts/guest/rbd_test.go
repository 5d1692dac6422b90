package guest

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/mountmedic/mountmedic/scripts/csilab"
	"github.com/mountmedic/mountmedic/scripts/kubetest"
)

// rbdTests are the tests of rbd-nbd on a real Ceph, by package
// (remount/rbd_guest_root_test.go, agent/rbd_guest_root_test.go): they need
// the host's Ceph lab, which TestRBDInGuest starts; TestInGuest skips them.
var rbdTests = map[string]string{"remount": "^TestRBD", "agent": "^TestAgentRBD$"}

// rbdDefaultTests are the ones TestRBDInGuest runs unless MOUNTMEDIC_RBD_RUN
// says otherwise: what fits CI's guest step. ceph-csi's re-attach waits for
// the killed rbd-nbd's watch on the image to expire (30 s), so each heal
// takes about 35-50 s under emulation; the plugin restart with several
// volumes runs in scripts/bench-rbd-nbd.sh, and CI covers it with nbdkit
// (remount's TestNBDPluginRestart). The agent's test runs whole.
var rbdDefaultTests = map[string]string{"remount": "^TestRBD(DaemonKilled|BackendDown)$", "agent": rbdTests["agent"]}

// rbdRunEnv names the setting that chooses a package's rbd tests.
var rbdRunEnv = map[string]string{"remount": "MOUNTMEDIC_RBD_RUN", "agent": "MOUNTMEDIC_RBD_AGENT_RUN"}

// TestMain stops the Ceph lab of TestRBDInGuest when the binary ends.
func TestMain(m *testing.M) {
	code := m.Run()
	if err := csilab.StopSharedCeph(); err != nil {
		fmt.Fprintf(os.Stderr, "stop the Ceph lab: %v\n", err)
		if code == 0 {
			code = 1
		}
	}
	os.Exit(code)
}

// TestRBDInGuest runs the rbd-nbd tests of remount and of the agent in the
// guest against a real Ceph on the host: the Ceph lab
// (scripts/ceph-lab.sh: mon, mgr, OSD on 127.0.0.1) with a pool for RBD,
// the guest on qemu's user-mode network, and scripts/guest/fwd in the
// guest forwarding each of the lab's ports to the host; for the agent, the
// API server on the host too (kubetest's broker). MOUNTMEDIC_RBD_RUN
// chooses remount's tests and MOUNTMEDIC_RBD_AGENT_RUN the agent's (go
// test's -run pattern; rbdDefaultTests when unset; "none" boots no guest
// for the package); MOUNTMEDIC_RBD_* pass to the guest
// (MOUNTMEDIC_RBD_VOLUMES: the plugin-restart benchmark's volume count).
func TestRBDInGuest(t *testing.T) {
	k := requireKernel(t)
	root := moduleRoot(t)
	start := time.Now()
	ceph := csilab.SharedCeph(t)
	ceph.RBDPool(t)
	ready := time.Since(start)
	t.Logf("guest figures: rbd: Ceph ready on the host %.2fs", ready.Seconds())
	for _, pkg := range []string{"remount", "agent"} {
		t.Run(pkg, func(t *testing.T) {
			pattern := rbdDefaultTests[pkg]
			if p := os.Getenv(rbdRunEnv[pkg]); p != "" {
				pattern = p
			}
			if pattern == "none" {
				t.Skipf("%s=none", rbdRunEnv[pkg])
			}
			// The guest sees the run directory: the binaries go there.
			run := t.TempDir()
			bin, fwd := filepath.Join(run, pkg+".test"), filepath.Join(run, "fwd")
			for _, b := range [][]string{
				{"test", "-c", "-tags", "guest", "-o", bin, "./" + pkg},
				{"build", "-o", fwd, "./scripts/guest/fwd"},
			} {
				build := exec.Command("go", b...)
				build.Dir = root
				if out, err := build.CombinedOutput(); err != nil {
					t.Fatalf("go %s: %v\n%s", strings.Join(b, " "), err, out)
				}
			}
			lo, hi := ceph.Ports()
			env := []string{"MOUNTMEDIC_REQUIRE_ROOT=1", "GOTRACEBACK=all",
				fmt.Sprintf("%s=%d-%d", csilab.EnvRBDPorts, lo, hi), csilab.EnvRBDFwd + "=" + fwd}
			for _, kv := range os.Environ() {
				if strings.HasPrefix(kv, "MOUNTMEDIC_RBD_") && !strings.HasPrefix(kv, csilab.EnvRBDPorts+"=") && !strings.HasPrefix(kv, csilab.EnvRBDFwd+"=") {
					env = append(env, kv)
				}
			}
			if pkg == "agent" {
				b := kubetest.Serve(t, filepath.Join(run, "kubetest"))
				env = append(env, kubetest.EnvBroker+"=10.0.2.2:"+b.Addr[strings.LastIndexByte(b.Addr, ':')+1:])
			}
			res, err := k.Run(context.Background(), Config{RunDir: run, Timeout: 25 * time.Minute, MemoryMiB: 1536, Network: true},
				Command{Args: []string{bin, "-test.v", "-test.count=1", "-test.timeout=20m", "-test.run", pattern},
					Dir: filepath.Join(root, pkg), Modules: guestModules, Env: env})
			if res != nil {
				t.Logf("guest figures: rbd %s: guest boot %.2fs; whole guest run %.2fs, exit %d",
					pkg, res.Boot.Seconds(), res.Took.Seconds(), res.Exit)
				t.Logf("summary of ./%s's rbd tests in the guest:\n%s", pkg, summary(res.Output))
				if dir := os.Getenv("MOUNTMEDIC_GUEST_KEEP"); dir != "" {
					// The whole output, for a look at each tier's actions.
					_ = os.WriteFile(filepath.Join(dir, pkg+"-rbd.out"), res.Output, 0o644)
				}
			}
			if err != nil {
				t.Fatal(err)
			}
			if res.Exit != 0 {
				t.Errorf("./%s's rbd tests in the guest exited %d; its output:\n%s\nconsole tail:\n%s", pkg, res.Exit, res.Output, tail(res.Console, 4000))
			}
		})
	}
}
