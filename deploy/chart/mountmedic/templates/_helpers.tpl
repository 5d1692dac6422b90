{{/* Hand-written; every other file in templates/ is generated. */}}

{{- define "mountmedic.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag }}
{{- end }}

{{/*
The agent's flags that the values add to the DaemonSet's own (the base's
args come first, unchanged, so that the default render is the base).
*/}}
{{- define "mountmedic.agentArgs" -}}
{{- with .Values.agent.tiers }}
- --tiers={{ join "," . }}
{{- end }}
{{- with .Values.agent.drivers }}
- --drivers={{ join "," . }}
{{- end }}
{{- with .Values.agent.includeNamespaces }}
- --include-namespaces={{ join "," . }}
{{- end }}
{{- with .Values.agent.excludeNamespaces }}
- --exclude-namespaces={{ join "," . }}
{{- end }}
{{- if .Values.agent.dryRun }}
- --dry-run=true
{{- end }}
{{- if .Values.failover.enabled }}
- --failover=true
{{- end }}
{{- range .Values.agent.extraArgs }}
- {{ . }}
{{- end }}
{{- end }}

{{/* The controller's flags that the values add to the Deployment's own. */}}
{{- define "mountmedic.controllerArgs" -}}
{{- range .Values.controller.extraArgs }}
- {{ . }}
{{- end }}
{{- end }}
