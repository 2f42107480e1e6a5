{{/* Common names and labels. */}}
{{- define "flexgpu.name" -}}flexgpu{{- end -}}

{{- define "flexgpu.fullname" -}}
{{- if contains "flexgpu" .Release.Name -}}{{ .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-flexgpu" .Release.Name | trunc 50 | trimSuffix "-" }}{{- end -}}
{{- end -}}

{{- define "flexgpu.labels" -}}
app.kubernetes.io/name: flexgpu
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "flexgpu.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "flexgpu.pluginName" -}}{{ include "flexgpu.fullname" . }}-kubelet-plugin{{- end -}}
{{- define "flexgpu.controllerName" -}}{{ include "flexgpu.fullname" . }}-controller{{- end -}}
{{- define "flexgpu.webhookSecret" -}}{{ include "flexgpu.fullname" . }}-webhook-tls{{- end -}}
{{- define "flexgpu.webhookConfiguration" -}}{{ include "flexgpu.fullname" . }}-validation{{- end -}}
