package agent

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"unsafe"

	"golang.org/x/sys/unix"
	"k8s.io/klog/v2"
)

// canceller wakes a goroutine blocked in poll(2): an eventfd polled beside
// the watched descriptor.
type canceller struct{ fd int }

func newCanceller() (*canceller, error) {
	fd, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("eventfd: %w", err)
	}
	return &canceller{fd: fd}, nil
}

func (c *canceller) cancel() {
	one := []byte{1, 0, 0, 0, 0, 0, 0, 0}
	_, _ = unix.Write(c.fd, one)
}

func (c *canceller) close() { _ = unix.Close(c.fd) }

// notify sends on a channel of capacity one without blocking: several
// wake-ups before the receiver runs become one.
func notify(ch chan<- struct{}) {
	select {
	case ch <- struct{}{}:
	default:
	}
}

// tableWatcher wakes on every mount, unmount and remount in the mount
// namespace of a /proc/<pid>/mountinfo file: the kernel flags the open file
// with POLLPRI|POLLERR when the namespace's mount list changes. It never
// wakes on a daemon dying behind a mount; probing covers that.
type tableWatcher struct {
	fd      int
	stop    *canceller
	changed chan struct{}
	done    chan struct{}
}

// watchTable starts watching path. A path that is not on procfs (a captured
// table) cannot be watched: it returns nil and no error, and the caller
// relies on its resync.
func watchTable(ctx context.Context, path string) (*tableWatcher, error) {
	logger := klog.FromContext(ctx)
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return nil, fmt.Errorf("watch mount table %s: %w", path, err)
	}
	if st.Type != unix.PROC_SUPER_MAGIC {
		logger.Info("Mount table is not a /proc file, not watching it for changes: only --resync re-reads it", "path", path)
		return nil, nil
	}
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open mount table %s: %w", path, err)
	}
	stop, err := newCanceller()
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	w := &tableWatcher{fd: fd, stop: stop, changed: make(chan struct{}, 1), done: make(chan struct{})}
	go w.loop(logger.WithValues("path", path))
	return w, nil
}

func (w *tableWatcher) loop(logger klog.Logger) {
	defer close(w.done)
	fds := []unix.PollFd{{Fd: int32(w.fd), Events: unix.POLLPRI}, {Fd: int32(w.stop.fd), Events: unix.POLLIN}}
	for {
		fds[0].Revents, fds[1].Revents = 0, 0
		_, err := unix.Poll(fds, -1)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			logger.Error(err, "Polling the mount table failed; only the resync re-reads it now")
			return
		}
		if fds[1].Revents != 0 {
			return
		}
		switch ev := fds[0].Revents; {
		case ev&unix.POLLNVAL != 0:
			logger.Error(nil, "Mount table descriptor became invalid; only the resync re-reads it now")
			return
		case ev&(unix.POLLPRI|unix.POLLERR) != 0:
			notify(w.changed)
		}
	}
}

// Close stops the watcher and waits for its goroutine.
func (w *tableWatcher) Close() {
	if w == nil {
		return
	}
	w.stop.cancel()
	<-w.done
	unix.Close(w.fd)
	w.stop.close()
}

// Changes returns the channel that receives a value after the table
// changed; nil for a nil watcher (never ready in a select).
func (w *tableWatcher) Changes() <-chan struct{} {
	if w == nil {
		return nil
	}
	return w.changed
}

// pluginWatcher watches the kubelet's plugin registration directory and the
// plugins/<driver> directories of the drivers with volumes on this node with
// inotify, and reports a driver whose socket appears: the driver was
// (re)started. A registration socket named <driver>-reg.sock names its
// driver; any other name reports "" (some driver, unknown which).
type pluginWatcher struct {
	root string
	ifd  int
	stop *canceller
	// events receives driver names ("" for unknown).
	events chan string
	done   chan struct{}

	mu      sync.Mutex
	watches map[int]watchDir // wd -> what it watches
	drivers map[string]bool  // drivers whose plugins/<driver> should be watched
}

type watchDir struct {
	path   string
	driver string // for plugins/<driver>
	kind   int
}

const (
	dirRegistry = iota
	dirPlugins
	dirDriver
)

const watchMask = unix.IN_CREATE | unix.IN_MOVED_TO | unix.IN_ONLYDIR | unix.IN_DONT_FOLLOW

func watchPlugins(ctx context.Context, kubeletRoot string) (*pluginWatcher, error) {
	ifd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		return nil, fmt.Errorf("inotify: %w", err)
	}
	stop, err := newCanceller()
	if err != nil {
		unix.Close(ifd)
		return nil, err
	}
	w := &pluginWatcher{root: kubeletRoot, ifd: ifd, stop: stop, events: make(chan string, 64),
		done: make(chan struct{}), watches: make(map[int]watchDir), drivers: make(map[string]bool)}
	w.ensure(ctx)
	go w.loop(klog.FromContext(ctx))
	return w, nil
}

// Events returns the channel of drivers whose socket appeared.
func (w *pluginWatcher) Events() <-chan string {
	if w == nil {
		return nil
	}
	return w.events
}

func (w *pluginWatcher) send(driver string) {
	select {
	case w.events <- driver:
	default:
		// Full: the resync retries every driver that is down anyway.
	}
}

// Watch adds the drivers whose plugins/<driver> directory should be watched
// and adds watches that are missing (a directory that did not exist yet).
func (w *pluginWatcher) Watch(ctx context.Context, drivers []string) {
	if w == nil {
		return
	}
	w.mu.Lock()
	for _, d := range drivers {
		if d != "" && !strings.ContainsAny(d, "/\x00") && d != "." && d != ".." {
			w.drivers[d] = true
		}
	}
	w.mu.Unlock()
	w.ensure(ctx)
}

// ensure adds every watch that is not in place.
func (w *pluginWatcher) ensure(ctx context.Context) {
	w.mu.Lock()
	defer w.mu.Unlock()
	have := make(map[string]bool, len(w.watches))
	for _, d := range w.watches {
		have[d.path] = true
	}
	add := func(d watchDir) {
		if have[d.path] {
			return
		}
		wd, err := unix.InotifyAddWatch(w.ifd, d.path, watchMask)
		if err != nil {
			if !errors.Is(err, unix.ENOENT) {
				klog.FromContext(ctx).V(2).Info("Cannot watch plugin directory", "path", d.path, "err", err)
			}
			return
		}
		w.watches[wd] = d
		have[d.path] = true
	}
	add(watchDir{path: filepath.Join(w.root, "plugins_registry"), kind: dirRegistry})
	add(watchDir{path: filepath.Join(w.root, "plugins"), kind: dirPlugins})
	for driver := range w.drivers {
		add(watchDir{path: filepath.Join(w.root, "plugins", driver), driver: driver, kind: dirDriver})
	}
}

func (w *pluginWatcher) loop(logger klog.Logger) {
	defer close(w.done)
	buf := make([]byte, 64*(unix.SizeofInotifyEvent+unix.NAME_MAX+1))
	fds := []unix.PollFd{{Fd: int32(w.ifd), Events: unix.POLLIN}, {Fd: int32(w.stop.fd), Events: unix.POLLIN}}
	for {
		fds[0].Revents, fds[1].Revents = 0, 0
		_, err := unix.Poll(fds, -1)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			logger.Error(err, "Polling inotify failed; driver restarts are noticed at resync only")
			return
		}
		if fds[1].Revents != 0 {
			return
		}
		if fds[0].Revents&unix.POLLIN == 0 {
			continue
		}
		n, err := unix.Read(w.ifd, buf)
		if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			logger.Error(err, "Reading inotify failed; driver restarts are noticed at resync only")
			return
		}
		w.handle(logger, buf[:n])
	}
}

// handle decodes a buffer of inotify events.
func (w *pluginWatcher) handle(logger klog.Logger, buf []byte) {
	for off := 0; off+unix.SizeofInotifyEvent <= len(buf); {
		ev := (*unix.InotifyEvent)(unsafe.Pointer(&buf[off]))
		nameLen := int(ev.Len)
		end := off + unix.SizeofInotifyEvent + nameLen
		if end > len(buf) {
			return
		}
		name := strings.TrimRight(string(buf[off+unix.SizeofInotifyEvent:end]), "\x00")
		off = end
		w.event(logger, int(ev.Wd), ev.Mask, name)
	}
}

func (w *pluginWatcher) event(logger klog.Logger, wd int, mask uint32, name string) {
	if mask&unix.IN_Q_OVERFLOW != 0 {
		w.send("")
		return
	}
	w.mu.Lock()
	d, ok := w.watches[wd]
	if mask&unix.IN_IGNORED != 0 {
		delete(w.watches, wd) // the directory went away; ensure adds it again
		w.mu.Unlock()
		return
	}
	interested := ok && d.kind == dirPlugins && w.drivers[name]
	w.mu.Unlock()
	if !ok || name == "" || strings.HasPrefix(name, ".") {
		return
	}
	path := filepath.Join(d.path, name)
	switch d.kind {
	case dirRegistry:
		if isSocket(path) {
			driver, _ := strings.CutSuffix(name, "-reg.sock")
			if driver == name {
				driver = ""
			}
			logger.V(2).Info("CSI registration socket appeared", "path", path, "driver", driver)
			w.send(driver)
		}
	case dirPlugins:
		if interested && mask&unix.IN_ISDIR != 0 {
			w.ensure(klog.NewContext(context.Background(), logger))
			if isSocket(filepath.Join(path, "csi.sock")) {
				w.send(name)
			}
		}
	case dirDriver:
		if isSocket(path) {
			logger.V(2).Info("CSI driver socket appeared", "path", path, "driver", d.driver)
			w.send(d.driver)
		}
	}
}

func isSocket(path string) bool {
	fi, err := os.Lstat(path)
	return err == nil && fi.Mode().Type() == fs.ModeSocket
}

// Close stops the watcher and waits for its goroutine.
func (w *pluginWatcher) Close() {
	if w == nil {
		return
	}
	w.stop.cancel()
	<-w.done
	unix.Close(w.ifd)
	w.stop.close()
}
