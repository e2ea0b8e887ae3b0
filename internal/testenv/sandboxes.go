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
	removed := 0
	err := n.withStoppedSandboxes(ctx, func(rt runtimeapi.RuntimeServiceClient, stopped []*runtimeapi.PodSandbox) error {
		for _, s := range stopped {
			if _, err := rt.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: s.Id}); err != nil {
				return fmt.Errorf("removing pod sandbox %s of %s/%s: %w", s.Id, s.Metadata.GetNamespace(), s.Metadata.GetName(), err)
			}
			removed++
		}
		return nil
	})
	return removed, err
}

// StoppedSandboxes names (namespace/name) the pods of the sandboxes that
// are no longer ready.
func (n *KubeNode) StoppedSandboxes(ctx context.Context) ([]string, error) {
	var names []string
	err := n.withStoppedSandboxes(ctx, func(_ runtimeapi.RuntimeServiceClient, stopped []*runtimeapi.PodSandbox) error {
		for _, s := range stopped {
			names = append(names, s.Metadata.GetNamespace()+"/"+s.Metadata.GetName())
		}
		return nil
	})
	return names, err
}

// withStoppedSandboxes lists the sandboxes that are no longer ready over
// a CRI connection to the node's runtime, and hands both to use.
func (n *KubeNode) withStoppedSandboxes(ctx context.Context, use func(runtimeapi.RuntimeServiceClient, []*runtimeapi.PodSandbox) error) error {
	conn, err := grpc.NewClient("unix://"+n.Socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	rt := runtimeapi.NewRuntimeServiceClient(conn)
	list, err := rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{Filter: &runtimeapi.PodSandboxFilter{
		State: &runtimeapi.PodSandboxStateValue{State: runtimeapi.PodSandboxState_SANDBOX_NOTREADY}}})
	if err != nil {
		return fmt.Errorf("listing stopped pod sandboxes: %w", err)
	}
	return use(rt, list.Items)
}
