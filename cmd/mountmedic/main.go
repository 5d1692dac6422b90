// Command mountmedic finds pod volume mounts that died under running pods
// and brings them back. See the README for its commands.
package main

import (
	"context"
	"os"
	"os/signal"
	"runtime"
	"syscall"

	"golang.org/x/sys/unix"
)

// init keeps the main goroutine on the main thread, so that no probe or
// table read ever blocks there: the kernel hands a process signal
// (kubelet's SIGTERM) to the main thread first, and a thread stuck on a
// hung FUSE daemon would hold it pending until the daemon answers.
func init() { runtime.LockOSThread() }

func main() { os.Exit(run()) }

// run runs the command on its own goroutine (never on the main thread, see
// init) and returns its exit status.
func run() int {
	ctx, stop := notifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	code := make(chan int, 1)
	go func() { code <- execute(ctx, commandArgs(os.Args), os.Stdout, os.Stderr) }()
	return <-code
}

// signalled is the cause of a context that a signal ended. It is
// context.Canceled to errors.Is.
type signalled struct{ sig syscall.Signal }

func (s signalled) Error() string { return "stopped by " + unix.SignalName(s.sig) }

func (s signalled) Is(target error) bool { return target == context.Canceled }

// exitCode is the shell's status for a process the signal ended: 128+n
// (130 for SIGINT, 143 for SIGTERM).
func (s signalled) exitCode() int { return 128 + int(s.sig) }

// notifyContext is signal.NotifyContext whose cause (context.Cause) is a
// signalled naming the signal, so that the exit status can say which one
// ended the command. After the first signal the default action is back: a
// second one ends the process at once, whatever it is blocked in.
func notifyContext(parent context.Context, sigs ...os.Signal) (context.Context, func()) {
	ctx, cancel := context.WithCancelCause(parent)
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, sigs...)
	go func() {
		select {
		case s := <-ch:
			signal.Stop(ch)
			sig, _ := s.(syscall.Signal)
			cancel(signalled{sig})
		case <-ctx.Done():
		}
	}()
	return ctx, func() {
		signal.Stop(ch)
		cancel(nil)
	}
}
