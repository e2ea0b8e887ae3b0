package podcache

import (
	"encoding/json"
	"reflect"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/istio-cni-go/istio-cni/internal/podinfo"
)

// TestPodFromCoreMatchesJSON: the agent's pods (from its informer) and the
// fallback's (decoded from the API's JSON) must lead to the same decision,
// so the two conversions must agree field for field.
func TestPodFromCoreMatchesJSON(t *testing.T) {
	uid, gid := int64(1337), int64(1338)
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p", UID: "u-1",
			Labels:      map[string]string{"app": "x"},
			Annotations: map[string]string{"sidecar.istio.io/status": "{}", "traffic.sidecar.istio.io/excludeOutboundPorts": "9090"}},
		Spec: corev1.PodSpec{
			InitContainers: []corev1.Container{{Name: "istio-proxy", Args: []string{"proxy", "sidecar"},
				Env: []corev1.EnvVar{
					{Name: "ISTIO_META_DNS_CAPTURE", Value: "true"},
					{Name: "EMPTY", Value: ""},
					{Name: "FROM_REF", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{FieldPath: "status.podIP"}}},
				},
				SecurityContext: &corev1.SecurityContext{RunAsUser: &uid, RunAsGroup: &gid}}},
			Containers: []corev1.Container{{Name: "app"}},
		},
		Status: corev1.PodStatus{PodIPs: []corev1.PodIP{{IP: "10.0.0.1"}, {IP: "fd00::1"}}},
	}
	data, err := json.Marshal(pod)
	if err != nil {
		t.Fatal(err)
	}
	want, err := podinfo.DecodeJSON(data)
	if err != nil {
		t.Fatal(err)
	}
	got := PodFromCore(pod)
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("from the informer:\n%+v\nfrom JSON:\n%+v", got, want)
	}
	if _, ok := got.InitContainers[0].Env["FROM_REF"]; ok {
		t.Fatal("a referenced env value must be left out")
	}
}
