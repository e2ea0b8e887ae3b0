package testenv

import (
	"crypto/tls"
	"encoding/base64"
)

func b64(b []byte) string { return base64.StdEncoding.EncodeToString(b) }

// insecureTLS is for polling readiness before the CA file exists.
func insecureTLS() *tls.Config { return &tls.Config{InsecureSkipVerify: true} } //nolint:gosec // readiness poll of a local test server
