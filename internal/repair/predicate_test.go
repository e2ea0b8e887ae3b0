package repair

import (
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func pod(mut func(*corev1.Pod)) *corev1.Pod {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Name: "web", Annotations: map[string]string{"sidecar.istio.io/status": "{}"}}}
	if mut != nil {
		mut(p)
	}
	return p
}

func validation(state, last *corev1.ContainerStateTerminated) func(*corev1.Pod) {
	return func(p *corev1.Pod) {
		st := corev1.ContainerStatus{Name: "istio-validation"}
		st.State.Terminated = state
		st.LastTerminationState.Terminated = last
		p.Status.InitContainerStatuses = append(p.Status.InitContainerStatuses, st)
	}
}

func TestBroken(t *testing.T) {
	failed := &corev1.ContainerStateTerminated{ExitCode: 126, Reason: "Error"}
	ok := &corev1.ContainerStateTerminated{ExitCode: 0, Reason: "Completed"}
	cfg := DefaultConfig()
	cases := []struct {
		name string
		pod  *corev1.Pod
		want bool
	}{
		{"healthy", pod(validation(ok, nil)), false},
		{"crashed before, running again", pod(validation(nil, failed)), true},
		{"first failure (restartPolicy Never counts)", pod(validation(failed, nil)), true},
		{"completed after a failure", pod(validation(ok, failed)), false},
		{"other exit code", pod(validation(&corev1.ContainerStateTerminated{ExitCode: 1}, nil)), false},
		{"no sidecar annotation", pod(func(p *corev1.Pod) {
			validation(failed, nil)(p)
			delete(p.Annotations, "sidecar.istio.io/status")
		}), false},
		{"other init container", pod(func(p *corev1.Pod) {
			p.Status.InitContainerStatuses = []corev1.ContainerStatus{{Name: "setup", State: corev1.ContainerState{Terminated: failed}}}
		}), false},
		{"being deleted", pod(func(p *corev1.Pod) {
			validation(failed, nil)(p)
			now := metav1.Now()
			p.DeletionTimestamp = &now
		}), false},
	}
	for _, c := range cases {
		if _, got := cfg.Broken(c.pod); got != c.want {
			t.Errorf("%s: broken=%v, want %v", c.name, got, c.want)
		}
	}
	msg := cfg
	msg.TerminationMessage = "rules missing"
	if _, got := msg.Broken(pod(validation(failed, nil))); got {
		t.Error("termination message not compared")
	}
	if _, got := msg.Broken(pod(validation(&corev1.ContainerStateTerminated{ExitCode: 126, Message: " rules missing\n"}, nil))); !got {
		t.Error("matching termination message not accepted")
	}
	if m := (Config{DeletePods: true, LabelPods: true}).Mode(); m != "delete" {
		t.Errorf("precedence: %s", m)
	}
}
