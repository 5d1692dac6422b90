package kubetest

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// pki is the throwaway key material of one cluster: a CA, the apiserver's serving
// certificate, the admin client certificate and the service-account signing key.
// The CA's key stays in memory so that tests can mint more client certificates
// (nodes' identities: clientCert).
type pki struct {
	caCert []byte // PEM
	caFile string
	ca     *x509.Certificate
	caKey  crypto.Signer

	servingCertFile, servingKeyFile string

	adminCert, adminKey []byte // PEM

	saKeyFile, saPubFile string
}

func newPKI(dir string) (*pki, error) {
	p := &pki{}
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate ca key: %w", err)
	}
	caTmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "kubetest-ca"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, caKey.Public(), caKey)
	if err != nil {
		return nil, fmt.Errorf("create ca certificate: %w", err)
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return nil, fmt.Errorf("parse ca certificate: %w", err)
	}
	p.ca, p.caKey = ca, caKey
	p.caCert = pemBlock("CERTIFICATE", caDER)
	p.caFile = filepath.Join(dir, "ca.crt")
	if err := os.WriteFile(p.caFile, p.caCert, 0o600); err != nil {
		return nil, fmt.Errorf("write ca certificate: %w", err)
	}

	serving := &x509.Certificate{
		SerialNumber: big.NewInt(2),
		Subject:      pkix.Name{CommonName: "kube-apiserver"},
		DNSNames:     []string{"localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc"},
		IPAddresses:  []net.IP{net.IPv4(127, 0, 0, 1), net.IPv4(10, 0, 0, 1)},
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	cert, key, err := issue(serving, ca, caKey)
	if err != nil {
		return nil, fmt.Errorf("issue serving certificate: %w", err)
	}
	p.servingCertFile = filepath.Join(dir, "apiserver.crt")
	p.servingKeyFile = filepath.Join(dir, "apiserver.key")
	if err := writeFiles(map[string][]byte{p.servingCertFile: cert, p.servingKeyFile: key}); err != nil {
		return nil, err
	}

	admin := &x509.Certificate{
		SerialNumber: big.NewInt(3),
		Subject:      pkix.Name{CommonName: "kubetest-admin", Organization: []string{"system:masters"}},
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	if p.adminCert, p.adminKey, err = issue(admin, ca, caKey); err != nil {
		return nil, fmt.Errorf("issue admin certificate: %w", err)
	}
	// The CA key and the admin's credentials on file too: a test binary
	// that attaches to this cluster (Attach) mints its clients from them.
	caKeyDER, err := x509.MarshalECPrivateKey(caKey)
	if err != nil {
		return nil, fmt.Errorf("marshal ca key: %w", err)
	}
	if err := writeFiles(map[string][]byte{
		filepath.Join(dir, caKeyName):     pemBlock("EC PRIVATE KEY", caKeyDER),
		filepath.Join(dir, adminCertName): p.adminCert, filepath.Join(dir, adminKeyName): p.adminKey,
	}); err != nil {
		return nil, err
	}

	saKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("generate service-account key: %w", err)
	}
	saPriv, err := x509.MarshalECPrivateKey(saKey)
	if err != nil {
		return nil, fmt.Errorf("marshal service-account key: %w", err)
	}
	saPub, err := x509.MarshalPKIXPublicKey(saKey.Public())
	if err != nil {
		return nil, fmt.Errorf("marshal service-account public key: %w", err)
	}
	p.saKeyFile = filepath.Join(dir, "sa.key")
	p.saPubFile = filepath.Join(dir, "sa.pub")
	if err := writeFiles(map[string][]byte{
		p.saKeyFile: pemBlock("EC PRIVATE KEY", saPriv),
		p.saPubFile: pemBlock("PUBLIC KEY", saPub),
	}); err != nil {
		return nil, err
	}
	return p, nil
}

// Files of the key material beside ca.crt, for loadPKI.
const (
	caKeyName     = "ca.key"
	adminCertName = "admin.crt"
	adminKeyName  = "admin.key"
)

// loadPKI reads what newPKI wrote in dir: the CA (with its key) and the
// admin's credentials.
func loadPKI(dir string) (*pki, error) {
	p := &pki{caFile: filepath.Join(dir, "ca.crt"), saKeyFile: filepath.Join(dir, "sa.key"), saPubFile: filepath.Join(dir, "sa.pub"),
		servingCertFile: filepath.Join(dir, "apiserver.crt"), servingKeyFile: filepath.Join(dir, "apiserver.key")}
	read := func(name string) ([]byte, *pem.Block, error) {
		raw, err := os.ReadFile(filepath.Join(dir, name))
		if err != nil {
			return nil, nil, err
		}
		b, _ := pem.Decode(raw)
		if b == nil {
			return nil, nil, fmt.Errorf("%s in %s holds no PEM block", name, dir)
		}
		return raw, b, nil
	}
	raw, b, err := read("ca.crt")
	if err != nil {
		return nil, err
	}
	if p.ca, err = x509.ParseCertificate(b.Bytes); err != nil {
		return nil, fmt.Errorf("parse ca.crt in %s: %w", dir, err)
	}
	p.caCert = raw
	if _, b, err = read(caKeyName); err != nil {
		return nil, err
	}
	if p.caKey, err = x509.ParseECPrivateKey(b.Bytes); err != nil {
		return nil, fmt.Errorf("parse %s in %s: %w", caKeyName, dir, err)
	}
	if p.adminCert, _, err = read(adminCertName); err != nil {
		return nil, err
	}
	if p.adminKey, _, err = read(adminKeyName); err != nil {
		return nil, err
	}
	return p, nil
}

// clientCert issues a client certificate for user in groups (the subject's
// common name and organizations, as the API server's x509 authenticator reads
// them), valid for a day.
func (p *pki) clientCert(user string, groups []string) (certPEM, keyPEM []byte, err error) {
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 62))
	if err != nil {
		return nil, nil, fmt.Errorf("generate serial: %w", err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: user, Organization: groups},
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	return issue(tmpl, p.ca, p.caKey)
}

// issue signs tmpl with the CA and returns the certificate and a new key, both PEM.
func issue(tmpl, ca *x509.Certificate, caKey crypto.Signer) (certPEM, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("generate key: %w", err)
	}
	tmpl.NotBefore = time.Now().Add(-time.Hour)
	tmpl.NotAfter = time.Now().Add(24 * time.Hour)
	tmpl.KeyUsage = x509.KeyUsageDigitalSignature
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, key.Public(), caKey)
	if err != nil {
		return nil, nil, fmt.Errorf("create certificate: %w", err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, fmt.Errorf("marshal key: %w", err)
	}
	return pemBlock("CERTIFICATE", der), pemBlock("EC PRIVATE KEY", keyDER), nil
}

func pemBlock(typ string, der []byte) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der})
}

func writeFiles(files map[string][]byte) error {
	for name, data := range files {
		if err := os.WriteFile(name, data, 0o600); err != nil {
			return fmt.Errorf("write %s: %w", filepath.Base(name), err)
		}
	}
	return nil
}
