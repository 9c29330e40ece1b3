{{/* The release's base name: the release name, with the chart's name added when it lacks it. */}}
{{- define "gpu-ckpt.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The node installer's objects: DaemonSet, ServiceAccount, ClusterRole(Binding). */}}
{{- define "gpu-ckpt.installerName" -}}
{{- printf "%s-node-installer" (include "gpu-ckpt.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpu-ckpt.serviceAccountName" -}}
{{- default (include "gpu-ckpt.installerName" .) .Values.nodeInstaller.serviceAccount.name -}}
{{- end -}}

{{- define "gpu-ckpt.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "gpu-ckpt.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "gpu-ckpt.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gpu-ckpt
{{- end -}}

{{- define "gpu-ckpt.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/*
The installer's arguments after its action, one per line of a YAML list (gpu-ckpt-node-installer
install|uninstall; runtime-class/installer/). $(NODE_NAME) is expanded by the kubelet.
*/}}
{{- define "gpu-ckpt.installerArgs" -}}
- --root
- {{ .Values.paths.hostRoot | quote }}
- --containerd-config
- {{ .Values.paths.containerdConfig | quote }}
- --dropin-dir
- {{ .Values.paths.dropinDir | quote }}
- --bin-dir
- {{ .Values.paths.binDir | quote }}
- --lib-dir
- {{ .Values.paths.libDir | quote }}
- --payload
- {{ .Values.nodeInstaller.payloadDir | quote }}
{{- with .Values.nodeInstaller.restartCommand }}
- --restart-command
- {{ . | quote }}
{{- end }}
{{- if .Values.nodeInstaller.labelNode }}
- --label-node
- $(NODE_NAME)
{{- end }}
- --driver-root
- {{ .Values.nodeInstaller.driverRoot | quote }}
- --ready-file
- {{ .Values.nodeInstaller.readyFile | quote }}
{{- if and (eq .Values.nodeInstaller.action "install") .Values.nodeInstaller.uninstallOnStop }}
- --daemonset
- {{ printf "%s/%s" .Release.Namespace (include "gpu-ckpt.installerName" .) | quote }}
{{- end }}
{{- end -}}

{{/* The prefix of every node label the installer sets (values.yaml lists them): under
node-restriction.kubernetes.io/, which a kubelet may not set on its own Node. */}}
{{- define "gpu-ckpt.nodeLabelPrefix" -}}
node-restriction.kubernetes.io/gpu-ckpt-
{{- end -}}
