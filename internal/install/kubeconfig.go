package install

import (
	"encoding/base64"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"strings"
)

// KubeconfigSettings say how the plugin reaches the API server.
type KubeconfigSettings struct {
	Protocol, Host, Port string
	// CAFile defaults to <ServiceAccountDir>/ca.crt.
	CAFile            string
	SkipTLSVerify     bool
	ServiceAccountDir string
}

// KubeconfigName is the plugin's kubeconfig in the run directory.
const KubeconfigName = "istio-cni-kubeconfig"

// BuildKubeconfig renders the plugin's kubeconfig from the agent's service
// account: the same cluster, user and context names as Istio's.
func BuildKubeconfig(s KubeconfigSettings) ([]byte, error) {
	if s.Host == "" || s.Port == "" {
		return nil, errors.New("KUBERNETES_SERVICE_HOST or KUBERNETES_SERVICE_PORT is not set: is the agent running in a pod?")
	}
	proto := s.Protocol
	if proto == "" {
		proto = "https"
	}
	token, err := readFile(filepath.Join(s.ServiceAccountDir, "token"))
	if err != nil {
		return nil, fmt.Errorf("reading the service account token: %w", err)
	}
	tok := strings.TrimSpace(string(token))
	if tok == "" {
		return nil, fmt.Errorf("the service account token in %s is empty", s.ServiceAccountDir)
	}
	var tlsLine string
	if s.SkipTLSVerify {
		tlsLine = "    insecure-skip-tls-verify: true\n"
	} else {
		caFile := s.CAFile
		if caFile == "" {
			caFile = filepath.Join(s.ServiceAccountDir, "ca.crt")
		}
		ca, err := readFile(caFile)
		if err != nil {
			return nil, fmt.Errorf("reading the API server CA: %w", err)
		}
		tlsLine = "    certificate-authority-data: " + base64.StdEncoding.EncodeToString(ca) + "\n"
	}
	server := proto + "://" + net.JoinHostPort(s.Host, s.Port)
	return []byte("# Written by the istio-cni node agent for the istio-cni plugin.\n" +
		"apiVersion: v1\nkind: Config\nclusters:\n- name: local\n  cluster:\n    server: " + server + "\n" + tlsLine +
		"users:\n- name: istio-cni\n  user:\n    token: " + tok + "\n" +
		"contexts:\n- name: istio-cni-context\n  context:\n    cluster: local\n    user: istio-cni\n" +
		"current-context: istio-cni-context\n"), nil
}
