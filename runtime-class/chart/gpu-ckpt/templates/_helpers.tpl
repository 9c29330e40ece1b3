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
- --min-restart-interval-seconds
- {{ .Values.nodeInstaller.minRestartIntervalSeconds | int | quote }}
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

{{/*
The site's options (trust, restore sources, registry, runc, handler options) as the installer's
arguments, one per line of a YAML list, after gpu-ckpt.installerArgs. Files come from the
volumes gpu-ckpt.siteVolumes mounts (gpu-ckpt.siteMountDir).
*/}}
{{- define "gpu-ckpt.siteMountDir" -}}
/etc/gpu-ckpt-installer
{{- end -}}

{{- define "gpu-ckpt.registryCaName" -}}
{{- printf "%s-registry-ca-%s" (include "gpu-ckpt.installerName" .) (toJson .Values.registry.caBundles | sha256sum | trunc 8) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "gpu-ckpt.siteArgs" -}}
{{- $dir := include "gpu-ckpt.siteMountDir" . -}}
{{- if eq .Values.trust.mode "cluster" }}
- --signing-key
- {{ printf "%s/cluster-key/signing.key" $dir | quote }}
{{- end }}
{{- range $name := keys .Values.trust.trustedKeys | sortAlpha }}
- --trusted-key
- {{ printf "%s=%s" $name (index $.Values.trust.trustedKeys $name) | quote }}
{{- end }}
{{- range .Values.trust.revokedKeys }}
- --revoked-key
- {{ . | quote }}
{{- end }}
{{- range .Values.restoreSources }}
- --restore-source
- {{ . | quote }}
{{- end }}
{{- if .Values.registry.authSecretName }}
- --registry-auth
- {{ printf "%s/registry-auth/config.json" $dir | quote }}
{{- end }}
{{- range $i, $host := keys .Values.registry.caBundles | sortAlpha }}
- --registry-ca
- {{ printf "%s=%s/registry-ca/ca-%d.crt" $host $dir $i | quote }}
{{- end }}
{{- with .Values.runc.path }}
- --runc-path
- {{ . | quote }}
{{- end }}
{{- if .Values.runc.systemdCgroup }}
- --runc-systemd-cgroup
{{- end }}
{{- with .Values.handlerOptions }}
- --handler-options
- {{ toJson . | quote }}
{{- end }}
{{- end -}}

{{/* The site's Secrets and CA bundles: the container's volumeMounts (siteMounts) and the pod's
volumes (siteVolumes), read-only, root-only. */}}
{{- define "gpu-ckpt.siteMounts" -}}
{{- $dir := include "gpu-ckpt.siteMountDir" . -}}
{{- if eq .Values.trust.mode "cluster" }}
- name: cluster-key
  mountPath: {{ printf "%s/cluster-key" $dir }}
  readOnly: true
{{- end }}
{{- if .Values.registry.authSecretName }}
- name: registry-auth
  mountPath: {{ printf "%s/registry-auth" $dir }}
  readOnly: true
{{- end }}
{{- if .Values.registry.caBundles }}
- name: registry-ca
  mountPath: {{ printf "%s/registry-ca" $dir }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "gpu-ckpt.siteVolumes" -}}
{{- if eq .Values.trust.mode "cluster" }}
- name: cluster-key
  secret:
    secretName: {{ .Values.trust.clusterKey.secretName }}
    defaultMode: 0400
    items:
      - key: {{ .Values.trust.clusterKey.secretKey }}
        path: signing.key
{{- end }}
{{- if .Values.registry.authSecretName }}
- name: registry-auth
  secret:
    secretName: {{ .Values.registry.authSecretName }}
    defaultMode: 0400
    items:
      - key: .dockerconfigjson
        path: config.json
{{- end }}
{{- if .Values.registry.caBundles }}
- name: registry-ca
  configMap:
    name: {{ include "gpu-ckpt.registryCaName" . }}
    defaultMode: 0444
{{- end }}
{{- end -}}

{{/* The node agent's DaemonSet and Service (templates/agent.yaml). */}}
{{- define "gpu-ckpt.agentName" -}}
{{- printf "%s-agent" (include "gpu-ckpt.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The journal the agent reads: metrics.eventsDir, else the handlers' EventsDir, else the
shim's default. */}}
{{- define "gpu-ckpt.eventsDir" -}}
{{- .Values.metrics.eventsDir | default (get .Values.handlerOptions "EventsDir") | default "/var/lib/gpu-ckpt/events" -}}
{{- end -}}

