"""status.kvStore: the KV store the engines are told to use, and whether the one pdserve deployed serves.

Pure, like `status`: from the effective spec and the observed `<name>-kvstore` Deployment. A deployed master and
store server count as ready when the Deployment has a ready pod, that is when the kubelet's probes of both
containers pass (`/health` of the master's admin port and of the store server's HTTP server: `render.kvcache`).
An external master (`masterAddress`) is reported as the engines see it; pdserve does not probe it (the engines,
whose start-up fails without a reachable master, are what shows it missing).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.api.defaults import EffectiveSpec
from pdserve.api.v1alpha1 import PDService
from pdserve_operator.render.kvcache import master_address
from pdserve_operator.render.names import child_name


def kv_store_status(pds: PDService, spec: EffectiveSpec, deployment: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The `kvStore` status field, or None without a store."""
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
