{{/*
Names and labels, in the prometheus-community charts' shape.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "pdserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
The full name: fullnameOverride, else the release name when it already contains the chart name, else
<release>-<chart>. Truncated to 63 characters (a DNS label).
*/}}
{{- define "pdserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* chart-version, for the helm.sh/chart label (never in a selector: it changes with every chart release). */}}
{{- define "pdserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Labels of every object. `app.kubernetes.io/managed-by` is Helm's, never `pdserve-operator`: the operator watches
objects carrying that value as its children.
*/}}
{{- define "pdserve.labels" -}}
helm.sh/chart: {{ include "pdserve.chart" . }}
{{ include "pdserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pdserve
{{- end -}}

{{/*
Selector labels: stable for the release's lifetime. The component keeps the operator's selector from matching a
PDService's router or engine pods (they carry app.kubernetes.io/name=pdserve too, with component router, prefill
or decode).
*/}}
{{- define "pdserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The operator's ServiceAccount name. */}}
{{- define "pdserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "pdserve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The image reference: repository@digest, or repository:tag (default: the chart's appVersion). */}}
{{- define "pdserve.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/* The leader-election Lease name. */}}
{{- define "pdserve.leaseName" -}}
{{- default (include "pdserve.fullname" .) .Values.operator.leaderElection.leaseName -}}
{{- end -}}

{{/* The operator's API access (files/operator-rbac.yaml), parsed once per use. */}}
{{- define "pdserve.rbacRules" -}}
{{- .Files.Get "files/operator-rbac.yaml" -}}
{{- end -}}

{{/*
Checks of values that the schema cannot express. Included by the Deployment, so a failing check fails every
render (`helm template`, `helm install`, Argo CD, Flux) before anything is applied.
*/}}
{{- define "pdserve.validate" -}}
{{- if eq .Values.watch.mode "namespaced" -}}
{{- if not .Values.watch.namespaces -}}
{{- fail "watch.mode=namespaced needs at least one namespace in watch.namespaces" -}}
{{- end -}}
{{- if ne (len .Values.watch.namespaces) (len (uniq .Values.watch.namespaces)) -}}
{{- fail (printf "watch.namespaces lists a namespace twice: %v" .Values.watch.namespaces) -}}
{{- end -}}
{{- end -}}
{{- if and (gt (int .Values.operator.replicas) 1) (not .Values.operator.leaderElection.enabled) -}}
{{- fail (printf "operator.replicas=%d needs operator.leaderElection.enabled: without a leader every replica would act" (int .Values.operator.replicas)) -}}
{{- end -}}
{{- $election := .Values.operator.leaderElection -}}
{{- if ge (float64 $election.renewDeadlineSeconds) (float64 $election.leaseSeconds) -}}
{{- fail "operator.leaderElection.renewDeadlineSeconds must be shorter than leaseSeconds" -}}
{{- end -}}
{{- include "pdserve.validateScalers" . -}}
{{- end -}}

{{/*
One owner per pool: an HPA/KEDA object from `scalers` must not share a pool with another entry. pdserve's SLO
autoscaler (operator.prometheusUrl) runs beside them: it scales only pools with spec.<pool>.autoscaling.mode
pdserve (the default), and a pool given to a scaler here sets mode external, which makes pdserve leave its
replicas alone (neither scaling nor clamping them). That lives in the PDService, which the chart does not render,
so NOTES.txt reminds of it rather than a check here.
*/}}
{{- define "pdserve.validateScalers" -}}
{{- $seen := dict -}}
{{- range $index, $scaler := .Values.scalers -}}
{{- $pool := printf "%s/%s/%s" $scaler.namespace $scaler.pdservice $scaler.pool -}}
{{- $here := printf "scalers[%d] (%s)" $index $scaler.kind -}}
{{- if hasKey $seen $pool -}}
{{- fail (printf "pool %s would have two owners: %s and %s; give each pool one scaler" $pool (get $seen $pool) $here) -}}
{{- end -}}
{{- $_ := set $seen $pool $here -}}
{{- if and (eq $.Values.watch.mode "namespaced") (not (has $scaler.namespace $.Values.watch.namespaces)) -}}
{{- fail (printf "%s targets namespace %s, which this operator does not watch (watch.namespaces: %v)" $here $scaler.namespace $.Values.watch.namespaces) -}}
{{- end -}}
{{- if gt (int $scaler.minReplicas) (int $scaler.maxReplicas) -}}
{{- fail (printf "%s: minReplicas %d is greater than maxReplicas %d" $here (int $scaler.minReplicas) (int $scaler.maxReplicas)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
