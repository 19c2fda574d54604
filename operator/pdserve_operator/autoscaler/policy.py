"""The scaling policy (pure): the model's recommendation -> replicas each pool gets, and why.

Algorithm, per tick (every step leaves a reason; the first that applies to a pool wins):

1. Unmanaged pools (autoscaling off, or mode external: HPA/KEDA owns the /scale) keep whatever they run.
2. Fail-static: if a pool's metrics are missing, older than `max_age_s` or cover fewer than `min_completeness` of
   its ready pods, it holds its current size, raised to its minimum if below (MetricsUnavailable). A Prometheus
   outage never reads as zero load.
3. Pods Pending (unschedulable): hold; more replicas would only add more Pending pods (PodsPending).
4. Recommendation: ceil(required) replicas, or one more than now when the pool's own latency breaches its target
   while the model thinks it has enough (the model is wrong; the learning will catch up). Recorded every tick.
5. Fast up: if the recommendation exceeds the current size by more than the tolerance band (or the pool
   breaches), scale up to it at once. While earlier replicas are still starting, only a recommendation beyond
   the size already asked for is acted on (starting pods are credited, never double-counted).
6. Slow down: no scale-down while replicas are starting (ScalingInProgress). Otherwise the pool shrinks to the
   largest recommendation of the last `scale_down_window_s` (HPA's stabilization window; flapping input never
   flaps the pool; a scale-up is recorded as its steady size, not as the size scaled up to, whose headroom on top
   of the latest window was for the ramp), and only to a size that passes the consolidation check: the predicted
   demand spread over the smaller pool stays under `consolidation_margin` x the per-replica capacity (Dynamo's fix
   for 2 <-> 1 flapping). Nor below the burst floor (`burst_floor`): the latest load plus the largest burst (a
   rise to at least triple within one start-up horizon) seen in the last `burst_memory_s`, capped at that window's
   peak load, so a pool keeps between bursts what the next one needs before new replicas could be ready.
7. Bounds: min/max replicas (AtMinReplicas, AtMaxReplicas).
8. Both pools together: the prefill:decode ratio bounds raise the lagging pool (or, at its max, lower the
   leading one) (RatioBound); then the GPU budget: no pool is taken below min(current, wanted) to feed the
   other, GPUs a shrinking pool frees and the unused budget go to growing pools by their shortfall, and the
   total never exceeds the budget (BudgetExhausted).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from pdserve_operator.autoscaler.decision import Decision, PoolDecision, Reason
from pdserve_operator.autoscaler.model import Cause, Estimates, PoolEstimate, Slo
from pdserve_operator.autoscaler.signals import ROLES, PoolSignals, Role, ServiceSignals

#: A rise counts as a burst when the load reaches this multiple of its lowest within one start-up horizon; smaller
#: rises are what the demand forecast's surprise headroom covers.
BURST_FACTOR = 3.0


@dataclass(frozen=True, slots=True)
class PoolBounds:
    """One pool's limits and owner."""

    min_replicas: int = 1
    max_replicas: int = 8
    gpus_per_replica: int = 1
    #: False when pdserve does not scale the pool; `unmanaged_reason` says why (EXTERNAL or DISABLED).
    managed: bool = True
    unmanaged_reason: Reason = Reason.DISABLED

    def clamp(self, replicas: int) -> int:
        return max(self.min_replicas, min(self.max_replicas, replicas))


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """The policy's knobs (the PDService spec sets bounds, ratio, budget and window; the rest are defaults)."""

    prefill: PoolBounds = field(default_factory=PoolBounds)
    decode: PoolBounds = field(default_factory=PoolBounds)
    #: Bounds of prefill replicas / decode replicas.
    ratio_min: float | None = None
    ratio_max: float | None = None
    #: GPU budget of both pools together.
    max_gpus: int | None = None
    scale_down_window_s: float = 180.0
    #: Relative band around the current size within which the pool does not grow.
    tolerance: float = 0.1
    #: A smaller pool must carry the demand at this fraction of its capacity before a replica goes.
    consolidation_margin: float = 1.0
    #: Metrics older than this are stale.
    max_age_s: float = 60.0
    #: Share of ready pods that must report for the pool's metrics to count.
    min_completeness: float = 0.5
    #: Act on a recommendation beyond the in-progress size while replicas start (see module docstring, 5).
    scale_up_while_starting: bool = True
    #: The most a pool sheds in one tick, as a share of its size (at least one replica).
    scale_down_step: float = 1.0
    #: How long a burst is remembered: scaling down never goes below what the largest load seen in this window
    #: needs (`burst_floor`), so a pool does not shed between bursts the replicas the next one needs on arrival.
    #: 0 turns the rule off.
    burst_memory_s: float = 300.0

    def bounds(self, role: Role) -> PoolBounds:
        return self.prefill if role == "prefill" else self.decode


@dataclass(frozen=True, slots=True)
class PolicyState:
    """Recent recommendations per pool: (time, replicas), oldest first, for the scale-down window; and when the
    first tick was (no scale-down before a whole window has been seen, e.g. after the operator restarts)."""

    history: Mapping[Role, tuple[tuple[float, int], ...]] = field(default_factory=lambda: {"prefill": (), "decode": ()})
    since: float | None = None
    #: Observed load per pool in replicas' worth: (time, load / capacity per replica), oldest first, for
    #: `burst_floor`.
    loads: Mapping[Role, tuple[tuple[float, float], ...]] = field(default_factory=lambda: {"prefill": (), "decode": ()})

    def remember(self, role: Role, at: float, replicas: int, window_s: float) -> PolicyState:
        kept = tuple((t, n) for t, n in self.history.get(role, ()) if t > at - window_s)
        since = at if self.since is None else self.since
        return PolicyState({**self.history, role: (*kept, (at, replicas))}, since, self.loads)

    def observe(self, role: Role, at: float, replicas: float, window_s: float) -> PolicyState:
        """Remember a tick's observed load (in replicas' worth), forgetting what is older than `window_s`."""
        kept = tuple((t, n) for t, n in self.loads.get(role, ()) if t > at - window_s)
        return replace(self, loads={**self.loads, role: (*kept, (at, replicas))})

    def covers(self, at: float, window_s: float) -> bool:
        """Whether recommendations were recorded for a whole window before `at`."""
        return self.since is not None and at - self.since >= window_s

    def peak(self, role: Role, since: float) -> int | None:
        values = [n for t, n in self.history.get(role, ()) if t >= since]
        return max(values) if values else None


def decide(
    config: PolicyConfig,
    slo: Slo,
    state: PolicyState,
    signals: ServiceSignals,
    estimates: Estimates,
    *,
    horizon_s: float,
) -> tuple[Decision, PolicyState]:
    """One tick of the policy (module docstring). `horizon_s` is the model's: the time a replica asked for now
    needs to serve (start-up plus one tick)."""
    now = signals.at
    pools: dict[Role, PoolDecision] = {}
    for role in ROLES:
        pool_decision, state = _pool(
            config, slo, state, signals=signals, estimates=estimates, role=role, horizon_s=horizon_s
        )
        pools[role] = pool_decision
    pools = _ratio(config, pools)
    pools = _budget(config, pools)
    return Decision(now, pools["prefill"], pools["decode"], estimates.ttft_cause), state


# ------------------------------------------------------------------------------------------------- one pool


def _pool(
    config: PolicyConfig,
    slo: Slo,
    state: PolicyState,
    *,
    signals: ServiceSignals,
    estimates: Estimates,
    role: Role,
    horizon_s: float,
) -> tuple[PoolDecision, PolicyState]:
    now = signals.at
    bounds = config.bounds(role)
    pool = signals.pool(role)
    estimate = estimates.pool(role)
    current = pool.desired
    if not bounds.managed:
        return PoolDecision(role, current, current, bounds.unmanaged_reason, _unmanaged(bounds)), state

    blind = _blind(config, pool, estimate, signals)
    if blind is not None:
        return _hold_clamped(
            bounds, role, current, reason=Reason.METRICS_UNAVAILABLE, message=blind, estimate=estimate
        ), state
    if pool.pending > 0:
        message = f"{pool.pending} pod(s) cannot be scheduled; holding until they are or the pool shrinks"
        return _hold_clamped(
            bounds, role, current, reason=Reason.PODS_PENDING, message=message, estimate=estimate
        ), state

    assert estimate.required is not None  # _blind checked it
    starting = max(current - pool.ready, 0)
    recommended = max(math.ceil(estimate.required - 1e-9), 0)
    if estimate.breach and recommended <= current and starting == 0:
        # The pool misses its own target although the model says it has enough: trust the latency.
        recommended = current + 1
    # Scaling down looks at the steady demand: the smallest size that passes the consolidation check for it.
    steady = estimate.steady_required if estimate.steady_required is not None else estimate.required
    consolidated = _consolidated(config, estimate, max(math.ceil(steady - 1e-9), 0))
    if estimate.breach and starting == 0:
        consolidated = max(consolidated, current + 1)
    # Arrivals, not computed tokens: new replicas working off a backlog compute far more than arrives, and that
    # spike read as a burst to hold for the whole memory.
    offered = estimate.offered if estimate.offered is not None else estimate.load
    if offered is not None and config.burst_memory_s > 0:
        state = state.observe(role, now, offered / estimate.capacity_per_replica, config.burst_memory_s)
    floor = burst_floor(state.loads.get(role, ()), now=now, memory_s=config.burst_memory_s, horizon_s=horizon_s)
    why = _why(slo, estimates, estimate)
    if floor > consolidated and floor >= current:
        why = f"{why}; {floor} replica(s) kept for a burst like those of the last {config.burst_memory_s:.0f} s"
    consolidated = max(consolidated, floor)

    wants_up = recommended > current and (
        estimate.breach or estimate.required > current * (1.0 + config.tolerance) or current == 0
    )
    if wants_up and (starting == 0 or config.scale_up_while_starting):
        # The window remembers the steady size (consolidated), not the size scaled up to: the scale-up adds the
        # surprise headroom to the latest window, a reserve for the ramp that a pool need not hold once the burst
        # is over. Nothing goes before the new replicas are ready (ScalingInProgress); then what the steady demand
        # asked for in the window stays. Remembering the scale-up's size held the code trace's prefill pool at
        # 55-60 replicas for the whole window after bursts that needed 40-46 (issue 19's benchmark).
        state = state.remember(role, now, consolidated, config.scale_down_window_s)
        return _bounded(
            bounds, role, current, wanted=recommended, reason=Reason.SCALED_UP, message=why, estimate=estimate
        ), state
    # The scale-down window remembers what consolidation would allow, so a brief dip never removes a replica.
    state = state.remember(role, now, consolidated, config.scale_down_window_s)
    if starting > 0:
        message = f"{starting} replica(s) still starting; {why}"
        return _hold_clamped(
            bounds, role, current, reason=Reason.SCALING_IN_PROGRESS, message=message, estimate=estimate
        ), state
    if consolidated >= current:
        return _bounded(
            bounds, role, current, wanted=current, reason=Reason.WITHIN_TOLERANCE, message=why, estimate=estimate
        ), state
    stable = state.peak(role, now - config.scale_down_window_s) or consolidated
    if not state.covers(now, config.scale_down_window_s):
        message = (
            f"{consolidated} replica(s) would do, but the last {config.scale_down_window_s:.0f} s are not "
            f"observed yet; {why}"
        )
        return _bounded(
            bounds, role, current, wanted=current, reason=Reason.STABILIZING, message=message, estimate=estimate
        ), state
    if stable >= current:
        message = (
            f"{consolidated} replica(s) would do, but {stable} were recommended within the last "
            f"{config.scale_down_window_s:.0f} s; {why}"
        )
        return _bounded(
            bounds, role, current, wanted=current, reason=Reason.STABILIZING, message=message, estimate=estimate
        ), state
    # Shed at most a step per tick: traffic that just fell may come back, and a pool that walks down keeps
    # spare capacity for a while at little cost.
    step = max(1, math.ceil(current * config.scale_down_step))
    wanted = max(stable, current - step)
    return _bounded(
        bounds, role, current, wanted=wanted, reason=Reason.SCALED_DOWN, message=why, estimate=estimate
    ), state


def burst_floor(loads: Sequence[tuple[float, float]], *, now: float, memory_s: float, horizon_s: float) -> int:
    """The fewest replicas a pool may shrink to: the latest load plus the largest rise the load made within one
    start-up horizon in the last `memory_s`, but never more than the largest load of that window. `loads` are
    (time, load in replicas' worth) ticks, oldest first.

    A replica asked for when a burst shows is ready only a start-up later; a burst that rises within that time
    queues on the pool it finds. Bursty traffic (code completion) idles for minutes between bursts that reach
    full height within a tick or two, so a pool that shrinks to its idle load misses every next burst. The
    largest rise seen within a horizon is how far the load has recently climbed before new replicas could help:
    keep that much above the current load. Only a rise to at least `BURST_FACTOR` x the horizon's lowest load
    counts: smooth traffic (chat) and steps of a few tens of percent never triple within a start-up; their rises
    are what the forecast's surprise headroom covers, and the rule keeps nothing there (at 2x it held the
    synthetic trace's ramp down after a doubling step for a whole memory, at a cost and no gain).
    """
    recent = [(t, x) for t, x in loads if t > now - memory_s]
    if not recent:
        return 0
    rise = 0.0
    # The lowest load of the horizon ending at each tick, as a sliding-window minimum (ascending loads, oldest
    # first): one pass, whatever the memory holds (a 2 s tick and an hour's memory are 1,800 ticks per pool).
    lows: deque[tuple[float, float]] = deque()
    for at, load in recent:
        while lows and lows[-1][1] >= load:
            lows.pop()
        lows.append((at, load))
        while lows[0][0] < at - horizon_s:
            lows.popleft()
        low = lows[0][1]
        if load >= BURST_FACTOR * low:
            rise = max(rise, load - low)
    peak = max(x for _, x in recent)
    return max(math.ceil(min(recent[-1][1] + rise, peak) - 1e-9), 0)


def _blind(config: PolicyConfig, pool: PoolSignals, estimate: PoolEstimate, signals: ServiceSignals) -> str | None:
    """Why the pool's metrics cannot be trusted this tick, or None."""
    failed = ", ".join(signals.errors)
    if estimate.required is None:
        detail = f" ({failed})" if failed else ""
        return f"no load metrics for the {pool.role} pool{detail}; holding"
    if pool.ready > 0 and pool.completeness < config.min_completeness:
        return f"only {pool.completeness:.0%} of ready {pool.role} pods report metrics; holding"
    if pool.freshness_s is not None and pool.freshness_s > config.max_age_s:
        return f"{pool.role} metrics are {pool.freshness_s:.0f} s old (limit {config.max_age_s:.0f} s); holding"
    return None


def _consolidated(config: PolicyConfig, estimate: PoolEstimate, floor: int) -> int:
    """The smallest size at or above `floor` that passes the consolidation check."""
    size = floor
    while not estimate.load_fits(size, config.consolidation_margin) and size < floor + 1000:
        size += 1
    return size


def _why(slo: Slo, estimates: Estimates, estimate: PoolEstimate) -> str:
    """The sentence behind a pool's decision: client latency vs target first, then the model's numbers."""
    parts: list[str] = []
    p = slo.percentile
    if estimate.role == "prefill":
        if estimates.ttft_s is not None:
            relation = ">" if estimates.ttft_s > slo.ttft_s else "<="
            parts.append(f"TTFT p{p} {_s(estimates.ttft_s)} {relation} {_s(slo.ttft_s)} target")
        if estimates.ttft_cause not in (Cause.NONE, Cause.PREFILL):
            parts.append(f"TTFT breach attributed to {estimates.ttft_cause}, not prefill")
        if estimate.latency_s is not None:
            parts.append(f"prefill engine TTFT {_s(estimate.latency_s)} (budget {_s(estimate.target_s)})")
        unit = "uncached prompt tok/s"
    else:
        if estimates.itl_s is not None:
            relation = ">" if estimates.itl_s > slo.itl_s else "<="
            parts.append(f"ITL p{p} {_s(estimates.itl_s)} {relation} {_s(slo.itl_s)} target")
        if estimates.ttft_cause is Cause.DECODE_SLOT:
            parts.append("TTFT breach from requests waiting for a decode slot")
        unit = "generated tok/s"
    if estimate.demand is not None:
        parts.append(
            f"{estimate.role} demand {_n(estimate.demand)} {unit} at {_n(estimate.capacity_per_replica)} per "
            f"replica ({estimate.basis})"
        )
    parts.extend(estimate.notes)
    return "; ".join(parts)


def _unmanaged(bounds: PoolBounds) -> str:
    if bounds.unmanaged_reason is Reason.EXTERNAL:
        return "autoscaling.mode is external: another autoscaler owns this pool"
    return "autoscaling is disabled for this pool"


def _hold_clamped(
    bounds: PoolBounds, role: Role, current: int, *, reason: Reason, message: str, estimate: PoolEstimate
) -> PoolDecision:
    """Hold the current size, but never outside the bounds (fail-static still honours min)."""
    desired = bounds.clamp(current)
    if desired > current:
        message = f"{message}; raised to minReplicas {bounds.min_replicas}"
    elif desired < current:
        message = f"{message}; lowered to maxReplicas {bounds.max_replicas}"
    return PoolDecision(role, current, desired, reason, message, (), estimate)


def _bounded(
    bounds: PoolBounds,
    role: Role,
    current: int,
    *,
    wanted: int,
    reason: Reason,
    message: str,
    estimate: PoolEstimate,
) -> PoolDecision:
    """Clamp a wanted size into the bounds, naming the bound that clipped it."""
    desired = bounds.clamp(wanted)
    limits: tuple[Reason, ...] = ()
    if wanted > bounds.max_replicas:
        limits = (Reason.AT_MAX,)
        message = f"{message}; capped at maxReplicas {bounds.max_replicas} (wanted {wanted})"
    elif wanted < bounds.min_replicas:
        limits = (Reason.AT_MIN,)
        message = f"{message}; kept at minReplicas {bounds.min_replicas} (wanted {wanted})"
    if desired == current and reason in (Reason.SCALED_UP, Reason.SCALED_DOWN):
        reason = limits[0] if limits else Reason.WITHIN_TOLERANCE
    elif desired != current and reason not in (Reason.SCALED_UP, Reason.SCALED_DOWN):
        reason = Reason.SCALED_UP if desired > current else Reason.SCALED_DOWN
    return PoolDecision(role, current, desired, reason, message, limits, estimate)


# ----------------------------------------------------------------------------------------------- both pools


def _ratio(config: PolicyConfig, pools: dict[Role, PoolDecision]) -> dict[Role, PoolDecision]:
    """Keep prefill / decode within the ratio bounds, moving managed pools only."""
    low, high = config.ratio_min, config.ratio_max
    if low is None and high is None:
        return pools
    p, d = pools["prefill"].desired, pools["decode"].desired
    pb, db = config.prefill, config.decode
    if low is not None and p < low * d:
        if pb.managed:
            p = min(pb.max_replicas, math.ceil(low * d - 1e-9))
        if p < low * d and db.managed:
            d = max(db.min_replicas, math.floor(p / low + 1e-9))
    if high is not None and p > high * d:
        if db.managed:
            d = min(db.max_replicas, math.ceil(p / high - 1e-9))
        if p > high * d and pb.managed:
            p = max(pb.min_replicas, math.floor(high * d + 1e-9))
    bounds = f"[{_ratio_text(low)}, {_ratio_text(high)}]"
    return {
        "prefill": _moved(pools["prefill"], p, Reason.RATIO, f"prefill:decode ratio kept within {bounds}"),
        "decode": _moved(pools["decode"], d, Reason.RATIO, f"prefill:decode ratio kept within {bounds}"),
    }


def _budget(config: PolicyConfig, pools: dict[Role, PoolDecision]) -> dict[Role, PoolDecision]:
    """Fit both pools into the GPU budget without robbing either (module docstring, 8)."""
    budget = config.max_gpus
    if budget is None:
        return pools
    gpus = {role: config.bounds(role).gpus_per_replica for role in ROLES}
    wanted = {role: pools[role].desired for role in ROLES}
    if sum(wanted[r] * gpus[r] for r in ROLES) <= budget:
        return pools
    alloc: dict[Role, int] = {}
    for role in ROLES:
        bounds, decision = config.bounds(role), pools[role]
        if not bounds.managed:
            alloc[role] = decision.desired
        else:
            alloc[role] = min(decision.current, wanted[role])
    if sum(alloc[r] * gpus[r] for r in ROLES) > budget:
        # Already over (the budget was lowered): restart from the minimums and share what the budget allows.
        alloc = {r: (config.bounds(r).min_replicas if config.bounds(r).managed else wanted[r]) for r in ROLES}
    used = sum(alloc[r] * gpus[r] for r in ROLES)
    while True:
        growing = [r for r in ROLES if config.bounds(r).managed and alloc[r] < wanted[r] and used + gpus[r] <= budget]
        if not growing:
            break
        role = max(growing, key=lambda r: (wanted[r] - alloc[r]) / max(wanted[r], 1))
        alloc[role] += 1
        used += gpus[role]
    message = f"GPU budget {budget} reached"
    return {role: _moved(pools[role], alloc[role], Reason.BUDGET, message) for role in ROLES}


def _moved(decision: PoolDecision, desired: int, limit: Reason, message: str) -> PoolDecision:
    """A pool decision after a joint constraint changed (or confirmed) its size."""
    if desired == decision.desired:
        return decision
    limits = (*decision.limits, limit) if limit not in decision.limits else decision.limits
    if desired > decision.current:
        reason = Reason.SCALED_UP
    elif desired < decision.current:
        reason = Reason.SCALED_DOWN
    else:
        reason = limit
    wanted = decision.desired
    return replace(
        decision,
        desired=desired,
        reason=reason,
        limits=limits,
        message=f"{decision.message}; {message} (wanted {wanted})",
    )


def _ratio_text(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def _s(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2g} s"


def _n(value: float) -> str:
    if value >= 10_000:
        return f"{value / 1000:.0f}k"
    if value >= 1000:
        return f"{value / 1000:.1f}k"
    return f"{value:.0f}"
