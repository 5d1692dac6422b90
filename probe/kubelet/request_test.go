package kubelet

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2/textlogger"
)

func TestAccessMode(t *testing.T) {
	tests := []struct {
		pv   corev1.PersistentVolumeAccessMode
		snmw bool
		want csi.VolumeCapability_AccessMode_Mode
	}{
		{corev1.ReadWriteOnce, false, csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		{corev1.ReadWriteOnce, true, csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER},
		{corev1.ReadOnlyMany, false, csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY},
		{corev1.ReadOnlyMany, true, csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY},
		{corev1.ReadWriteMany, false, csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER},
		{corev1.ReadWriteMany, true, csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER},
		// kubelet sends SINGLE_NODE_WRITER for RWOP to drivers without
		// SINGLE_NODE_MULTI_WRITER.
		{corev1.ReadWriteOncePod, false, csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER},
		{corev1.ReadWriteOncePod, true, csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER},
		{"Bogus", true, csi.VolumeCapability_AccessMode_UNKNOWN},
	}
	for _, tc := range tests {
		if got := AccessMode(tc.pv, tc.snmw); got != tc.want {
			t.Errorf("AccessMode(%s, %v) = %v, want %v", tc.pv, tc.snmw, got, tc.want)
		}
	}
}

func TestPaths(t *testing.T) {
	// Hashes computed with sha256sum, independently of the code under test.
	const handleSum = "776438227fc871210ff4c338c95a3e617758616783aa9d1a9fe1abadf01a1a6d" // "bucket/prefix"
	uid := types.UID("0b5d7a0c-1111-2222-3333-444455556666")
	tests := map[string]struct{ got, want string }{
		"AttachmentName": {
			got:  AttachmentName("bucket/prefix", "s3.csi.example.com", "node-1"),
			want: "csi-501a777958f4154bfc5c3ee1d97843b89e1a776028fa61745fc3b4eac21138c3",
		},
		"StagingPath": {
			got:  StagingPath("/var/lib/kubelet", "s3.csi.example.com", "bucket/prefix"),
			want: "/var/lib/kubelet/plugins/kubernetes.io/csi/s3.csi.example.com/" + handleSum + "/globalmount",
		},
		"TargetPath": {
			got:  TargetPath("/var/lib/kubelet", uid, "pv-s3"),
			want: "/var/lib/kubelet/pods/0b5d7a0c-1111-2222-3333-444455556666/volumes/kubernetes.io~csi/pv-s3/mount",
		},
		"TargetPath escapes slashes": {
			got:  TargetPath("/var/lib/kubelet/", uid, "a/b"),
			want: "/var/lib/kubelet/pods/0b5d7a0c-1111-2222-3333-444455556666/volumes/kubernetes.io~csi/a~b/mount",
		},
		"BlockStagingPath": {
			got:  BlockStagingPath("/var/lib/kubelet", "pv-blk"),
			want: "/var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/staging/pv-blk",
		},
		"BlockTargetPath": {
			got:  BlockTargetPath("/var/lib/kubelet", "pv-blk", uid),
			want: "/var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/publish/pv-blk/0b5d7a0c-1111-2222-3333-444455556666",
		},
	}
	for name, tc := range tests {
		if tc.got != tc.want {
			t.Errorf("%s = %q, want %q", name, tc.got, tc.want)
		}
	}
}

// secretValues are the secret values the redaction test must never see.
var secretValues = []string{"AKIAEXAMPLE", "very-secret-value", "publish-only-value", "eyJhbGciOi-token"}

func secretRequest() VolumeRequest {
	return VolumeRequest{
		Driver:           "s3.csi.example.com",
		VolumeHandle:     "bucket/prefix",
		VolumeAttributes: map[string]string{"mounter": "s3fs"},
		PodAttributes:    map[string]string{PodNameKey: "web-0", ServiceAccountTokensKey: `{"":{"token":"eyJhbGciOi-token"}}`},
		StageSecrets:     map[string]string{"accessKeyID": "AKIAEXAMPLE", "secretAccessKey": "very-secret-value"},
		PublishSecrets:   map[string]string{"publishKey": "publish-only-value"},
		StagingPath:      "/s",
		TargetPath:       "/t",
	}
}

func TestVolumeRequestRedacted(t *testing.T) {
	vr := secretRequest()
	type holder struct {
		Req VolumeRequest
		Ptr *VolumeRequest
	}
	logJSON, err := json.Marshal(vr.MarshalLog())
	if err != nil {
		t.Fatalf("json.Marshal(MarshalLog()) = %v", err)
	}
	var logged bytes.Buffer
	textlogger.NewLogger(textlogger.NewConfig(textlogger.Output(&logged))).Info("Repairing", "request", vr, "ptr", &vr)
	outputs := map[string]string{
		"String":     vr.String(),
		"%v":         fmt.Sprintf("%v", vr),
		"%+v":        fmt.Sprintf("%+v", vr),
		"%#v":        fmt.Sprintf("%#v", vr),
		"pointer %v": fmt.Sprintf("%v", &vr),
		"nested %+v": fmt.Sprintf("%+v", holder{Req: vr, Ptr: &vr}),
		"MarshalLog": string(logJSON),
		"klog":       logged.String(),
		"Redacted":   fmt.Sprintf("%v", map[string]string(vr.Redacted().StageSecrets)),
	}
	for name, out := range outputs {
		for _, secret := range secretValues {
			if strings.Contains(out, secret) {
				t.Errorf("%s output shows a secret value: %s", name, out)
			}
		}
		if name != "Redacted" && !strings.Contains(out, "s3fs") {
			t.Errorf("%s output lost non-secret fields: %s", name, out)
		}
		if !strings.Contains(out, "secretAccessKey") {
			t.Errorf("%s output lost the secret key names: %s", name, out)
		}
	}
	// Redaction works on a copy.
	if vr.StageSecrets["secretAccessKey"] != "very-secret-value" || !strings.Contains(vr.PodAttributes[ServiceAccountTokensKey], "eyJhbGciOi-token") {
		t.Errorf("Redacted() changed the request it was called on: %v", vr.Redacted())
	}
}

func TestRequestsDoNotAlias(t *testing.T) {
	vr := secretRequest()
	vr.MountOptions = []string{"allow_other"}
	stage, publish := StageRequest(vr), PublishRequest(vr)
	stage.Secrets["accessKeyID"] = "changed"
	stage.VolumeContext["mounter"] = "changed"
	publish.VolumeContext["mounter"] = "changed"
	publish.VolumeCapability.GetMount().MountFlags[0] = "changed"
	if vr.StageSecrets["accessKeyID"] != "AKIAEXAMPLE" || vr.VolumeAttributes["mounter"] != "s3fs" || vr.MountOptions[0] != "allow_other" {
		t.Errorf("changing a built request changed the VolumeRequest: %v", vr)
	}
}
