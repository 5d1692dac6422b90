// Command pause is the e2e node's pod sandbox program: PID 1 of a pod's
// sandbox container, it holds the pod's namespaces open, reaps the zombies a
// shared PID namespace leaves it and exits on SIGTERM or SIGINT. The e2e
// harness builds it statically and packs it into the sandbox image, because
// the machines the tests run on reach no container registry.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD)
	for s := range sigs {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var ws syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
