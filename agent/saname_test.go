package agent

import (
	"encoding/base64"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"k8s.io/client-go/rest"
)

// jwt is an unsigned token whose payload is claims.
func jwt(claims string) string {
	enc := base64.RawURLEncoding.EncodeToString
	return enc([]byte(`{"alg":"RS256"}`)) + "." + enc([]byte(claims)) + ".c2ln"
}

func TestCheckServiceAccountName(t *testing.T) {
	file := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(file, []byte(jwt(`{"sub":"system:serviceaccount:ops:team-mountmedic"}`)+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	tests := map[string]struct {
		rc    rest.Config
		fails bool
	}{
		"its own name":               {rest.Config{BearerToken: jwt(`{"sub":"system:serviceaccount:ops:mountmedic"}`)}, false},
		"renamed by a prefix":        {rest.Config{BearerToken: jwt(`{"sub":"system:serviceaccount:ops:team-mountmedic"}`)}, true},
		"renamed, from the pod file": {rest.Config{BearerTokenFile: file}, true},
		"no token":                   {rest.Config{}, false},
		"a user's token":             {rest.Config{BearerToken: jwt(`{"sub":"alice"}`)}, false},
		"not a JWT":                  {rest.Config{BearerToken: "abcdef"}, false},
		"unreadable file":            {rest.Config{BearerTokenFile: filepath.Join(t.TempDir(), "none")}, false},
	}
	for name, tc := range tests {
		err := CheckServiceAccountName(&tc.rc, DefaultServiceAccountName)
		if got := errors.Is(err, ErrServiceAccountName); got != tc.fails || (err != nil && !tc.fails) {
			t.Errorf("%s: CheckServiceAccountName = %v, want ErrServiceAccountName %v", name, err, tc.fails)
		}
	}
	if err := CheckServiceAccountName(&rest.Config{BearerTokenFile: file}, "team-mountmedic"); err != nil {
		t.Errorf("CheckServiceAccountName(team-mountmedic's token, --service-account-name=team-mountmedic) = %v, want nil", err)
	}
}
