{{/* The name every object of the release starts with. */}}
{{- define "moorage.fullname" -}}
{{- printf "%s" .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "moorage.labels" -}}
app.kubernetes.io/name: moorage
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* image: (dict "root" . "name" "provisioner") */}}
{{- define "moorage.image" -}}
{{- $i := index .root.Values.images .name -}}
{{- printf "%s:%s" $i.repository $i.tag -}}
{{- end -}}

{{- define "moorage.tokenSecret" -}}
{{- if .Values.backendToken.create -}}
{{ include "moorage.fullname" . }}-backend-token
{{- else -}}
{{ .Values.backendToken.existingSecret }}
{{- end -}}
{{- end -}}

{{- define "moorage.pluginDir" -}}
{{ .Values.kubeletDir }}/plugins/csi.moorage.dev
{{- end -}}

{{- define "moorage.metricsAnnotations" -}}
{{- if .root.Values.metrics.annotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}
