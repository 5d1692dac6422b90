package probe

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
)

// CheckKubeletRoot checks a kubelet root directory given by a person (the
// --kubelet-root of scan and agent): an absolute path other than "/". When
// onHost says the root is this machine's (a live table, the agent), no
// component of it may be a symlink either: the mount table shows resolved
// paths, so a root reached through a symlink matches no mount, and a scan
// would report "nothing to check" while kubelet's volumes are there. A root
// that does not exist is fine: a machine without kubelet has nothing to
// check. The error says what to give instead.
func CheckKubeletRoot(root string, onHost bool) error {
	if !filepath.IsAbs(root) {
		return fmt.Errorf("kubelet root %q is not an absolute path: give kubelet's --root-dir, for example %s", root, DefaultKubeletRoot)
	}
	clean := filepath.Clean(root)
	if clean == "/" {
		return fmt.Errorf("kubelet root %q is the whole file system: give kubelet's --root-dir, for example %s", root, DefaultKubeletRoot)
	}
	if !onHost {
		return nil
	}
	p := "/"
	for _, seg := range strings.Split(clean[1:], "/") {
		p = filepath.Join(p, seg)
		fi, err := os.Lstat(p)
		if errors.Is(err, fs.ErrNotExist) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("kubelet root %q: %w", root, err)
		}
		if fi.Mode()&fs.ModeSymlink == 0 {
			continue
		}
		// Resolve the part up to the link; what follows may not exist yet.
		resolved, err := filepath.EvalSymlinks(p)
		if err == nil {
			resolved = filepath.Join(resolved, strings.TrimPrefix(clean, p))
		}
		if err != nil {
			return fmt.Errorf("kubelet root %q goes through the symlink %s, which does not resolve (%v): give the directory kubelet uses as it appears in /proc/self/mountinfo", root, p, err)
		}
		return fmt.Errorf("kubelet root %q goes through the symlink %s: give the resolved path %s, as the mount table shows it", root, p, resolved)
	}
	return nil
}
