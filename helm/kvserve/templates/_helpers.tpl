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

{{/* preStop + drain + margin, or the explicit value once checked to be long enough. */}}
{{- define "kvserve.terminationGracePeriodSeconds" -}}
{{- $drain := add (int .Values.lifecycle.preStopSleepSeconds) (int (ceil .Values.kvserve.shutdownGraceSeconds)) }}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds }}
{{- add $drain 15 }}
{{- else if le (int .Values.terminationGracePeriodSeconds) (int $drain) }}
{{- fail (printf "terminationGracePeriodSeconds (%v) must exceed lifecycle.preStopSleepSeconds + kvserve.shutdownGraceSeconds (%v) so in-flight requests can drain" .Values.terminationGracePeriodSeconds $drain) }}
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
{{- else }}
emptyDir:
  {{- with $spec.emptyDir.sizeLimit }}
  sizeLimit: {{ . }}
  {{- end }}
{{- end }}
{{- end }}
