"""The engine pools: a StatefulSet of vLLM engines, a headless Service and a PodDisruptionBudget per pool.

Why a StatefulSet: stable pod names make engine logs and metrics traceable across restarts, and the headless Service
gives each pod a stable DNS name. (The router finds engines through the per-kv-compat Services of
`render.discovery` instead, whose slices say which kv-compat value their engines carry.) Pods start in parallel
(engines do not depend on each other) and roll one at a time.

The engine command line is what vLLM 0.32 accepts (`vllm serve MODEL ...`, KNOWLEDGE.md). NIXL specifics:
- `--kv-transfer-config` names NixlConnector with `kv_producer` on prefill and `kv_consumer` on decode, and an
  `engine_id` of `$(POD_NAME)-$(POD_UID)`: unique per pod *incarnation*, so a restarted pod is never mistaken by
  decode engines for the stale peer it replaces (vLLM issue 49238). Kubernetes expands `$(VAR)` in args.
- `VLLM_NIXL_SIDE_CHANNEL_HOST` is the pod IP, the port fixed per PDService, so `remote_host:remote_port` in
  `kv_transfer_params` is reachable from any decode pod.
- UCX transports are always named explicitly (their defaults, RDMA unless `placement.rdma=off`, are in
  `pdserve.api.defaults`): a silent fallback to TCP is the most common invisible PD failure (10-40x TTFT). Users
  override them with spec.engine.ucx (env cannot: the names are owned, `pdserve.api.owned`).

KV events: with `spec.engine.kvEvents.enabled` (the default) every engine publishes its prefix cache's changes
(`--kv-events-config`, ZMQ on `kvEvents.port` and `kvEvents.replayPort`, each data-parallel rank on the port plus its
rank, as vLLM offsets them), so every router replica keeps the same per-engine prefix index
(`pdserve_runtime.router.kvhub`). The ports are named container ports, listed on the per-kv-compat Services
(`render.discovery`), where the router finds them in the slices it already watches.

Drain on termination (scale-down, rollout, eviction): nothing an engine accepted is lost. What vLLM 0.32 does on
SIGTERM, and what the pod adds around it:
- `--shutdown-timeout N` (vLLM PR #36666, `vllm/entrypoints/launcher.py` + `vllm/v1/engine/core.py`; flag listed in
  tests/api/data/vllm-0.32-serve-flags.txt): on SIGTERM the API server rejects every new request with 503 (its
  `ScalingMiddleware`, `vllm/entrypoints/serve/middleware.py`, answers 503 on every path but `/live` and
  `/metrics`, so `/health` turns 503 and readiness false) and lets in-flight requests finish for up to N s, then
  aborts what is left. vLLM's default is 0: abort everything at once, which is why pdserve always passes it.
- A prefill engine's finished requests stay in the scheduler while NIXL waits for a decode engine to read their
  blocks (`delay_free_blocks`); under a shutdown timeout the engine keeps stepping until they are read or their
  lease expires (vLLM PR #43433; the lease: `docs/design/nixl_kv_cache_lease.md`, `kv_lease_duration`, extended by
  decode heartbeats while the request waits on decode). So prefill's timeout is at least `kvLeaseSeconds`: KV it
  handed out is served until pulled or expired, never stranded by the scale-down.
- A `preStop` hook (`sleep 5`, exec form: the `sleep` action needs Kubernetes 1.30 and the chart supports 1.29)
  holds SIGTERM back while the pod's EndpointSlice entry (`ready: false`, `terminating: true`, set the moment the
  pod is deleted) reaches the router and any other load balancer; the engine keeps serving meanwhile. A request
  that still races in after SIGTERM gets vLLM's 503 before any byte, which the router retries elsewhere.
- `terminationGracePeriodSeconds` = preStop + shutdown timeout + 10 s for vLLM's own teardown, so the kubelet's
  SIGKILL never cuts a drain short (the grace period counts from deletion, preStop included). A pod exits as soon
  as its drain is done; the timeout is only the bound (`spec.engine.drainSeconds`, default 120 s).
- Liveness keeps probing `/health`, which answers 503 while draining: harmless, the kubelet stops liveness and
  startup probes of a pod being deleted and keeps only readiness.

Every value comes from the effective spec (`pdserve.api.defaults.effective`), never from `x or DEFAULT` here.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.api.defaults import EffectivePool, EffectiveSpec
from pdserve.api.kvcompat import KV_COMPAT_LABEL, kv_compat_hash
from pdserve.api.v1alpha1 import EnvVar, PDService
from pdserve_operator.names import EngineRole, child_name, labels, selector_labels
from pdserve_operator.render import discovery, kvcache, placement
from pdserve_operator.render.objects import metadata

ENGINE_CONTAINER = "vllm"
MODEL_MOUNT_ROOT = "/models"
#: A non-root engine's HOME: an emptyDir, so what vLLM, Hugging Face, Triton and Inductor keep under ~/.cache works.
NON_ROOT_HOME = "/home/vllm"
# How long SIGTERM waits for endpoint removal to propagate (the preStop hook), and what the grace period adds on top
# of the drain for vLLM's own teardown (module docstring).
PRE_STOP_SECONDS = 5
TEARDOWN_SECONDS = 10


def shutdown_timeout(spec: EffectiveSpec, role: EngineRole) -> int:
    """vLLM's --shutdown-timeout: the drain; a prefill engine's also covers the lease of KV it handed out."""
    drain = spec.engine.drain_seconds
    if role == "prefill" and drain > 0:
        return max(drain, spec.engine.kv_lease_seconds)
    return drain


def termination_grace_seconds(spec: EffectiveSpec, role: EngineRole) -> int:
    """The pod's grace period: preStop, then the whole drain, then vLLM's teardown, before any SIGKILL."""
    return PRE_STOP_SECONDS + shutdown_timeout(spec, role) + TEARDOWN_SECONDS


def _model_source(spec: EffectiveSpec) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    """The model argument for vLLM plus the volumes and mounts that make it reachable."""
    uri = spec.model.uri
    if uri.startswith("hf://"):
        return uri.removeprefix("hf://"), [], []
    if uri.startswith("pvc://"):
        claim, _, path = uri.removeprefix("pvc://").partition("/")
        mount = f"{MODEL_MOUNT_ROOT}/{claim}"
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        return (
            f"{mount}/{path}".rstrip("/"),
            [volume],
            [{"name": "model", "mountPath": mount, "readOnly": True}],
        )
    # An absolute path already on the node: mount it read-only at the same path.
    volume = {"name": "model", "hostPath": {"path": uri, "type": "Directory"}}
    return uri, [volume], [{"name": "model", "mountPath": uri, "readOnly": True}]


def kv_events_config(spec: EffectiveSpec) -> dict[str, Any]:
    """vLLM's --kv-events-config: a ZMQ publisher and replay socket on every interface of the pod (rank r on the
    ports + r), topic `kv@<pod name>-<pod UID>` so a subscriber tells a replaced pod from the one it followed."""
    events = spec.engine.kv_events
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events.port}",
        "replay_endpoint": f"tcp://*:{events.replay_port}",
        "topic": "kv@$(POD_NAME)-$(POD_UID)",
    }


def engine_args(pds: PDService, spec: EffectiveSpec, role: EngineRole) -> list[str]:
    """`vllm serve` arguments (after `serve`), flags owned by pdserve first, user args last."""
    engine, pool = spec.engine, spec.pool(role)
    model_arg, _, _ = _model_source(spec)
    args = [
        model_arg,
        "--served-model-name",
        spec.model.name,
        "--port",
        str(engine.port),
        "--tensor-parallel-size",
        str(pool.tensor_parallel_size),
    ]
    if pool.data_parallel_size > 1:
        args += ["--data-parallel-size", str(pool.data_parallel_size)]
    if spec.model.revision:
        args += ["--revision", spec.model.revision]
    args += ["--block-size", str(engine.block_size), "--kv-cache-dtype", engine.kv_cache_dtype]
    if engine.max_model_len is not None:
        args += ["--max-model-len", str(engine.max_model_len)]
    if pool.max_num_seqs is not None:
        args += ["--max-num-seqs", str(pool.max_num_seqs)]
    if pool.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(pool.max_num_batched_tokens)]
    args += ["--shutdown-timeout", str(shutdown_timeout(spec, role))]
    args += ["--kv-transfer-config", json.dumps(kvcache.kv_transfer_config(pds, spec, role), separators=(",", ":"))]
    if engine.kv_events.enabled:
        args += ["--kv-events-config", json.dumps(kv_events_config(spec), separators=(",", ":"))]
    return args + list(engine.args) + list(pool.args)


def _env(var: EnvVar) -> dict[str, Any]:
    return var.model_dump(by_alias=True, exclude_none=True)


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def engine_env(spec: EffectiveSpec, role: EngineRole) -> list[dict[str, Any]]:
    engine, pool = spec.engine, spec.pool(role)
    env: list[dict[str, Any]] = [
        # Downward API first: later entries may reference them with $(VAR).
        _field_env("POD_NAME", "metadata.name"),
        _field_env("POD_UID", "metadata.uid"),
        _field_env("POD_NAMESPACE", "metadata.namespace"),
        _field_env("POD_IP", "status.podIP"),
        {"name": "VLLM_NIXL_SIDE_CHANNEL_HOST", "value": "$(POD_IP)"},
        {"name": "VLLM_NIXL_SIDE_CHANNEL_PORT", "value": str(engine.side_channel_port)},
        {"name": "UCX_TLS", "value": engine.ucx.transports},
        {"name": "PDSERVE_KV_COMPAT", "value": kv_compat_hash(spec)},
    ]
    if engine.ucx.net_devices:
        env.append({"name": "UCX_NET_DEVICES", "value": engine.ucx.net_devices})
    if spec.model.hf_token_secret:
        env.append(
            {
                "name": "HF_TOKEN",
                "valueFrom": {"secretKeyRef": {"name": spec.model.hf_token_secret, "key": "HF_TOKEN"}},
            }
        )
    env += kvcache.engine_env(spec)
    # User env last; validation refuses every name set above (pdserve.api.owned), so nothing here is overridden.
    # A pool's variable replaces the engine's of the same name.
    user = {var.name: _env(var) for var in [*engine.env, *pool.env]}
    if spec.engine.run_as_user is not None and "HOME" not in user:
        # vLLM's image keeps its caches under /root; a UID its /etc/passwd does not know gets HOME=/ from the
        # runtime, which it cannot write ("Error saving model info cache: PermissionError: '/.cache'", measured on
        # real vLLM 0.32 in tests/realvllm; compiled kernels and hub downloads go there too). A user's HOME wins.
        env.append({"name": "HOME", "value": NON_ROOT_HOME})
    return env + list(user.values())


def _resources(spec: EffectiveSpec, pool: EffectivePool) -> dict[str, Any]:
    requests: dict[str, str] = dict(pool.resources.requests)
    limits: dict[str, str] = dict(pool.resources.limits)
    extended: dict[str, str] = {}
    if pool.gpus_per_pod > 0:
        extended[spec.placement.gpu_resource_name] = str(pool.gpus_per_pod)
    if spec.placement.rdma == "required":
        extended[pool.rdma.resource_name] = str(pool.rdma.count)
    # Extended resources cannot be overcommitted: requests must equal limits.
    out: dict[str, Any] = {}
    if requests or extended:
        out["requests"] = {**requests, **extended}
    if limits or extended:
        out["limits"] = {**limits, **extended}
    return out


def _probes(port_name: str) -> dict[str, Any]:
    def http(period: int, failures: int, timeout: int = 5) -> dict[str, Any]:
        return {
            "httpGet": {"path": "/health", "port": port_name},
            "periodSeconds": period,
            "failureThreshold": failures,
            "timeoutSeconds": timeout,
        }

    return {
        # Loading weights (and downloading them from the hub) can take many minutes: 10 s x 360 = 1 hour.
        "startupProbe": http(10, 360),
        "readinessProbe": http(5, 3),
        "livenessProbe": http(10, 6),
    }


def security_context(spec: EffectiveSpec) -> dict[str, Any]:
    """The most restrictive context vLLM with NIXL runs under (README, "Pod Security").

    Every capability is dropped; RDMA memory registration pins pages, so UCX's verbs transports need IPC_LOCK
    wherever RDMA may be used (`placement.rdma` required or preferred; with `off` UCX uses TCP and needs nothing).
    vLLM's official image runs as root and keeps its caches under /root, so a non-root user is the author's
    choice (`engine.runAsUser`, for images built for it), which Pod Security `restricted` then admits.
    """
    capabilities: dict[str, list[str]] = {"drop": ["ALL"]}
    if spec.placement.rdma != "off":
        capabilities["add"] = ["IPC_LOCK"]
    context: dict[str, Any] = {
        "allowPrivilegeEscalation": False,
        "capabilities": capabilities,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if spec.engine.run_as_user is not None:
        context.update(runAsNonRoot=True, runAsUser=spec.engine.run_as_user)
    return context


def _home_mounts(spec: EffectiveSpec) -> list[dict[str, Any]]:
    """A non-root engine's writable HOME (see `engine_env`); none for the image's own user."""
    return [] if spec.engine.run_as_user is None else [{"name": "home", "mountPath": NON_ROOT_HOME}]


def statefulset(pds: PDService, spec: EffectiveSpec, role: EngineRole) -> dict[str, Any]:
    engine, pool = spec.engine, spec.pool(role)
    name = child_name(pds, role)
    _, model_volumes, model_mounts = _model_source(spec)
    store_volumes, store_mounts = kvcache.engine_volumes(pds, spec)
    pod_labels = {**labels(pds, role), KV_COMPAT_LABEL: kv_compat_hash(spec)}
    container: dict[str, Any] = {
        "name": ENGINE_CONTAINER,
        "image": engine.image,
        "command": ["vllm", "serve"],
        "args": engine_args(pds, spec, role),
        "env": engine_env(spec, role),
        "ports": [
            {"name": "http", "containerPort": engine.port, "protocol": "TCP"},
            {"name": "nixl", "containerPort": engine.side_channel_port, "protocol": "TCP"},
            *(
                {"name": name, "containerPort": port, "protocol": "TCP"}
                for name, port in discovery.kv_event_ports(spec, role)
            ),
        ],
        "resources": _resources(spec, pool),
        "volumeMounts": [
            {"name": "dshm", "mountPath": "/dev/shm"},
            *_home_mounts(spec),
            *model_mounts,
            *store_mounts,
        ],
        **_probes("http"),
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRE_STOP_SECONDS)]}}},
        "securityContext": security_context(spec),
    }
    if engine.image_pull_policy:
        container["imagePullPolicy"] = engine.image_pull_policy
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": termination_grace_seconds(spec, role),
        "containers": [container],
        "volumes": [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": engine.shm_size}},
            *({"name": "home", "emptyDir": {}} for _ in _home_mounts(spec)),
            *model_volumes,
            *store_volumes,
        ],
        "tolerations": placement.tolerations(spec, pool),
        "topologySpreadConstraints": placement.topology_spread(pds, spec, role),
    }
    selector = placement.node_selector(spec, pool)
    if selector:
        pod_spec["nodeSelector"] = selector
    affinity = placement.affinity(pds, spec, role)
    if affinity:
        pod_spec["affinity"] = affinity
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": metadata(pds, name, role),
        "spec": {
            "serviceName": name,
            "replicas": pool.desired_replicas,
            "podManagementPolicy": "Parallel",
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"partition": 0}},
            "selector": {"matchLabels": selector_labels(pds, role)},
            "template": {"metadata": {"labels": pod_labels}, "spec": pod_spec},
        },
    }


def headless_service(pds: PDService, spec: EffectiveSpec, role: EngineRole) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(pds, child_name(pds, role), role),
        "spec": {
            "clusterIP": "None",
            "selector": selector_labels(pds, role),
            "ports": [
                {"name": "http", "port": spec.engine.port, "targetPort": "http", "protocol": "TCP"},
                {"name": "nixl", "port": spec.engine.side_channel_port, "targetPort": "nixl", "protocol": "TCP"},
            ],
        },
    }


def disruption_budget(pds: PDService, spec: EffectiveSpec, role: EngineRole) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(pds, child_name(pds, role), role),
        "spec": {
            "maxUnavailable": spec.pool(role).max_unavailable,
            "selector": {"matchLabels": selector_labels(pds, role)},
        },
    }
