package lab

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"k8s.io/apimachinery/pkg/types"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// The tree's layout is kubelet's, from the one package that knows it
// (probe/kubelet).
const (
	// DefaultNodeName is the node name a lab Kubelet writes into
	// vol_data.json.
	DefaultNodeName = "lab-node"
)

// Kubelet builds a kubelet root directory with real mounts, laid out as
// kubelet lays it out: staging (globalmount) paths, publish targets,
// volume-subpaths, emptyDirs and block volume maps. Like kubelet, it makes
// its root a shared mount, so a container started with "slave" propagation
// receives mounts made under it later. Cleanup lazily unmounts every mount it
// made, deepest first.
type Kubelet struct {
	t    testing.TB
	root string

	mu     sync.Mutex
	mounts []string
}

// NewKubelet prepares root (typically t.TempDir()+"/var/lib/kubelet"): it
// creates it, bind-mounts it onto itself and makes it recursively shared.
func NewKubelet(t testing.TB, root string) *Kubelet {
	t.Helper()
	if err := os.MkdirAll(root, 0o750); err != nil {
		t.Fatalf("create kubelet root: %v", err)
	}
	r, err := filepath.EvalSymlinks(root)
	if err != nil {
		t.Fatalf("resolve kubelet root: %v", err)
	}
	k := &Kubelet{t: t, root: r}
	t.Cleanup(k.cleanup)
	k.mount(r, r, "", unix.MS_BIND|unix.MS_REC, "")
	if err := unix.Mount("", r, "", unix.MS_SHARED|unix.MS_REC, ""); err != nil {
		t.Fatalf("make kubelet root %s shared: %v", r, err)
	}
	return k
}

// Root is the kubelet root directory (symlinks resolved).
func (k *Kubelet) Root() string { return k.root }

// NodeName is the node name written into vol_data.json.
func (k *Kubelet) NodeName() string { return DefaultNodeName }

// StagingPath creates and returns the staging (NodeStageVolume) path kubelet
// uses for a CSI volume: plugins/kubernetes.io/csi/<driver>/<hex
// sha256(volumeHandle)>/globalmount. It writes vol_data.json beside
// globalmount with the keys kubelet writes there (driverName, volumeHandle).
// Mount the staged filesystem on the returned path, e.g. with StartFaultFS.
func (k *Kubelet) StagingPath(driver, volumeHandle string) string {
	k.t.Helper()
	p := kubelet.StagingPath(k.root, driver, volumeHandle)
	k.makeStaging(filepath.Dir(p), driver, volumeHandle)
	return p
}

// LegacyStagingPath creates and returns the staging path of kubelets before
// 1.25 (plugins/kubernetes.io/csi/pv/<pvName>/globalmount), which volumes
// staged by an older kubelet keep, with its vol_data.json.
func (k *Kubelet) LegacyStagingPath(pvName, driver, volumeHandle string) string {
	k.t.Helper()
	p := kubelet.LegacyStagingPath(k.root, pvName)
	k.makeStaging(filepath.Dir(p), driver, volumeHandle)
	return p
}

func (k *Kubelet) makeStaging(dir, driver, volumeHandle string) {
	k.t.Helper()
	k.mkdir(filepath.Join(dir, kubelet.GlobalMountDir))
	k.writeVolData(dir, map[string]string{
		"driverName":   driver,
		"volumeHandle": volumeHandle,
	})
}

// PublishPath creates and returns the publish (NodePublishVolume) target of
// a CSI volume: pods/<podUID>/volumes/kubernetes.io~csi/<volName>/mount.
// volName is the volume's spec name: the PV name for a PV.
func (k *Kubelet) PublishPath(podUID, volName string) string {
	k.t.Helper()
	p := k.publishPath(podUID, volName)
	k.mkdir(p)
	return p
}

func (k *Kubelet) publishPath(podUID, volName string) string {
	return kubelet.TargetPath(k.root, types.UID(podUID), volName)
}

// Publish bind-mounts source (normally the staging mount) onto the publish
// path of the volume, read-only if asked, as a CSI driver's NodePublishVolume
// does, and writes vol_data.json beside mount with the keys kubelet writes
// there. It returns the publish path.
func (k *Kubelet) Publish(podUID, volName, driver, volumeHandle, source string, readOnly bool) string {
	k.t.Helper()
	target := k.PreparePublish(podUID, volName, driver, volumeHandle)
	k.mount(source, target, "", unix.MS_BIND, "")
	if readOnly {
		k.remountReadOnly(target)
	}
	return target
}

// PreparePublish does what kubelet does before it calls NodePublishVolume:
// it creates the publish path of the volume and writes vol_data.json beside
// it, without mounting anything, and returns the path. A real CSI driver
// then publishes there.
func (k *Kubelet) PreparePublish(podUID, volName, driver, volumeHandle string) string {
	k.t.Helper()
	target := k.PublishPath(podUID, volName)
	node := k.NodeName()
	k.writeVolData(filepath.Dir(target), map[string]string{
		"specVolID":           volName,
		"volumeHandle":        volumeHandle,
		"driverName":          driver,
		"nodeName":            node,
		"attachmentID":        kubelet.AttachmentName(volumeHandle, driver, node),
		"volumeLifecycleMode": "Persistent",
	})
	return target
}

// SubPath bind-mounts source (a directory or file inside a volume) onto
// pods/<podUID>/volume-subpaths/<volName>/<container>/<index>, as kubelet
// does for a volumeMount with subPath; the target is a file when source is
// one. It returns the target.
func (k *Kubelet) SubPath(podUID, volName, container string, index int, source string) string {
	k.t.Helper()
	target := kubelet.SubPathTarget(k.root, types.UID(podUID), volName, container, index)
	k.makeTargetLike(source, target)
	k.mount(source, target, "", unix.MS_BIND, "")
	return target
}

// EmptyDir creates pods/<podUID>/volumes/kubernetes.io~empty-dir/<name>, a
// tmpfs mount when memory is true (medium: Memory), and returns it.
func (k *Kubelet) EmptyDir(podUID, name string, memory bool) string {
	k.t.Helper()
	p := kubelet.PodVolumePath(k.root, types.UID(podUID), "kubernetes.io/empty-dir", name)
	k.mkdir(p)
	if err := os.Chmod(p, 0o777); err != nil {
		k.t.Fatalf("chmod emptyDir %s: %v", p, err)
	}
	if memory {
		k.mount("tmpfs", p, "tmpfs", 0, "mode=0777")
	}
	return p
}

// BlockDevice maps the block device node device (e.g. a BlockFS's Device)
// for a pod the way a CSI raw block volume is mapped: the driver's publish
// file plugins/kubernetes.io/csi/volumeDevices/publish/<volName>/<podUID>
// (a bind of the device node), kubelet's global map
// plugins/kubernetes.io/csi/volumeDevices/<volName>/dev/<podUID> (a bind of
// the publish file) and the pod's device path
// pods/<podUID>/volumeDevices/kubernetes.io~csi/<volName>, a symlink to the
// publish file, which it returns.
func (k *Kubelet) BlockDevice(podUID, volName, device string) string {
	k.t.Helper()
	publish := kubelet.BlockTargetPath(k.root, volName, types.UID(podUID))
	k.makeFile(publish)
	k.mount(device, publish, "", unix.MS_BIND, "")
	global := kubelet.BlockMapPath(k.root, volName, types.UID(podUID))
	k.makeFile(global)
	k.mount(publish, global, "", unix.MS_BIND, "")
	link := kubelet.PodDevicePath(k.root, types.UID(podUID), volName)
	k.mkdir(filepath.Dir(link))
	if err := os.Symlink(publish, link); err != nil {
		k.t.Fatalf("link pod device %s: %v", link, err)
	}
	return link
}

func (k *Kubelet) mkdir(p string) {
	k.t.Helper()
	if err := os.MkdirAll(p, 0o750); err != nil {
		k.t.Fatalf("create %s: %v", p, err)
	}
}

func (k *Kubelet) makeFile(p string) {
	k.t.Helper()
	k.mkdir(filepath.Dir(p))
	f, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY, 0o640)
	if err != nil {
		k.t.Fatalf("create %s: %v", p, err)
	}
	f.Close()
}

// makeTargetLike creates target as a directory, or as a file when source is
// not a directory.
func (k *Kubelet) makeTargetLike(source, target string) {
	k.t.Helper()
	if err := makeMountTarget(source, target); err != nil {
		k.t.Fatalf("%v", err)
	}
}

func makeMountTarget(source, target string) error {
	fi, err := os.Stat(source)
	if err != nil {
		return fmt.Errorf("stat bind source: %w", err)
	}
	if fi.IsDir() {
		if err := os.MkdirAll(target, 0o750); err != nil {
			return fmt.Errorf("create bind target: %w", err)
		}
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(target), 0o750); err != nil {
		return fmt.Errorf("create bind target dir: %w", err)
	}
	f, err := os.OpenFile(target, os.O_CREATE|os.O_WRONLY, 0o640)
	if err != nil {
		return fmt.Errorf("create bind target: %w", err)
	}
	return f.Close()
}

// AgeVolData dates the vol_data.json beside a publish target back by d, as
// for a pod kubelet published that long ago: the probe counts a target that
// is not mounted as Unmounted only once the file is older than its publish
// grace (kubelet writes it before NodePublishVolume).
func (k *Kubelet) AgeVolData(target string, d time.Duration) {
	k.t.Helper()
	p := filepath.Join(filepath.Dir(target), kubelet.VolDataFile)
	at := time.Now().Add(-d)
	if err := os.Chtimes(p, at, at); err != nil {
		k.t.Fatalf("age %s: %v", p, err)
	}
}

func (k *Kubelet) writeVolData(dir string, data map[string]string) {
	k.t.Helper()
	k.mkdir(dir)
	b, err := json.Marshal(data)
	if err != nil {
		k.t.Fatalf("encode %s: %v", kubelet.VolDataFile, err)
	}
	p := filepath.Join(dir, kubelet.VolDataFile)
	if err := os.WriteFile(p, append(b, '\n'), 0o640); err != nil {
		k.t.Fatalf("write %s: %v", p, err)
	}
}

func (k *Kubelet) mount(source, target, fstype string, flags uintptr, data string) {
	k.t.Helper()
	if err := unix.Mount(source, target, fstype, flags, data); err != nil {
		k.t.Fatalf("mount %s on %s: %v", source, target, err)
	}
	k.mu.Lock()
	k.mounts = append(k.mounts, target)
	k.mu.Unlock()
}

func (k *Kubelet) remountReadOnly(target string) {
	k.t.Helper()
	if err := unix.Mount("", target, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
		k.t.Fatalf("remount %s read-only: %v", target, err)
	}
}

func (k *Kubelet) cleanup() {
	k.mu.Lock()
	mounts := slices.Clone(k.mounts)
	k.mu.Unlock()
	slices.Reverse(mounts) // later first among equals
	slices.SortStableFunc(mounts, func(a, b string) int {
		return strings.Count(b, "/") - strings.Count(a, "/")
	})
	for _, p := range mounts {
		if err := unix.Unmount(p, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			k.t.Errorf("kubelet cleanup: unmount %s: %v", p, err)
		}
	}
}
