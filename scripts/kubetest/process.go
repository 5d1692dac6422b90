package kubetest

import (
	"os/exec"
	"path/filepath"
	"syscall"

	"github.com/mountmedic/mountmedic/probe/lab"
)

// startProcess runs bin with args in its own process group (stopping it
// reaches its children), its output in logDir/name.log. It dies with the
// test binary (lab.RunProcess).
func startProcess(name, bin string, args []string, logDir string) (*lab.Process, error) {
	cmd := exec.Command(bin, args...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	return lab.RunProcess(name, cmd, filepath.Join(logDir, name+".log"))
}
