{{/* The release's name for its objects, at most 63 characters. */}}
{{- define "metrale-worker.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "metrale-worker.selectorLabels" -}}
app.kubernetes.io/name: {{ default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "metrale-worker.labels" -}}
{{ include "metrale-worker.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* A flag's value as the worker parses it: whole numbers without an exponent, the rest as they are. */}}
{{- define "metrale-worker.flagValue" -}}
{{- if and (kindIs "float64" .) (eq . (floor .)) -}}
{{- int64 . -}}
{{- else -}}
{{- . -}}
{{- end -}}
{{- end -}}

{{/* metrale-worker serve's arguments: the chart's own, then every worker flag that is set. */}}
{{- define "metrale-worker.args" -}}
- serve
- --host=0.0.0.0
- --port={{ .Values.grpcPort }}
- --health-port={{ .Values.healthPort }}
- --cache-dir=/cache
{{- if ne .Values.model.source "default" }}
- {{ printf "--model=%s" .Values.model.path | quote }}
{{- end }}
{{- if .Values.metrics.enabled }}
- --metrics-port={{ .Values.metrics.port }}
{{- end }}
{{- if .Values.tls.enabled }}
- --tls-cert=/etc/metrale/tls/tls.crt
- --tls-key=/etc/metrale/tls/tls.key
{{- if .Values.tls.clientCA }}
- --tls-client-ca=/etc/metrale/tls/ca.crt
{{- end }}
{{- end }}
{{- if .Values.auth.enabled }}
- {{ printf "--auth-tokens-file=/etc/metrale/auth/%s" .Values.auth.key | quote }}
{{- end }}
{{- range $flag, $value := .Values.worker }}
{{- if not (kindIs "invalid" $value) }}
- {{ printf "--%s=%s" $flag (include "metrale-worker.flagValue" $value) | quote }}
{{- end }}
{{- end }}
{{- end -}}
