// Package layout holds no code, only a test of the repository's import
// rules: the rules each production package's doc states (probe knows no
// Kubernetes client, remount no informers or agent, ...) and that no
// production package depends on test support (scripts/lab, scripts/...,
// the testing package, the FUSE fault daemon's library). A change that
// breaks one fails `go test ./scripts/layout` with the chain to blame.
package layout
