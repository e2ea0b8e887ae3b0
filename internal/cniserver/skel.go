package cniserver

import (
	"encoding/json"
	"fmt"

	"github.com/containernetworking/cni/pkg/types"
	"github.com/containernetworking/cni/pkg/utils"
	"github.com/containernetworking/cni/pkg/version"

	"github.com/istio-cni-go/istio-cni/internal/cnirelay"
)

// checkAsSkel makes the checks the CNI library's skel makes of a command
// before it calls a plugin, in its order and with its errors: the relay
// speaks CNI itself to start faster, and leaves them to the agent (the
// fallback runs skel as it is). It does not repeat what the relay checks:
// that the variables are there.
func checkAsSkel(req *cnirelay.Request) *types.Error {
	switch req.Command {
	case "ADD", "CHECK", "DEL":
		if err := utils.ValidateContainerID(req.ContainerID); err != nil {
			return err
		}
		if err := utils.ValidateInterfaceName(req.IfName); err != nil {
			return err
		}
	}
	return checkConfig(req.Command, req.Stdin)
}

// checkConfig is checkAsSkel's part on the config, for command.
func checkConfig(command string, stdin []byte) *types.Error {
	var conf struct {
		Name string `json:"name"`
	}
	if err := json.Unmarshal(stdin, &conf); err != nil {
		return types.NewError(types.ErrDecodingFailure, fmt.Sprintf("error unmarshall network config: %v", err), "")
	}
	if conf.Name == "" {
		return types.NewError(types.ErrInvalidNetworkConfig, "missing network name", "")
	}
	if err := utils.ValidateNetworkName(conf.Name); err != nil {
		return err
	}
	var decoder version.ConfigDecoder
	switch command {
	case "ADD", "DEL":
		return reconcile(stdin)
	case "CHECK", "GC", "STATUS":
		configVersion, err := decoder.Decode(stdin)
		if err != nil {
			return types.NewError(types.ErrDecodingFailure, err.Error(), "")
		}
		first := map[string]string{"CHECK": "0.4.0", "GC": "1.1.0", "STATUS": "1.1.0"}[command]
		if gtet, err := version.GreaterThanOrEqualTo(configVersion, first); err != nil {
			return types.NewError(types.ErrDecodingFailure, err.Error(), "")
		} else if !gtet {
			return types.NewError(types.ErrIncompatibleCNIVersion, "config version does not allow "+command, "")
		}
		for _, pluginVersion := range version.All.SupportedVersions() {
			gtet, err := version.GreaterThanOrEqualTo(pluginVersion, configVersion)
			if err != nil {
				return types.NewError(types.ErrDecodingFailure, err.Error(), "")
			}
			if gtet {
				return reconcile(stdin)
			}
		}
		return types.NewError(types.ErrIncompatibleCNIVersion, "plugin version does not allow "+command, "")
	}
	return types.NewError(types.ErrInvalidEnvironmentVariables, fmt.Sprintf("unknown CNI_COMMAND: %v", command), "")
}

// reconcile is skel's check that the plugin speaks the config's version.
func reconcile(conf []byte) *types.Error {
	var decoder version.ConfigDecoder
	configVersion, err := decoder.Decode(conf)
	if err != nil {
		return types.NewError(types.ErrDecodingFailure, err.Error(), "")
	}
	var reconciler version.Reconciler
	if verErr := reconciler.Check(configVersion, version.All); verErr != nil {
		return types.NewError(types.ErrIncompatibleCNIVersion, "incompatible CNI versions", verErr.Details())
	}
	return nil
}

// relayError is a CNI error for the relay's wire.
func relayError(e *types.Error) *cnirelay.Error {
	return cnirelay.NewError(e.Code, e.Msg, e.Details)
}
