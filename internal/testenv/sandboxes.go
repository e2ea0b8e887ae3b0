package testenv

import (
	"context"
	"fmt"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
)

// RemoveStoppedSandboxes removes, through the runtime's CRI, every pod
// sandbox that is no longer ready: what the kubelet's container garbage
// collection would remove at its next minute. Each removal runs the CNI
// DEL chain once more, so a GC that lands in a measured burst adds tens of
// DELs to it; the bench removes them between bursts instead. It returns
// how many it removed.
func (n *KubeNode) RemoveStoppedSandboxes(ctx context.Context) (int, error) {
	rt, stopped, done, err := n.stoppedSandboxes(ctx)
	if err != nil {
		return 0, err
	}
	defer done()
	for _, s := range stopped {
		if _, err := rt.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: s.Id}); err != nil {
			return 0, fmt.Errorf("removing pod sandbox %s of %s/%s: %w", s.Id, s.Metadata.GetNamespace(), s.Metadata.GetName(), err)
		}
	}
	return len(stopped), nil
}

// StoppedSandboxes names (namespace/name) the pods of the sandboxes that
// are no longer ready.
func (n *KubeNode) StoppedSandboxes(ctx context.Context) ([]string, error) {
	_, stopped, done, err := n.stoppedSandboxes(ctx)
	if err != nil {
		return nil, err
	}
	defer done()
	var names []string
	for _, s := range stopped {
		names = append(names, s.Metadata.GetNamespace()+"/"+s.Metadata.GetName())
	}
	return names, nil
}

func (n *KubeNode) stoppedSandboxes(ctx context.Context) (runtimeapi.RuntimeServiceClient, []*runtimeapi.PodSandbox, func(), error) {
	conn, err := grpc.NewClient("unix://"+n.Socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, nil, nil, err
	}
	rt := runtimeapi.NewRuntimeServiceClient(conn)
	list, err := rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{Filter: &runtimeapi.PodSandboxFilter{
		State: &runtimeapi.PodSandboxStateValue{State: runtimeapi.PodSandboxState_SANDBOX_NOTREADY}}})
	if err != nil {
		_ = conn.Close()
		return nil, nil, nil, fmt.Errorf("listing stopped pod sandboxes: %w", err)
	}
	return rt, list.Items, func() { _ = conn.Close() }, nil
}
