package probe

import (
	"errors"
	"fmt"

	"golang.org/x/sys/unix"
)

// WriteCheck asks a block filesystem mounted read-write at path whether it
// still takes writes, for kernels whose mount table does not say: Linux 6.1
// shows neither the "shutdown" nor the "emergency_ro" super option
// (docs/kernel-facts.md). Two steps, neither of which leaves a file on the
// volume, though both reach the device (a cache flush, a journal
// transaction): the probe runs it only when configured (Config.WriteCheck).
//
//   - fsync(2) of the root directory: nothing to write on a clean
//     directory, but ext4 and xfs answer EIO once shut down;
//   - an unnamed file, open(O_TMPFILE) in the root directory, closed at
//     once (the inode is freed at close and never linked): EROFS once the
//     journal aborted under errors=remount-ro, EIO after a shutdown.
//
// Only EIO, EUCLEAN and EROFS count: any other error (ENOSPC, EDQUOT, a
// filesystem without O_TMPFILE) says nothing about the filesystem's health
// and is Healthy. The result is Shutdown for EIO and EUCLEAN, ReadOnly for
// EROFS, with the error. It blocks while the device holds its I/O (a dead
// NBD connection waiting for a re-attach): call it where a probe may hang.
func WriteCheck(path string) (State, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return writeState(fmt.Errorf("open %s: %w", path, err))
	}
	err = unix.Fsync(fd)
	unix.Close(fd)
	if err != nil {
		if st, werr := writeState(fmt.Errorf("fsync %s: %w", path, err)); st != Healthy {
			return st, werr
		}
	}
	tmp, err := unix.Open(path, unix.O_TMPFILE|unix.O_WRONLY|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return writeState(fmt.Errorf("create an unnamed file in %s: %w", path, err))
	}
	unix.Close(tmp)
	return Healthy, nil
}

// writeState keeps the errors that say the filesystem refuses writes.
func writeState(err error) (State, error) {
	switch {
	case errors.Is(err, unix.EIO), errors.Is(err, unix.EUCLEAN):
		return Shutdown, err
	case errors.Is(err, unix.EROFS):
		return ReadOnly, err
	}
	return Healthy, nil
}

// writable reports whether the backend's filesystem is meant to take
// writes: a read-write superblock under a read-write probed mount.
func writable(b *Backend) bool {
	if hasOpt(b.SuperOptions, "ro") {
		return false
	}
	m := b.probeMount()
	return m != nil && !hasOpt(m.Options, "ro")
}
