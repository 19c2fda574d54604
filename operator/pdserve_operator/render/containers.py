"""What every container running pdserve's own image shares: its securityContext, its HTTP probes, and where the
router's pods (and the pods pdserve runs beside it) may be scheduled."""

from __future__ import annotations

from typing import Any

from pdserve.api.defaults import EffectiveRouter

#: pdserve's image runs as its non-root user with nothing else: Pod Security `restricted` plus a read-only root.
RESTRICTED_NON_ROOT: dict[str, Any] = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "runAsUser": 65532,
    "runAsGroup": 65532,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def http_probes(port: str) -> dict[str, Any]:
    """Readiness on `/ready` (out of rotation within ~4 s) and liveness on `/health` (restarted after ~30 s)."""
    return {
        "readinessProbe": {"httpGet": {"path": "/ready", "port": port}, "periodSeconds": 2, "failureThreshold": 2},
        "livenessProbe": {"httpGet": {"path": "/health", "port": port}, "periodSeconds": 10, "failureThreshold": 3},
    }


def router_scheduling(router: EffectiveRouter) -> dict[str, Any]:
    """The pod spec's nodeSelector and tolerations from `spec.router` (absent when the user set none)."""
    out: dict[str, Any] = {}
    if router.node_selector:
        out["nodeSelector"] = dict(router.node_selector)
    if router.tolerations:
        out["tolerations"] = [t.model_dump(by_alias=True, exclude_none=True) for t in router.tolerations]
    return out
