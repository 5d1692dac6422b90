// Package csilab runs a real CSI node plugin with FUSE volumes for root tests: the
// k8s-csi-s3 driver (s3driver, mounting with Debian's s3fs) against a versitygw S3
// server on a loopback port.
//
// The driver runs as PID 1 of a new PID namespace. s3fs daemonizes with setsid, so
// only the namespace holds the plugin and its FUSE daemons together: killing PID 1
// kills them all, as a node-plugin crash does, and leaves the mounts dead
// (ENOTCONN). The driver shares the caller's mount namespace; tests run it inside
// the private mount namespace of probe/lab (lab.Main, lab.RequireRoot).
//
// Binaries come from $MOUNTMEDIC_BIN, else $MOUNTMEDIC_CACHE/bin/current (default
// /var/cache/mountmedic), as scripts/tools.sh builds them; s3fs comes from PATH.
// Missing binaries skip the test, or fail it when MOUNTMEDIC_REQUIRE_ROOT=1.
//
// This package is test support, imported from _test.go files only.
package csilab

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/mountmedic/mountmedic/probe/lab"
)

// RequireEnv is the variable that turns every skip of this package into a failure.
const RequireEnv = "MOUNTMEDIC_REQUIRE_ROOT"

// binary returns the path of a binary that scripts/tools.sh builds.
func binary(t testing.TB, name string) string {
	t.Helper()
	p := filepath.Join(lab.BinDir(), name)
	if fi, err := os.Stat(p); err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 {
		skipOrFail(t, "missing %s in %s: build it with scripts/tools.sh s3 (or set MOUNTMEDIC_BIN)", name, lab.BinDir())
	}
	return p
}

// systemBinary returns the path of a program from the distribution, such as s3fs.
func systemBinary(t testing.TB, name, pkg string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	if err != nil {
		skipOrFail(t, "missing %s in PATH: install the Debian package %s", name, pkg)
	}
	return p
}

func skipOrFail(t testing.TB, format string, args ...any) {
	t.Helper()
	msg := fmt.Sprintf(format, args...)
	if os.Getenv(RequireEnv) == "1" {
		t.Fatalf("%s (%s=1 turns this skip into a failure)", msg, RequireEnv)
	}
	t.Skip(msg)
}
