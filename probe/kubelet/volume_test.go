package kubelet

import (
	"encoding/json"
	"errors"
	"maps"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/protobuf/proto"
	authenticationv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	storagev1 "k8s.io/api/storage/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
)

const (
	testDriver = "s3.csi.example.com"
	testNode   = "node-1"
	testRoot   = "/var/lib/kubelet"
	testHandle = "bucket/prefix"
	testPodUID = types.UID("0b5d7a0c-1111-2222-3333-444455556666")
	// sha256sum of testHandle.
	testHandleSum = "776438227fc871210ff4c338c95a3e617758616783aa9d1a9fe1abadf01a1a6d"
)

// objects is a pod with a PVC-backed k8s-csi-s3 volume, everything
// resolved: the case kubelet staged and published.
func objects() VolumeObjects {
	fsGroup := int64(2000)
	controller := true
	pvName := "pv-s3"
	return VolumeObjects{
		Pod: &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: "web-0", Namespace: "apps", UID: testPodUID},
			Spec: corev1.PodSpec{
				NodeName:           testNode,
				ServiceAccountName: "web",
				SecurityContext:    &corev1.PodSecurityContext{FSGroup: &fsGroup},
				Volumes: []corev1.Volume{
					{Name: "cache", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}},
					{Name: "data", VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: "data-web-0"}}},
				},
				Containers: []corev1.Container{{Name: "app", VolumeMounts: []corev1.VolumeMount{{Name: "data", MountPath: "/data"}}}},
			},
		},
		VolumeName: "data",
		PVC: &corev1.PersistentVolumeClaim{
			ObjectMeta: metav1.ObjectMeta{Name: "data-web-0", Namespace: "apps", UID: "pvc-uid",
				OwnerReferences: []metav1.OwnerReference{{APIVersion: "v1", Kind: "Pod", Name: "web-0", UID: testPodUID, Controller: &controller}}},
			Spec:   corev1.PersistentVolumeClaimSpec{VolumeName: pvName},
			Status: corev1.PersistentVolumeClaimStatus{Phase: corev1.ClaimBound},
		},
		PV: &corev1.PersistentVolume{
			ObjectMeta: metav1.ObjectMeta{Name: pvName},
			Spec: corev1.PersistentVolumeSpec{
				AccessModes:  []corev1.PersistentVolumeAccessMode{corev1.ReadWriteMany, corev1.ReadWriteOnce},
				MountOptions: []string{"allow_other"},
				ClaimRef:     &corev1.ObjectReference{Namespace: "apps", Name: "data-web-0", UID: "pvc-uid"},
				PersistentVolumeSource: corev1.PersistentVolumeSource{CSI: &corev1.CSIPersistentVolumeSource{
					Driver:               testDriver,
					VolumeHandle:         testHandle,
					FSType:               "fuse.s3fs",
					VolumeAttributes:     map[string]string{"mounter": "s3fs"},
					NodeStageSecretRef:   &corev1.SecretReference{Name: "s3-creds", Namespace: "kube-system"},
					NodePublishSecretRef: &corev1.SecretReference{Name: "s3-publish", Namespace: "kube-system"},
				}},
			},
		},
		CSIDriver: &storagev1.CSIDriver{ObjectMeta: metav1.ObjectMeta{Name: testDriver}},
		VolumeAttachment: &storagev1.VolumeAttachment{
			ObjectMeta: metav1.ObjectMeta{Name: AttachmentName(testHandle, testDriver, testNode)},
			Spec: storagev1.VolumeAttachmentSpec{Attacher: testDriver, NodeName: testNode,
				Source: storagev1.VolumeAttachmentSource{PersistentVolumeName: &pvName}},
			Status: storagev1.VolumeAttachmentStatus{Attached: true, AttachmentMetadata: map[string]string{"devicePath": "/dev/nbd0"}},
		},
		StageSecret: &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Name: "s3-creds", Namespace: "kube-system"},
			Data:       map[string][]byte{"accessKeyID": []byte("AKIAEXAMPLE"), "secretAccessKey": []byte("very-secret-value")},
			StringData: map[string]string{"ignored": "kubelet reads data only"},
		},
		PublishSecret: &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Name: "s3-publish", Namespace: "kube-system"},
			Data:       map[string][]byte{"publishKey": []byte("publish-only-value")},
		},
		Capabilities: NodeCapabilities{StageUnstage: true},
		KubeletRoot:  testRoot,
	}
}

func ptr[T any](v T) *T { return &v }

func TestBuildVolumeRequestFilesystem(t *testing.T) {
	vr, err := BuildVolumeRequest(objects())
	if err != nil {
		t.Fatalf("BuildVolumeRequest() = %v", err)
	}
	staging := testRoot + "/plugins/kubernetes.io/csi/" + testDriver + "/" + testHandleSum + "/globalmount"
	capability := &csi.VolumeCapability{
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER},
		AccessType: &csi.VolumeCapability_Mount{Mount: &csi.VolumeCapability_MountVolume{FsType: "fuse.s3fs", MountFlags: []string{"allow_other"}}},
	}
	wantStage := &csi.NodeStageVolumeRequest{
		VolumeId:          testHandle,
		PublishContext:    map[string]string{"devicePath": "/dev/nbd0"},
		StagingTargetPath: staging,
		VolumeCapability:  capability,
		Secrets:           map[string]string{"accessKeyID": "AKIAEXAMPLE", "secretAccessKey": "very-secret-value"},
		VolumeContext:     map[string]string{"mounter": "s3fs"},
	}
	wantPublish := &csi.NodePublishVolumeRequest{
		VolumeId:          testHandle,
		PublishContext:    map[string]string{"devicePath": "/dev/nbd0"},
		StagingTargetPath: staging,
		TargetPath:        testRoot + "/pods/" + string(testPodUID) + "/volumes/kubernetes.io~csi/pv-s3/mount",
		VolumeCapability:  capability,
		Secrets:           map[string]string{"publishKey": "publish-only-value"},
		VolumeContext:     map[string]string{"mounter": "s3fs"},
	}
	if got := StageRequest(vr); !proto.Equal(got, wantStage) {
		t.Errorf("StageRequest() = %v\nwant %v", got, wantStage)
	}
	if got := PublishRequest(vr); !proto.Equal(got, wantPublish) {
		t.Errorf("PublishRequest() = %v\nwant %v", got, wantPublish)
	}
	if vr.Pod != (types.NamespacedName{Namespace: "apps", Name: "web-0"}) || vr.PodUID != testPodUID || vr.PVName != "pv-s3" {
		t.Errorf("BuildVolumeRequest() pod/PV = %v %v %v, want apps/web-0 %v pv-s3", vr.Pod, vr.PodUID, vr.PVName, testPodUID)
	}
}

func TestBuildVolumeRequestBlock(t *testing.T) {
	in := objects()
	in.PV.Spec.VolumeMode = ptr(corev1.PersistentVolumeBlock)
	in.Pod.Spec.Containers[0].VolumeMounts = nil
	in.Pod.Spec.Containers[0].VolumeDevices = []corev1.VolumeDevice{{Name: "data", DevicePath: "/dev/xvda"}}
	in.Capabilities = NodeCapabilities{VolumeMountGroup: true} // no STAGE_UNSTAGE: block publish still names the staging path
	in.CSIDriver.Spec.PodInfoOnMount = ptr(true)
	in.CSIDriver.Spec.TokenRequests = []storagev1.TokenRequest{{Audience: "vault"}} // not sent for block
	vr, err := BuildVolumeRequest(in)
	if err != nil {
		t.Fatalf("BuildVolumeRequest() = %v", err)
	}
	staging := testRoot + "/plugins/kubernetes.io/csi/volumeDevices/staging/pv-s3"
	capability := &csi.VolumeCapability{
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER},
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
	}
	wantStage := &csi.NodeStageVolumeRequest{
		VolumeId:          testHandle,
		PublishContext:    map[string]string{"devicePath": "/dev/nbd0"},
		StagingTargetPath: staging,
		VolumeCapability:  capability,
		Secrets:           map[string]string{"accessKeyID": "AKIAEXAMPLE", "secretAccessKey": "very-secret-value"},
		VolumeContext:     map[string]string{"mounter": "s3fs"},
	}
	wantPublish := &csi.NodePublishVolumeRequest{
		VolumeId:          testHandle,
		PublishContext:    map[string]string{"devicePath": "/dev/nbd0"},
		StagingTargetPath: staging,
		TargetPath:        testRoot + "/plugins/kubernetes.io/csi/volumeDevices/publish/pv-s3/" + string(testPodUID),
		VolumeCapability:  capability,
		Secrets:           map[string]string{"publishKey": "publish-only-value"},
		VolumeContext: map[string]string{"mounter": "s3fs",
			PodNameKey: "web-0", PodNamespaceKey: "apps", PodUIDKey: string(testPodUID), ServiceAccountNameKey: "web", EphemeralKey: "false"},
	}
	if got := StageRequest(vr); !proto.Equal(got, wantStage) {
		t.Errorf("StageRequest() = %v\nwant %v", got, wantStage)
	}
	if got := PublishRequest(vr); !proto.Equal(got, wantPublish) {
		t.Errorf("PublishRequest() = %v\nwant %v", got, wantPublish)
	}
}

func TestBuildVolumeRequestVariants(t *testing.T) {
	tests := map[string]struct {
		mutate func(*VolumeObjects)
		check  func(t *testing.T, stage *csi.NodeStageVolumeRequest, publish *csi.NodePublishVolumeRequest)
	}{
		"no STAGE_UNSTAGE: no staging path in publish, stage secret not needed": {
			mutate: func(in *VolumeObjects) {
				in.Capabilities.StageUnstage = false
				in.StageSecret = nil
			},
			check: func(t *testing.T, _ *csi.NodeStageVolumeRequest, p *csi.NodePublishVolumeRequest) {
				if p.GetStagingTargetPath() != "" {
					t.Errorf("publish staging path = %q, want empty", p.GetStagingTargetPath())
				}
			},
		},
		"RWO with SINGLE_NODE_MULTI_WRITER": {
			mutate: func(in *VolumeObjects) {
				in.PV.Spec.AccessModes = []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}
				in.Capabilities.SingleNodeMultiWriter = true
			},
			check: wantModes(csi.VolumeCapability_AccessMode_SINGLE_NODE_MULTI_WRITER),
		},
		"RWO without SINGLE_NODE_MULTI_WRITER": {
			mutate: func(in *VolumeObjects) {
				in.PV.Spec.AccessModes = []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOnce}
			},
			check: wantModes(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER),
		},
		"ROX": {
			mutate: func(in *VolumeObjects) {
				in.PV.Spec.AccessModes = []corev1.PersistentVolumeAccessMode{corev1.ReadOnlyMany}
			},
			check: wantModes(csi.VolumeCapability_AccessMode_MULTI_NODE_READER_ONLY),
		},
		"RWOP with SINGLE_NODE_MULTI_WRITER": {
			mutate: func(in *VolumeObjects) {
				in.PV.Spec.AccessModes = []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOncePod}
				in.Capabilities.SingleNodeMultiWriter = true
			},
			check: wantModes(csi.VolumeCapability_AccessMode_SINGLE_NODE_SINGLE_WRITER),
		},
		"RWOP without SINGLE_NODE_MULTI_WRITER": {
			mutate: func(in *VolumeObjects) {
				in.PV.Spec.AccessModes = []corev1.PersistentVolumeAccessMode{corev1.ReadWriteOncePod}
			},
			check: wantModes(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER),
		},
		"no access modes defaults to RWO": {
			mutate: func(in *VolumeObjects) { in.PV.Spec.AccessModes = nil },
			check:  wantModes(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER),
		},
		"podInfoOnMount adds pod keys to publish only": {
			mutate: func(in *VolumeObjects) { in.CSIDriver.Spec.PodInfoOnMount = ptr(true) },
			check: func(t *testing.T, s *csi.NodeStageVolumeRequest, p *csi.NodePublishVolumeRequest) {
				want := map[string]string{"mounter": "s3fs", PodNameKey: "web-0", PodNamespaceKey: "apps",
					PodUIDKey: string(testPodUID), ServiceAccountNameKey: "web", EphemeralKey: "false"}
				if !maps.Equal(p.GetVolumeContext(), want) {
					t.Errorf("publish volume context = %v, want %v", p.GetVolumeContext(), want)
				}
				if !maps.Equal(s.GetVolumeContext(), map[string]string{"mounter": "s3fs"}) {
					t.Errorf("stage volume context = %v, want the PV attributes only", s.GetVolumeContext())
				}
			},
		},
		"pod info keys override volume attributes": {
			mutate: func(in *VolumeObjects) {
				in.CSIDriver.Spec.PodInfoOnMount = ptr(true)
				in.PV.Spec.CSI.VolumeAttributes[PodNameKey] = "spoofed"
			},
			check: func(t *testing.T, _ *csi.NodeStageVolumeRequest, p *csi.NodePublishVolumeRequest) {
				if got := p.GetVolumeContext()[PodNameKey]; got != "web-0" {
					t.Errorf("publish %s = %q, want web-0", PodNameKey, got)
				}
			},
		},
		"no CSIDriver object: no pod info, attachment required": {
			mutate: func(in *VolumeObjects) { in.CSIDriver = nil },
			check: func(t *testing.T, _ *csi.NodeStageVolumeRequest, p *csi.NodePublishVolumeRequest) {
				if _, ok := p.GetVolumeContext()[PodNameKey]; ok || p.GetPublishContext()["devicePath"] != "/dev/nbd0" {
					t.Errorf("publish = %v, want no pod info and the attachment metadata", p)
				}
			},
		},
		"attachRequired false: no publish context, no VolumeAttachment needed": {
			mutate: func(in *VolumeObjects) {
				in.CSIDriver.Spec.AttachRequired = ptr(false)
				in.VolumeAttachment = nil
			},
			check: func(t *testing.T, s *csi.NodeStageVolumeRequest, p *csi.NodePublishVolumeRequest) {
				if len(s.GetPublishContext()) != 0 || len(p.GetPublishContext()) != 0 {
					t.Errorf("publish contexts = %v, %v, want none", s.GetPublishContext(), p.GetPublishContext())
				}
			},
		},
		"PVC source readOnly": {
			mutate: func(in *VolumeObjects) { in.Pod.Spec.Volumes[1].PersistentVolumeClaim.ReadOnly = true },
			check: func(t *testing.T, _ *csi.NodeStageVolumeRequest, p *csi.NodePublishVolumeRequest) {
				if !p.GetReadonly() {
					t.Error("publish readonly = false, want true")
				}
			},
		},
		"container mount readOnly is not sent": {
			mutate: func(in *VolumeObjects) { in.Pod.Spec.Containers[0].VolumeMounts[0].ReadOnly = true },
			check: func(t *testing.T, _ *csi.NodeStageVolumeRequest, p *csi.NodePublishVolumeRequest) {
				if p.GetReadonly() {
					t.Error("publish readonly = true, want false (kubelet sends the PVC source flag only)")
				}
			},
		},
		"fsGroup with VOLUME_MOUNT_GROUP": {
			mutate: func(in *VolumeObjects) { in.Capabilities.VolumeMountGroup = true },
			check: func(t *testing.T, s *csi.NodeStageVolumeRequest, p *csi.NodePublishVolumeRequest) {
				for name, c := range map[string]*csi.VolumeCapability{"stage": s.GetVolumeCapability(), "publish": p.GetVolumeCapability()} {
					if got := c.GetMount().GetVolumeMountGroup(); got != "2000" {
						t.Errorf("%s volume mount group = %q, want 2000", name, got)
					}
				}
			},
		},
		"fsGroup without VOLUME_MOUNT_GROUP": {
			check: func(t *testing.T, s *csi.NodeStageVolumeRequest, p *csi.NodePublishVolumeRequest) {
				if s.GetVolumeCapability().GetMount().GetVolumeMountGroup() != "" || p.GetVolumeCapability().GetMount().GetVolumeMountGroup() != "" {
					t.Error("volume mount group set for a driver without VOLUME_MOUNT_GROUP")
				}
			},
		},
		"no secret refs": {
			mutate: func(in *VolumeObjects) {
				in.PV.Spec.CSI.NodeStageSecretRef, in.PV.Spec.CSI.NodePublishSecretRef = nil, nil
				in.StageSecret, in.PublishSecret = nil, nil
			},
			check: func(t *testing.T, s *csi.NodeStageVolumeRequest, p *csi.NodePublishVolumeRequest) {
				if len(s.GetSecrets()) != 0 || len(p.GetSecrets()) != 0 {
					t.Errorf("secrets = %v, %v, want none", s.GetSecrets(), p.GetSecrets())
				}
			},
		},
		"generic ephemeral volume": {
			mutate: func(in *VolumeObjects) {
				in.Pod.Spec.Volumes[1].VolumeSource = corev1.VolumeSource{Ephemeral: &corev1.EphemeralVolumeSource{}}
				in.PVC.Name = "web-0-data"
				in.PV.Spec.ClaimRef.Name = "web-0-data"
			},
			check: func(t *testing.T, _ *csi.NodeStageVolumeRequest, p *csi.NodePublishVolumeRequest) {
				if p.GetVolumeId() != testHandle {
					t.Errorf("publish volume id = %q, want %q", p.GetVolumeId(), testHandle)
				}
			},
		},
		"tokens in volume context": {
			mutate: func(in *VolumeObjects) {
				in.CSIDriver.Spec.TokenRequests = []storagev1.TokenRequest{{Audience: "vault"}, {Audience: ""}}
				in.ServiceAccountTokens = map[string]authenticationv1.TokenRequestStatus{"vault": {Token: "tok-vault"}, "": {Token: "tok-api"}}
			},
			check: func(t *testing.T, s *csi.NodeStageVolumeRequest, p *csi.NodePublishVolumeRequest) {
				checkTokens(t, p.GetVolumeContext(), map[string]string{"vault": "tok-vault", "": "tok-api"})
				if _, ok := s.GetVolumeContext()[ServiceAccountTokensKey]; ok {
					t.Error("stage volume context has tokens, want publish only")
				}
			},
		},
		"tokens in secrets": {
			mutate: func(in *VolumeObjects) {
				in.CSIDriver.Spec.TokenRequests = []storagev1.TokenRequest{{Audience: "vault"}}
				in.CSIDriver.Spec.ServiceAccountTokenInSecrets = ptr(true)
				in.ServiceAccountTokens = map[string]authenticationv1.TokenRequestStatus{"vault": {Token: "tok-vault"}}
			},
			check: func(t *testing.T, _ *csi.NodeStageVolumeRequest, p *csi.NodePublishVolumeRequest) {
				checkTokens(t, p.GetSecrets(), map[string]string{"vault": "tok-vault"})
				if p.GetSecrets()["publishKey"] != "publish-only-value" {
					t.Errorf("publish secrets lost the publish secret: keys %v", keys(p.GetSecrets()))
				}
				if _, ok := p.GetVolumeContext()[ServiceAccountTokensKey]; ok {
					t.Error("publish volume context has tokens, want them in secrets only")
				}
			},
		},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			in := objects()
			if tc.mutate != nil {
				tc.mutate(&in)
			}
			vr, err := BuildVolumeRequest(in)
			if err != nil {
				t.Fatalf("BuildVolumeRequest() = %v, want a request", err)
			}
			tc.check(t, StageRequest(vr), PublishRequest(vr))
		})
	}
}

func TestBuildVolumeRequestErrors(t *testing.T) {
	tests := map[string]struct {
		mutate func(*VolumeObjects)
		want   error // nil: any error
	}{
		"no pod":                           {mutate: func(in *VolumeObjects) { in.Pod = nil }, want: ErrMissingObject},
		"no PVC":                           {mutate: func(in *VolumeObjects) { in.PVC = nil }, want: ErrMissingObject},
		"no PV":                            {mutate: func(in *VolumeObjects) { in.PV = nil }, want: ErrMissingObject},
		"missing stage secret":             {mutate: func(in *VolumeObjects) { in.StageSecret = nil }, want: ErrMissingObject},
		"missing publish secret":           {mutate: func(in *VolumeObjects) { in.PublishSecret = nil }, want: ErrMissingObject},
		"missing attachment":               {mutate: func(in *VolumeObjects) { in.VolumeAttachment = nil }, want: ErrMissingObject},
		"missing attachment, no CSIDriver": {mutate: func(in *VolumeObjects) { in.CSIDriver, in.VolumeAttachment = nil, nil }, want: ErrMissingObject},
		"missing tokens": {
			mutate: func(in *VolumeObjects) {
				in.CSIDriver.Spec.TokenRequests = []storagev1.TokenRequest{{Audience: "vault"}}
			},
			want: ErrMissingObject,
		},
		"wrong stage secret": {
			mutate: func(in *VolumeObjects) { in.StageSecret.Name = "other" },
			want:   ErrObjectMismatch,
		},
		"no such pod volume": {mutate: func(in *VolumeObjects) { in.VolumeName = "nope" }, want: ErrObjectMismatch},
		"wrong PVC":          {mutate: func(in *VolumeObjects) { in.PVC.Name = "other" }, want: ErrObjectMismatch},
		"PVC not bound":      {mutate: func(in *VolumeObjects) { in.PVC.Status.Phase = corev1.ClaimPending }, want: ErrObjectMismatch},
		"wrong PV":           {mutate: func(in *VolumeObjects) { in.PV.Name = "other" }, want: ErrObjectMismatch},
		"PV bound elsewhere": {mutate: func(in *VolumeObjects) { in.PV.Spec.ClaimRef.UID = "other" }, want: ErrObjectMismatch},
		"ephemeral PVC not owned by the pod": {
			mutate: func(in *VolumeObjects) {
				in.Pod.Spec.Volumes[1].VolumeSource = corev1.VolumeSource{Ephemeral: &corev1.EphemeralVolumeSource{}}
				in.PVC.Name = "web-0-data"
				in.PVC.OwnerReferences = nil
			},
			want: ErrObjectMismatch,
		},
		"block PV in volumeMounts": {
			mutate: func(in *VolumeObjects) { in.PV.Spec.VolumeMode = ptr(corev1.PersistentVolumeBlock) },
			want:   ErrObjectMismatch,
		},
		"filesystem PV in volumeDevices": {
			mutate: func(in *VolumeObjects) {
				in.Pod.Spec.InitContainers = []corev1.Container{{Name: "init", VolumeDevices: []corev1.VolumeDevice{{Name: "data", DevicePath: "/dev/x"}}}}
			},
			want: ErrObjectMismatch,
		},
		"wrong CSIDriver": {mutate: func(in *VolumeObjects) { in.CSIDriver.Name = "other.csi.example.com" }, want: ErrObjectMismatch},
		"attachment for another node": {
			mutate: func(in *VolumeObjects) { in.VolumeAttachment.Spec.NodeName = "node-2" },
			want:   ErrObjectMismatch,
		},
		"attachment with another name": {
			mutate: func(in *VolumeObjects) { in.VolumeAttachment.Name = "csi-0000" },
			want:   ErrObjectMismatch,
		},
		"pod not scheduled": {mutate: func(in *VolumeObjects) { in.Pod.Spec.NodeName = "" }, want: ErrObjectMismatch},
		"not attached":      {mutate: func(in *VolumeObjects) { in.VolumeAttachment.Status.Attached = false }, want: ErrNotAttached},
		"attachment being deleted": {
			mutate: func(in *VolumeObjects) { in.VolumeAttachment.DeletionTimestamp = &metav1.Time{} },
			want:   ErrNotAttached,
		},
		"in-tree PV without spec.csi": {
			mutate: func(in *VolumeObjects) {
				in.PV.Spec.PersistentVolumeSource = corev1.PersistentVolumeSource{NFS: &corev1.NFSVolumeSource{Server: "nfs", Path: "/x"}}
			},
			want: ErrUnsupportedVolume,
		},
		"CSI-migrated in-tree PV": {
			mutate: func(in *VolumeObjects) {
				in.PV.Annotations = map[string]string{"pv.kubernetes.io/migrated-to": "ebs.csi.aws.com"}
				in.PV.Spec.PersistentVolumeSource = corev1.PersistentVolumeSource{AWSElasticBlockStore: &corev1.AWSElasticBlockStoreVolumeSource{VolumeID: "vol-1"}}
			},
			want: ErrUnsupportedVolume,
		},
		"inline CSI volume": {
			mutate: func(in *VolumeObjects) {
				in.Pod.Spec.Volumes[1].VolumeSource = corev1.VolumeSource{CSI: &corev1.CSIVolumeSource{Driver: testDriver}}
			},
			want: ErrUnsupportedVolume,
		},
		"emptyDir volume": {mutate: func(in *VolumeObjects) { in.VolumeName = "cache" }, want: ErrUnsupportedVolume},
		"driver name with slash": {
			mutate: func(in *VolumeObjects) {
				in.PV.Spec.CSI.Driver = "../../etc"
			},
			want: ErrUnsupportedVolume,
		},
		"CSIDriver without Persistent mode": {
			mutate: func(in *VolumeObjects) {
				in.CSIDriver.Spec.VolumeLifecycleModes = []storagev1.VolumeLifecycleMode{storagev1.VolumeLifecycleEphemeral}
			},
			want: ErrUnsupportedVolume,
		},
		"relative kubelet root": {mutate: func(in *VolumeObjects) { in.KubeletRoot = "var/lib/kubelet" }},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			in := objects()
			tc.mutate(&in)
			vr, err := BuildVolumeRequest(in)
			if err == nil {
				t.Fatalf("BuildVolumeRequest() = %v, nil; want an error", vr)
			}
			if tc.want != nil && !errors.Is(err, tc.want) {
				t.Errorf("BuildVolumeRequest() = %v, want errors.Is(%v)", err, tc.want)
			}
		})
	}
}

func TestSecretRefs(t *testing.T) {
	in := objects()
	stage, publish := SecretRefs(in.PV)
	if stage == nil || stage.Name != "s3-creds" || publish == nil || publish.Name != "s3-publish" {
		t.Errorf("SecretRefs() = %v, %v; want s3-creds, s3-publish", stage, publish)
	}
	in.PV.Spec.CSI = nil
	if stage, publish := SecretRefs(in.PV); stage != nil || publish != nil {
		t.Errorf("SecretRefs(PV without spec.csi) = %v, %v; want nil, nil", stage, publish)
	}
	if stage, publish := SecretRefs(nil); stage != nil || publish != nil {
		t.Errorf("SecretRefs(nil) = %v, %v; want nil, nil", stage, publish)
	}
}

func TestTokenRequests(t *testing.T) {
	in := objects()
	if got := TokenRequests(in.CSIDriver, in.Pod); got != nil {
		t.Errorf("TokenRequests(no tokenRequests) = %v, want nil", got)
	}
	in.CSIDriver.Spec.TokenRequests = []storagev1.TokenRequest{{Audience: "vault", ExpirationSeconds: ptr(int64(3600))}, {Audience: ""}}
	got := TokenRequests(in.CSIDriver, in.Pod)
	if len(got) != 2 {
		t.Fatalf("TokenRequests() = %v, want 2 requests", got)
	}
	vault := got["vault"].Spec
	if len(vault.Audiences) != 1 || vault.Audiences[0] != "vault" || vault.ExpirationSeconds == nil || *vault.ExpirationSeconds != 3600 {
		t.Errorf("TokenRequests()[vault] = %+v, want audience vault, 3600 s", vault)
	}
	if ref := vault.BoundObjectRef; ref == nil || ref.Kind != "Pod" || ref.Name != "web-0" || ref.UID != testPodUID {
		t.Errorf("TokenRequests()[vault] bound to %+v, want the pod", ref)
	}
	if def := got[""].Spec; def.Audiences == nil || len(def.Audiences) != 0 {
		t.Errorf("TokenRequests()[\"\"] audiences = %#v, want an empty list (the API server's audience)", def.Audiences)
	}
}

func wantModes(want csi.VolumeCapability_AccessMode_Mode) func(*testing.T, *csi.NodeStageVolumeRequest, *csi.NodePublishVolumeRequest) {
	return func(t *testing.T, s *csi.NodeStageVolumeRequest, p *csi.NodePublishVolumeRequest) {
		t.Helper()
		if got := s.GetVolumeCapability().GetAccessMode().GetMode(); got != want {
			t.Errorf("stage access mode = %v, want %v", got, want)
		}
		if got := p.GetVolumeCapability().GetAccessMode().GetMode(); got != want {
			t.Errorf("publish access mode = %v, want %v", got, want)
		}
	}
}

// checkTokens decodes the tokens entry of m and compares the tokens by
// audience.
func checkTokens(t *testing.T, m map[string]string, want map[string]string) {
	t.Helper()
	var got map[string]authenticationv1.TokenRequestStatus
	if err := json.Unmarshal([]byte(m[ServiceAccountTokensKey]), &got); err != nil {
		t.Fatalf("decode %s: %v", ServiceAccountTokensKey, err)
	}
	if len(got) != len(want) {
		t.Fatalf("tokens for audiences %v, want %v", keys(got), keys(want))
	}
	for aud, tok := range want {
		if got[aud].Token != tok {
			t.Errorf("token for audience %q does not match", aud)
		}
	}
}

func keys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	return out
}

func TestClaimName(t *testing.T) {
	pod := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "web-0", Namespace: "ns"}}
	tests := []struct {
		name      string
		vol       corev1.Volume
		wantClaim string
		wantOK    bool
	}{
		{
			name:      "persistentVolumeClaim",
			vol:       corev1.Volume{Name: "data", VolumeSource: corev1.VolumeSource{PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: "data-web-0"}}},
			wantClaim: "data-web-0", wantOK: true,
		},
		{
			name:      "generic ephemeral: <pod>-<volume>",
			vol:       corev1.Volume{Name: "scratch", VolumeSource: corev1.VolumeSource{Ephemeral: &corev1.EphemeralVolumeSource{}}},
			wantClaim: "web-0-scratch", wantOK: true,
		},
		{
			name: "inline CSI",
			vol:  corev1.Volume{Name: "inline", VolumeSource: corev1.VolumeSource{CSI: &corev1.CSIVolumeSource{Driver: "d"}}},
		},
		{
			name: "emptyDir",
			vol:  corev1.Volume{Name: "tmp", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			claim, ok := ClaimName(pod, &tt.vol)
			if claim != tt.wantClaim || ok != tt.wantOK {
				t.Errorf("ClaimName(%s) = %q, %v; want %q, %v", tt.vol.Name, claim, ok, tt.wantClaim, tt.wantOK)
			}
		})
	}
}
