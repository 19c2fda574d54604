"""What the autoscaler tells users (pure): a tick's decision as PDService status fields and conditions.

The loop (`loop.py`) turns each tick into a `ScalingReport` and leaves it on the `ScalingBoard`; the reconcile
path, the only writer of a PDService's status, reads the board and places the report (`status_view`) beside the
conditions it computes itself. One writer means the autoscaler never races the reconcile for `.status` (a merge
patch replaces the whole `conditions` list), and the status is still written only when it changed.

`status_view` decides from the spec, not from the report alone, so the status always matches what the spec asks:

- no pool has autoscaling enabled: no autoscaling status and no scaling conditions at all;
- a pool in mode external: `ExternallyScaled`, its replicas as HPA/KEDA set them (pdserve never decides for it);
- a pool in mode pdserve, the operator started without `--prometheus-url`: `PrometheusNotConfigured`, the pool
  holds its replicas (the operator only keeps them within [minReplicas, maxReplicas]) and `ScalingActive` is False;
- a pool in mode pdserve with a report: the report's decision and numbers, and its conditions;
- no report yet (the loop has not ticked since this replica became the leader): what the previous leader wrote,
  else `WaitingForMetrics`.

Numbers are rounded to three significant digits so that noise in the fourth digit does not rewrite the status on
every tick.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pdserve.api.defaults import EffectiveSpec
from pdserve.api.router_config import RouterControl
from pdserve_operator.autoscaler.decision import Decision, PoolDecision, Reason
from pdserve_operator.autoscaler.model import Slo
from pdserve_operator.autoscaler.signals import ROLES, Role, ServiceSignals
from pdserve_operator.conditions import Condition
from pdserve_operator.observed import OwnerKey

SCALING_ACTIVE = "ScalingActive"
ABLE_TO_SCALE = "AbleToScale"
SCALING_LIMITED = "ScalingLimited"
SCALING_CONDITION_TYPES = (SCALING_ACTIVE, ABLE_TO_SCALE, SCALING_LIMITED)

#: Reasons the operator adds to the decision's (`decision.Reason`).
PROMETHEUS_NOT_CONFIGURED = "PrometheusNotConfigured"
WAITING_FOR_METRICS = "WaitingForMetrics"
FAILED_UPDATE_SCALE = "FailedUpdateScale"

METRIC: dict[Role, str] = {"prefill": "TTFT", "decode": "ITL"}
LOAD_UNIT: dict[Role, str] = {"prefill": "uncached prompt tokens/s", "decode": "generated tokens/s"}


@dataclass(frozen=True, slots=True)
class PoolReport:
    """One pool's line of a report: its `status.<pool>.autoscaling`."""

    role: Role
    mode: str
    current: int
    desired: int
    reason: str
    message: str
    percentile: int | None = None
    #: Client-visible quantile of the pool's metric (router TTFT for prefill, router ITL for decode), seconds;
    #: the pool's engines' when the routers saw none in the window.
    observed_s: float | None = None
    target_s: float | None = None
    #: The pool's own engines' quantile (prefill engine TTFT, decode ITL), seconds.
    pool_s: float | None = None
    capacity: float | None = None
    demand: float | None = None
    basis: str | None = None
    last_scale_time: str | None = None

    def fields(self) -> dict[str, Any]:
        """The status fields (camelCase, unknown values left out)."""
        values: dict[str, Any] = {
            "mode": self.mode,
            "currentReplicas": self.current,
            "desiredReplicas": self.desired,
            "reason": self.reason,
            "message": self.message,
            "metric": METRIC[self.role],
            "percentile": self.percentile,
            "observedMilliseconds": _ms(self.observed_s),
            "targetMilliseconds": _ms(self.target_s),
            "poolMilliseconds": _ms(self.pool_s),
            "capacityPerReplica": _round(self.capacity),
            "demand": _round(self.demand),
            "loadUnit": LOAD_UNIT[self.role] if self.capacity is not None or self.demand is not None else None,
            "capacityBasis": self.basis,
            "lastScaleTime": self.last_scale_time,
        }
        return {key: value for key, value in values.items() if value is not None}


@dataclass(frozen=True, slots=True)
class ThresholdReport:
    """The disaggregation threshold after a tick (`threshold.py`): `status.disaggregationThreshold`, and what the
    router control ConfigMap publishes (the value, and the change that set it: it is rewritten only on a change)."""

    tokens: int
    minimum: int
    maximum: int
    reason: str
    message: str
    #: When the autoscaler last changed the value, and why (None, "": it has not changed it).
    last_change_time: str | None = None
    last_change: str = ""

    def fields(self) -> dict[str, Any]:
        """The status fields (camelCase)."""
        values: dict[str, Any] = {
            "tokens": self.tokens,
            "minTokens": self.minimum,
            "maxTokens": self.maximum,
            "reason": self.reason,
            "message": self.message,
            "lastChangeTime": self.last_change_time,
        }
        return {key: value for key, value in values.items() if value is not None}

    def control(self) -> RouterControl:
        """What the routers are told."""
        reason = self.last_change or "the configured threshold"
        return RouterControl(
            disaggregation_threshold=self.tokens, reason=reason[:1024], decided_at=self.last_change_time or ""
        )


@dataclass(frozen=True, slots=True)
class ScalingReport:
    """One service's latest report: per managed or external pool, and the three HPA-style conditions; the
    disaggregation threshold while the spec lets the autoscaler choose it."""

    pools: Mapping[Role, PoolReport]
    conditions: tuple[Condition, ...]
    threshold: ThresholdReport | None = None


# ---------------------------------------------------------------------------------------------------- the board


@dataclass
class ScalingBoard:
    """The latest report of every service's loop, read by the reconcile path (thread-safe: loops write from the
    event loop, reconciles read from worker threads). `configured` is whether the operator has a Prometheus to
    read at all (`--prometheus-url`)."""

    configured: bool = False
    _reports: dict[OwnerKey, ScalingReport] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def put(self, key: OwnerKey, report: ScalingReport) -> bool:
        """Store `report`; True when it differs from the previous one (the status needs writing)."""
        with self._lock:
            changed = self._reports.get(key) != report
            self._reports[key] = report
        return changed

    def get(self, key: OwnerKey) -> ScalingReport | None:
        with self._lock:
            return self._reports.get(key)

    def drop(self, key: OwnerKey) -> None:
        with self._lock:
            self._reports.pop(key, None)


# ---------------------------------------------------------------------------------------- decision -> report


def from_decision(
    decision: Decision,
    signals: ServiceSignals,
    slo: Slo,
    *,
    now: str,
    last_scale_time: Mapping[Role, str | None] | None = None,
    failed: Mapping[Role, str] | None = None,
) -> ScalingReport:
    """The report of one tick. `failed`: pools whose /scale write the API server refused, with its message;
    `last_scale_time`: when each pool was last scaled before this tick; `now` stamps the pools scaled now."""
    failed = failed or {}
    last_scale_time = last_scale_time or {}
    # What clients saw (the routers' quantiles), else the pools' own engines' when the routers saw nothing in the
    # window (no streamed answer has an inter-token latency at the router): the same choice the model makes.
    router = signals.router
    observed: dict[Role, float | None] = {
        "prefill": _first(router.ttft_pd_s, router.ttft_s, signals.prefill.engine_ttft_s),
        "decode": _first(router.itl_s, signals.decode.engine_itl_s),
    }
    targets: dict[Role, float] = {"prefill": slo.ttft_s, "decode": slo.itl_s}
    pools: dict[Role, PoolReport] = {}
    for pool in decision.pools:
        role = pool.role
        last = last_scale_time.get(role)
        if pool.changed and role not in failed:
            last = now
        pools[role] = _pool_report(
            pool, observed[role], targets[role], percentile=signals.percentile, last=last, failure=failed.get(role)
        )
    conditions = decision.conditions()
    if failed:
        roles = [role for role in ROLES if role in failed]
        message = "; ".join(f"{role}: {failed[role]}" for role in roles)
        conditions = (conditions[0], Condition(ABLE_TO_SCALE, "False", FAILED_UPDATE_SCALE, message), conditions[2])
    return ScalingReport(pools, conditions)


def _pool_report(
    pool: PoolDecision,
    observed_s: float | None,
    target_s: float,
    *,
    percentile: int,
    last: str | None,
    failure: str | None,
) -> PoolReport:
    estimate = pool.estimate
    external = pool.reason is Reason.EXTERNAL
    reason, message = str(pool.reason), pool.message
    if failure is not None:
        reason = FAILED_UPDATE_SCALE
        message = f"wanted {pool.desired} replicas ({pool.reason}: {pool.message}); the write failed: {failure}"
    return PoolReport(
        role=pool.role,
        mode="external" if external else "pdserve",
        current=pool.current,
        desired=pool.desired,
        reason=reason,
        message=message,
        percentile=percentile,
        observed_s=observed_s,
        target_s=target_s if math.isfinite(target_s) else None,
        pool_s=None if external or estimate is None else estimate.latency_s,
        capacity=None if external or estimate is None else estimate.capacity_per_replica,
        demand=None if external or estimate is None else estimate.demand,
        basis=None if external or estimate is None else estimate.basis,
        last_scale_time=last,
    )


def holding(spec: EffectiveSpec, replicas: Mapping[Role, int], reason: str, message: str) -> ScalingReport:
    """A report for a service the loop cannot decide for at all (e.g. no SLO target): every pdserve pool holds."""
    pools: dict[Role, PoolReport] = {}
    for role in ROLES:
        scaling = spec.pool(role).autoscaling
        if scaling.enabled and scaling.mode == "pdserve":
            current = replicas.get(role, spec.pool(role).desired_replicas)
            pools[role] = PoolReport(role, "pdserve", current, current, reason, message)
    return ScalingReport(
        pools,
        (
            Condition(SCALING_ACTIVE, "False", reason, message),
            Condition(ABLE_TO_SCALE, "Unknown", reason, message),
            Condition(SCALING_LIMITED, "Unknown", reason, message),
        ),
    )


# ------------------------------------------------------------------------------------------- report -> status


def status_view(
    spec: EffectiveSpec,
    replicas: Mapping[Role, int | None],
    *,
    configured: bool,
    report: ScalingReport | None,
    old_status: Mapping[str, Any] | None = None,
) -> tuple[dict[Role, dict[str, Any]], list[Condition]]:
    """`status.<pool>.autoscaling` of every pool with autoscaling enabled, and the scaling conditions (empty when
    no pool is scaled by pdserve). `replicas`: each pool StatefulSet's spec.replicas (None when it does not exist
    yet). See the module docstring for the cases."""
    old_status = old_status or {}
    fields: dict[Role, dict[str, Any]] = {}
    managed: list[Role] = []
    for role in ROLES:
        scaling = spec.pool(role).autoscaling
        if not scaling.enabled:
            continue
        current = replicas.get(role)
        if current is None:
            current = spec.pool(role).desired_replicas
        if scaling.mode == "external":
            fields[role] = PoolReport(
                role,
                "external",
                current,
                current,
                str(Reason.EXTERNAL),
                "autoscaling.mode is external: another autoscaler owns this pool's /scale; pdserve leaves it alone",
            ).fields()
            continue
        managed.append(role)
        target = scaling.target_milliseconds
        if not configured:
            fields[role] = PoolReport(
                role,
                "pdserve",
                current,
                scaling.clamp(current),
                PROMETHEUS_NOT_CONFIGURED,
                "the operator runs without --prometheus-url: the pool holds its replicas within "
                f"[{scaling.min_replicas}, {scaling.max_replicas}]",
                percentile=spec.slo.percentile,
                target_s=None if target is None else target / 1000.0,
            ).fields()
        elif report is not None and role in report.pools and report.pools[role].mode == "pdserve":
            fields[role] = report.pools[role].fields()
        else:
            kept = _old_pool(old_status, role)
            fields[role] = (
                kept
                or PoolReport(
                    role,
                    "pdserve",
                    current,
                    current,
                    WAITING_FOR_METRICS,
                    "the autoscaler has not decided yet",
                    percentile=spec.slo.percentile,
                    target_s=None if target is None else target / 1000.0,
                ).fields()
            )
    if not managed:
        return fields, []
    if not configured:
        message = "the operator was started without --prometheus-url; pools scaled by pdserve hold their replicas"
        return fields, [
            Condition(SCALING_ACTIVE, "False", PROMETHEUS_NOT_CONFIGURED, message),
            Condition(ABLE_TO_SCALE, "Unknown", PROMETHEUS_NOT_CONFIGURED, message),
            Condition(SCALING_LIMITED, "Unknown", PROMETHEUS_NOT_CONFIGURED, message),
        ]
    if report is not None:
        return fields, list(report.conditions)
    kept_conditions = _old_conditions(old_status)
    if kept_conditions:
        return fields, kept_conditions
    waiting = "the autoscaler has not decided yet"
    return fields, [Condition(type_, "Unknown", WAITING_FOR_METRICS, waiting) for type_ in SCALING_CONDITION_TYPES]


def threshold_view(
    spec: EffectiveSpec,
    report: ScalingReport | None,
    old_status: Mapping[str, Any] | None = None,
    *,
    configured: bool = True,
) -> dict[str, Any] | None:
    """`status.disaggregationThreshold`: None unless the spec lets the autoscaler choose the threshold; then the
    report's, else what the previous leader wrote (within today's bounds), else the configured value and why the
    autoscaler does not choose (`configured`: whether the operator has a Prometheus)."""
    value, low, high = spec.disaggregation_threshold_bounds()
    if low >= high:
        return None
    if report is not None and report.threshold is not None:
        return report.threshold.fields()
    scaled = any(p.autoscaling.enabled and p.autoscaling.mode == "pdserve" for p in (spec.prefill, spec.decode))
    old = (old_status or {}).get("disaggregationThreshold")
    if (
        configured
        and scaled
        and isinstance(old, Mapping)
        and (old.get("minTokens"), old.get("maxTokens")) == (low, high)
    ):
        return dict(old)
    if not scaled:
        why = "no pool is scaled by pdserve, so its autoscaler does not run"
    elif not configured:
        why = "the operator runs without --prometheus-url, so its autoscaler does not run"
    else:
        why = "the autoscaler has not decided yet"
    return ThresholdReport(
        max(low, min(high, value)), low, high, "Configured", f"the configured threshold: {why}"
    ).fields()


def kept_view(old_status: Mapping[str, Any] | None) -> tuple[dict[Role, dict[str, Any]], list[Condition]]:
    """What the status said of the autoscaler, unchanged: while the spec is invalid its children and the autoscaler
    stay as they were, and so does what status says of them (`status.<pool>.autoscaling` and the scaling
    conditions, as `status_view` returns them)."""
    old_status = old_status or {}
    fields: dict[Role, dict[str, Any]] = {}
    for role in ROLES:
        kept = (old_status.get(role) or {}).get("autoscaling")
        if kept:
            fields[role] = kept
    conditions = [
        Condition(c["type"], c["status"], c["reason"], c.get("message", ""))
        for c in old_status.get("conditions") or []
        if c.get("type") in SCALING_CONDITION_TYPES
    ]
    return fields, conditions


def _old_pool(old_status: Mapping[str, Any], role: Role) -> dict[str, Any] | None:
    """The previous leader's decision for a pdserve pool, unless it said Prometheus was not configured."""
    old = ((old_status.get(role) or {}).get("autoscaling")) or None
    if not isinstance(old, Mapping) or old.get("mode") != "pdserve" or old.get("reason") == PROMETHEUS_NOT_CONFIGURED:
        return None
    return dict(old)


def _old_conditions(old_status: Mapping[str, Any]) -> list[Condition]:
    found = {
        c.get("type"): c
        for c in old_status.get("conditions") or []
        if isinstance(c, Mapping) and c.get("type") in SCALING_CONDITION_TYPES
    }
    if set(found) != set(SCALING_CONDITION_TYPES) or any(
        c.get("reason") == PROMETHEUS_NOT_CONFIGURED for c in found.values()
    ):
        return []
    return [
        Condition(t, str(found[t].get("status")), str(found[t].get("reason")), str(found[t].get("message") or ""))
        for t in SCALING_CONDITION_TYPES
    ]


def _first(*values: float | None) -> float | None:
    return next((value for value in values if value is not None), None)


def _round(value: float | None, digits: int = 3) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    if value == 0:
        return 0.0
    return float(round(value, digits - 1 - math.floor(math.log10(abs(value)))))


def _ms(seconds: float | None) -> float | None:
    return _round(None if seconds is None else seconds * 1000.0)
