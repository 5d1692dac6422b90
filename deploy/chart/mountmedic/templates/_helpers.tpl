{{/* Hand-written; the other files in templates/ but NOTES.txt and
servicemonitor.yaml are generated from deploy/. */}}

{{/* The app.kubernetes.io/name label's value (the agents' and the
controller's selectors, the scrape job): nameOverride, else the chart's
name. */}}
{{- define "mountmedic.name" -}}
{{- .Values.nameOverride | default .Chart.Name -}}
{{- end }}

{{/* The install's name, which every object's name starts with (the
ServiceAccounts the admission policies match among them):
fullnameOverride, else the name. The release's name is not part of it, so
that installing under another release name renames nothing. */}}
{{- define "mountmedic.fullname" -}}
{{- .Values.fullnameOverride | default (include "mountmedic.name" .) -}}
{{- end }}

{{- define "mountmedic.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* The labels Helm users expect on every object, beyond the base's. */}}
{{- define "mountmedic.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service | quote }}
app.kubernetes.io/instance: {{ .Release.Name | quote }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
{{- end }}

{{- define "mountmedic.monitorLabels" -}}
{{- with .Values.prometheus.additionalLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The selected profile's layout (templates/_profiles.tpl). */}}
{{- define "mountmedic.profile" -}}
{{- $all := include "mountmedic.profiles" . | fromYaml -}}
{{- if not (hasKey $all .Values.profile) -}}
{{- fail (printf "profile %q: want one of %s (deploy/profiles/README.md)" .Values.profile (keys $all | sortAlpha | join ", ")) -}}
{{- end -}}
{{- index $all .Values.profile | toYaml -}}
{{- end }}

{{/* The agent's --identity: the value's, else the profile's. */}}
{{- define "mountmedic.identity" -}}
{{- $p := include "mountmedic.profile" . | fromYaml -}}
{{- .Values.identity | default $p.identity -}}
{{- end }}

{{- define "mountmedic.kubeletRoot" -}}
{{- $p := include "mountmedic.profile" . | fromYaml -}}
{{- .Values.kubelet.root | default $p.kubeletRoot | trimSuffix "/" -}}
{{- end }}

{{- define "mountmedic.kubeletKubeconfig" -}}
{{- $p := include "mountmedic.profile" . | fromYaml -}}
{{- .Values.kubelet.kubeconfig | default $p.kubeletKubeconfig -}}
{{- end }}

{{- define "mountmedic.criSocket" -}}
{{- $p := include "mountmedic.profile" . | fromYaml -}}
{{- .Values.criSocket | default $p.criSocket -}}
{{- end }}

{{- define "mountmedic.criSocketDir" -}}
{{- include "mountmedic.criSocket" . | trimPrefix "unix://" | dir -}}
{{- end }}

{{/* The credentials directories, one a line (none with the
ServiceAccount identity: the agent then reads no kubelet credentials). */}}
{{- define "mountmedic.credentialDirs" -}}
{{- if ne (include "mountmedic.identity" .) "serviceaccount" -}}
{{- $p := include "mountmedic.profile" . | fromYaml -}}
{{- $dirs := $p.credentialDirs -}}
{{- if not (kindIs "invalid" .Values.kubelet.credentialDirs) }}{{ $dirs = .Values.kubelet.credentialDirs }}{{ end -}}
{{- range $dirs }}
{{ trimSuffix "/" . }}
{{- end }}
{{- end -}}
{{- end }}

{{- define "mountmedic.hostNetwork" -}}
{{- $p := include "mountmedic.profile" . | fromYaml -}}
{{- if kindIs "invalid" .Values.kubelet.hostNetwork }}{{ $p.hostNetwork }}{{ else }}{{ .Values.kubelet.hostNetwork }}{{ end -}}
{{- end }}

{{/* Whether the kubeconfig needs a mount of its own: not when it lies
under the kubelet root (a file bind inside that Bidirectional mount would
reach the host) or under a credentials directory. */}}
{{- define "mountmedic.kubeconfigMounted" -}}
{{- if ne (include "mountmedic.identity" .) "serviceaccount" -}}
{{- $kc := include "mountmedic.kubeletKubeconfig" . -}}
{{- $covered := hasPrefix (printf "%s/" (include "mountmedic.kubeletRoot" .)) $kc -}}
{{- range splitList "\n" (include "mountmedic.credentialDirs" .) }}
{{- if and . (hasPrefix (printf "%s/" .) $kc) }}{{ $covered = true }}{{ end }}
{{- end -}}
{{- if not $covered }}true{{ end -}}
{{- end -}}
{{- end }}

{{/* The identity's flag: the kubelet's kubeconfig, or the
ServiceAccount. */}}
{{- define "mountmedic.argNodeKubeconfig" -}}
{{- if eq (include "mountmedic.identity" .) "serviceaccount" -}}
--identity=serviceaccount
{{- else -}}
--node-kubeconfig={{ include "mountmedic.kubeletKubeconfig" . }}
{{- end -}}
{{- end }}
{{- define "mountmedic.argKubeletRoot" -}}
--kubelet-root={{ include "mountmedic.kubeletRoot" . }}
{{- end }}
{{- define "mountmedic.argCRISocket" -}}
--cri-socket={{ include "mountmedic.criSocket" . }}
{{- end }}

{{- define "mountmedic.agentVolumes" -}}
{{- if include "mountmedic.kubeconfigMounted" . }}
- name: kubelet-kubeconfig
  hostPath:
    path: {{ include "mountmedic.kubeletKubeconfig" . | quote }}
    type: File
{{- end }}
{{- range $i, $d := splitList "\n" (include "mountmedic.credentialDirs" .) | compact }}
- name: kubelet-credentials-{{ $i }}
  hostPath:
    path: {{ $d | quote }}
    type: Directory
{{- end }}
{{- with .Values.agent.extraVolumes }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "mountmedic.agentVolumeMounts" -}}
{{- if include "mountmedic.kubeconfigMounted" . }}
- name: kubelet-kubeconfig
  mountPath: {{ include "mountmedic.kubeletKubeconfig" . | quote }}
  readOnly: true
{{- end }}
{{- range $i, $d := splitList "\n" (include "mountmedic.credentialDirs" .) | compact }}
- name: kubelet-credentials-{{ $i }}
  mountPath: {{ $d | quote }}
  readOnly: true
{{- end }}
{{- with .Values.agent.extraVolumeMounts }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "mountmedic.agentEnv" -}}
{{- with .Values.agent.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Pod spec fields beyond the base's: host network, pull secrets,
affinity. */}}
{{- define "mountmedic.agentPodSpec" -}}
{{- if eq (include "mountmedic.hostNetwork" .) "true" }}
hostNetwork: true
dnsPolicy: ClusterFirstWithHostNet
{{- end }}
{{- include "mountmedic.pullSecrets" . }}
{{- with .Values.agent.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "mountmedic.controllerPodSpec" -}}
{{- include "mountmedic.pullSecrets" . }}
{{- end }}

{{- define "mountmedic.pullSecrets" -}}
{{- with .Values.image.pullSecrets }}
imagePullSecrets:
{{- range . }}
  - name: {{ . | quote }}
{{- end }}
{{- end }}
{{- end }}

{{- define "mountmedic.podAnnotations" -}}
{{- with .Values.agent.podAnnotations }}
annotations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "mountmedic.podLabels" -}}
{{- with .Values.agent.podLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Values that contradict each other fail the render, naming the fix. */}}
{{- define "mountmedic.validate" -}}
{{- if and .Values.controller.enabled (not .Values.failover.enabled) -}}
{{- fail "controller.enabled=true needs failover.enabled=true: the controller confirms a node dead only from the agents' heartbeats, so without them it would never act (deploy/README.md, \"Failover (opt-in)\")" -}}
{{- end -}}
{{- if not (has (include "mountmedic.identity" .) (list "node" "serviceaccount")) -}}
{{- fail (printf "identity %q: want node (the kubelet's credentials) or serviceaccount (the agent's own, node-bound; docs/security.md)" (include "mountmedic.identity" .)) -}}
{{- end -}}
{{- if and (eq (include "mountmedic.identity" .) "serviceaccount") (or .Values.kubelet.kubeconfig .Values.kubelet.credentialDirs) -}}
{{- fail "identity=serviceaccount reads no kubelet credentials: unset kubelet.kubeconfig and kubelet.credentialDirs, or choose identity=node" -}}
{{- end -}}
{{- $owned := dict "identity" "identity" "node-kubeconfig" "kubelet.kubeconfig" "kubelet-root" "kubelet.root" "cri-socket" "criSocket" "tiers" "agent.tiers" "drivers" "agent.drivers" "include-namespaces" "agent.includeNamespaces" "exclude-namespaces" "agent.excludeNamespaces" "dry-run" "agent.dryRun" "failover" "failover.enabled" "service-account-name" "fullnameOverride" "host-table" "" "metrics-addr" "" "failover-peer-key-file" "" "node-name" "" -}}
{{- range .Values.agent.extraArgs -}}
{{- $flag := regexReplaceAll "^--?([^=]+).*$" (toString .) "${1}" -}}
{{- if hasKey $owned $flag -}}
{{- $v := get $owned $flag -}}
{{- if $v -}}
{{- fail (printf "agent.extraArgs has %s: the chart sets --%s from the value %s (the profile's by default); set that value instead of a second flag" . $flag $v) -}}
{{- else -}}
{{- fail (printf "agent.extraArgs has %s: the chart sets --%s itself (the DaemonSet's mounts and ports depend on it)" . $flag $flag) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and .Values.prometheus.serviceMonitor.enabled (not .Values.prometheus.enabled) -}}
{{- fail "prometheus.serviceMonitor.enabled=true needs prometheus.enabled=true (the Prometheus Operator's CRDs and the rules come with it)" -}}
{{- end -}}
{{- end }}

{{/*
The agent's flags that the values add to the DaemonSet's own (the base's
args come first, so that the default render is the base).
*/}}
{{- define "mountmedic.agentArgs" -}}
{{- include "mountmedic.validate" . }}
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
{{- if ne (include "mountmedic.fullname" .) .Chart.Name }}
- --service-account-name={{ include "mountmedic.fullname" . }}
{{- end }}
{{- range .Values.agent.extraArgs }}
- {{ . }}
{{- end }}
{{- end }}

{{/* The controller's flags that the values add to the Deployment's own. */}}
{{- define "mountmedic.controllerArgs" -}}
{{- if ne (include "mountmedic.fullname" .) .Chart.Name }}
- --failover-leader-lease={{ include "mountmedic.fullname" . }}-failover-leader
- --service-account-name={{ include "mountmedic.fullname" . }}-controller
{{- end }}
{{- range .Values.controller.extraArgs }}
- {{ . }}
{{- end }}
{{- end }}
