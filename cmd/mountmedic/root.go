package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"

	"github.com/spf13/cobra"
	"k8s.io/klog/v2"
)

// Exit statuses, documented in the README.
const (
	exitOK     = 0
	exitError  = 1
	exitBroken = 2
)

// exitCodeError carries an exit status out of a command that printed its
// own result.
type exitCodeError struct{ code int }

func (e exitCodeError) Error() string { return fmt.Sprintf("exit status %d", e.code) }

func newRootCommand(stdout, stderr io.Writer) *cobra.Command {
	root := &cobra.Command{
		Use:   "mountmedic",
		Short: "Find and heal dead pod volume mounts on Kubernetes nodes",
		Long: `mountmedic maps the host mount table to kubelet's pod volumes (CSI publish
targets, staging mounts, subPath binds), probes them for dead FUSE daemons,
EIO, stale handles and hangs, and repairs them through the CSI driver.`,
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.SetOut(stdout)
	root.SetErr(stderr)
	klogFlags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(klogFlags)
	root.PersistentFlags().AddGoFlagSet(klogFlags)
	root.AddCommand(newAgentCommand(), newControllerCommand(), newScanCommand(), newVersionCommand())
	return root
}

func execute(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	klog.SetOutput(stderr)
	klog.LogToStderr(false)
	root := newRootCommand(stdout, stderr)
	root.SetArgs(args)
	err := root.ExecuteContext(klog.NewContext(ctx, klog.Background()))
	var ec exitCodeError
	switch {
	case err == nil:
		return exitOK
	case errors.As(err, &ec):
		return ec.code
	}
	fmt.Fprintf(stderr, "mountmedic: %v\n", err)
	return exitError
}
