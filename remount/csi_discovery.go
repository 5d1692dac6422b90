package remount

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"k8s.io/apimachinery/pkg/util/version"
	"k8s.io/klog/v2"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"

	"github.com/mountmedic/mountmedic/probe/kubelet"
)

// registrationTimeout bounds the connection and the GetInfo call on one
// registration socket (kubelet gives GetInfo one second after connecting).
const registrationTimeout = 2 * time.Second

// Endpoint is where a CSI driver's node service listens.
type Endpoint struct {
	Driver string
	// Path is the absolute path of the driver's unix socket.
	Path string
	// Registration is the registration socket that named Path; empty when
	// Path was found at the conventional <kubeletRoot>/plugins/<driver>/csi.sock.
	Registration string
	// Versions are the CSI versions the registration answered with.
	Versions []string
}

// registration is one answered GetInfo.
type registration struct {
	Endpoint
	highest *version.Version
	// refused: the answer named an endpoint that is not a unix socket path.
	refused error
}

// scan is what the registration sockets answered.
type scan struct {
	found   map[string]Endpoint
	refused map[string]error // driver -> why its endpoint was refused
	silent  []string         // sockets that did not answer
}

// FindDriver finds the node socket of the CSI driver named driver the way
// kubelet does: every unix socket under <kubeletRoot>/plugins_registry (the
// only registration directory kubelet watches) is asked for its
// pluginregistration v1 GetInfo, and an answer of type CSIPlugin with this
// name and a 1.x version gives the endpoint (the registration socket itself
// when the answer names none). Failing that, the conventional
// <kubeletRoot>/plugins/<driver>/csi.sock is used when it is a socket.
//
// FindDriver never calls NotifyRegistrationStatus: that is kubelet's, and
// node-driver-registrar exits when told that registration failed.
//
// A driver named by no answer and with no conventional socket gives an
// error matching both errDriverNotFound and ErrDriverUnavailable: a driver
// that is not registered counts as down, since it may be restarting. A
// registered driver whose socket is missing gives ErrDriverUnavailable; an
// endpoint that is not a unix socket is refused.
func FindDriver(ctx context.Context, kubeletRoot, driver string) (Endpoint, error) {
	if err := kubelet.CheckPathName("csi driver name", driver); err != nil {
		return Endpoint{}, err
	}
	sc, err := scanRegistry(ctx, kubeletRoot)
	if err != nil {
		return Endpoint{}, err
	}
	if ep, ok := sc.found[driver]; ok {
		if err := checkSocket("csi", ep.Path, ErrDriverUnavailable); err != nil {
			return Endpoint{}, fmt.Errorf("csi driver %q registered by %s: %w", driver, ep.Registration, err)
		}
		return ep, nil
	}
	if err, ok := sc.refused[driver]; ok {
		return Endpoint{}, fmt.Errorf("csi driver %q: %w", driver, err)
	}
	conventional := filepath.Join(kubeletRoot, "plugins", driver, "csi.sock")
	switch err := checkSocket("csi", conventional, ErrDriverUnavailable); {
	case err == nil:
		return Endpoint{Driver: driver, Path: conventional}, nil
	case !errors.Is(err, ErrDriverUnavailable):
		return Endpoint{}, fmt.Errorf("csi driver %q: %w", driver, err)
	}
	var silent string
	if len(sc.silent) > 0 {
		silent = fmt.Sprintf("; %d registration sockets did not answer (%s)", len(sc.silent), strings.Join(sc.silent, ", "))
	}
	return Endpoint{}, fmt.Errorf("csi driver %q is not registered in %s and %s does not exist%s: %w: %w",
		driver, registryDir(kubeletRoot), conventional, silent, errDriverNotFound, ErrDriverUnavailable)
}

func registryDir(kubeletRoot string) string {
	return filepath.Join(kubeletRoot, "plugins_registry")
}

// scanRegistry asks every registration socket for its info, in parallel.
func scanRegistry(ctx context.Context, kubeletRoot string) (scan, error) {
	logger := klog.FromContext(ctx)
	if !filepath.IsAbs(kubeletRoot) {
		return scan{}, fmt.Errorf("kubelet root %q is not an absolute path: set it to kubelet's --root-dir", kubeletRoot)
	}
	socks, err := registrationSockets(registryDir(kubeletRoot))
	if err != nil {
		return scan{}, err
	}
	regs := make([]*registration, len(socks))
	errs := make([]error, len(socks))
	var wg sync.WaitGroup
	for i, s := range socks {
		wg.Go(func() { regs[i], errs[i] = getInfo(ctx, s) })
	}
	wg.Wait()

	sc := scan{refused: map[string]error{}}
	best := map[string]*registration{}
	for i, s := range socks {
		switch {
		case errs[i] != nil:
			logger.V(4).Info("Registration socket did not answer", "path", s, "err", errs[i])
			sc.silent = append(sc.silent, s)
		case regs[i] == nil:
			// Answered, but not a usable CSI plugin.
		case regs[i].refused != nil:
			sc.refused[regs[i].Driver] = regs[i].refused
		default:
			r := regs[i]
			// Like kubelet, a later registration of the same driver wins
			// only with a higher version.
			if old, ok := best[r.Driver]; !ok || old.highest.LessThan(r.highest) {
				best[r.Driver] = r
			}
		}
	}
	sc.found = make(map[string]Endpoint, len(best))
	for name, r := range best {
		sc.found[name] = r.Endpoint
	}
	return sc, nil
}

// registrationSockets walks dir like kubelet's plugin watcher: every unix
// socket below it, in subdirectories too, except names starting with ".".
func registrationSockets(dir string) ([]string, error) {
	var socks []string
	err := filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			if path == dir {
				return err
			}
			return nil // kubelet skips what it cannot read
		}
		if path != dir && strings.HasPrefix(d.Name(), ".") {
			if d.IsDir() {
				return fs.SkipDir
			}
			return nil
		}
		if d.Type() == fs.ModeSocket {
			socks = append(socks, path)
		}
		return nil
	})
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil // kubelet has not created it: nothing registered
	}
	if err != nil {
		return nil, fmt.Errorf("scan csi registration sockets in %s: %w", dir, err)
	}
	sort.Strings(socks)
	return socks, nil
}

// getInfo asks one registration socket who it is. It returns nil, nil for an
// answer that is not a usable CSI plugin (another plugin type, no 1.x
// version), and a registration with refused set for an endpoint that is not
// a unix socket path.
func getInfo(ctx context.Context, sock string) (*registration, error) {
	logger := klog.FromContext(ctx)
	ctx, cancel := context.WithTimeout(ctx, registrationTimeout)
	defer cancel()
	conn, err := grpc.NewClient("unix://"+sock,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithNoProxy(),
		grpc.WithAuthority("localhost"),
	)
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	info, err := registerapi.NewRegistrationClient(conn).GetInfo(ctx, &registerapi.InfoRequest{})
	if err != nil {
		return nil, err
	}
	if info.GetType() != registerapi.CSIPlugin {
		logger.V(5).Info("Registration socket is not a CSI plugin", "path", sock, "type", info.GetType())
		return nil, nil
	}
	highest, err := version.HighestSupportedVersion(info.GetSupportedVersions())
	if err != nil {
		logger.V(4).Info("CSI registration has no supported version, ignored as kubelet does", "path", sock, "driver", info.GetName(), "err", err)
		return nil, nil
	}
	endpoint := info.GetEndpoint()
	if endpoint == "" {
		endpoint = sock // kubelet's rule: the registration socket is the endpoint
	}
	path, err := socketPath("csi", endpoint)
	if err != nil {
		logger.V(4).Info("CSI registration names an endpoint that is not a unix socket, refused", "path", sock, "driver", info.GetName(), "err", err)
		return &registration{Endpoint: Endpoint{Driver: info.GetName(), Registration: sock}, refused: fmt.Errorf("registered by %s: %w", sock, err)}, nil
	}
	return &registration{
		Endpoint: Endpoint{Driver: info.GetName(), Path: path, Registration: sock, Versions: info.GetSupportedVersions()},
		highest:  highest,
	}, nil
}
