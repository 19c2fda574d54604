"""KV tiers beyond direct prefill -> decode transfer: the engines' `--kv-transfer-config` and the Mooncake store.

Without `spec.engine.kvCache` (or a pool's `kvCache`) an engine gets vLLM's NixlConnector alone, as before. With a
CPU offload tier or a store, vLLM's MultiConnector composes connectors in this order (vLLM 0.32,
`multi_connector.py`: KV is loaded from the first connector that reports matched tokens, and saved to all of them):

1. NixlConnector, with the pool's role (`kv_producer` on prefill, `kv_consumer` on decode): a request that carries
   prefill's `kv_transfer_params` is pulled over NIXL, the lowest-latency path;
2. OffloadingConnector (`kv_both`): the engine's own CPU tier (`cpu_bytes_to_use`, `eviction_policy`);
3. MooncakeStoreConnector: prefill (`kv_both`) writes every prompt it computes and reads prefixes others computed;
   decode (`kv_consumer`) only reads: a request that reaches it without `kv_transfer_params` (the router's retry
   after a failed pull, a later turn on another engine) loads what the store holds instead of recomputing it.

`--kv-offloading-size` is never used (and is an owned flag): vLLM 0.32 turns it into a kv-transfer-config of its
own, replacing the configured connector, so NIXL would silently be gone.

The store. MooncakeStoreConnector reads its client settings from the JSON file `MOONCAKE_CONFIG_PATH` names
(`vllm/distributed/mooncake_store.py`); pdserve renders it into a ConfigMap mounted into every engine. Engines run
in vLLM's `standalone-store` mode: they contribute no memory of their own (`global_segment_size` 0), so a KV block
never lives in an engine that may die (a killed prefill engine's blocks are exactly what decode then needs). The
memory is a store server's: without `masterAddress` pdserve deploys one Deployment `<name>-kvstore` whose pod runs
`mooncake_master` (metadata, allocation, the HTTP metadata server the transfer engines register with) and
`mooncake_client` (the store server holding `capacityBytes`), and a Service of the same name the engines reach it
by. Both containers are health-checked (`/health` of the master's admin port; the store server's HTTP server),
and status.kvStore reports the Deployment's readiness. With `masterAddress` the user's master and store servers
are used as they are. Keys carry a `cache_prefix` of namespace, name and kv-compat value: deployments sharing one
master never read each other's blocks, and engines of another kv-compat value (mid-rollout) never read blocks of a
layout they cannot use.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pdserve.api.defaults import (
    MOONCAKE_METADATA_PORT,
    MOONCAKE_METRICS_PORT,
    MOONCAKE_RPC_PORT,
    MOONCAKE_STORE_PORT,
    EffectiveSpec,
)
from pdserve.api.kubeformats import quantity_bytes
from pdserve.api.kvcompat import kv_compat_hash
from pdserve.api.v1alpha1 import PDService
from pdserve_operator.names import EngineRole, child_name, labels, selector_labels
from pdserve_operator.render.containers import router_scheduling
from pdserve_operator.render.objects import metadata

STORE_CONFIG_KEY = "mooncake.json"
STORE_CONFIG_DIR = "/etc/pdserve/kvstore"
STORE_CONFIG_ENV = "MOONCAKE_CONFIG_PATH"
STORE_HTTP_PORT = 9300
#: The container port of the deployed master's HTTP metadata server (its Service still offers it on Mooncake's
#: 8080). mooncake_master 0.3.13 binds that server on every address whatever `--http_metadata_server_host` says
#: (`ss -ltnp` shows 0.0.0.0:8080), so on a shared host network (the local cluster's process node; a node running
#: pods with hostNetwork) it took the port of a router beside it (8080 too) whenever it started first, and the
#: master, or the router, never came up. No other pdserve container listens on 8090.
MASTER_METADATA_CONTAINER_PORT = 8090


def _nixl(spec: EffectiveSpec, role: EngineRole) -> dict[str, Any]:
    engine = spec.engine
    return {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_buffer_device": engine.kv_buffer_device,
        "engine_id": "$(POD_NAME)-$(POD_UID)",
        "kv_load_failure_policy": engine.kv_load_failure_policy,
        "kv_connector_extra_config": {"kv_lease_duration": engine.kv_lease_seconds},
    }


def cache_prefix(pds: PDService, spec: EffectiveSpec) -> str:
    """The namespace of this PDService's keys in the store (module docstring)."""
    return f"pdserve/{pds.metadata.namespace}/{pds.metadata.name}/{kv_compat_hash(spec)}"


def tiers(spec: EffectiveSpec, role: EngineRole) -> tuple[bool, bool]:
    """(CPU offload tier, store) of the pool."""
    return spec.pool(role).kv_cache.offload.enabled, spec.engine.kv_cache.store.enabled


def kv_transfer_config(pds: PDService, spec: EffectiveSpec, role: EngineRole) -> dict[str, Any]:
    """The pool's `--kv-transfer-config`: NIXL alone, or NIXL first inside a MultiConnector (module docstring)."""
    nixl = _nixl(spec, role)
    offload, store = tiers(spec, role)
    if not offload and not store:
        return nixl
    # The NIXL entry carries no engine_id: vLLM 0.32's MultiConnector builds each child's config as
    # `KVTransferConfig(**child, engine_id=child.get("engine_id", outer))` (`multi_connector.py`,
    # `_get_connector_classes_and_configs`), so a child with its own engine_id fails the engine's start-up with
    # "got multiple values for keyword argument 'engine_id'". The child inherits the outer one, which is the same.
    connectors = [{key: value for key, value in nixl.items() if key != "engine_id"}]
    if offload:
        tier = spec.pool(role).kv_cache.offload
        assert tier.cpu_bytes is not None
        connectors.append(
            {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "cpu_bytes_to_use": quantity_bytes(tier.cpu_bytes),
                    "eviction_policy": tier.eviction_policy,
                },
            }
        )
    if store:
        connectors.append(
            {
                "kv_connector": "MooncakeStoreConnector",
                "kv_role": "kv_both" if role == "prefill" else "kv_consumer",
                "kv_connector_extra_config": {"cache_prefix": cache_prefix(pds, spec)},
            }
        )
    return {
        "kv_connector": "MultiConnector",
        "kv_role": nixl["kv_role"],
        "kv_buffer_device": nixl["kv_buffer_device"],
        "engine_id": nixl["engine_id"],
        "kv_load_failure_policy": nixl["kv_load_failure_policy"],
        "kv_connector_extra_config": {"connectors": connectors},
    }


def master_address(pds: PDService, spec: EffectiveSpec) -> str:
    """host:port of the master's RPC service, as the engines are told (and status reports)."""
    mooncake = spec.engine.kv_cache.store.mooncake
    if mooncake.master_address is not None:
        return mooncake.master_address
    return f"{child_name(pds, 'kvstore')}.{pds.metadata.namespace}.svc:{MOONCAKE_RPC_PORT}"


def metadata_server(pds: PDService, spec: EffectiveSpec) -> str:
    mooncake = spec.engine.kv_cache.store.mooncake
    if mooncake.metadata_server is not None:
        return mooncake.metadata_server
    host = master_address(pds, spec).rsplit(":", 1)[0]
    return f"http://{host}:{MOONCAKE_METADATA_PORT}/metadata"


def store_client_config(pds: PDService, spec: EffectiveSpec) -> dict[str, Any]:
    """The engines' MOONCAKE_CONFIG_PATH file (vLLM's MooncakeStoreConfig.from_file reads these keys)."""
    mooncake = spec.engine.kv_cache.store.mooncake
    return {
        "metadata_server": metadata_server(pds, spec),
        "master_server_address": master_address(pds, spec),
        "protocol": mooncake.protocol,
        "device_name": mooncake.device_names,
        "mode": "standalone-store",
        "global_segment_size": 0,
        "local_buffer_size": quantity_bytes(mooncake.local_buffer_bytes),
    }


def engine_env(spec: EffectiveSpec) -> list[dict[str, Any]]:
    """The engines' store env: where the client config is."""
    if not spec.engine.kv_cache.store.enabled:
        return []
    return [{"name": STORE_CONFIG_ENV, "value": f"{STORE_CONFIG_DIR}/{STORE_CONFIG_KEY}"}]


def engine_volumes(pds: PDService, spec: EffectiveSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) that put the client config into an engine pod."""
    if not spec.engine.kv_cache.store.enabled:
        return [], []
    volume = {"name": "kvstore", "configMap": {"name": client_config_name(pds)}}
    return [volume], [{"name": "kvstore", "mountPath": STORE_CONFIG_DIR, "readOnly": True}]


def client_config_name(pds: PDService) -> str:
    return f"{child_name(pds, 'kvstore')}-client"


def objects(pds: PDService, spec: EffectiveSpec) -> list[dict[str, Any]]:
    """The store's objects: the client ConfigMap always; the master Deployment and Service when pdserve runs it."""
    store = spec.engine.kv_cache.store
    if not store.enabled:
        return []
    config = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(pds, client_config_name(pds), "kvstore"),
        "data": {STORE_CONFIG_KEY: json.dumps(store_client_config(pds, spec), indent=2, sort_keys=True) + "\n"},
    }
    if not store.mooncake.managed:
        return [config]
    return [config, service(pds), deployment(pds, spec)]


def _probe(path: str, port: str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": port}, "periodSeconds": period, "failureThreshold": failures}


_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def deployment(pds: PDService, spec: EffectiveSpec) -> dict[str, Any]:
    """One pod: `mooncake_master` and the store server `mooncake_client` beside it (module docstring)."""
    mooncake = spec.engine.kv_cache.store.mooncake
    name = child_name(pds, "kvstore")
    master = {
        "name": "master",
        "image": mooncake.image,
        "command": ["mooncake_master"],
        "args": [
            f"--rpc_port={MOONCAKE_RPC_PORT}",
            "--rpc_address=$(POD_IP)",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=$(POD_IP)",
            f"--http_metadata_server_port={MASTER_METADATA_CONTAINER_PORT}",
            "--metrics_host=$(POD_IP)",
            f"--metrics_port={MOONCAKE_METRICS_PORT}",
        ],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "ports": [
            {"name": "rpc", "containerPort": MOONCAKE_RPC_PORT, "protocol": "TCP"},
            {"name": "metadata", "containerPort": MASTER_METADATA_CONTAINER_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": MOONCAKE_METRICS_PORT, "protocol": "TCP"},
        ],
        "readinessProbe": _probe("/health", "metrics", 2, 3),
        "livenessProbe": _probe("/health", "metrics", 10, 6),
        "securityContext": _SECURITY,
    }
    capacity = quantity_bytes(mooncake.capacity_bytes)
    store = {
        "name": "store",
        "image": mooncake.image,
        "command": ["mooncake_client"],
        "args": [
            "--host=$(POD_IP)",
            f"--port={MOONCAKE_STORE_PORT}",
            f"--global_segment_size={capacity}",
            # The master listens on the pod's address only (every listener here does: no port is taken on a
            # shared host network), so the store server reaches it there, not on 127.0.0.1.
            f"--master_server_address=$(POD_IP):{MOONCAKE_RPC_PORT}",
            f"--metadata_server=http://$(POD_IP):{MASTER_METADATA_CONTAINER_PORT}/metadata",
            f"--protocol={mooncake.protocol}",
            *([f"--device_names={mooncake.device_names}"] if mooncake.device_names else []),
            "--enable_http_server=true",
            f"--http_port={STORE_HTTP_PORT}",
        ],
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            # The transfer engine serves the segment on the pod's address (not the first LAN interface it finds).
            {"name": "MC_TCP_BIND_ADDRESS", "value": "$(POD_IP)"},
        ],
        "ports": [
            {"name": "store", "containerPort": MOONCAKE_STORE_PORT, "protocol": "TCP"},
            {"name": "store-http", "containerPort": STORE_HTTP_PORT, "protocol": "TCP"},
        ],
        # The segment is pinned host memory: request it, so the scheduler places the pod where it fits.
        "resources": {"requests": {"memory": str(capacity)}},
        "readinessProbe": _probe("/health", "store-http", 2, 3),
        "livenessProbe": _probe("/health", "store-http", 10, 6),
        "securityContext": _SECURITY,
    }
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "containers": [master, store],
    }
    pod_spec.update(router_scheduling(spec.router))
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(pds, name, "kvstore"),
        "spec": {
            # One master: Mooncake's HA mode needs etcd. A restarted master starts empty, which costs prefills,
            # never correctness (a miss is recomputed).
            "replicas": 1,
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector_labels(pds, "kvstore")},
            "template": {"metadata": {"labels": labels(pds, "kvstore")}, "spec": pod_spec},
        },
    }


def service(pds: PDService) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(pds, child_name(pds, "kvstore"), "kvstore"),
        "spec": {
            "selector": selector_labels(pds, "kvstore"),
            "ports": [
                {"name": "rpc", "port": MOONCAKE_RPC_PORT, "targetPort": "rpc", "protocol": "TCP"},
                {"name": "metadata", "port": MOONCAKE_METADATA_PORT, "targetPort": "metadata", "protocol": "TCP"},
                {"name": "metrics", "port": MOONCAKE_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
            ],
        },
    }


# ------------------------------------------------------------------------------------------------------ status


def kv_store_status(pds: PDService, spec: EffectiveSpec, deployment: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The `kvStore` status field, or None without a store (the reconcile passes it to status as a value).

    A deployed master and store server count as ready when the Deployment has a ready pod, that is when the
    kubelet's probes of both containers pass. An external master is reported as the engines see it; pdserve does
    not probe it (the engines, whose start-up fails without a reachable master, are what shows it missing)."""
    store = spec.engine.kv_cache.store
    if store.backend is None:
        return None
    status: dict[str, Any] = {
        "backend": store.backend,
        "masterAddress": master_address(pds, spec),
        "managed": store.mooncake.managed,
    }
    if not store.mooncake.managed:
        status["message"] = "external master: not probed by pdserve"
        return status
    name = child_name(pds, "kvstore")
    ready = int(((deployment or {}).get("status") or {}).get("readyReplicas") or 0)
    status["ready"] = ready > 0
    if deployment is None:
        status["message"] = f"Deployment {name} does not exist yet"
    elif ready == 0:
        status["message"] = f"Deployment {name} has no ready pod (master or store server failing its health check)"
    else:
        status["message"] = ""
    return status
