// Command run boots the guest kernel of scripts/guest and runs one command in
// it, as root, with the host's root read-only under a tmpfs overlay:
//
//	go run ./scripts/guest/run [-m MiB] [-smp N] [-modules nbd,ext4] [-timeout 10m] -- PROGRAM ARGS...
//
// The command's output goes to stdout, the guest's console to stderr with -v;
// it exits with the command's status. Files the command needs must be on the
// host's filesystem (the guest sees it read-only) or in -dir, shared
// read-write at its host path.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/mountmedic/mountmedic/scripts/guest"
)

func main() { os.Exit(run()) }

func run() int {
	mem := flag.Int("m", 1024, "guest memory in MiB")
	cpus := flag.Int("smp", 2, "guest CPUs")
	modules := flag.String("modules", "", "comma-separated modules to load before the command")
	timeout := flag.Duration("timeout", 10*time.Minute, "bound on the whole run")
	dir := flag.String("dir", "", "directory shared read-write with the guest at its host path (default: a new temporary one)")
	verbose := flag.Bool("v", false, "copy the guest console to stderr")
	network := flag.Bool("net", false, "give the guest qemu's user-mode network (10.0.2.2 is the host's loopback)")
	flag.Parse()
	if flag.NArg() == 0 {
		fmt.Fprintln(os.Stderr, "usage: run [flags] -- PROGRAM ARGS...")
		return 2
	}
	k, err := guest.FindKernel()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	cfg := guest.Config{MemoryMiB: *mem, CPUs: *cpus, Timeout: *timeout, RunDir: *dir, Network: *network}
	if *verbose {
		cfg.Console = os.Stderr
	}
	cmd := guest.Command{Args: flag.Args(), Env: passEnv()}
	if *modules != "" {
		cmd.Modules = strings.Split(*modules, ",")
	}
	res, err := k.Run(context.Background(), cfg, cmd)
	if res != nil {
		_, _ = io.Copy(os.Stdout, strings.NewReader(string(res.Output)))
		fmt.Fprintf(os.Stderr, "guest: kernel %s, command started %.2fs after qemu (guest uptime %.2fs), exit %d, %.2fs in all\n",
			k.Release, res.Boot.Seconds(), res.GuestUptime, res.Exit, res.Took.Seconds())
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return res.Exit
}

// passEnv hands the guest the MOUNTMEDIC_* variables of this process.
func passEnv() []string {
	var env []string
	for _, e := range os.Environ() {
		if strings.HasPrefix(e, "MOUNTMEDIC_") && !strings.HasPrefix(e, guest.EnvKernel+"=") {
			env = append(env, e)
		}
	}
	return env
}
