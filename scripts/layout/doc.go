// Package layout holds no code, only tests of the repository's layout: the
// import rules each production package's doc states (probe knows no
// Kubernetes client, remount no informers or agent, ...), that no
// production package depends on test support (scripts/lab, scripts/...,
// the testing package, the FUSE fault daemon's library), and that the
// markdown docs link only to files and headings that exist and use no words
// of the project's working process. A change that breaks one fails
// `go test ./scripts/layout` naming what to fix.
package layout
