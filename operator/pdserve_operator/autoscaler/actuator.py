"""The actuator (IO): a pool's desired replicas written to its StatefulSet's /scale; and the pure mapping from the
operator's cached Pod objects to the autoscaler's view of them (`pod_states`).

Where the replicas go (decision): the pool StatefulSet's scale subresource, not a per-role scale object of our
own (LWS's RoleScaler, Dynamo's DGDSA):

- HPA and KEDA target any object with a /scale, and a StatefulSet already has one: a pool handed to them
  (`autoscaling.mode: external`) is scaled through exactly the same field as one scaled by pdserve, with nothing
  extra to install, watch or garbage-collect, and `kubectl scale sts/NAME-decode` works as users expect.
- GitOps never sees the autoscaler: it writes neither the PDService spec (a per-role object mirrored into the
  spec would) nor anything else a user applies, so Argo CD and Flux report no drift of their manifests.
- One owner per field: the write is a merge patch of `spec.replicas` under its own field manager
  (`kube.AUTOSCALER_FIELD_MANAGER`, `pdserve-autoscaler`), so `managedFields` tell who set the replicas. The
  operator's server-side apply re-applies the observed value (co-owning, never changing it; clamped into bounds
  in mode pdserve) under a resourceVersion precondition, so a stale cache can never undo a scale (`plan.py`).
- What a per-role object would add (a status of its own, a selector for HPA's pod metrics) the PDService's
  status already says (`status.<pool>.autoscaling`), and the StatefulSet's /scale carries the selector too.

The price: the scale target's name is derived (`<pdservice>-<pool>`), which is how the chart's and the README's
HPA and ScaledObject examples name it.
"""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, Protocol

from pdserve_operator.autoscaler.signals import PodPhase, PodState, Role
from pdserve_operator.kinds import STATEFUL_SET
from pdserve_operator.kube import KubeIO
from pdserve_operator.names import ROLE_LABEL, child_name


class Actuator(Protocol):
    """Writes a pool's desired replicas. A pool in mode external is never passed here: HPA/KEDA own its /scale."""

    async def scale(self, namespace: str, name: str, role: Role, replicas: int) -> dict[str, Any]:
        """Set `role`'s replicas of PDService `namespace/name` to `replicas`; returns the Scale the API answered
        with. Raises `kube.ApiError` when refused, `kube.NotLeaderError` when this replica no longer leads."""
        ...


class StatefulSetScaler:
    """The actuator: `KubeIO.scale` of the pool's StatefulSet, in a worker thread (the client is synchronous)."""

    def __init__(self, api: KubeIO, executor: Executor | None = None) -> None:
        self.api = api
        self.executor = executor

    async def scale(self, namespace: str, name: str, role: Role, replicas: int) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        target = child_name(name, role)
        return await loop.run_in_executor(self.executor, self.api.scale, STATEFUL_SET, namespace, target, replicas)


def pod_states(pods: Sequence[Mapping[str, Any]], now: datetime.datetime) -> list[PodState]:
    """The autoscaler's view of engine Pod objects: role, phase (Pending = not schedulable; Terminating =
    being deleted; Ready; else Starting) and seconds since Ready. Pods without a pdserve role are skipped."""
    out: list[PodState] = []
    for pod in pods:
        metadata = pod.get("metadata") or {}
        role = (metadata.get("labels") or {}).get(ROLE_LABEL)
        if role not in ("prefill", "decode"):
            continue
        conditions = {c.get("type"): c for c in (pod.get("status") or {}).get("conditions") or []}
        ready = conditions.get("Ready", {})
        scheduled = conditions.get("PodScheduled", {})
        ready_for: float | None = None
        if metadata.get("deletionTimestamp"):
            phase = PodPhase.TERMINATING
        elif ready.get("status") == "True":
            phase = PodPhase.READY
            since = _time(ready.get("lastTransitionTime"))
            ready_for = max(0.0, (now - since).total_seconds()) if since else 0.0
        elif scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
            phase = PodPhase.PENDING
        else:
            phase = PodPhase.STARTING
        out.append(PodState(str(metadata.get("name", "")), role, phase, ready_for))
    return out


def _time(text: object) -> datetime.datetime | None:
    if not isinstance(text, str) or not text:
        return None
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
