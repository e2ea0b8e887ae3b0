package cnirelay

import (
	"testing"

	"github.com/containernetworking/cni/pkg/types"
)

// libraryArgs is the plugin's CNI_ARGS, read by the CNI library as the
// plugin reads them.
type libraryArgs struct {
	types.CommonArgs
	K8S_POD_NAMESPACE          types.UnmarshallableString //nolint:revive // the CNI_ARGS key
	K8S_POD_NAME               types.UnmarshallableString //nolint:revive // the CNI_ARGS key
	K8S_POD_INFRA_CONTAINER_ID types.UnmarshallableString //nolint:revive // the CNI_ARGS key
	K8S_POD_UID                types.UnmarshallableString //nolint:revive // the CNI_ARGS key
}

// TestPlainArgsAsTheLibrary: the relay answers a command itself only for
// arguments the plugin, through the CNI library, would take; where the
// library refuses them, the command goes to the agent, which says why.
func TestPlainArgsAsTheLibrary(t *testing.T) {
	const pod = "K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p;K8S_POD_INFRA_CONTAINER_ID=c1;K8S_POD_UID=u1"
	for _, args := range []string{
		pod,
		"IgnoreUnknown=1;" + pod + ";OTHER=x",
		"IgnoreUnknown=TRUE;" + pod + ";OTHER=x",
		"IgnoreUnknown=0;" + pod,
		"IgnoreUnknown=false;" + pod + ";OTHER=x",
		"IgnoreUnknown=yes;" + pod,
		"K8S_POD_NAMESPACE=ns;K8S_POD_NAME=p=q",
		"K8S_POD_NAMESPACE=ns;K8S_POD_INFRA_CONTAINER_ID=abc=",
		"IgnoreUnknown=1;FOO=a=b;" + pod,
		"K8S_POD_NAME",
		pod + ";OTHER=x",
	} {
		want := types.LoadArgs(args, &libraryArgs{}) == nil
		if got := plainArgs(&Args{ContainerID: "c1", IfName: "eth0", Args: args}); got != want {
			t.Errorf("CNI_ARGS %q: plain %v, the library takes it: %v", args, got, want)
		}
	}
}
