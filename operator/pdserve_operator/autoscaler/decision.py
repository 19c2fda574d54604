"""What the autoscaler decided and why: one value feeding status, events and metrics alike.

A `Decision` holds one `PoolDecision` per pool: replicas before and after, the reason (a CamelCase word, as
Kubernetes condition reasons are) and a sentence with the numbers behind it, e.g. "TTFT p90 1.2 s > 0.8 s
target; prefill demand 31k tok/s at 9.6k tok/s per replica (learned)". Changed pools become Events
("Scaled prefill 2 -> 3: ..."); every pool's reason becomes a `pdserve_autoscaler_decisions_total{reason}`
sample; `conditions()` summarises the tick as HPA's three conditions do (ScalingActive, AbleToScale,
ScalingLimited).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdserve_operator.autoscaler.model import Cause, PoolEstimate
from pdserve_operator.autoscaler.signals import Role
from pdserve_operator.autoscaler.threshold import ThresholdDecision
from pdserve_operator.conditions import Condition


class Reason(enum.StrEnum):
    """Why a pool has the size it has after a tick."""

    SCALED_UP = "ScaledUp"
    SCALED_DOWN = "ScaledDown"
    #: The need is within the tolerance band around the current size.
    WITHIN_TOLERANCE = "WithinTolerance"
    #: Fewer replicas would do now, but the scale-down window still remembers a higher recommendation.
    STABILIZING = "ScaleDownStabilizing"
    #: Fail-static: metrics missing, stale or partial; the pool holds (never below its minimum).
    METRICS_UNAVAILABLE = "MetricsUnavailable"
    #: Pods cannot be scheduled (no free GPU): adding more would only add Pending pods.
    PODS_PENDING = "PodsPending"
    #: Replicas asked for earlier are still starting.
    SCALING_IN_PROGRESS = "ScalingInProgress"
    AT_MAX = "AtMaxReplicas"
    AT_MIN = "AtMinReplicas"
    #: The GPU budget (spec.autoscaling.maxGpus) is what stops the pool from growing.
    BUDGET = "BudgetExhausted"
    #: The prefill:decode ratio bounds moved the pool.
    RATIO = "RatioBound"
    #: autoscaling.mode is external: HPA or KEDA owns the pool.
    EXTERNAL = "ExternallyScaled"
    DISABLED = "AutoscalingDisabled"


#: Reasons that mean "would have scaled further but a limit said no" (HPA's ScalingLimited).
LIMITS = frozenset({Reason.AT_MAX, Reason.AT_MIN, Reason.BUDGET, Reason.RATIO})


@dataclass(frozen=True, slots=True)
class PoolDecision:
    """One pool's outcome of a tick."""

    role: Role
    current: int
    desired: int
    reason: Reason
    message: str
    #: Every limit that clipped the recommendation (a pool can be at max and hit the budget).
    limits: tuple[Reason, ...] = ()
    estimate: PoolEstimate | None = None

    @property
    def changed(self) -> bool:
        """Whether this decision asks for a different replica count."""
        return self.desired != self.current

    def event(self) -> str | None:
        """The Event text of a scaling action, None when the pool keeps its size."""
        if not self.changed:
            return None
        return f"Scaled {self.role} {self.current} -> {self.desired}: {self.message}"


@dataclass(frozen=True, slots=True)
class Decision:
    """Both pools' outcome of one tick."""

    at: float
    prefill: PoolDecision
    decode: PoolDecision
    ttft_cause: Cause = Cause.NONE
    #: The disaggregation threshold's tick, when the bounds let the autoscaler choose it (`threshold.py`).
    threshold: ThresholdDecision | None = None

    def pool(self, role: Role) -> PoolDecision:
        return self.prefill if role == "prefill" else self.decode

    @property
    def pools(self) -> tuple[PoolDecision, PoolDecision]:
        return (self.prefill, self.decode)

    def actions(self) -> list[PoolDecision]:
        """Pools whose replica count changes."""
        return [p for p in self.pools if p.changed]

    def events(self) -> list[str]:
        """Event messages of the scaling actions."""
        return [text for p in self.pools if (text := p.event()) is not None]

    def conditions(self) -> tuple[Condition, Condition, Condition]:
        """HPA-style conditions: ScalingActive, AbleToScale, ScalingLimited."""
        managed = [p for p in self.pools if p.reason not in (Reason.EXTERNAL, Reason.DISABLED)]
        blind = [p for p in managed if p.reason is Reason.METRICS_UNAVAILABLE]
        if not managed:
            active = Condition("ScalingActive", "False", "AutoscalingDisabled", "no pool is scaled by pdserve")
        elif blind:
            active = Condition("ScalingActive", "False", Reason.METRICS_UNAVAILABLE, _join(blind))
        else:
            active = Condition("ScalingActive", "True", "ValidMetricFound", "both pools have fresh metrics")
        stuck = [p for p in managed if p.reason in (Reason.PODS_PENDING, Reason.SCALING_IN_PROGRESS)]
        if stuck:
            able = Condition("AbleToScale", "False", stuck[0].reason, _join(stuck))
        else:
            able = Condition("AbleToScale", "True", "ReadyForNewScale", "no scaling in progress")
        limited = [p for p in managed if p.limits]
        if limited:
            limit = Condition("ScalingLimited", "True", limited[0].limits[0], _join(limited))
        else:
            limit = Condition("ScalingLimited", "False", "DesiredWithinRange", "the desired sizes are within bounds")
        return active, able, limit


def _join(pools: list[PoolDecision]) -> str:
    return "; ".join(f"{p.role}: {p.message}" for p in pools)
