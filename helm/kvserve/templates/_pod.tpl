{{- /*
The pod template of a kvserve server (dict "root" . "role" ROLE): "server" (a Deployment's pod:
one node, every rank of --tensor-parallel-size on it), or on tensorParallel.nodes > 1 a
LeaderWorkerSet's "leader" (node 0: serves HTTP) or "worker" (nodes 1..: its ranks follow the
leader's; no HTTP, no probes).
*/}}
{{- define "kvserve.podTemplate" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $metrics := include "kvserve.metricsPortEnabled" $root }}
{{- $apiKeySecret := include "kvserve.apiKeySecretName" $root }}
{{- $kvDisk := $root.Values.kvTiers.disk }}
{{- $lora := $root.Values.lora }}
{{- $loraOn := or $lora.adapters $lora.enableLoading }}
{{- $tp := $root.Values.tensorParallel }}
{{- $nodes := int $tp.nodes }}
metadata:
  {{- $annotations := deepCopy $root.Values.podAnnotations }}
  {{- if and $apiKeySecret (not $root.Values.apiKey.existingSecret) }}
  {{- /* Roll the pods when the chart-made keys change (the file is read at start). */}}
  {{- $_ := set $annotations "checksum/api-keys" (include (print $root.Template.BasePath "/secret.yaml") $root | sha256sum) }}
  {{- end }}
  {{- with $annotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  labels:
    {{- include "kvserve.labels" $root | nindent 4 }}
    {{- with $root.Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "kvserve.serviceAccountName" $root }}
  automountServiceAccountToken: {{ $root.Values.serviceAccount.automountServiceAccountToken }}
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $root.Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with $root.Values.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  # Longer than preStop + KVSERVE_SHUTDOWN_GRACE_S (+ the disk tier's session writes):
  # in-flight requests drain, and sessions are written, before SIGKILL.
  terminationGracePeriodSeconds: {{ include "kvserve.terminationGracePeriodSeconds" $root }}
  securityContext:
    {{- toYaml $root.Values.podSecurityContext | nindent 4 }}
  {{- if $root.Values.cache.seedFromImage }}
  initContainers:
    # Copies the model converted at image build time into the cache volume (files already
    # there are kept), so the server starts without converting it again.
    - name: seed-cache
      image: {{ include "kvserve.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      command:
        - python
        - -c
        - |
          import os, shutil, sys
          src, dst = sys.argv[1], sys.argv[2]
          for root, _, files in os.walk(src):
              out = os.path.join(dst, os.path.relpath(root, src))
              os.makedirs(out, exist_ok=True)
              for name in files:
                  target = os.path.join(out, name)
                  if not os.path.exists(target):
                      shutil.copy2(os.path.join(root, name), target + ".part")
                      os.replace(target + ".part", target)
        - {{ $root.Values.cache.imageCacheDir }}
        - /seed
      securityContext:
        {{- toYaml $root.Values.securityContext | nindent 8 }}
      resources:
        requests:
          cpu: 100m
          memory: 128Mi
        limits:
          memory: 512Mi
      volumeMounts:
        - name: cache
          mountPath: /seed
        - name: tmp
          mountPath: /tmp
  {{- end }}
  containers:
    - name: kvserve
      image: {{ include "kvserve.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      {{- if eq $role "server" }}
      args: [serve]
      {{- else }}
      # LeaderWorkerSet sets both: the leader's address and this pod's index in its group
      args: [serve, --master-addr, "$(LWS_LEADER_ADDRESS)", --node-rank, "$(LWS_WORKER_INDEX)"]
      {{- end }}
      env:
        - name: KVSERVE_HOST
          value: 0.0.0.0
        - name: KVSERVE_PORT
          value: {{ $root.Values.service.port | quote }}
        - name: KVSERVE_CACHE_DIR
          value: {{ $root.Values.cache.mountPath | quote }}
        - name: KVSERVE_DTYPE
          value: {{ $root.Values.kvserve.dtype | quote }}
        - name: KVSERVE_DEVICE
          value: {{ $root.Values.kvserve.device | quote }}
        - name: KVSERVE_LOG_LEVEL
          value: {{ $root.Values.kvserve.logLevel | quote }}
        - name: KVSERVE_SHUTDOWN_GRACE_S
          value: {{ $root.Values.kvserve.shutdownGraceSeconds | quote }}
        {{- if gt (int $tp.size) 1 }}
        - name: KVSERVE_TENSOR_PARALLEL_SIZE
          value: {{ $tp.size | quote }}
        - name: KVSERVE_TENSOR_PARALLEL_TIMEOUT_S
          value: {{ $tp.timeoutSeconds | quote }}
        {{- end }}
        {{- if gt $nodes 1 }}
        - name: KVSERVE_NNODES
          value: {{ $nodes | quote }}
        - name: KVSERVE_MASTER_PORT
          value: {{ $tp.port | quote }}
        {{- end }}
        {{- with $root.Values.kvserve.model }}
        - name: KVSERVE_MODEL
          value: {{ . | quote }}
        {{- end }}
        {{- with $root.Values.kvserve.servedModelName }}
        - name: KVSERVE_SERVED_MODEL_NAME
          value: {{ . | quote }}
        {{- end }}
        {{- if $metrics }}
        - name: KVSERVE_METRICS_PORT
          value: {{ $root.Values.kvserve.metricsPort | quote }}
        {{- end }}
        {{- if ne $root.Values.kvserve.kvCacheDtype "auto" }}
        - name: KVSERVE_KV_CACHE_DTYPE
          value: {{ $root.Values.kvserve.kvCacheDtype | quote }}
        {{- end }}
        - name: KVSERVE_GPU_MEMORY_UTILIZATION
          value: {{ $root.Values.kvserve.gpuMemoryUtilization | quote }}
        {{- if not (kindIs "invalid" $root.Values.kvserve.kvBudgetBytes) }}
        - name: KVSERVE_KV_BUDGET_BYTES
          value: {{ int64 $root.Values.kvserve.kvBudgetBytes | quote }}
        {{- end }}
        {{- if not (kindIs "invalid" $root.Values.kvserve.maxModelLen) }}
        - name: KVSERVE_MAX_MODEL_LEN
          value: {{ int64 $root.Values.kvserve.maxModelLen | quote }}
        {{- end }}
        {{- if $root.Values.kvserve.deterministic }}
        - name: KVSERVE_DETERMINISTIC
          value: "true"
        {{- end }}
        {{- with $root.Values.kvserve.allowedMediaDomains }}
        - name: KVSERVE_ALLOWED_MEDIA_DOMAINS
          value: {{ join "," . | quote }}
        {{- end }}
        {{- if gt (int64 $root.Values.kvTiers.hostBytes) 0 }}
        - name: KVSERVE_KV_HOST_BYTES
          value: {{ int64 $root.Values.kvTiers.hostBytes | quote }}
        {{- end }}
        {{- if $kvDisk.enabled }}
        - name: KVSERVE_KV_DISK_DIR
          value: {{ $kvDisk.mountPath | quote }}
        {{- if not (kindIs "invalid" $kvDisk.bytes) }}
        - name: KVSERVE_KV_DISK_BYTES
          value: {{ int64 $kvDisk.bytes | quote }}
        {{- end }}
        - name: KVSERVE_KV_PERSIST_INTERVAL_S
          value: {{ $kvDisk.persistIntervalSeconds | quote }}
        {{- end }}
        {{- if $loraOn }}
        {{- with $lora.adapters }}
        - name: KVSERVE_LORA
          value: {{ include "kvserve.loraEnv" $lora | quote }}
        {{- end }}
        {{- if $lora.enableLoading }}
        - name: KVSERVE_ENABLE_LORA_LOADING
          value: "true"
        - name: KVSERVE_LORA_DIR
          value: {{ $lora.mountPath | quote }}
        {{- end }}
        {{- if not (kindIs "invalid" $lora.maxLoras) }}
        - name: KVSERVE_MAX_LORAS
          value: {{ int64 $lora.maxLoras | quote }}
        {{- end }}
        {{- if not (kindIs "invalid" $lora.maxCpuLoras) }}
        - name: KVSERVE_MAX_CPU_LORAS
          value: {{ int64 $lora.maxCpuLoras | quote }}
        {{- end }}
        {{- if not (kindIs "invalid" $lora.maxRank) }}
        - name: KVSERVE_MAX_LORA_RANK
          value: {{ int64 $lora.maxRank | quote }}
        {{- end }}
        {{- end }}
        {{- if $apiKeySecret }}
        - name: KVSERVE_API_KEY_FILE
          value: {{ printf "%s/%s" $root.Values.apiKey.mountPath $root.Values.apiKey.secretKey | quote }}
        {{- end }}
        - name: HF_HOME
          value: {{ printf "%s/huggingface" $root.Values.models.mountPath | quote }}
        - name: HOME
          value: /tmp
        {{- range $name, $value := $root.Values.env }}
        - name: {{ $name }}
          value: {{ $value | quote }}
        {{- end }}
        {{- with $root.Values.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- if ne $role "worker" }}
      ports:
        - name: http
          containerPort: {{ $root.Values.service.port }}
          protocol: TCP
        {{- if $metrics }}
        - name: metrics
          containerPort: {{ $root.Values.kvserve.metricsPort }}
          protocol: TCP
        {{- end }}
      startupProbe:
        httpGet:
          path: {{ $root.Values.probes.startup.path }}
          port: http
        periodSeconds: {{ $root.Values.probes.startup.periodSeconds }}
        timeoutSeconds: {{ $root.Values.probes.startup.timeoutSeconds }}
        failureThreshold: {{ $root.Values.probes.startup.failureThreshold }}
      livenessProbe:
        httpGet:
          path: {{ $root.Values.probes.liveness.path }}
          port: http
        periodSeconds: {{ $root.Values.probes.liveness.periodSeconds }}
        timeoutSeconds: {{ $root.Values.probes.liveness.timeoutSeconds }}
        failureThreshold: {{ $root.Values.probes.liveness.failureThreshold }}
      readinessProbe:
        httpGet:
          path: {{ $root.Values.probes.readiness.path }}
          port: http
        periodSeconds: {{ $root.Values.probes.readiness.periodSeconds }}
        timeoutSeconds: {{ $root.Values.probes.readiness.timeoutSeconds }}
        failureThreshold: {{ $root.Values.probes.readiness.failureThreshold }}
      {{- end }}
      lifecycle:
        preStop:
          # Endpoints and ingresses drop a terminating pod asynchronously: keep serving
          # a few seconds before SIGTERM starts the drain.
          exec:
            command: ["sleep", "{{ $root.Values.lifecycle.preStopSleepSeconds }}"]
      securityContext:
        {{- toYaml $root.Values.securityContext | nindent 8 }}
      resources:
        {{- $resources := deepCopy (default dict $root.Values.resources) }}
        {{- if $root.Values.gpu.enabled }}
        {{- $limits := default dict $resources.limits }}
        {{- $gpus := gt (int $tp.size) 1 | ternary (div (int $tp.size) $nodes) (int $root.Values.gpu.count) }}
        {{- $_ := set $limits $root.Values.gpu.resourceName $gpus }}
        {{- $_ := set $resources "limits" $limits }}
        {{- end }}
        {{- toYaml $resources | nindent 8 }}
      volumeMounts:
        - name: cache
          mountPath: {{ $root.Values.cache.mountPath }}
        - name: models
          mountPath: {{ $root.Values.models.mountPath }}
          {{- if $root.Values.models.readOnly }}
          readOnly: true
          {{- end }}
        - name: tmp
          mountPath: /tmp
        {{- if gt (int $tp.size) 1 }}
        - name: dshm
          mountPath: /dev/shm
        {{- end }}
        {{- if $kvDisk.enabled }}
        - name: kv-sessions
          mountPath: {{ $kvDisk.mountPath }}
        {{- end }}
        {{- if and $loraOn $lora.volume }}
        - name: lora-adapters
          mountPath: {{ $lora.mountPath }}
          readOnly: true
        {{- end }}
        {{- if $apiKeySecret }}
        - name: api-keys
          mountPath: {{ $root.Values.apiKey.mountPath }}
          readOnly: true
        {{- end }}
  volumes:
    - name: cache
      {{- include "kvserve.volumeSource" (dict "root" $root "name" "cache" "spec" $root.Values.cache) | trim | nindent 6 }}
    - name: models
      {{- include "kvserve.volumeSource" (dict "root" $root "name" "models" "spec" $root.Values.models "readOnly" $root.Values.models.readOnly) | trim | nindent 6 }}
    - name: tmp
      emptyDir:
        sizeLimit: {{ $root.Values.tmp.sizeLimit }}
    {{- if gt (int $tp.size) 1 }}
    # NCCL's shared memory between the ranks of a node (a container's /dev/shm is 64 MiB)
    - name: dshm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $tp.shmSize }}
    {{- end }}
    {{- if $kvDisk.enabled }}
    - name: kv-sessions
      {{- include "kvserve.volumeSource" (dict "root" $root "name" "kv-sessions" "spec" $kvDisk) | trim | nindent 6 }}
    {{- end }}
    {{- if and $loraOn $lora.volume }}
    - name: lora-adapters
      {{- toYaml $lora.volume | nindent 6 }}
    {{- end }}
    {{- if $apiKeySecret }}
    - name: api-keys
      secret:
        secretName: {{ $apiKeySecret }}
        items:
          - key: {{ $root.Values.apiKey.secretKey }}
            path: {{ $root.Values.apiKey.secretKey }}
        # 0440: readable by the pod's fsGroup (the server's group), by no one else.
        defaultMode: 288
    {{- end }}
  {{- with $root.Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $root.Values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $root.Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $root.Values.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
