"""The scaling policy: fast up, slow down, flapping, fail-static, pending pods, ratio bounds and the GPU budget."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve_operator.autoscaler.decision import Decision, Reason
from pdserve_operator.autoscaler.model import Cause, Curve, Estimates, PoolEstimate, Slo
from pdserve_operator.autoscaler.policy import (
    BURST_FACTOR,
    PolicyConfig,
    PolicyState,
    PoolBounds,
    burst_floor,
    decide,
)
from pdserve_operator.autoscaler.signals import PoolSignals, Role, RouterSignals, ServiceSignals

SLO = Slo(ttft_s=0.8, itl_s=0.04, percentile=90)
CAPACITY = 1000.0
# The rules other than the burst floor are tested without it (its own tests below turn it on): their steps up are
# bursts by its measure and would be held for its memory.
CONFIG = PolicyConfig(
    prefill=PoolBounds(1, 20),
    decode=PoolBounds(1, 20),
    scale_down_window_s=60.0,
    burst_memory_s=0.0,
)
BURST_CONFIG = replace(CONFIG, burst_memory_s=300.0)


@dataclass(frozen=True)
class Tick:
    """One tick's inputs for one pool: demand in replicas' worth of capacity, and what Kubernetes reports."""

    need: float | None
    current: int
    ready: int | None = None
    pending: int = 0
    breach: bool = False
    steady: float | None = None
    freshness_s: float | None = 5.0
    completeness: float = 1.0
    #: Load arriving, where it differs from the load computed (a backlog growing or being worked off).
    offered: float | None = None


def pool_estimate(role: Role, tick: Tick) -> PoolEstimate:
    demand = None if tick.need is None else tick.need * CAPACITY
    steady = demand if tick.steady is None else tick.steady * CAPACITY
    return PoolEstimate(
        role=role,
        load=demand,
        demand=demand,
        curve=Curve(0.1, CAPACITY / 0.9, 1.0),
        capacity_per_replica=CAPACITY,
        required=None if demand is None else demand / CAPACITY,
        latency_s=0.2,
        target_s=0.7,
        breach=tick.breach,
        basis="prior",
        steady_demand=None if demand is None else steady,
        offered=None if tick.offered is None else tick.offered * CAPACITY,
    )


def pool_signals(role: Role, tick: Tick) -> PoolSignals:
    return PoolSignals(
        role=role,
        desired=tick.current,
        ready=tick.current if tick.ready is None else tick.ready,
        pending=tick.pending,
        freshness_s=tick.freshness_s,
        completeness=tick.completeness,
    )


def step(
    state: PolicyState,
    at: float,
    p: Tick,
    d: Tick | None = None,
    config: PolicyConfig = CONFIG,
) -> tuple[Decision, PolicyState]:
    d = d or Tick(need=1.0, current=2)
    signals = ServiceSignals(
        at=at,
        window_s=15.0,
        percentile=90,
        prefill=pool_signals("prefill", p),
        decode=pool_signals("decode", d),
        router=RouterSignals(ttft_s=1.2 if p.breach else 0.3, itl_s=0.02),
    )
    ttft = 1.2 if p.breach else 0.3
    estimates = Estimates(pool_estimate("prefill", p), pool_estimate("decode", d), Cause.NONE, ttft, 0.02)
    return decide(config, SLO, state, signals, estimates, horizon_s=45.0)


def replay(needs: Sequence[float | None], start: int, config: PolicyConfig = CONFIG) -> list[tuple[int, Reason]]:
    """Feed prefill needs tick by tick (15 s apart), applying each decision at once (replicas ready at once)."""
    state = PolicyState()
    current = start
    out: list[tuple[int, Reason]] = []
    for i, need in enumerate(needs):
        decision, state = step(state, 15.0 * i, Tick(need=need, current=current), config=config)
        current = decision.prefill.desired
        out.append((current, decision.prefill.reason))
    return out


# ----------------------------------------------------------------------------------------- up, down, flapping


def test_breach_and_recovery() -> None:
    needs = [2.0] * 6 + [7.5] * 4 + [2.0] * 12
    sizes = [size for size, _ in replay(needs, start=2)]
    # Fast up: the whole step at once, on the first tick that sees it.
    assert sizes[6] == 8
    # Slow down: held until the last high recommendation (tick 9) leaves the 60 s window, then straight to the
    # need.
    assert sizes[9:13] == [8, 8, 8, 8]
    assert sizes[13:] == [2] * 9
    changes = sum(1 for a, b in itertools.pairwise(sizes) if a != b)
    assert changes == 2


def test_flapping_input_never_flaps_the_pool() -> None:
    needs = [2.0, 6.0] * 12
    result = replay(needs, start=2)
    sizes = [size for size, _ in result]
    assert sizes[1] == 6
    assert set(sizes[1:]) == {6}
    assert Reason.STABILIZING in {reason for _, reason in result[2:]}


def test_within_tolerance_holds() -> None:
    decision, _ = step(PolicyState(), 0.0, Tick(need=4.3, current=4))
    assert decision.prefill.desired == 4
    assert decision.prefill.reason is Reason.WITHIN_TOLERANCE


def test_consolidation_check_before_removing_a_replica() -> None:
    # 3.05 replicas' worth of steady demand does not fit in 3: keep 4.
    state = PolicyState()
    for i in range(8):
        decision, state = step(state, 15.0 * i, Tick(need=3.05, current=4))
    assert decision.prefill.desired == 4
    for i in range(8, 16):
        decision, state = step(state, 15.0 * i, Tick(need=2.95, current=4))
    assert decision.prefill.desired == 3


def test_scale_down_follows_the_steady_demand_not_one_noisy_window() -> None:
    state = PolicyState()
    for i in range(8):
        decision, state = step(state, 15.0 * i, Tick(need=6.0, steady=2.0, current=4))
    # The noisy window (6) scales up at once; the steady demand (2) is what the way down looks at.
    assert decision.prefill.desired == 6
    for i in range(8, 20):
        decision, state = step(state, 15.0 * i, Tick(need=2.0, current=6))
    assert decision.prefill.desired == 2


def test_the_window_holds_the_steady_size_not_the_size_a_burst_scaled_up_to() -> None:
    # A burst: the latest window needs 10 replicas, the steady demand (the forecast's level and reserve) 5.
    state = PolicyState()
    for i in range(4):
        decision, state = step(state, 15.0 * i, Tick(need=10.0, steady=5.0, current=4))
    assert decision.prefill.desired == 10
    # The burst is over and its replicas are ready: the pool goes to what the steady demand asked for within the
    # window (5) at once, not a window after the scale-up (the surprise headroom on top of the burst's window was
    # for its ramp)...
    decision, state = step(state, 60.0, Tick(need=2.0, current=10))
    assert (decision.prefill.desired, decision.prefill.reason) == (5, Reason.SCALED_DOWN)
    # ... holds that until its last recommendation (45 s) leaves the 60 s window...
    for at in (75.0, 90.0):
        decision, state = step(state, at, Tick(need=2.0, current=5))
        assert (decision.prefill.desired, decision.prefill.reason) == (5, Reason.STABILIZING)
    # ... then follows the steady demand down.
    decision, state = step(state, 105.0, Tick(need=2.0, current=5))
    assert decision.prefill.desired == 2
    # While the burst's replicas still start nothing goes (they are credited, never double-counted).
    state = PolicyState()
    for i in range(4):
        decision, state = step(state, 15.0 * i, Tick(need=10.0, steady=5.0, current=4))
    decision, _ = step(state, 60.0, Tick(need=2.0, current=10, ready=4))
    assert (decision.prefill.desired, decision.prefill.reason) == (10, Reason.SCALING_IN_PROGRESS)


# ------------------------------------------------------------------------------------------------ burst floor


def ticks(loads: Sequence[float], every_s: float = 15.0) -> list[tuple[float, float]]:
    return [(every_s * i, load) for i, load in enumerate(loads)]


def test_burst_floor_keeps_what_the_last_burst_needed_between_bursts() -> None:
    # Idle at 1 replica's worth, a burst to 20 within one tick, idle again: the next burst may come as fast.
    loads = ticks([1.0] * 4 + [20.0] * 4 + [1.0] * 4)
    assert burst_floor(loads, now=165.0, memory_s=300.0, horizon_s=45.0) == 20


def test_burst_floor_adds_the_rise_to_the_current_load_up_to_the_peak() -> None:
    # The load rose by 6 within a horizon (3 -> 9) and sits at 4 now: 4 + 6 = 10 is more than the peak 9.
    assert burst_floor(ticks([3.0, 9.0, 4.0]), now=30.0, memory_s=300.0, horizon_s=45.0) == 9
    # A rise of 4 (2 -> 6), a peak of 20 reached slowly: 5 + 4 = 9.
    slow_then_fast = [20.0, 17.0, 14.0, 11.0, 8.0, 5.0, 2.0, 6.0, 5.0]
    assert burst_floor(ticks(slow_then_fast), now=120.0, memory_s=300.0, horizon_s=45.0) == 9


def test_burst_floor_ignores_smooth_traffic() -> None:
    # Noise and a slow ramp never triple within a horizon: the floor is the load now, which the forecast's
    # headroom already exceeds.
    loads = ticks([10.0, 12.0, 9.0, 13.0, 15.0, 17.0, 19.0, 14.0, 11.0])
    assert burst_floor(loads, now=120.0, memory_s=300.0, horizon_s=45.0) == 11


def test_burst_floor_counts_only_rises_within_one_horizon() -> None:
    # 3 -> 9 tripled in 90 s, but no horizon (45 s, four ticks) saw it triple.
    ramp = ticks([3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 4.0])
    assert burst_floor(ramp, now=105.0, memory_s=300.0, horizon_s=45.0) == 4
    # The same ramp seen by a start-up twice as long is a burst: 4 + 6, capped at the peak 9.
    assert burst_floor(ramp, now=105.0, memory_s=300.0, horizon_s=90.0) == 9


def test_burst_floor_forgets_bursts_older_than_its_memory() -> None:
    loads = ticks([1.0, 20.0] + [1.0] * 30)
    assert burst_floor(loads, now=15.0 * 31, memory_s=300.0, horizon_s=45.0) == 1
    assert burst_floor(loads, now=15.0 * 31, memory_s=0.0, horizon_s=45.0) == 0


def test_a_bursty_pool_keeps_its_burst_size_between_bursts() -> None:
    bursty = ([1.0] * 4 + [12.0] * 2) * 5
    with_floor = [size for size, _ in replay(bursty, start=2, config=BURST_CONFIG)]
    without = [size for size, _ in replay(bursty, start=2, config=CONFIG)]
    # Without the floor the pool shrinks to the idle load between bursts and meets each burst with 1 replica...
    assert min(without[12:]) == 1
    # ...with it the pool meets every burst after the first with the replicas it needs.
    assert min(with_floor[6:]) == 12


def test_burst_floor_explains_itself() -> None:
    state = PolicyState()
    current = 2
    for i, need in enumerate([1.0] * 4 + [12.0] * 2 + [1.0] * 8):
        decision, state = step(state, 15.0 * i, Tick(need=need, current=current), config=BURST_CONFIG)
        current = decision.prefill.desired
    assert current == 12
    assert "12 replica(s) kept for a burst like those of the last 300 s" in decision.prefill.message


def test_a_backlog_worked_off_is_not_a_burst_to_keep() -> None:
    # Two ticks compute 12 replicas' worth (new replicas working off a queue) while 1 replica's worth arrives:
    # the burst memory reads arrivals, so the pool goes back to 1 once the window has passed.
    state = PolicyState()
    current = 2
    for i, need in enumerate([1.0] * 4 + [12.0] * 2 + [1.0] * 8):
        tick = Tick(need=need, current=current, offered=1.0)
        decision, state = step(state, 15.0 * i, tick, config=BURST_CONFIG)
        current = decision.prefill.desired
    assert current == 1
    assert "kept for a burst" not in decision.prefill.message


def test_no_scale_down_before_a_whole_window_was_observed() -> None:
    # A restarted operator knows nothing of the last minutes: it may scale up, never down, until it has seen
    # a whole window.
    result = replay([1.0] * 6, start=5)
    assert [size for size, _ in result[:4]] == [5, 5, 5, 5]
    assert result[4][0] == 1


def test_own_breach_adds_a_replica_beyond_the_model() -> None:
    decision, _ = step(PolicyState(), 0.0, Tick(need=3.0, current=4, breach=True))
    assert decision.prefill.desired == 5
    assert decision.prefill.reason is Reason.SCALED_UP


# ---------------------------------------------------------------------------------------------- fail-static


@pytest.mark.parametrize(
    ("case", "tick", "desired"),
    [
        ("no load metrics", Tick(need=None, current=4), 4),
        ("stale metrics", Tick(need=9.0, current=4, freshness_s=300.0), 4),
        ("partial metrics", Tick(need=9.0, current=4, completeness=0.25), 4),
        ("below min while blind", Tick(need=None, current=0), 1),
    ],
)
def test_fail_static(case: str, tick: Tick, desired: int) -> None:
    decision, _ = step(PolicyState(), 0.0, tick)
    assert decision.prefill.desired == desired
    assert decision.prefill.reason is Reason.METRICS_UNAVAILABLE
    active, _, _ = decision.conditions()
    assert (active.type, active.status, active.reason) == ("ScalingActive", "False", "MetricsUnavailable")
    assert "holding" in decision.prefill.message


def test_a_metrics_outage_never_reads_as_zero_load() -> None:
    result = replay([6.0] * 5 + [None] * 20, start=6)
    assert {size for size, _ in result} == {6}


# ---------------------------------------------------------------------------------------- pods not ready yet


def test_pending_pods_hold_the_pool() -> None:
    decision, _ = step(PolicyState(), 0.0, Tick(need=12.0, current=8, ready=6, pending=2))
    assert decision.prefill.desired == 8
    assert decision.prefill.reason is Reason.PODS_PENDING
    _, able, _ = decision.conditions()
    assert (able.status, able.reason) == ("False", "PodsPending")


def test_starting_replicas_are_credited() -> None:
    # 8 asked for, 5 ready: a need of 8 is already covered, so nothing changes and nothing goes.
    decision, _ = step(PolicyState(), 0.0, Tick(need=8.0, current=8, ready=5))
    assert decision.prefill.desired == 8
    assert decision.prefill.reason is Reason.SCALING_IN_PROGRESS
    down, _ = step(PolicyState(), 0.0, Tick(need=2.0, current=8, ready=5))
    assert down.prefill.desired == 8
    # A need beyond what is coming scales further (a steep ramp)...
    more, _ = step(PolicyState(), 0.0, Tick(need=11.0, current=8, ready=5))
    assert more.prefill.desired == 11
    # ...unless the policy is told to wait for the pods in progress.
    strict = replace(CONFIG, scale_up_while_starting=False)
    held, _ = step(PolicyState(), 0.0, Tick(need=11.0, current=8, ready=5), config=strict)
    assert held.prefill.desired == 8


# --------------------------------------------------------------------------------------------------- bounds


def test_bounds_are_limits_and_say_so() -> None:
    config = replace(CONFIG, prefill=PoolBounds(2, 6))
    decision, _ = step(PolicyState(), 0.0, Tick(need=9.0, current=4), config=config)
    assert decision.prefill.desired == 6
    assert decision.prefill.limits == (Reason.AT_MAX,)
    _, _, limited = decision.conditions()
    assert (limited.status, limited.reason) == ("True", "AtMaxReplicas")


def test_unmanaged_pools_are_left_alone() -> None:
    config = replace(
        CONFIG,
        prefill=PoolBounds(1, 20, managed=False, unmanaged_reason=Reason.EXTERNAL),
        decode=PoolBounds(1, 20, managed=False, unmanaged_reason=Reason.DISABLED),
    )
    decision, _ = step(PolicyState(), 0.0, Tick(need=15.0, current=3), Tick(need=None, current=7), config=config)
    assert (decision.prefill.desired, decision.prefill.reason) == (3, Reason.EXTERNAL)
    assert (decision.decode.desired, decision.decode.reason) == (7, Reason.DISABLED)
    assert decision.actions() == []


@dataclass(frozen=True)
class RatioCase:
    p: float
    d: float
    low: float | None
    high: float | None
    p_max: int
    expected: tuple[int, int]


RATIO = [
    RatioCase(2.0, 6.0, 0.5, None, 20, (3, 6)),  # prefill raised to half of decode
    RatioCase(2.0, 6.0, 0.5, None, 2, (2, 4)),  # prefill at its max: decode lowered instead
    RatioCase(9.0, 2.0, None, 2.0, 20, (9, 5)),  # decode raised to half of prefill
    RatioCase(3.0, 3.0, 0.5, 2.0, 20, (3, 3)),  # within bounds: untouched
]


@pytest.mark.parametrize("case", RATIO)
def test_ratio_bounds(case: RatioCase) -> None:
    config = replace(CONFIG, prefill=PoolBounds(1, case.p_max), ratio_min=case.low, ratio_max=case.high)
    decision, _ = step(PolicyState(), 0.0, Tick(need=case.p, current=1), Tick(need=case.d, current=1), config=config)
    p, d = decision.prefill.desired, decision.decode.desired
    assert (p, d) == case.expected
    assert case.low is None or p >= case.low * d - 1e-9
    assert case.high is None or p <= case.high * d + 1e-9


@dataclass(frozen=True)
class BudgetCase:
    p: float
    p_current: int
    d: float
    d_current: int
    budget: int
    gpus: tuple[int, int]
    expected: tuple[int, int]
    limited: bool


BUDGET = [
    BudgetCase(8.0, 4, 4.0, 4, 10, (1, 1), (6, 4), True),  # prefill grows into what is left, decode keeps its own
    BudgetCase(9.0, 4, 2.0, 4, 10, (1, 1), (8, 2), True),  # decode shrinks, its GPUs go to prefill
    BudgetCase(6.0, 2, 6.0, 2, 10, (1, 1), (5, 5), True),  # both grow: shared by shortfall
    BudgetCase(4.0, 2, 4.0, 2, 9, (1, 2), (3, 3), True),  # GPUs per replica count
    BudgetCase(5.0, 4, 4.0, 4, 10, (1, 1), (5, 4), False),  # fits: the budget changes nothing
]


@pytest.mark.parametrize("case", BUDGET)
def test_gpu_budget_is_never_exceeded(case: BudgetCase) -> None:
    config = replace(
        CONFIG,
        prefill=PoolBounds(1, 20, gpus_per_replica=case.gpus[0]),
        decode=PoolBounds(1, 20, gpus_per_replica=case.gpus[1]),
        max_gpus=case.budget,
    )
    state = PolicyState({"prefill": ((-100.0, case.p_current),), "decode": ((-100.0, case.d_current),)}, since=-100.0)
    decision, _ = step(
        state, 0.0, Tick(need=case.p, current=case.p_current), Tick(need=case.d, current=case.d_current), config=config
    )
    got = (decision.prefill.desired, decision.decode.desired)
    assert got == case.expected
    assert got[0] * case.gpus[0] + got[1] * case.gpus[1] <= case.budget
    short = [pool.role for pool in decision.pools if Reason.BUDGET in pool.limits]
    assert bool(short) is case.limited, "a pool the budget stopped says so, and only then"


# ------------------------------------------------------------------------------------------ explanations


def test_scaling_actions_explain_themselves() -> None:
    decision, _ = step(PolicyState(), 0.0, Tick(need=3.0, current=2, breach=True))
    (event,) = decision.events()
    assert event.startswith("Scaled prefill 2 -> 3: TTFT p90 1.2 s > 800 ms target;")
    assert "prefill demand 3.0k uncached prompt tok/s at 1.0k per replica (prior)" in event


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(min_value=0, max_value=100, allow_nan=False), min_size=1, max_size=60),
    st.sampled_from([5.0, 17.0, 45.0]),
)
def test_the_burst_floor_is_its_definition(values: list[float], horizon_s: float) -> None:
    """The one-pass floor equals its definition, computed the long way: for every tick, the lowest load of the
    horizon ending there; a rise to BURST_FACTOR x that low counts; the latest load plus the largest such rise,
    capped at the window's peak."""
    loads = [(2.0 * i, value) for i, value in enumerate(values)]
    now, memory_s = loads[-1][0], 90.0
    recent = [(t, x) for t, x in loads if t > now - memory_s]
    rise = 0.0
    for index, (at, load) in enumerate(recent):
        low = min(x for t, x in recent[: index + 1] if t >= at - horizon_s)
        if load >= BURST_FACTOR * low:
            rise = max(rise, load - low)
    expected = max(math.ceil(min(recent[-1][1] + rise, max(x for _, x in recent)) - 1e-9), 0)
    assert burst_floor(loads, now=now, memory_s=memory_s, horizon_s=horizon_s) == expected
