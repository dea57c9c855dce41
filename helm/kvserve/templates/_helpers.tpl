{{- define "kvserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvserve.labels" -}}
helm.sh/chart: {{ include "kvserve.chart" . }}
{{ include "kvserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "kvserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The Secret holding API keys: an existing one, or the chart's. Empty = no auth. */}}
{{- define "kvserve.apiKeySecretName" -}}
{{- if .Values.apiKey.enabled }}
{{- if .Values.apiKey.existingSecret }}
{{- .Values.apiKey.existingSecret }}
{{- else if .Values.apiKey.keys }}
{{- printf "%s-api-keys" (include "kvserve.fullname" .) }}
{{- else }}
{{- fail "apiKey.enabled needs apiKey.existingSecret or apiKey.keys" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvserve.metricsPortEnabled" -}}
{{- if not (kindIs "invalid" .Values.kvserve.metricsPort) }}true{{- end }}
{{- end }}

{{/* preStop + drain (+ writing the sessions to the disk tier, which the server gives
max(5, shutdown grace) seconds after the drain) + margin, or the explicit value once checked
to be long enough. */}}
{{- define "kvserve.terminationGracePeriodSeconds" -}}
{{- $grace := int (ceil .Values.kvserve.shutdownGraceSeconds) }}
{{- $drain := add (int .Values.lifecycle.preStopSleepSeconds) $grace }}
{{- $needs := "lifecycle.preStopSleepSeconds + kvserve.shutdownGraceSeconds" }}
{{- $why := "so in-flight requests can drain" }}
{{- if .Values.kvTiers.disk.enabled }}
{{- $drain = add $drain (max 5 $grace) }}
{{- $needs = printf "%s + max(5, kvserve.shutdownGraceSeconds)" $needs }}
{{- $why = "so in-flight requests can drain and then sessions be written to the disk tier (kvTiers.disk)" }}
{{- end }}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds }}
{{- add $drain 15 }}
{{- else if le (int .Values.terminationGracePeriodSeconds) (int $drain) }}
{{- fail (printf "terminationGracePeriodSeconds (%v) must exceed %s (%v) %s" .Values.terminationGracePeriodSeconds $needs $drain $why) }}
{{- else }}
{{- int .Values.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}

{{- define "kvserve.volumeSource" -}}
{{- $spec := .spec }}
{{- if $spec.persistence.enabled }}
persistentVolumeClaim:
  claimName: {{ default (printf "%s-%s" (include "kvserve.fullname" .root) .name) $spec.persistence.existingClaim }}
  {{- if .readOnly }}
  readOnly: true
  {{- end }}
{{- else if $spec.emptyDir.sizeLimit }}
emptyDir:
  sizeLimit: {{ $spec.emptyDir.sizeLimit }}
{{- else }}
{{- /* No limit: an empty object (`emptyDir:` alone would be null, a volume without a source). */}}
emptyDir: {}
{{- end }}
{{- end }}

{{/* KVSERVE_LORA: NAME=PATH of each lora.adapters entry, PATH under lora.mountPath, comma-separated
(the env var's list form). */}}
{{- define "kvserve.loraEnv" -}}
{{- $entries := list }}
{{- range .adapters }}
{{- $entries = append $entries (printf "%s=%s/%s" .name (trimSuffix "/" $.mountPath) .path) }}
{{- end }}
{{- join "," $entries }}
{{- end }}

{{/* What the server would refuse at start (a crash loop), or SMG would break, refused at render time. */}}
{{- define "kvserve.checkLora" -}}
{{- $lora := .Values.lora }}
{{- if .Values.router.enabled }}
{{- fail "lora with router.enabled: SMG registers each replica under its base model only and answers 404 model_not_found for an adapter's name (its --model-alias would rewrite the request to the base model, dropping the adapter). Route adapters with llm-d / the Gateway API Inference Extension (docs/scale-out/README.md) or the Ingress" }}
{{- end }}
{{- if and (not $lora.volume) (not (hasPrefix (printf "%s/" (trimSuffix "/" .Values.models.mountPath)) $lora.mountPath)) }}
{{- fail (printf "lora.volume is empty, so the adapters must be on the models volume: lora.mountPath (%s) must lie under models.mountPath (%s), or set lora.volume" $lora.mountPath .Values.models.mountPath) }}
{{- end }}
{{- $names := dict }}
{{- range $lora.adapters }}
{{- if hasKey $names .name }}
{{- fail (printf "lora.adapters: the name %q is given twice" .name) }}
{{- end }}
{{- $_ := set $names .name true }}
{{- if or (eq .path "..") (hasPrefix "../" .path) (contains "/../" .path) (hasSuffix "/.." .path) }}
{{- fail (printf "lora.adapters %s: the path %q leaves lora.mountPath" .name .path) }}
{{- end }}
{{- end }}
{{- $maxLoras := ternary 8 $lora.maxLoras (kindIs "invalid" $lora.maxLoras) | int }}
{{- $capacity := ternary (max 32 $maxLoras) $lora.maxCpuLoras (kindIs "invalid" $lora.maxCpuLoras) | int }}
{{- if lt $capacity $maxLoras }}
{{- fail (printf "lora.maxCpuLoras (%d) is below lora.maxLoras (%d): the adapters resident on the device count among those loaded" $capacity $maxLoras) }}
{{- end }}
{{- if gt (len $lora.adapters) $capacity }}
{{- fail (printf "lora.adapters lists %d adapters, more than lora.maxCpuLoras (%d) loads at once" (len $lora.adapters) $capacity) }}
{{- end }}
{{- end }}

{{/* ---- Router (SMG) in front of the replicas: router.enabled ---- */}}

{{- define "kvserve.routerName" -}}
{{- printf "%s-router" (include "kvserve.fullname" . | trunc 56 | trimSuffix "-") }}
{{- end }}

{{/* The router's pods carry their own name label, so no kvserve selector (Deployment, Service,
PDB, NetworkPolicy, the router's own discovery) ever matches them. */}}
{{- define "kvserve.routerSelectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-router" (include "kvserve.name" . | trunc 56 | trimSuffix "-") }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: router
{{- end }}

{{- define "kvserve.routerLabels" -}}
helm.sh/chart: {{ include "kvserve.chart" . }}
{{ include "kvserve.routerSelectorLabels" . }}
app.kubernetes.io/version: {{ .Values.router.image.tag | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: {{ include "kvserve.name" . }}
{{- end }}

{{- define "kvserve.routerServiceAccountName" -}}
{{- if .Values.router.serviceAccount.create }}
{{- default (include "kvserve.routerName" .) .Values.router.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.router.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvserve.routerImage" -}}
{{- $image := .Values.router.image }}
{{- if $image.digest }}
{{- printf "%s:%s@%s" $image.repository $image.tag $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository $image.tag }}
{{- end }}
{{- end }}

{{- define "kvserve.routerKubernetesDiscovery" -}}
{{- if and .Values.router.enabled (eq .Values.router.discovery.mode "kubernetes") }}true{{- end }}
{{- end }}

{{- define "kvserve.routerTerminationGracePeriodSeconds" -}}
{{- add (int .Values.lifecycle.preStopSleepSeconds) (int .Values.router.shutdownGraceSeconds) 15 }}
{{- end }}

{{/* `smg launch` flags (the image's entrypoint is `python3 -m smg.launch_router`, which takes
the same flags). One flag or value per line: rendered as the container's args. */}}
{{- define "kvserve.routerArgs" -}}
{{- $r := .Values.router }}
- --host
- 0.0.0.0
- --port
- {{ $r.port | quote }}
- --prometheus-host
- 0.0.0.0
- --prometheus-port
- {{ $r.metricsPort | quote }}
- --policy
- {{ $r.policy }}
{{- if eq $r.policy "cache_aware" }}
- --cache-threshold
- {{ $r.cacheThreshold | quote }}
{{- end }}
- --load-monitor-interval
- {{ $r.loadMonitorIntervalSeconds | quote }}
{{- if eq $r.discovery.mode "kubernetes" }}
- --service-discovery
- --selector
{{- range $key, $value := (include "kvserve.selectorLabels" . | fromYaml) }}
- {{ printf "%s=%s" $key $value }}
{{- end }}
- --service-discovery-namespace
- {{ .Release.Namespace }}
- --service-discovery-port
- {{ .Values.service.port | quote }}
{{- else }}
- --worker-urls
{{- range $r.discovery.workerUrls }}
- {{ . }}
{{- end }}
{{- end }}
- --health-check-endpoint
- {{ $r.healthCheck.path }}
- --health-check-interval-secs
- {{ $r.healthCheck.intervalSeconds | quote }}
- --health-check-timeout-secs
- {{ $r.healthCheck.timeoutSeconds | quote }}
- --health-failure-threshold
- {{ $r.healthCheck.failureThreshold | quote }}
- --health-success-threshold
- {{ $r.healthCheck.successThreshold | quote }}
- --disable-tokenizer-autoload
- --request-timeout-secs
- {{ $r.requestTimeoutSeconds | quote }}
- --shutdown-grace-period-secs
- {{ $r.shutdownGraceSeconds | quote }}
- --log-level
- {{ $r.logLevel }}
{{- range $r.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}
