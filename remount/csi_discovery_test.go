package remount

import (
	"errors"
	"os"
	"path/filepath"
	"testing"

	"google.golang.org/grpc"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

const testDriver = "s3.csi.example.com"

// kubeletDirs makes <root>/plugins_registry and <root>/plugins/<driver>.
func kubeletDirs(t *testing.T) (root, registry, pluginDir string) {
	t.Helper()
	root = socketDir(t)
	registry = filepath.Join(root, "plugins_registry")
	pluginDir = filepath.Join(root, "plugins", testDriver)
	for _, d := range []string{registry, pluginDir} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			t.Fatal(err)
		}
	}
	return root, registry, pluginDir
}

func TestFindDriver(t *testing.T) {
	type want struct {
		path         string // relative to the kubelet root
		registration string // relative to the kubelet root
		notFound     bool
		unavailable  bool
		otherErr     bool
	}
	tests := map[string]struct {
		setup func(t *testing.T, root, registry, pluginDir string)
		want  want
	}{
		"registered endpoint path": {
			setup: func(t *testing.T, root, registry, pluginDir string) {
				serveDriver2(t, filepath.Join(pluginDir, "csi.sock"))
				serveRegistration(t, filepath.Join(registry, testDriver+"-reg.sock"), registerapi.CSIPlugin, testDriver, filepath.Join(pluginDir, "csi.sock"), "1.0.0")
			},
			want: want{path: "plugins/" + testDriver + "/csi.sock", registration: "plugins_registry/" + testDriver + "-reg.sock"},
		},
		"registered unix url to another name": {
			setup: func(t *testing.T, root, registry, pluginDir string) {
				serveDriver2(t, filepath.Join(pluginDir, "node.sock"))
				serveRegistration(t, filepath.Join(registry, "reg.sock"), registerapi.CSIPlugin, testDriver, "unix://"+filepath.Join(pluginDir, "node.sock"), "0.3.0", "1.2.0")
			},
			want: want{path: "plugins/" + testDriver + "/node.sock", registration: "plugins_registry/reg.sock"},
		},
		"empty endpoint is the registration socket": {
			setup: func(t *testing.T, root, registry, pluginDir string) {
				serveRegistration(t, filepath.Join(registry, "reg.sock"), registerapi.CSIPlugin, testDriver, "", "1.0.0")
			},
			want: want{path: "plugins_registry/reg.sock", registration: "plugins_registry/reg.sock"},
		},
		"registration in a subdirectory": {
			setup: func(t *testing.T, root, registry, pluginDir string) {
				sub := filepath.Join(registry, "sub")
				if err := os.Mkdir(sub, 0o750); err != nil {
					t.Fatal(err)
				}
				serveDriver2(t, filepath.Join(pluginDir, "csi.sock"))
				serveRegistration(t, filepath.Join(sub, "r.sock"), registerapi.CSIPlugin, testDriver, filepath.Join(pluginDir, "csi.sock"), "1.0.0")
			},
			want: want{path: "plugins/" + testDriver + "/csi.sock", registration: "plugins_registry/sub/r.sock"},
		},
		"higher version wins": {
			setup: func(t *testing.T, root, registry, pluginDir string) {
				serveDriver2(t, filepath.Join(pluginDir, "old.sock"))
				serveDriver2(t, filepath.Join(pluginDir, "new.sock"))
				serveRegistration(t, filepath.Join(registry, "a.sock"), registerapi.CSIPlugin, testDriver, filepath.Join(pluginDir, "old.sock"), "1.0.0")
				serveRegistration(t, filepath.Join(registry, "b.sock"), registerapi.CSIPlugin, testDriver, filepath.Join(pluginDir, "new.sock"), "1.5.0")
				serveRegistration(t, filepath.Join(registry, "c.sock"), registerapi.CSIPlugin, testDriver, filepath.Join(pluginDir, "old.sock"), "1.1.0")
			},
			want: want{path: "plugins/" + testDriver + "/new.sock", registration: "plugins_registry/b.sock"},
		},
		"other drivers and plugin types are skipped": {
			setup: func(t *testing.T, root, registry, pluginDir string) {
				serveDriver2(t, filepath.Join(pluginDir, "csi.sock"))
				serveRegistration(t, filepath.Join(registry, "dev.sock"), registerapi.DevicePlugin, testDriver, filepath.Join(root, "x.sock"), "v1beta1")
				serveRegistration(t, filepath.Join(registry, "other.sock"), registerapi.CSIPlugin, "other.csi.example.com", filepath.Join(root, "x.sock"), "1.0.0")
				serveRegistration(t, filepath.Join(registry, "reg.sock"), registerapi.CSIPlugin, testDriver, filepath.Join(pluginDir, "csi.sock"), "1.0.0")
			},
			want: want{path: "plugins/" + testDriver + "/csi.sock", registration: "plugins_registry/reg.sock"},
		},
		"conventional socket without registration": {
			setup: func(t *testing.T, root, registry, pluginDir string) {
				serveDriver2(t, filepath.Join(pluginDir, "csi.sock"))
			},
			want: want{path: "plugins/" + testDriver + "/csi.sock"},
		},
		"no registry directory, conventional socket": {
			setup: func(t *testing.T, root, registry, pluginDir string) {
				if err := os.Remove(registry); err != nil {
					t.Fatal(err)
				}
				serveDriver2(t, filepath.Join(pluginDir, "csi.sock"))
			},
			want: want{path: "plugins/" + testDriver + "/csi.sock"},
		},
		"dot socket is ignored": {
			setup: func(t *testing.T, root, registry, pluginDir string) {
				serveRegistration(t, filepath.Join(registry, ".hidden.sock"), registerapi.CSIPlugin, testDriver, "", "1.0.0")
			},
			want: want{notFound: true, unavailable: true},
		},
		"only CSI 2.x offered": {
			setup: func(t *testing.T, root, registry, pluginDir string) {
				serveRegistration(t, filepath.Join(registry, "reg.sock"), registerapi.CSIPlugin, testDriver, "", "2.0.0")
			},
			want: want{notFound: true, unavailable: true},
		},
		"nothing at all": {
			setup: func(t *testing.T, root, registry, pluginDir string) {},
			want:  want{notFound: true, unavailable: true},
		},
		"registration socket left behind": {
			setup: func(t *testing.T, root, registry, pluginDir string) {
				deadSocket(t, filepath.Join(registry, testDriver+"-reg.sock"))
			},
			want: want{notFound: true, unavailable: true},
		},
		"registered socket is gone": {
			setup: func(t *testing.T, root, registry, pluginDir string) {
				serveRegistration(t, filepath.Join(registry, "reg.sock"), registerapi.CSIPlugin, testDriver, filepath.Join(pluginDir, "csi.sock"), "1.0.0")
			},
			want: want{unavailable: true},
		},
		"registered endpoint is tcp": {
			setup: func(t *testing.T, root, registry, pluginDir string) {
				serveRegistration(t, filepath.Join(registry, "reg.sock"), registerapi.CSIPlugin, testDriver, "tcp://127.0.0.1:9000", "1.0.0")
			},
			want: want{otherErr: true},
		},
		"registered endpoint is a regular file": {
			setup: func(t *testing.T, root, registry, pluginDir string) {
				file := filepath.Join(pluginDir, "csi.sock")
				if err := os.WriteFile(file, nil, 0o600); err != nil {
					t.Fatal(err)
				}
				serveRegistration(t, filepath.Join(registry, "reg.sock"), registerapi.CSIPlugin, testDriver, file, "1.0.0")
			},
			want: want{otherErr: true},
		},
		"conventional path is a regular file": {
			setup: func(t *testing.T, root, registry, pluginDir string) {
				if err := os.WriteFile(filepath.Join(pluginDir, "csi.sock"), nil, 0o600); err != nil {
					t.Fatal(err)
				}
			},
			want: want{otherErr: true},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			root, registry, pluginDir := kubeletDirs(t)
			tc.setup(t, root, registry, pluginDir)
			ep, err := FindDriver(t.Context(), root, testDriver)
			w := tc.want
			if w.notFound || w.unavailable || w.otherErr {
				if err == nil {
					t.Fatalf("FindDriver() = %+v, nil; want an error", ep)
				}
				if got := errors.Is(err, errDriverNotFound); got != w.notFound {
					t.Errorf("FindDriver() = %v; errors.Is(errDriverNotFound) = %v, want %v", err, got, w.notFound)
				}
				if got := errors.Is(err, ErrDriverUnavailable); got != w.unavailable {
					t.Errorf("FindDriver() = %v; errors.Is(ErrDriverUnavailable) = %v, want %v", err, got, w.unavailable)
				}
				return
			}
			if err != nil {
				t.Fatalf("FindDriver() = %v, want an endpoint", err)
			}
			wantEp := Endpoint{Driver: testDriver, Path: filepath.Join(root, w.path)}
			if w.registration != "" {
				wantEp.Registration = filepath.Join(root, w.registration)
			}
			if ep.Driver != wantEp.Driver || ep.Path != wantEp.Path || ep.Registration != wantEp.Registration {
				t.Errorf("FindDriver() = %+v, want %+v", ep, wantEp)
			}
			if w.registration != "" && len(ep.Versions) == 0 {
				t.Errorf("FindDriver() = %+v, want the registration's versions", ep)
			}
		})
	}
}

// serveDriver2 serves a fake CSI driver at path.
func serveDriver2(t *testing.T, path string) {
	t.Helper()
	serveUnix(t, path, func(s *grpc.Server) { registerDriver(s, &fakeDriver{}) })
}

func TestFindDriverNeverNotifies(t *testing.T) {
	root, registry, pluginDir := kubeletDirs(t)
	serveDriver2(t, filepath.Join(pluginDir, "csi.sock"))
	reg := serveRegistration(t, filepath.Join(registry, "reg.sock"), registerapi.CSIPlugin, testDriver, filepath.Join(pluginDir, "csi.sock"), "1.0.0")
	other := serveRegistration(t, filepath.Join(registry, "dev.sock"), registerapi.DevicePlugin, "vendor/gpu", "", "v1beta1")
	if _, err := FindDriver(t.Context(), root, testDriver); err != nil {
		t.Fatalf("FindDriver() = %v", err)
	}
	if _, err := FindDriver(t.Context(), root, "missing.csi.example.com"); !errors.Is(err, errDriverNotFound) {
		t.Fatalf("FindDriver(missing) = %v, want errDriverNotFound", err)
	}
	if n := reg.notified.Load() + other.notified.Load(); n != 0 {
		t.Errorf("registration servers got %d NotifyRegistrationStatus calls, want 0 (that call is kubelet's)", n)
	}
}

func TestFindDriverRefusesBadNames(t *testing.T) {
	root, _, _ := kubeletDirs(t)
	for _, name := range []string{"", ".", "..", "a/b", "../../etc"} {
		if _, err := FindDriver(t.Context(), root, name); err == nil || errors.Is(err, errDriverNotFound) {
			t.Errorf("FindDriver(%q) = %v, want a bad-name error", name, err)
		}
	}
}
