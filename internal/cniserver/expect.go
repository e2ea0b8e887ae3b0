package cniserver

import (
	"errors"
	"fmt"

	"github.com/containernetworking/cni/libcni"

	"github.com/istio-cni-go/istio-cni/internal/plugin"
	"github.com/istio-cni-go/istio-cni/internal/prepared"
)

// ExpectedConfig is the config a runtime that reads conflist through
// libcni (containerd, CRI-O) hands the plugin of type pluginType on each
// ADD, without its prevResult: the plugin's entry with the list's name
// and cniVersion put in, re-encoded as libcni encodes it. The plugin
// declares no capabilities, so the runtime adds no runtimeConfig.
func ExpectedConfig(conflist []byte, pluginType string) ([]byte, error) {
	list, err := libcni.ConfListFromBytes(conflist)
	if err != nil {
		return nil, err
	}
	var entry *libcni.PluginConfig
	for _, p := range list.Plugins {
		if p.Network.Type == pluginType {
			if entry != nil {
				return nil, fmt.Errorf("the conflist %q holds two %s entries", list.Name, pluginType)
			}
			entry = p
		}
	}
	if entry == nil {
		return nil, fmt.Errorf("the conflist %q holds no %s entry", list.Name, pluginType)
	}
	if len(entry.Network.Capabilities) > 0 {
		return nil, fmt.Errorf("the %s entry declares capabilities, whose arguments each ADD may carry", pluginType)
	}
	// libcni's own encoding, so that the bytes are the runtime's.
	conf, err := libcni.InjectConf(entry, map[string]any{"name": list.Name, "cniVersion": list.CNIVersion})
	if err != nil {
		return nil, err
	}
	c, err := prepared.ParseConfig(conf.Bytes)
	if err != nil {
		return nil, err
	}
	return c.Canonical, nil
}

// ExpectConflist takes the conflist the agent placed its entry in, so
// that pods get their ADDs prepared from the agent's start under the
// config the runtime will hand them, rather than only once two ADDs have
// taught it (a node's first pods, all at once, would otherwise each ask
// the agent). A runtime that sends another config (one not reading the
// file through libcni) still has it learnt from its ADDs; the expected
// one then only costs records an entry that no ADD matches. It is nil
// when the agent does not prepare ADDs.
func (s *Server) ExpectConflist(conflist []byte, pluginType string) error {
	if s.prep == nil {
		return nil
	}
	canonical, err := ExpectedConfig(conflist, pluginType)
	if err != nil {
		return err
	}
	// The checks a learnt config passed: skel's, then the plugin's own.
	if serr := checkConfig("ADD", canonical); serr != nil {
		return errors.New(serr.Msg + ": " + serr.Details)
	}
	conf, err := plugin.ParseConfig(canonical)
	if err != nil {
		return err
	}
	if conf.AmbientEnabled {
		return nil
	}
	s.prep.adopt(canonical, conf, true)
	return nil
}
