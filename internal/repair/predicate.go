// Package repair finds pods that started before their traffic redirection
// was in place (the validation init container failed) and repairs them in
// place, deletes them, or labels them.
package repair

import (
	"strings"

	corev1 "k8s.io/api/core/v1"
)

// Config is the repair controller's configuration, with Istio's defaults.
type Config struct {
	RepairPods bool
	DeletePods bool
	LabelPods  bool
	// LabelKey and LabelValue mark broken pods in label mode.
	LabelKey, LabelValue string
	// SidecarAnnotation must be on a pod for it to be considered.
	SidecarAnnotation string
	// InitContainerName, ExitCode and TerminationMessage identify a failed
	// validation; an empty name, code 0 or empty message match anything.
	InitContainerName  string
	ExitCode           int32
	TerminationMessage string
	// LabelSelectors and FieldSelectors narrow the pods watched, as
	// Istio's REPAIR_LABEL_SELECTORS and REPAIR_FIELD_SELECTORS do; the
	// node's own field selector always applies.
	LabelSelectors, FieldSelectors string
}

// DefaultConfig is Istio's default: repair in place.
func DefaultConfig() Config {
	return Config{RepairPods: true, LabelKey: "cni.istio.io/uninitialized", LabelValue: "true",
		SidecarAnnotation: "sidecar.istio.io/status", InitContainerName: "istio-validation", ExitCode: 126}
}

// Mode is the action taken, by precedence repair > delete > label.
func (c Config) Mode() string {
	switch {
	case c.RepairPods:
		return "repair"
	case c.DeletePods:
		return "delete"
	case c.LabelPods:
		return "label"
	}
	return ""
}

// Broken reports whether the pod's validation failed, and why.
//
// Beyond Istio's predicate, which needs a previous crash
// (lastTerminationState), a validation container that has terminated with
// the failure code now counts too: a pod with restartPolicy Never (a Job)
// never gets a second attempt, and repair can start a restart earlier.
func (c Config) Broken(pod *corev1.Pod) (string, bool) {
	if c.SidecarAnnotation != "" {
		if _, ok := pod.Annotations[c.SidecarAnnotation]; !ok {
			return "", false
		}
	}
	if pod.DeletionTimestamp != nil {
		return "", false
	}
	for i := range pod.Status.InitContainerStatuses {
		st := &pod.Status.InitContainerStatuses[i]
		if c.InitContainerName != "" && st.Name != c.InitContainerName {
			continue
		}
		if t := st.State.Terminated; t != nil && (t.ExitCode == 0 || t.Reason == "Completed") {
			continue
		}
		if t := st.State.Terminated; t != nil && c.matches(t) {
			return "validation container " + st.Name + " failed", true
		}
		if t := st.LastTerminationState.Terminated; t != nil && c.matches(t) {
			return "validation container " + st.Name + " failed before its last restart", true
		}
	}
	return "", false
}

func (c Config) matches(t *corev1.ContainerStateTerminated) bool {
	if c.ExitCode != 0 && t.ExitCode != c.ExitCode {
		return false
	}
	if m := strings.TrimSpace(c.TerminationMessage); m != "" && m != strings.TrimSpace(t.Message) {
		return false
	}
	return true
}
