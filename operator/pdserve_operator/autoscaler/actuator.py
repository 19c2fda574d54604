"""What phase 2 wires: the actuator, and what the autoscaler's loop reads from the operator.

No implementation against the Kubernetes API lives here yet; these are the interfaces the loop is written
against, and `pod_states`, the pure mapping from the operator's cached Pod objects to the autoscaler's view.

The loop (phase 2), per PDService with a pool whose autoscaling is enabled in mode pdserve, on the leader only,
every `AutoscalerConfig.interval_s`:

1. `config_from_spec(pds)` (cheap; the spec may have changed) -> `Autoscaler.reconfigure`.
2. `Target(namespace, name, percentile, desired={role: StatefulSet spec.replicas})` and
   `pod_states(pods, now)` from the informer cache (the pods of the service's two engine StatefulSets) plus the
   names of its router pods.
3. `await asyncio.to_thread(collector.collect, target, pods, time.time(), routers)`.
4. `decision = autoscaler.step(signals)`.
5. For each pool in `decision.actions()`: `await actuator.scale(namespace, name, role, desired, reason)`, one
   Event per action (`PoolDecision.event()`, reason `Scaled`), the pool's status fields, the conditions
   (`Decision.conditions()`), and the metrics (`pdserve_autoscaler_*`).
A collector that raised would be a bug (it reports failures in `signals.errors`); an actuator error is logged,
reported in the AbleToScale condition and retried at the next tick with the same decision logic.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from pdserve_operator.autoscaler.signals import PodPhase, PodState, Role

ROLE_LABEL = "pdserve.io/role"


class Actuator(Protocol):
    """Writes a pool's desired replicas.

    Phase 2's implementation patches the pool StatefulSet's /scale subresource (`replicas` only, under a field
    manager of its own, so the operator's server-side apply of the rest of the StatefulSet and the autoscaler
    never fight over the field, and a GitOps tool applying the PDService never sees a diff: the PDService spec is
    never written). A pool in mode external is never passed here; HPA/KEDA own its /scale.
    """

    async def scale(self, namespace: str, name: str, role: Role, replicas: int, reason: str) -> None:
        """Set `role`'s replicas of PDService `namespace/name` to `replicas`; `reason` is the decision's text."""
        ...


class PodSource(Protocol):
    """The operator's view of a service's pods (its informer cache)."""

    def engine_pods(self, namespace: str, name: str) -> Sequence[Mapping[str, Any]]:
        """The Pod objects of the service's prefill and decode StatefulSets, as the API server returns them."""
        ...

    def router_pods(self, namespace: str, name: str) -> Sequence[str]:
        """The names of the service's router pods that exist now."""
        ...


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
