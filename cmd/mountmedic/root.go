package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"path/filepath"

	"github.com/go-logr/logr/funcr"
	"github.com/spf13/cobra"
	"k8s.io/klog/v2"

	"github.com/mountmedic/mountmedic/agent/status/statuscmd"
)

// Exit statuses, documented in the README. A command that SIGINT or SIGTERM
// cut short exits 128+n: 130 and 143.
const (
	exitOK     = 0
	exitError  = 1
	exitBroken = 2
)

// exitCodeError carries an exit status out of a command that printed its
// own result.
type exitCodeError struct{ code int }

func (e exitCodeError) Error() string { return fmt.Sprintf("exit status %d", e.code) }

// jsonLogger is whether --log-format=json set klog's logger.
var jsonLogger bool

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
	// Of klog's flags only the verbosity ones: the others (--log_dir,
	// --logtostderr, --skip_headers...) are its legacy file and format
	// switches, which Kubernetes components deprecated; logs go to stderr.
	klogFlags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(klogFlags)
	for _, name := range []string{"v", "vmodule"} {
		root.PersistentFlags().AddGoFlag(klogFlags.Lookup(name))
	}
	var logFormat string
	root.PersistentFlags().StringVar(&logFormat, "log-format", "text", "format of the log lines on stderr: text (klog's) or json (one object a line: ts, level, msg and the line's keys)")
	root.PersistentPreRunE = func(*cobra.Command, []string) error {
		switch logFormat {
		case "text":
		case "json":
			// klog still decides what is logged (-v, --vmodule) and
			// passes each line on to this sink, so its verbosity is open.
			klog.SetLogger(funcr.NewJSON(func(obj string) { fmt.Fprintln(stderr, obj) },
				funcr.Options{LogTimestamp: true, TimestampFormat: "2006-01-02T15:04:05.000000Z07:00", Verbosity: 1 << 20}))
			jsonLogger = true
		default:
			return fmt.Errorf("--log-format %q: want text or json", logFormat)
		}
		return nil
	}
	root.AddCommand(newAgentCommand(), newControllerCommand(), newScanCommand(), statuscmd.NewStatusCommand(newKubeconfigFlags(), version), statuscmd.NewNodeCommand(newKubeconfigFlags(), version), newVersionCommand())
	return root
}

func execute(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	klog.SetOutput(stderr)
	klog.LogToStderr(false)
	defer func() {
		// --log-format=json's logger, for a next call in the same process
		// (tests). klog does not guard its logger against goroutines that
		// still log, so it is touched only when it was set.
		if jsonLogger {
			klog.ClearLogger()
			jsonLogger = false
		}
	}()
	root := newRootCommand(stdout, stderr)
	root.SetArgs(args)
	err := root.ExecuteContext(klog.NewContext(ctx, klog.Background()))
	var (
		ec  exitCodeError
		sig signalled
	)
	switch {
	case err == nil:
		return exitOK
	case errors.As(err, &ec):
		return ec.code
	case errors.As(context.Cause(ctx), &sig):
		// A command the signal cut short: the shell's status for it.
		fmt.Fprintf(stderr, "mountmedic: %v\n", sig)
		return sig.exitCode()
	}
	fmt.Fprintf(stderr, "mountmedic: %s\n", printableText(err.Error()))
	return exitError
}

// pluginName is the name kubectl finds the plugin "kubectl mountmedic" by.
const pluginName = "kubectl-mountmedic"

// commandArgs are the arguments to run: as the kubectl plugin (argv[0]
// kubectl-mountmedic), "kubectl mountmedic [flags]" means status unless a
// subcommand is named.
func commandArgs(argv []string) []string {
	if len(argv) == 0 {
		return nil
	}
	args := argv[1:]
	if filepath.Base(argv[0]) != pluginName {
		return args
	}
	if len(args) > 0 {
		for _, c := range newRootCommand(io.Discard, io.Discard).Commands() {
			if c.Name() == args[0] || args[0] == "help" || args[0] == "completion" {
				return args
			}
		}
	}
	return append([]string{"status"}, args...)
}
