// Command fwd forwards TCP connections, for the guest of scripts/guest:
//
//	fwd 127.0.0.1:6789=10.0.2.2:6789 127.0.0.1:6800=10.0.2.2:6800
//
// Each LISTEN=TARGET pair accepts on LISTEN and copies both ways to TARGET.
// A Ceph cluster on the host's 127.0.0.1 hands its clients 127.0.0.1
// addresses; in the guest those must lead to the host (10.0.2.2 under qemu's
// user-mode network).
package main

import (
	"fmt"
	"io"
	"net"
	"os"
	"strings"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: fwd LISTEN=TARGET...")
		os.Exit(2)
	}
	for _, pair := range os.Args[1:] {
		listen, target, ok := strings.Cut(pair, "=")
		if !ok {
			fmt.Fprintf(os.Stderr, "fwd: %q is not LISTEN=TARGET\n", pair)
			os.Exit(2)
		}
		l, err := net.Listen("tcp", listen)
		if err != nil {
			fmt.Fprintf(os.Stderr, "fwd: %v\n", err)
			os.Exit(1)
		}
		go serve(l, target)
	}
	select {}
}

func serve(l net.Listener, target string) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			t, err := net.Dial("tcp", target)
			if err != nil {
				fmt.Fprintf(os.Stderr, "fwd: %v\n", err)
				return
			}
			defer t.Close()
			go func() { _, _ = io.Copy(t, c); t.(*net.TCPConn).CloseWrite() }()
			_, _ = io.Copy(c, t)
		}()
	}
}
