package csilab

import (
	"bytes"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mountmedic/mountmedic/scripts/lab"
)

// Credentials of the lab's S3 server. They protect nothing: the server listens on
// loopback and lives as long as one test.
const (
	AccessKey = "mountmedic"
	SecretKey = "mountmedic-secret"
	// Bucket is the bucket StartS3 creates.
	Bucket = "mountmedic"
	region = "us-east-1"
)

// S3 is a versitygw server with the posix backend, rooted in a test directory.
type S3 struct {
	// Endpoint is the server URL, http://127.0.0.1:PORT.
	Endpoint string
	// Root is the posix backend directory: one subdirectory a bucket (with its
	// ACL in extended attributes, so a bucket must be made through the API).
	Root string
	proc *lab.Process
}

// StartS3 starts versitygw on a free loopback port, creates Bucket and stops the
// server when the test ends.
func StartS3(t testing.TB) *S3 {
	t.Helper()
	bin := lab.RequireTool(t, "versitygw")
	dir := t.TempDir()
	root := filepath.Join(dir, "root")
	if err := os.Mkdir(root, 0o755); err != nil {
		t.Fatalf("create s3 root: %v", err)
	}
	ports, err := lab.FreePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	addr := "127.0.0.1:" + strconv.Itoa(ports[0])
	cmd := exec.Command(bin, "--access", AccessKey, "--secret", SecretKey, "--region", region,
		"--port", addr, "posix", root)
	p, err := lab.RunProcess("versitygw", cmd, filepath.Join(dir, "versitygw.log"))
	if err != nil {
		t.Fatal(err)
	}
	s := &S3{Endpoint: "http://" + addr, Root: root, proc: p}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("last lines of versitygw:\n%s", p.Tail(15))
		}
		p.Kill()
	})
	if err := p.WaitDial("tcp", addr, 30*time.Second); err != nil {
		t.Fatal(err)
	}
	if err := s.CreateBucket(Bucket); err != nil {
		t.Fatal(err)
	}
	return s
}

// CreateBucket creates a bucket through the S3 API.
func (s *S3) CreateBucket(name string) error {
	if err := s.do(http.MethodPut, "/"+name, nil); err != nil {
		return fmt.Errorf("create bucket %s: %w", name, err)
	}
	return nil
}

// PutObject stores data under key in bucket. A key ending in "/" with no data is
// the directory marker that makes a volume prefix exist.
func (s *S3) PutObject(bucket, key string, data []byte) error {
	if err := s.do(http.MethodPut, "/"+bucket+"/"+strings.TrimPrefix(key, "/"), data); err != nil {
		return fmt.Errorf("put object %s/%s: %w", bucket, key, err)
	}
	return nil
}

// HasObject reports whether key exists in bucket.
func (s *S3) HasObject(bucket, key string) (bool, error) {
	err := s.do(http.MethodHead, "/"+bucket+"/"+strings.TrimPrefix(key, "/"), nil)
	var se *statusError
	switch {
	case err == nil:
		return true, nil
	case errors.As(err, &se) && se.code == http.StatusNotFound:
		return false, nil
	}
	return false, fmt.Errorf("head object %s/%s: %w", bucket, key, err)
}

// statusError is an S3 answer other than 2xx.
type statusError struct {
	code int
	msg  string
}

func (e *statusError) Error() string { return e.msg }

// do sends a request signed with AWS signature version 4.
func (s *S3) do(method, path string, body []byte) error {
	req, err := http.NewRequest(method, s.Endpoint+path, bytes.NewReader(body))
	if err != nil {
		return fmt.Errorf("build request: %w", err)
	}
	sign(req, body, time.Now().UTC())
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("send request: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return &statusError{code: resp.StatusCode, msg: fmt.Sprintf("%s %s answered %s: %s", method, path, resp.Status, bytes.TrimSpace(msg))}
	}
	return nil
}

// sign adds the AWS signature version 4 headers for the lab's credentials. It
// handles what the lab sends: no query string, paths of plain characters.
func sign(req *http.Request, body []byte, now time.Time) {
	payload := sha256.Sum256(body)
	payloadHex := hex.EncodeToString(payload[:])
	amzDate := now.Format("20060102T150405Z")
	day := now.Format("20060102")
	req.Header.Set("x-amz-content-sha256", payloadHex)
	req.Header.Set("x-amz-date", amzDate)

	const signed = "host;x-amz-content-sha256;x-amz-date"
	canonical := strings.Join([]string{
		req.Method,
		req.URL.EscapedPath(),
		"",
		"host:" + req.URL.Host,
		"x-amz-content-sha256:" + payloadHex,
		"x-amz-date:" + amzDate,
		"",
		signed,
		payloadHex,
	}, "\n")
	scope := day + "/" + region + "/s3/aws4_request"
	canonicalSum := sha256.Sum256([]byte(canonical))
	toSign := "AWS4-HMAC-SHA256\n" + amzDate + "\n" + scope + "\n" + hex.EncodeToString(canonicalSum[:])

	key := []byte("AWS4" + SecretKey)
	for _, part := range []string{day, region, "s3", "aws4_request"} {
		key = hmacSum(key, part)
	}
	req.Header.Set("Authorization", fmt.Sprintf("AWS4-HMAC-SHA256 Credential=%s/%s, SignedHeaders=%s, Signature=%s",
		AccessKey, scope, signed, hex.EncodeToString(hmacSum(key, toSign))))
}

func hmacSum(key []byte, data string) []byte {
	h := hmac.New(sha256.New, key)
	h.Write([]byte(data))
	return h.Sum(nil)
}

// Volume is the data the s3driver needs for one volume, as a PV would carry
// it: the volume handle, the node stage and publish secrets and the volume
// attributes (kubelet.VolumeRequest's VolumeHandle, StageSecrets and
// PublishSecrets, VolumeAttributes).
type Volume struct {
	Handle     string            // "bucket" or "bucket/prefix"
	Secrets    map[string]string // accessKeyID, secretAccessKey, endpoint
	Attributes map[string]string // mounter: s3fs
}

// Volume returns the request data for bucket and an optional prefix (which must
// exist: create it with PutObject(bucket, prefix+"/", nil)).
func (s *S3) Volume(bucket, prefix string) Volume {
	handle := bucket
	if prefix != "" {
		handle += "/" + prefix
	}
	return Volume{
		Handle: handle,
		Secrets: map[string]string{
			"accessKeyID":     AccessKey,
			"secretAccessKey": SecretKey,
			"endpoint":        s.Endpoint,
		},
		Attributes: map[string]string{"mounter": "s3fs"},
	}
}
