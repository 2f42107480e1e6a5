{{/* The namespace every namespaced object goes to: namespaceOverride, else the release's. */}}
{{- define "flexgpu.namespace" -}}
{{- default .Release.Namespace .Values.namespaceOverride -}}
{{- end -}}

{{/* Common names and labels. */}}
{{- define "flexgpu.name" -}}
{{- default "flexgpu" .Values.nameOverride | trunc 50 | trimSuffix "-" -}}
{{- end -}}

{{/* Object names get suffixes (-kubelet-plugin-own-node-policy-status): 50 leaves room. */}}
{{- define "flexgpu.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- $name := include "flexgpu.name" . -}}
{{- if contains $name .Release.Name -}}{{ .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else -}}{{ printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}{{- end -}}
{{- end -}}
{{- end -}}

{{/* Labels that never change across upgrades (selectors are immutable, so the workloads'
selectors keep instance + component only, as the first charts had them). */}}
{{- define "flexgpu.selectorLabels" -}}
app.kubernetes.io/name: {{ include "flexgpu.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "flexgpu.labels" -}}
{{ include "flexgpu.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: flexgpu
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* A pod template's labels: the recommended labels, the component and the user's podLabels
(which may add labels; ours win, as the selectors use them). Call with
(dict "top" $ "component" "controller" "extra" .Values.controller.podLabels). */}}
{{- define "flexgpu.podLabels" -}}
{{- $ours := fromYaml (include "flexgpu.labels" .top) -}}
{{- $_ := set $ours "app.kubernetes.io/component" .component -}}
{{- toYaml (merge $ours (.extra | default dict)) -}}
{{- end -}}

{{/* The image both daemons (and the MPS daemon pods) run: [registry/]repository then
@digest when one is given (it pins the exact image), else :tag (default: appVersion).
global.imageRegistry, where set, replaces image.registry (a mirror for every chart). */}}
{{- define "flexgpu.image" -}}
{{- $registry := default .Values.image.registry (.Values.global).imageRegistry -}}
{{- if $registry }}{{ $registry | trimSuffix "/" }}/{{ end }}{{ .Values.image.repository }}
{{- if .Values.image.digest }}@{{ .Values.image.digest }}
{{- else }}:{{ .Values.image.tag | default .Chart.AppVersion }}{{ end }}
{{- end -}}

{{/* Fails the render when an optional object's API is missing from the cluster, saying what
to install, instead of a failed install halfway (helm template: pass --api-versions). */}}
{{- define "flexgpu.requireApi" -}}
{{- if not (.top.Capabilities.APIVersions.Has .api) -}}
{{- fail (printf "%s is true but the cluster serves no %s: install %s first (helm template: add --api-versions %s)" .value .api .what .api) -}}
{{- end -}}
{{- end -}}

{{- define "flexgpu.pluginName" -}}{{ include "flexgpu.fullname" . }}-kubelet-plugin{{- end -}}
{{- define "flexgpu.controllerName" -}}{{ include "flexgpu.fullname" . }}-controller{{- end -}}
{{- define "flexgpu.webhookSecret" -}}{{ include "flexgpu.fullname" . }}-webhook-tls{{- end -}}
{{/* The Secret the controller mounts its webhook certificate from: cert-manager's, or the
admin's own (webhook.tls.secretName); "": the controller makes its own and keeps it in
flexgpu.webhookSecret (then, and only then, it may touch that Secret). */}}
{{- define "flexgpu.webhookMountedSecret" -}}
{{- if .Values.webhook.enabled -}}
{{- if and .Values.webhook.certManager.enabled .Values.webhook.tls.secretName -}}
{{- fail "webhook.tls.secretName and webhook.certManager.enabled both say where the webhook's certificate comes from: set one of them" -}}
{{- else if .Values.webhook.certManager.enabled -}}{{ include "flexgpu.webhookSecret" . }}
{{- else -}}{{ .Values.webhook.tls.secretName }}
{{- end -}}
{{- end -}}
{{- end -}}
{{- define "flexgpu.webhookConfiguration" -}}{{ include "flexgpu.fullname" . }}-validation{{- end -}}
{{- define "flexgpu.tenantWebhookConfiguration" -}}{{ include "flexgpu.fullname" . }}-tenancy{{- end -}}
{{/* The tenancy webhook is rendered (and the controller may write it) when shared GPUs serve
one namespace at a time and the controller serves webhooks. */}}
{{- define "flexgpu.tolerationWebhookConfiguration" -}}{{ include "flexgpu.fullname" . }}-gpu-tolerations{{- end -}}
{{/* The pod toleration webhook is rendered (and the controller may write it) when the admin
names tolerations and the controller serves webhooks. */}}
{{- define "flexgpu.tolerationWebhook" -}}{{ if and .Values.webhook.enabled .Values.webhook.gpuTolerations }}true{{ end }}{{- end -}}
{{- define "flexgpu.tenantWebhook" -}}{{ if and .Values.webhook.enabled (eq .Values.kubeletPlugin.sharedGpuTenants "namespace") }}true{{ end }}{{- end -}}

{{/* ServiceAccounts: the chart's own, or one the admin made (serviceAccount.create=false). */}}
{{- define "flexgpu.pluginServiceAccount" -}}
{{- $sa := .Values.kubeletPlugin.serviceAccount -}}
{{- if $sa.create -}}{{ default (include "flexgpu.pluginName" .) $sa.name }}
{{- else -}}{{ required "kubeletPlugin.serviceAccount.name is required when kubeletPlugin.serviceAccount.create is false" $sa.name }}{{- end -}}
{{- end -}}
{{- define "flexgpu.controllerServiceAccount" -}}
{{- $sa := .Values.controller.serviceAccount -}}
{{- if $sa.create -}}{{ default (include "flexgpu.controllerName" .) $sa.name }}
{{- else -}}{{ required "controller.serviceAccount.name is required when controller.serviceAccount.create is false" $sa.name }}{{- end -}}
{{- end -}}

{{/* The username the apiserver gives each ServiceAccount (admission policies match on it). */}}
{{- define "flexgpu.pluginUser" -}}
system:serviceaccount:{{ include "flexgpu.namespace" . }}:{{ include "flexgpu.pluginServiceAccount" . }}
{{- end -}}
{{- define "flexgpu.controllerUser" -}}
system:serviceaccount:{{ include "flexgpu.namespace" . }}:{{ include "flexgpu.controllerServiceAccount" . }}
{{- end -}}

{{/* Binding conditions for on-demand MIG: "auto" (the plugin checks the server) only on
Kubernetes 1.36+, where they are on by default; else "off", and no right to list claims. */}}
{{- define "flexgpu.bindingConditions" -}}
{{- if and (eq (toString .Values.kubeletPlugin.bindingConditions) "auto") (semverCompare ">=1.36.0-0" .Capabilities.KubeVersion.Version) -}}
auto
{{- else -}}
off
{{- end -}}
{{- end -}}

{{/* The whole-GPU class's extendedResourceName: "auto" is nvidia.com/gpu on Kubernetes
1.37+, where DRAExtendedResource is GA (as NVIDIA's own DRA chart does), and none before;
"" none; anything else that name. */}}
{{- define "flexgpu.gpuExtendedResourceName" -}}
{{- $name := toString .Values.deviceClasses.gpuExtendedResourceName -}}
{{- if eq $name "auto" -}}
{{- if semverCompare ">=1.37.0-0" .Capabilities.KubeVersion.Version -}}nvidia.com/gpu{{- end -}}
{{- else -}}
{{- $name -}}
{{- end -}}
{{- end -}}

{{/* MPS daemons as pods need the driver root (their program comes from it). */}}
{{- define "flexgpu.mpsDaemonPods" -}}
{{- if and .Values.kubeletPlugin.mpsDaemonPods .Values.kubeletPlugin.nvidiaDriverRoot -}}true{{- end -}}
{{- end -}}

{{/*
The kubelet plugin's affinity: kubeletPlugin.affinity, with the device-plugin guard's label
(kubeletPlugin.devicePluginGuard.labelKey, when set) added to every required node selector
term (terms are ORed, so each needs it), so no override of the affinity can put the plugin
on a node so labelled. The guard proper is the plugin's own check of the Node's allocatable.
*/}}
{{- define "flexgpu.kubeletPluginAffinity" -}}
{{- $affinity := deepCopy (.Values.kubeletPlugin.affinity | default dict) -}}
{{- $guard := .Values.kubeletPlugin.devicePluginGuard -}}
{{- if and $guard.enabled $guard.labelKey -}}
{{- $expr := dict "key" $guard.labelKey "operator" "NotIn" "values" (list "true") -}}
{{- $node := get $affinity "nodeAffinity" | default dict -}}
{{- $required := get $node "requiredDuringSchedulingIgnoredDuringExecution" | default dict -}}
{{- $terms := get $required "nodeSelectorTerms" | default (list dict) -}}
{{- $guarded := list -}}
{{- range $terms -}}
{{- $term := deepCopy . -}}
{{- $_ := set $term "matchExpressions" (append (get $term "matchExpressions" | default list) $expr) -}}
{{- $guarded = append $guarded $term -}}
{{- end -}}
{{- $_ := set $required "nodeSelectorTerms" $guarded -}}
{{- $_ := set $node "requiredDuringSchedulingIgnoredDuringExecution" $required -}}
{{- $_ := set $affinity "nodeAffinity" $node -}}
{{- end -}}
{{- toYaml $affinity -}}
{{- end -}}
