// Command mountmedic finds pod volume mounts that died under running pods
// and brings them back. See the README for its commands.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"
)

func main() { os.Exit(run()) }

func run() int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return execute(ctx, commandArgs(os.Args), os.Stdout, os.Stderr)
}
