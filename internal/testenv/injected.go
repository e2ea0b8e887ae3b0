package testenv

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8stypes "k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
)

// injectedStatusLong is the sidecar.istio.io/status an injector of a
// recent Istio writes: every volume and secret it added, which is what
// makes real pods' annotations long.
const injectedStatusLong = `{"initContainers":["istio-validation"],"containers":["istio-proxy"],` +
	`"volumes":["workload-socket","credential-socket","workload-certs","istio-envoy","istio-data","istio-podinfo","istio-token","istiod-ca-cert","istio-ca-crl"],` +
	`"imagePullSecrets":null,"revision":"default"}`

// InjectedPod is a pod as a Deployment's ReplicaSet creates it once
// Istio's injector has added its sidecar (native or not): the labels,
// annotations, init container, proxy environment, volumes and probes a
// real cluster's pods carry, so what a pod cache keeps of them is
// measured on real sizes. i varies names, addresses and hashes.
func InjectedPod(ns, name, node string, i int) *corev1.Pod {
	app := fmt.Sprintf("svc-%d", i%40)
	hash := fmt.Sprintf("%08x", 0x5f3a7c00+i%40)
	proxyUID := int64(1337)
	f, t := false, true
	ports := fmt.Sprintf(`[{"name":"http","containerPort":8080,"protocol":"TCP"},{"name":"grpc","containerPort":%d,"protocol":"TCP"}]`, 9000+i%100)
	env := []corev1.EnvVar{
		{Name: "PILOT_CERT_PROVIDER", Value: "istiod"},
		{Name: "CA_ADDR", Value: "istiod.istio-system.svc:15012"},
		{Name: "POD_NAME", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{APIVersion: "v1", FieldPath: "metadata.name"}}},
		{Name: "POD_NAMESPACE", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{APIVersion: "v1", FieldPath: "metadata.namespace"}}},
		{Name: "INSTANCE_IP", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{APIVersion: "v1", FieldPath: "status.podIP"}}},
		{Name: "SERVICE_ACCOUNT", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{APIVersion: "v1", FieldPath: "spec.serviceAccountName"}}},
		{Name: "HOST_IP", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{APIVersion: "v1", FieldPath: "status.hostIP"}}},
		{Name: "ISTIO_CPU_LIMIT", ValueFrom: &corev1.EnvVarSource{ResourceFieldRef: &corev1.ResourceFieldSelector{Resource: "limits.cpu"}}},
		{Name: "PROXY_CONFIG", Value: `{"proxyMetadata":{"ISTIO_META_DNS_CAPTURE":"true"},"holdApplicationUntilProxyStarts":true}`},
		{Name: "ISTIO_META_POD_PORTS", Value: ports},
		{Name: "ISTIO_META_APP_CONTAINERS", Value: "app"},
		{Name: "GOMEMLIMIT", ValueFrom: &corev1.EnvVarSource{ResourceFieldRef: &corev1.ResourceFieldSelector{Resource: "limits.memory"}}},
		{Name: "GOMAXPROCS", ValueFrom: &corev1.EnvVarSource{ResourceFieldRef: &corev1.ResourceFieldSelector{Resource: "limits.cpu", Divisor: mustQuantity("1")}}},
		{Name: "ISTIO_META_CLUSTER_ID", Value: "Kubernetes"},
		{Name: "ISTIO_META_NODE_NAME", ValueFrom: &corev1.EnvVarSource{FieldRef: &corev1.ObjectFieldSelector{APIVersion: "v1", FieldPath: "spec.nodeName"}}},
		{Name: "ISTIO_META_INTERCEPTION_MODE", Value: "REDIRECT"},
		{Name: "ISTIO_META_WORKLOAD_NAME", Value: app},
		{Name: "ISTIO_META_OWNER", Value: "kubernetes://apis/apps/v1/namespaces/" + ns + "/deployments/" + app},
		{Name: "ISTIO_META_MESH_ID", Value: "cluster.local"},
		{Name: "TRUST_DOMAIN", Value: "cluster.local"},
		{Name: "ISTIO_META_DNS_CAPTURE", Value: "true"},
		{Name: "ISTIO_KUBE_APP_PROBERS", Value: `{"/app-health/app/readyz":{"httpGet":{"path":"/readyz","port":8080,"scheme":"HTTP"},"timeoutSeconds":1}}`},
	}
	mounts := []corev1.VolumeMount{
		{Name: "workload-socket", MountPath: "/var/run/secrets/workload-spiffe-uds"},
		{Name: "credential-socket", MountPath: "/var/run/secrets/credential-uds"},
		{Name: "workload-certs", MountPath: "/var/run/secrets/workload-spiffe-credentials"},
		{Name: "istiod-ca-cert", MountPath: "/var/run/secrets/istio"},
		{Name: "istio-data", MountPath: "/var/lib/istio/data"},
		{Name: "istio-envoy", MountPath: "/etc/istio/proxy"},
		{Name: "istio-token", MountPath: "/var/run/secrets/tokens"},
		{Name: "istio-podinfo", MountPath: "/etc/istio/pod"},
		{Name: "kube-api-access", MountPath: "/var/run/secrets/kubernetes.io/serviceaccount", ReadOnly: true},
	}
	dropAll := &corev1.Capabilities{Drop: []corev1.Capability{"ALL"}}
	proxySC := &corev1.SecurityContext{AllowPrivilegeEscalation: &f, Capabilities: dropAll, Privileged: &f,
		ReadOnlyRootFilesystem: &t, RunAsGroup: &proxyUID, RunAsNonRoot: &t, RunAsUser: &proxyUID}
	always := corev1.ContainerRestartPolicyAlways
	res := corev1.ResourceRequirements{
		Requests: corev1.ResourceList{corev1.ResourceCPU: mustQuantity("100m"), corev1.ResourceMemory: mustQuantity("128Mi")},
		Limits:   corev1.ResourceList{corev1.ResourceCPU: mustQuantity("2"), corev1.ResourceMemory: mustQuantity("1Gi")},
	}
	proxy := corev1.Container{Name: "istio-proxy", Image: "docker.io/istio/proxyv2:1.28.0", RestartPolicy: &always,
		Args:  []string{"proxy", "sidecar", "--domain", ns + ".svc.cluster.local", "--proxyLogLevel=warning", "--proxyComponentLogLevel=misc:error", "--log_output_level=default:info"},
		Ports: []corev1.ContainerPort{{Name: "http-envoy-prom", ContainerPort: 15090, Protocol: corev1.ProtocolTCP}},
		Env:   env, Resources: res, VolumeMounts: mounts, SecurityContext: proxySC,
		ReadinessProbe: &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/healthz/ready", Port: intOrStr(15021)}},
			PeriodSeconds: 15, TimeoutSeconds: 3, FailureThreshold: 4},
		StartupProbe: &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/healthz/ready", Port: intOrStr(15021)}},
			PeriodSeconds: 1, TimeoutSeconds: 3, FailureThreshold: 600},
		TerminationMessagePath: "/dev/termination-log", TerminationMessagePolicy: corev1.TerminationMessageReadFile, ImagePullPolicy: corev1.PullIfNotPresent,
	}
	validation := corev1.Container{Name: "istio-validation", Image: "docker.io/istio/proxyv2:1.28.0",
		Args:      InjectedValidationArgs(),
		Resources: res, SecurityContext: &corev1.SecurityContext{AllowPrivilegeEscalation: &f, Capabilities: dropAll, Privileged: &f,
			ReadOnlyRootFilesystem: &t, RunAsGroup: &proxyUID, RunAsNonRoot: &t, RunAsUser: &proxyUID},
		TerminationMessagePath: "/dev/termination-log", TerminationMessagePolicy: corev1.TerminationMessageReadFile, ImagePullPolicy: corev1.PullIfNotPresent,
	}
	appC := corev1.Container{Name: "app", Image: "registry.example.com/" + app + ":v1.4.2",
		Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8080, Protocol: corev1.ProtocolTCP}},
		Env: []corev1.EnvVar{{Name: "LOG_LEVEL", Value: "info"}, {Name: "DB_HOST", Value: "db." + ns + ".svc.cluster.local"},
			{Name: "DB_PASSWORD", ValueFrom: &corev1.EnvVarSource{SecretKeyRef: &corev1.SecretKeySelector{LocalObjectReference: corev1.LocalObjectReference{Name: app + "-db"}, Key: "password"}}}},
		ReadinessProbe: &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Path: "/app-health/app/readyz", Port: intOrStr(15020)}}, PeriodSeconds: 10},
		VolumeMounts:   []corev1.VolumeMount{{Name: "kube-api-access", MountPath: "/var/run/secrets/kubernetes.io/serviceaccount", ReadOnly: true}},
		Resources:      res, TerminationMessagePath: "/dev/termination-log", TerminationMessagePolicy: corev1.TerminationMessageReadFile, ImagePullPolicy: corev1.PullIfNotPresent,
	}
	expiry := int64(43200)
	mode := int32(420)
	medium := corev1.StorageMediumMemory
	return &corev1.Pod{
		TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Pod"},
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, GenerateName: app + "-" + hash + "-",
			Labels: map[string]string{"app": app, "version": "v1", "pod-template-hash": hash, "security.istio.io/tlsMode": "istio",
				"service.istio.io/canonical-name": app, "service.istio.io/canonical-revision": "v1"},
			Annotations: map[string]string{"sidecar.istio.io/status": injectedStatusLong, "istio.io/rev": "default",
				"kubectl.kubernetes.io/default-container": "app", "kubectl.kubernetes.io/default-logs-container": "app",
				"prometheus.io/path": "/stats/prometheus", "prometheus.io/port": "15020", "prometheus.io/scrape": "true"},
			OwnerReferences: []metav1.OwnerReference{{APIVersion: "apps/v1", Kind: "ReplicaSet", Name: app + "-" + hash,
				UID: k8stypes.UID(fmt.Sprintf("6c1f4c9e-3b1a-4f7e-9d2a-%012d", i%40)), Controller: &t, BlockOwnerDeletion: &t}}},
		Spec: corev1.PodSpec{NodeName: node, ServiceAccountName: "default", AutomountServiceAccountToken: &f,
			InitContainers: []corev1.Container{validation, proxy}, Containers: []corev1.Container{appC},
			Volumes: []corev1.Volume{
				{Name: "workload-socket", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}},
				{Name: "credential-socket", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}},
				{Name: "workload-certs", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}},
				{Name: "istio-envoy", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{Medium: medium}}},
				{Name: "istio-data", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}},
				{Name: "istio-podinfo", VolumeSource: corev1.VolumeSource{DownwardAPI: &corev1.DownwardAPIVolumeSource{DefaultMode: &mode, Items: []corev1.DownwardAPIVolumeFile{
					{Path: "labels", FieldRef: &corev1.ObjectFieldSelector{APIVersion: "v1", FieldPath: "metadata.labels"}},
					{Path: "annotations", FieldRef: &corev1.ObjectFieldSelector{APIVersion: "v1", FieldPath: "metadata.annotations"}}}}}},
				{Name: "istio-token", VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{DefaultMode: &mode, Sources: []corev1.VolumeProjection{
					{ServiceAccountToken: &corev1.ServiceAccountTokenProjection{Audience: "istio-ca", ExpirationSeconds: &expiry, Path: "istio-token"}}}}}},
				{Name: "istiod-ca-cert", VolumeSource: corev1.VolumeSource{ConfigMap: &corev1.ConfigMapVolumeSource{DefaultMode: &mode,
					LocalObjectReference: corev1.LocalObjectReference{Name: "istio-ca-root-cert"}}}},
				{Name: "kube-api-access", VolumeSource: corev1.VolumeSource{Projected: &corev1.ProjectedVolumeSource{DefaultMode: &mode, Sources: []corev1.VolumeProjection{
					{ServiceAccountToken: &corev1.ServiceAccountTokenProjection{ExpirationSeconds: &expiry, Path: "token"}},
					{ConfigMap: &corev1.ConfigMapProjection{LocalObjectReference: corev1.LocalObjectReference{Name: "kube-root-ca.crt"},
						Items: []corev1.KeyToPath{{Key: "ca.crt", Path: "ca.crt"}}}}}}}},
			},
			Tolerations: []corev1.Toleration{
				{Key: "node.kubernetes.io/not-ready", Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute, TolerationSeconds: &[]int64{300}[0]},
				{Key: "node.kubernetes.io/unreachable", Operator: corev1.TolerationOpExists, Effect: corev1.TaintEffectNoExecute, TolerationSeconds: &[]int64{300}[0]}},
			RestartPolicy: corev1.RestartPolicyAlways, DNSPolicy: corev1.DNSClusterFirst, SchedulerName: "default-scheduler",
			SecurityContext: &corev1.PodSecurityContext{FSGroup: &proxyUID},
		},
	}
}

// InjectedValidationArgs is the istio-validation container's command line
// exactly as Istio's injector writes it, the subcommand's name first.
func InjectedValidationArgs() []string {
	return []string{"istio-iptables", "-p", "15001", "-z", "15006", "-u", "1337", "-m", "REDIRECT", "-i", "*", "-x", "", "-b", "*", "-d", "15090,15021,15020",
		"--log_output_level=default:info", "--run-validation", "--skip-rule-apply"}
}

// InjectedPodStatus is the status a kubelet reports for an InjectedPod
// once it runs, with pod addresses derived from i.
func InjectedPodStatus(i int) corev1.PodStatus {
	ip := fmt.Sprintf("10.%d.%d.%d", 64+i/65536%64, i/256%256, i%256)
	now := metav1.Now()
	running := corev1.ContainerState{Running: &corev1.ContainerStateRunning{StartedAt: now}}
	cs := func(name, image string) corev1.ContainerStatus {
		t := true
		return corev1.ContainerStatus{Name: name, Ready: true, Started: &t, State: running, Image: image,
			ImageID:     "docker.io/library/" + image + "@sha256:4f6fa7b4a2c8d8d8c4b1a3a2e6b7f1c9d0e2b3a4c5d6e7f8091a2b3c4d5e6f70",
			ContainerID: fmt.Sprintf("containerd://%064x", i*7+len(name))}
	}
	conds := []corev1.PodCondition{}
	for _, c := range []corev1.PodConditionType{"PodReadyToStartContainers", corev1.PodInitialized, corev1.PodReady, corev1.ContainersReady, corev1.PodScheduled} {
		conds = append(conds, corev1.PodCondition{Type: c, Status: corev1.ConditionTrue, LastTransitionTime: now})
	}
	return corev1.PodStatus{Phase: corev1.PodRunning, Conditions: conds, HostIP: "192.168.0.10", HostIPs: []corev1.HostIP{{IP: "192.168.0.10"}},
		PodIP: ip, PodIPs: []corev1.PodIP{{IP: ip}}, StartTime: &now, QOSClass: corev1.PodQOSBurstable,
		InitContainerStatuses: []corev1.ContainerStatus{cs("istio-validation", "proxyv2:1.28.0"), cs("istio-proxy", "proxyv2:1.28.0")},
		ContainerStatuses:     []corev1.ContainerStatus{cs("app", "app:v1.4.2")}}
}

// ApplyPods creates the pods with server-side apply, as controllers and
// kubectl now do (so the API server keeps the managed fields a real
// cluster's pods carry), then applies the status status(i) gives as a
// kubelet would. A pod whose status is nil is created, not applied: the
// cheaper request, for pods only there to be many. workers requests run
// at once.
func ApplyPods(ctx context.Context, cs kubernetes.Interface, pods []*corev1.Pod, status func(i int) *corev1.PodStatus, workers int) error {
	next := make(chan int)
	errs := make(chan error, workers)
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				if err := applyPod(ctx, cs, pods[i], status(i)); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	var err error
feed:
	for i := range pods {
		select {
		case next <- i:
		case err = <-errs:
			break feed
		}
	}
	close(next)
	wg.Wait()
	close(errs)
	if err == nil {
		err = <-errs
	}
	return err
}

func applyPod(ctx context.Context, cs kubernetes.Interface, pod *corev1.Pod, status *corev1.PodStatus) error {
	if status == nil {
		if _, err := cs.CoreV1().Pods(pod.Namespace).Create(ctx, pod, metav1.CreateOptions{FieldManager: "kube-controller-manager"}); err != nil {
			return fmt.Errorf("creating pod %s/%s: %w", pod.Namespace, pod.Name, err)
		}
		return nil
	}
	force := true
	body, err := json.Marshal(pod)
	if err != nil {
		return err
	}
	if _, err := cs.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, k8stypes.ApplyPatchType, body,
		metav1.PatchOptions{FieldManager: "kube-controller-manager", Force: &force}); err != nil {
		return fmt.Errorf("applying pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	st := &corev1.Pod{TypeMeta: pod.TypeMeta, ObjectMeta: metav1.ObjectMeta{Namespace: pod.Namespace, Name: pod.Name}, Status: *status}
	if body, err = json.Marshal(st); err != nil {
		return err
	}
	if _, err := cs.CoreV1().Pods(pod.Namespace).Patch(ctx, pod.Name, k8stypes.ApplyPatchType, body,
		metav1.PatchOptions{FieldManager: "kubelet", Force: &force}, "status"); err != nil {
		return fmt.Errorf("applying the status of pod %s/%s: %w", pod.Namespace, pod.Name, err)
	}
	return nil
}

func mustQuantity(s string) resource.Quantity { return resource.MustParse(s) }

func intOrStr(port int) intstr.IntOrString { return intstr.FromInt32(int32(port)) } //nolint:gosec // G115: ports fit
