{{/* The release's full name, at most 63 characters (a DNS label). */}}
{{- define "ferry.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "ferry.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "ferry.labels" -}}
{{ include "ferry.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "ferry.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "ferry.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* preStop sleep + ferry's drain deadline + a margin: the pod is never killed while draining. */}}
{{- define "ferry.gracePeriod" -}}
{{- $s := .Values.shutdown -}}
{{- add (int $s.preStopSleepSeconds) (int $s.exitTimeoutSecs) (int $s.terminationMarginSeconds) -}}
{{- end -}}

{{/* The Secret that holds the admin key. */}}
{{- define "ferry.adminSecret" -}}
{{- default (printf "%s-admin" (include "ferry.fullname" .)) .Values.adminApi.existingSecret -}}
{{- end -}}
