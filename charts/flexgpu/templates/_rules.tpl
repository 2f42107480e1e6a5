{{/*
The alert rules, as the `groups:` of a Prometheus rule file: the PrometheusRule's spec, and
what the tests hand to promtool. Every figure the plugin or the controller exports per node
is aggregated with max across the pods that export it, so a rollout (two pods exporting the
same node for a while, then a new pod) never changes an alert's value.
*/}}
{{- define "flexgpu.ruleGroups" -}}
{{- $rule := .Values.metrics.prometheusRule -}}
{{- $idle := .Values.metrics.idleClaims -}}
groups:
  - name: flexgpu
    rules:
      - alert: FlexgpuKubeletPluginDown
        # kube-state-metrics: a GPU node where the plugin pod is not ready.
        expr: >-
          kube_daemonset_status_number_unavailable{namespace="{{ include "flexgpu.namespace" . }}",
          daemonset="{{ include "flexgpu.pluginName" . }}"} > 0
        for: 10m
        labels: {severity: warning}
        annotations:
          summary: flexgpu kubelet plugin is not running on {{ "{{ $value }}" }} GPU node(s)
          description: Pods on those nodes cannot get GPUs prepared, and their slices are withdrawn after 30 s.
      - alert: FlexgpuDevicesUnavailable
        # GPUs the plugin withdrew (hardware Xid, fell off the bus), or fewer GPUs than the
        # node had in the last day (a GPU gone across a plugin restart). Read per plugin pod
        # and combined with max, so a plugin or controller rollout changes nothing here.
        expr: >-
          max by (node) (flexgpu_plugin_gpus{health="unhealthy"}) > 0
          or
          max by (node) (sum without (health) (flexgpu_plugin_gpus))
          < max by (node) (max_over_time(sum without (health) (flexgpu_plugin_gpus)[1d:5m]))
        for: 5m
        labels: {severity: warning}
        annotations:
          summary: GPUs on node {{ "{{ $labels.node }}" }} are no longer offered
          description: Check the node's Events and the plugin log for Xid errors or lost GPUs.
      - alert: FlexgpuClaimPendingTooLong
        expr: max(flexgpu_claims_pending_oldest_seconds) > {{ $rule.pendingClaimSeconds }}
        labels: {severity: warning}
        annotations:
          summary: A GPU claim has been pending for more than {{ $rule.pendingClaimSeconds }} s
          description: Run `flexgpu explain <namespace>/<pod>`, or read the pod's GpuClaimUnsatisfiable Event.
      - alert: FlexgpuPoolNearlyExhausted
        expr: >-
          sum by (type, product) (flexgpu_devices_free) /
          sum by (type, product) (flexgpu_devices_published) < {{ $rule.poolFreeRatio }}
        for: 30m
        labels: {severity: info}
        annotations:
          summary: Few {{ "{{ $labels.product }}" }} {{ "{{ $labels.type }}" }} devices are free
          description: Less than {{ mulf $rule.poolFreeRatio 100 }}% of the pool is free.
      - alert: FlexgpuPreparesFailing
        expr: sum by (node, reason) (rate(flexgpu_plugin_prepare_errors_total[10m])) > 0
        for: 15m
        labels: {severity: warning}
        annotations:
          summary: Claims fail to prepare on node {{ "{{ $labels.node }}" }} ({{ "{{ $labels.reason }}" }})
          description: The pods' Events and the plugin log name the claim and the cause.
      - alert: FlexgpuSlicePublishingFailing
        expr: sum by (node) (rate(flexgpu_plugin_slice_publish_failures_total[10m])) > 0
        for: 15m
        labels: {severity: warning}
        annotations:
          summary: Node {{ "{{ $labels.node }}" }} cannot publish its GPUs
          description: The scheduler sees stale devices there; read the plugin log.
      {{- if $idle.enabled }}
      - alert: FlexgpuClaimIdle
        # A claim is idle when every device it holds stays below the threshold for the whole
        # window (max across its devices and across plugin pods).
        expr: >-
          max by (namespace, claim) (flexgpu_claim_sm_utilization_ratio) < {{ $idle.utilizationThreshold }}
        for: {{ $idle.window }}
        labels: {severity: info}
        annotations:
          summary: Claim {{ "{{ $labels.namespace }}/{{ $labels.claim }}" }} holds GPUs it does not use
          description: >-
            Its devices stayed below {{ mulf $idle.utilizationThreshold 100 }}% SM utilisation for
            {{ $idle.window }}. `flexgpu usage -n {{ "{{ $labels.namespace }}" }} -o wide` shows what it holds.
      {{- end }}
{{- end -}}
