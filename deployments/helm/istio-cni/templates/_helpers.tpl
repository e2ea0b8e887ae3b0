{{/* Values with Istio's legacy cni.* layout folded in (cni.* wins, as in Istio). */}}
{{- define "istio-cni.values" -}}
{{- $v := deepCopy .Values -}}
{{- if .Values.cni -}}{{- $v = mergeOverwrite $v .Values.cni -}}{{- end -}}
{{- toYaml $v -}}
{{- end -}}

{{- define "istio-cni.platform" -}}
{{- $v := include "istio-cni.values" . | fromYaml -}}
{{- $v.platform | default $v.global.platform | default "" -}}
{{- end -}}

{{/* Host CNI bin dir: the value, else the platform's, else /opt/cni/bin. */}}
{{- define "istio-cni.binDir" -}}
{{- $v := include "istio-cni.values" . | fromYaml -}}
{{- $p := include "istio-cni.platform" . -}}
{{- $byPlatform := dict "gke" "/home/kubernetes/bin" "k3d" "/bin" "k3s" "/var/lib/rancher/k3s/data/cni" "microk8s" "/var/snap/microk8s/current/opt/cni/bin" "openshift" "/var/lib/cni/bin" -}}
{{- $v.cniBinDir | default (get $byPlatform $p) | default "/opt/cni/bin" -}}
{{- end -}}

{{- define "istio-cni.confDir" -}}
{{- $v := include "istio-cni.values" . | fromYaml -}}
{{- $p := include "istio-cni.platform" . -}}
{{- $byPlatform := dict "k3d" "/var/lib/rancher/k3s/agent/etc/cni/net.d" "k3s" "/var/lib/rancher/k3s/agent/etc/cni/net.d" "microk8s" "/var/snap/microk8s/current/args/cni-network" "openshift" "/etc/cni/multus/net.d" -}}
{{- $v.cniConfDir | default (get $byPlatform $p) | default "/etc/cni/net.d" -}}
{{- end -}}

{{- define "istio-cni.chained" -}}
{{- $v := include "istio-cni.values" . | fromYaml -}}
{{- if eq (include "istio-cni.platform" .) "openshift" }}false{{ else }}{{ $v.chained }}{{ end -}}
{{- end -}}

{{- define "istio-cni.confFileName" -}}
{{- $v := include "istio-cni.values" . | fromYaml -}}
{{- if and (eq (include "istio-cni.platform" .) "openshift") (not $v.cniConfFileName) }}istio-cni.conf{{ else }}{{ $v.cniConfFileName }}{{ end -}}
{{- end -}}

{{- define "istio-cni.provider" -}}
{{- $v := include "istio-cni.values" . | fromYaml -}}
{{- if eq (include "istio-cni.platform" .) "openshift" }}multus{{ else }}{{ $v.provider }}{{ end -}}
{{- end -}}

{{- define "istio-cni.logLevel" -}}
{{- $v := include "istio-cni.values" . | fromYaml -}}
{{- $v.logLevel | default $v.logging.level | default $v.global.logging.level | default "info" -}}
{{- end -}}

{{- define "istio-cni.nativeNftables" -}}
{{- $v := include "istio-cni.values" . | fromYaml -}}
{{- $n := $v.nativeNftables -}}
{{- if and (kindIs "bool" $n) (not $n) }}{{ $n = $v.global.nativeNftables }}{{ end -}}
{{- $n -}}
{{- end -}}

{{- define "istio-cni.repairMode" -}}
{{- $r := (include "istio-cni.values" . | fromYaml).repair -}}
{{- if not $r.enabled }}{{ else if $r.repairPods }}repair{{ else if $r.deletePods }}delete{{ else if $r.labelPods }}label{{ end -}}
{{- end -}}

{{- define "istio-cni.image" -}}
{{- $v := include "istio-cni.values" . | fromYaml -}}
{{- if contains "/" $v.image -}}{{ $v.image }}{{- else -}}
{{ $v.hub | default $v.global.hub }}/{{ $v.image }}:{{ $v.tag | default $v.global.tag }}{{ if $v.variant }}-{{ $v.variant }}{{ end }}
{{- end -}}
{{- end -}}
