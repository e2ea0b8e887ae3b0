package testenv

import (
	"context"
	"fmt"
	"strings"
	"time"

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
			_, err := rt.RemovePodSandbox(ctx, &runtimeapi.RemovePodSandboxRequest{PodSandboxId: s.Id})
			if err != nil {
				// The kubelet's GC may be removing it at the same moment
				// (the runtime then refuses a second removal of its
				// containers): it is gone once that is done.
				err = waitSandboxGone(ctx, rt, s.Id, err)
			}
			if err != nil {
				return fmt.Errorf("removing pod sandbox %s of %s/%s: %w", s.Id, s.Metadata.GetNamespace(), s.Metadata.GetName(), err)
			}
			removed++
		}
		return nil
	})
	return removed, err
}

// waitSandboxGone waits up to a minute for a sandbox whose removal failed
// with failed to be gone all the same, removed by another (the kubelet);
// it returns failed if it stays.
func waitSandboxGone(ctx context.Context, rt runtimeapi.RuntimeServiceClient, id string, failed error) error {
	deadline := time.Now().Add(time.Minute)
	for {
		list, err := rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{Filter: &runtimeapi.PodSandboxFilter{Id: id}})
		if err != nil {
			return err
		}
		if len(list.Items) == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return failed
		}
		time.Sleep(100 * time.Millisecond) // polling the runtime, bounded
	}
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
	return n.withRuntime(func(rt runtimeapi.RuntimeServiceClient) error {
		list, err := rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{Filter: &runtimeapi.PodSandboxFilter{
			State: &runtimeapi.PodSandboxStateValue{State: runtimeapi.PodSandboxState_SANDBOX_NOTREADY}}})
		if err != nil {
			return fmt.Errorf("listing stopped pod sandboxes: %w", err)
		}
		return use(rt, list.Items)
	})
}

// withRuntime hands use a CRI client of the node's runtime, closed after.
func (n *KubeNode) withRuntime(use func(runtimeapi.RuntimeServiceClient) error) error {
	conn, err := grpc.NewClient("unix://"+n.Socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	return use(runtimeapi.NewRuntimeServiceClient(conn))
}

// RuntimeTimes are a pod's steps as its runtime stamped them, on the
// host's clock in nanoseconds: free of the kubelet's once-a-second relist,
// which quantizes when a pod turns Ready.
type RuntimeTimes struct {
	// SandboxCreated is when the runtime began the pod's sandbox (before
	// its network, the CNI ADD, is set up); ContainersCreated when it
	// created the first of the pod's containers, after the sandbox was
	// up; Started when the last of them started.
	SandboxCreated, ContainersCreated, Started time.Time
}

// RuntimeTimes gives, by pod name, the runtime's times of the running
// pods of namespace ns whose sandbox is ready.
func (n *KubeNode) RuntimeTimes(ctx context.Context, ns string) (map[string]RuntimeTimes, error) {
	var out map[string]RuntimeTimes
	err := n.withRuntime(func(rt runtimeapi.RuntimeServiceClient) error {
		var err error
		out, err = runtimeTimes(ctx, rt, ns)
		return err
	})
	return out, err
}

func runtimeTimes(ctx context.Context, rt runtimeapi.RuntimeServiceClient, ns string) (map[string]RuntimeTimes, error) {
	inNS := map[string]string{"io.kubernetes.pod.namespace": ns}
	boxes, err := rt.ListPodSandbox(ctx, &runtimeapi.ListPodSandboxRequest{Filter: &runtimeapi.PodSandboxFilter{
		State: &runtimeapi.PodSandboxStateValue{State: runtimeapi.PodSandboxState_SANDBOX_READY}, LabelSelector: inNS}})
	if err != nil {
		return nil, fmt.Errorf("listing ready pod sandboxes of %s: %w", ns, err)
	}
	out := map[string]RuntimeTimes{}
	byBox := map[string]string{}
	for _, b := range boxes.Items {
		name := b.Metadata.GetName()
		if _, dup := out[name]; dup {
			return nil, fmt.Errorf("pod %s/%s has two ready sandboxes", ns, name)
		}
		out[name] = RuntimeTimes{SandboxCreated: time.Unix(0, b.CreatedAt)}
		byBox[b.Id] = name
	}
	cs, err := rt.ListContainers(ctx, &runtimeapi.ListContainersRequest{Filter: &runtimeapi.ContainerFilter{
		State: &runtimeapi.ContainerStateValue{State: runtimeapi.ContainerState_CONTAINER_RUNNING}, LabelSelector: inNS}})
	if err != nil {
		return nil, fmt.Errorf("listing running containers of %s: %w", ns, err)
	}
	for _, c := range cs.Containers {
		name, ok := byBox[c.PodSandboxId]
		if !ok {
			continue
		}
		st, err := rt.ContainerStatus(ctx, &runtimeapi.ContainerStatusRequest{ContainerId: c.Id})
		if err != nil {
			return nil, fmt.Errorf("status of container %s of %s/%s: %w", c.Id, ns, name, err)
		}
		t := out[name]
		if created := time.Unix(0, c.CreatedAt); t.ContainersCreated.IsZero() || created.Before(t.ContainersCreated) {
			t.ContainersCreated = created
		}
		if started := time.Unix(0, st.GetStatus().GetStartedAt()); started.After(t.Started) {
			t.Started = started
		}
		out[name] = t
	}
	return out, nil
}

// CNIConfigNames reports whether the CNI config the runtime has loaded
// (its CRI status, verbose) names s: a config file written is taken up
// by the runtime a moment later, through its own file watch.
func (n *KubeNode) CNIConfigNames(ctx context.Context, s string) (bool, error) {
	var names bool
	err := n.withRuntime(func(rt runtimeapi.RuntimeServiceClient) error {
		st, err := rt.Status(ctx, &runtimeapi.StatusRequest{Verbose: true})
		if err != nil {
			return err
		}
		for k, v := range st.Info {
			if strings.HasPrefix(k, "cniconfig") && strings.Contains(v, s) {
				names = true
			}
		}
		return nil
	})
	return names, err
}
