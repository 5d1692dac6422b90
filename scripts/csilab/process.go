package csilab

import (
	"os/exec"

	"github.com/mountmedic/mountmedic/probe/lab"
)

// startProcess runs cmd with its output appended to logPath; it dies with
// the test binary (lab.RunProcess).
func startProcess(name string, cmd *exec.Cmd, logPath string) (*lab.Process, error) {
	return lab.RunProcess(name, cmd, logPath)
}

// freePort returns a free TCP port on the loopback interface.
func freePort() (int, error) {
	ports, err := lab.FreePorts(1)
	if err != nil {
		return 0, err
	}
	return ports[0], nil
}
