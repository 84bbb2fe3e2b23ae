{{/* Names: <release>-pagedweight-<role>, cut to the 63 characters of a DNS label. */}}
{{- define "pagedweight.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pagedweight.name" -}}
{{- printf "%s-%s" (include "pagedweight.fullname" .root) .role | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pagedweight.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/part-of: pagedweight
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{/* Selector labels of one role: {root, role}. */}}
{{- define "pagedweight.selector" -}}
app.kubernetes.io/name: pagedweight
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{/* image: {root, image: {repository, tag, pullPolicy}} */}}
{{- define "pagedweight.image" -}}
{{- printf "%s:%s" .image.repository (.image.tag | default .root.Chart.AppVersion) -}}
{{- end -}}

{{/* The Redis URL the gateway uses: the external one, or the bundled StatefulSet's. */}}
{{- define "pagedweight.redisURL" -}}
{{- if .Values.redis.url -}}
{{- .Values.redis.url -}}
{{- else -}}
{{- printf "redis://%s:6379/0" (include "pagedweight.name" (dict "root" . "role" "redis")) -}}
{{- end -}}
{{- end -}}

{{- define "pagedweight.apiKeySecret" -}}
{{- .Values.apiKey.existingSecret | default (include "pagedweight.name" (dict "root" . "role" "api-key")) -}}
{{- end -}}

{{/* Kubernetes waits this long after SIGTERM: the preStop sleep, the drain, and a margin. */}}
{{- define "pagedweight.gracePeriod" -}}
{{- add .preStopSleepSeconds .shutdownTimeoutSeconds 15 -}}
{{- end -}}

{{- define "pagedweight.preStop" -}}
preStop:
  exec:
    # endpoints stop sending new requests before the process starts draining
    command: ["sleep", "{{ .preStopSleepSeconds }}"]
{{- end -}}

{{/* The worker role of one model: {root, model}. Lowercased, so it is a DNS label. */}}
{{- define "pagedweight.workerRole" -}}
{{- printf "worker-%s" (.model.name | lower | replace "." "-" | replace "_" "-") -}}
{{- end -}}

{{- define "pagedweight.rpcSecret" -}}
{{- .Values.rpcAuth.existingSecret | default (include "pagedweight.name" (dict "root" . "role" "rpc-token")) -}}
{{- end -}}

{{/* The internal RPC token and this pod's IP (the worker and planner listen on it only). */}}
{{- define "pagedweight.rpcEnv" -}}
- name: PAGEDWEIGHT_RPC_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "pagedweight.rpcSecret" . }}
      key: {{ .Values.rpcAuth.secretKey }}
- name: POD_IP
  valueFrom:
    fieldRef: {fieldPath: status.podIP}
{{- end -}}

{{/* TLS flags of the internal RPC when rpcAuth.tlsSecret is set (mounted at /etc/pagedweight/rpc-tls). */}}
{{- define "pagedweight.rpcTLSArgs" -}}
{{- if .Values.rpcAuth.tlsSecret }}
- --rpc-tls-cert=/etc/pagedweight/rpc-tls/tls.crt
- --rpc-tls-key=/etc/pagedweight/rpc-tls/tls.key
- --rpc-tls-ca=/etc/pagedweight/rpc-tls/ca.crt
{{- end }}
{{- end -}}


{{/* One modelSpec entry with servingEngineSpec.modelDefaults under it: {root, model}. */}}
{{- define "pagedweight.model" -}}
{{- /* `set`, not sprig's merge: merge treats a given 0 or "" (requestGPU: 0) as unset */}}
{{- $model := deepCopy .root.Values.servingEngineSpec.modelDefaults }}
{{- range $key, $value := .model }}
{{- $_ := set $model $key $value }}
{{- end }}
{{- toYaml $model -}}
{{- end -}}

{{/* Pod annotations that let a Prometheus without the Operator scrape /metrics: {root, port}. */}}
{{- define "pagedweight.scrapeAnnotations" -}}
{{- if .root.Values.metrics.scrapeAnnotations -}}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end -}}
{{- end -}}
