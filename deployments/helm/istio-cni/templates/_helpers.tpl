{{/*
istio-cni.init replaces .Values with the effective values, once per render
(every template includes it first, so the order Helm renders templates in
does not matter): the defaults, then the profile, the compatibility version
and the platform named in your values, then your values, then your cni.*
values. Unlike Istio, where a platform's cni.* settings land after your
top-level values, anything you give (but an empty string) wins over every
named set.
It also fails the render on values this chart cannot honour: an unknown
profile, compatibility version or platform, a bad global.resourceScope,
values under defaults.
*/}}
{{- define "istio-cni.init" -}}
{{- if not (hasKey $ "IstioCNIEffectiveValues") -}}
{{- $raw := $.Values -}}
{{- if hasKey $raw "defaults" -}}
{{- fail (printf "defaults=%s: values go at the top level (--set hub=x, not --set defaults.hub=x)" (toJson (get $raw "defaults"))) -}}
{{- end -}}
{{- $data := $.Files.Get "files/profiles.yaml" | fromYaml -}}
{{- $user := deepCopy (omit $raw "_internal_defaults_do_not_set") -}}
{{- $userGlobal := dict -}}
{{- if kindIs "map" $user.global }}{{ $userGlobal = $user.global }}{{ end -}}
{{- $v := deepCopy (get $raw "_internal_defaults_do_not_set" | default dict) -}}
{{- $named := list -}}
{{- range $sel := list (list "profile" "profiles" "unknown profile") (list "compatibilityVersion" "compatibilityVersions" "unknown compatibility version") (list "platform" "platforms" "unknown platform") -}}
{{- $key := index $sel 0 -}}
{{- $name := coalesce (get $user $key) (get $userGlobal $key) -}}
{{- if $name -}}
{{- $what := $key -}}
{{- if not (get $user $key) }}{{ $what = printf "global.%s" $key }}{{ end -}}
{{- if kindIs "float64" $name }}{{ $name = printf "%.2f" $name }}{{ end -}}
{{- $table := get $data (index $sel 1) -}}
{{- if not (hasKey $table (toString $name)) -}}
{{- fail (printf "%s=%v: %s; known: %s" $what $name (index $sel 2) (keys $table | sortAlpha | join ", ")) -}}
{{- end -}}
{{- $named = append $named (list (printf "%s=%v" $what $name) (deepCopy (get $table (toString $name) | default dict))) -}}
{{- $_ := mustMergeOverwrite $v (deepCopy (index ($named | last) 1)) -}}
{{- end -}}
{{- end -}}
{{- $userCNI := dict -}}
{{- if kindIs "map" $user.cni }}{{ $userCNI = $user.cni }}{{ end -}}
{{- /* An empty string (this chart's older "use the platform's" default, in
  copied values files) leaves a named set's value in place, which is also
  what Istio renders there. */ -}}
{{- range $set := $named -}}
{{- range $k, $_ := index $set 1 -}}
{{- range $layer := list $user $userCNI -}}
{{- if and (hasKey $layer $k) (kindIs "string" (get $layer $k)) (eq (get $layer $k) "") }}{{ $_ := unset $layer $k }}{{ end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $_ := mustMergeOverwrite $v (omit $user "cni") $userCNI -}}
{{- /* Which layer named the image, for the image's error to name it. */ -}}
{{- $from := dict "hub" "hub" "image" "image" -}}
{{- range $k := list "hub" "image" -}}
{{- if get $userCNI $k }}{{ $_ := set $from $k (printf "cni.%s" $k) }}{{ end -}}
{{- end -}}
{{- $_ := set $ "IstioCNIImageKeys" $from -}}
{{- $_ := unset $v "cni" -}}
{{- if not (kindIs "map" $v.global) }}{{ $_ := set $v "global" dict }}{{ end -}}
{{- $scope := lower (toString ($v.global.resourceScope | default "all")) -}}
{{- if not (has $scope (list "all" "cluster" "namespace")) -}}
{{- fail (printf "global.resourceScope=%v: must be all, cluster or namespace" $v.global.resourceScope) -}}
{{- end -}}
{{- $_ := set $v.global "resourceScope" $scope -}}
{{- $_ := set $ "Values" $v -}}
{{- $_ := set $ "IstioCNIEffectiveValues" true -}}
{{- end -}}
{{- end -}}

{{/* Whether the namespaced / cluster-scoped objects render (global.resourceScope). */}}
{{- define "istio-cni.namespaced" -}}
{{- if ne .Values.global.resourceScope "cluster" }}true{{ end -}}
{{- end -}}
{{- define "istio-cni.clusterScoped" -}}
{{- if ne .Values.global.resourceScope "namespace" }}true{{ end -}}
{{- end -}}

{{/* Labels Istio puts on every object of its charts. */}}
{{- define "istio-cni.istioLabels" -}}
app.kubernetes.io/name: istio-cni
app.kubernetes.io/managed-by: {{ .Release.Service | quote }}
app.kubernetes.io/instance: {{ .Release.Name | quote }}
app.kubernetes.io/part-of: "istio"
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{/* Labels of the install operator and revisions, as Istio sets them. */}}
{{- define "istio-cni.operatorLabels" -}}
release: {{ .Release.Name | quote }}
istio.io/rev: {{ .Values.revision | default "default" | quote }}
install.operator.istio.io/owning-resource: {{ .Values.ownerName | default "unknown" | quote }}
operator.istio.io/component: "Cni"
{{- end -}}

{{- define "istio-cni.labels" -}}
app: istio-cni
{{ include "istio-cni.operatorLabels" . }}
{{ include "istio-cni.istioLabels" . }}
{{- end -}}

{{- define "istio-cni.platform" -}}
{{- .Values.platform | default .Values.global.platform | default "" -}}
{{- end -}}

{{/* Host CNI bin dir; empty detects GKE from the cluster's version, as Istio does. */}}
{{- define "istio-cni.binDir" -}}
{{- if .Values.cniBinDir -}}{{ .Values.cniBinDir }}
{{- else if contains "-gke" .Capabilities.KubeVersion.GitVersion -}}/home/kubernetes/bin
{{- else -}}/opt/cni/bin
{{- end -}}
{{- end -}}

{{- define "istio-cni.confDir" -}}
{{- .Values.cniConfDir | default "/etc/cni/net.d" -}}
{{- end -}}

{{/* --log_output_level: logging.level, else global.logging.level, as
     Istio's DaemonSet. logLevel (in Istio's 1.2x default values as
     "debug", never read by its DaemonSet) has no effect here either: read,
     it turned a copied values file's agent to debug. */}}
{{- define "istio-cni.logLevel" -}}
{{- coalesce (dig "logging" "level" "" .Values) (dig "logging" "level" "" .Values.global) | default "" -}}
{{- end -}}

{{- define "istio-cni.nativeNftables" -}}
{{- $n := .Values.nativeNftables -}}
{{- if and (kindIs "bool" $n) (not $n) }}{{ $n = .Values.global.nativeNftables | default false }}{{ end -}}
{{- $n -}}
{{- end -}}

{{/* Ambient mode (ambient.enabled). */}}
{{- define "istio-cni.ambient" -}}
{{- if (.Values.ambient | default dict).enabled }}true{{ end -}}
{{- end -}}

{{/* The agent in the node's network namespace: ambient.shareHostNetworkNamespace,
which, as in Istio, counts only with ambient mode on. */}}
{{- define "istio-cni.hostNetwork" -}}
{{- $a := .Values.ambient | default dict -}}
{{- if and $a.enabled $a.shareHostNetworkNamespace }}true{{ end -}}
{{- end -}}

{{/* The one repair mode in effect, by Istio's precedence (empty: repair off). */}}
{{- define "istio-cni.repairMode" -}}
{{- $r := .Values.repair | default dict -}}
{{- if not $r.enabled }}{{ else if $r.repairPods }}repair{{ else if $r.deletePods }}delete{{ else if $r.labelPods }}label{{ end -}}
{{- end -}}

{{/* The agent's image. This chart runs this project's agent, which no
     registry of Istio's holds: an image from one of them is Istio's own
     agent, whose probes and settings this DaemonSet does not fit (it would
     restart for ever on the liveness probe), so the render fails, naming
     the value that chose it, as it does without a hub. */}}
{{- define "istio-cni.image" -}}
{{- $how := "set hub and tag (cni.hub and cni.tag in the cni.* layout), or image, to where this project's install-cni image was pushed (make image builds it)" -}}
{{- $image := .Values.image | default "install-cni" | toString -}}
{{- $ref := $image -}}
{{- $what := printf "%s=%s" .IstioCNIImageKeys.image $image -}}
{{- if not (contains "/" $image) -}}
{{- $hub := .Values.hub | default .Values.global.hub | default "" | toString -}}
{{- $what = ternary (printf "%s=%s" .IstioCNIImageKeys.hub $hub) (printf "global.hub=%s" $hub) (not (empty .Values.hub)) -}}
{{- if not $hub -}}
{{- fail (printf "hub: no registry for the agent's image; %s" $how) -}}
{{- end -}}
{{- $variant := .Values.variant | default .Values.global.variant -}}
{{- $ref = printf "%s/%s:%s%s" $hub $image (include "istio-cni.tag" .) (ternary (printf "-%s" $variant) "" (not (empty $variant))) -}}
{{- end -}}
{{- $repo := regexReplaceAll "/[^/]*$" (regexReplaceAll "@.*$" $ref "") "" | lower -}}
{{- if regexMatch "^((docker\\.io|index\\.docker\\.io|registry-1\\.docker\\.io|registry\\.hub\\.docker\\.com|mirror\\.gcr\\.io)/)?istio$|^gcr\\.io/istio-(release|testing)$|^registry\\.istio\\.io(/|$)|^us-docker\\.pkg\\.dev/istio-(release|testing)/" $repo -}}
{{- fail (printf "%s: %s is Istio's own install-cni image, not this project's agent, which this chart runs; %s" $what $ref $how) -}}
{{- end -}}
{{- $ref -}}
{{- end -}}

{{/* The image's tag (tag, else global.tag), as a string. */}}
{{- define "istio-cni.tag" -}}
{{- .Values.tag | default .Values.global.tag | default "" | toString -}}
{{- end -}}

{{/* An env value as a string; null is empty, as in Istio's chart. */}}
{{- define "istio-cni.envString" -}}
{{- if not (kindIs "invalid" .) }}{{ toString . }}{{ end -}}
{{- end -}}

{{/* The container's resources as YAML, without the entries a values file
     set to null, nor a section left with none (resources.limits.cpu=null
     removes the default's limit rather than render "cpu: null", which the
     API server would read as 0). */}}
{{- define "istio-cni.resources" -}}
{{- if not (kindIs "map" .) -}}
{{- fail (printf "resources=%v: must be a map of requests and limits" .) -}}
{{- end -}}
{{- $out := dict -}}
{{- range $k, $v := . -}}
{{- if kindIs "map" $v -}}
{{- $kept := dict -}}
{{- range $name, $q := $v -}}
{{- if not (kindIs "invalid" $q) }}{{ $_ := set $kept $name $q }}{{ end -}}
{{- end -}}
{{- if $kept }}{{ $_ := set $out $k $kept }}{{ end -}}
{{- else if $v -}}
{{- $_ := set $out $k $v -}}
{{- end -}}
{{- end -}}
{{- toYaml $out -}}
{{- end -}}
