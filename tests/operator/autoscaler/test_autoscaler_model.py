"""The scaling model: capacity prior and learning, demand prediction, and which pool a breach belongs to."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from pdserve.api.settings import OperatorSettings
from pdserve_dev.replay.cluster import ReplayCluster, ReplayConfig
from pdserve_dev.replay.engines import DecodeEngine
from pdserve_dev.replay.observe import Observation
from pdserve_dev.replay.scalers import profile_from_timing
from pdserve_dev.replay.trace import Request
from pdserve_operator.autoscaler.model import (
    H200_8B,
    Cause,
    Curve,
    Estimates,
    ModelConfig,
    ModelState,
    Slo,
    estimate,
    prefill_budget_s,
)
from pdserve_operator.autoscaler.signals import PodSample, PoolSignals, RouterSignals, ServiceSignals
from pdserve_sim.presets import H200_8B as H200_8B_TIMING
from pdserve_sim.presets import TimingParams

SLO = Slo(ttft_s=0.8, itl_s=0.04, percentile=90)
# A tick of the operator's default interval (the model's backlog deadline is one tick).
INTERVAL_S = OperatorSettings.autoscaler_interval_seconds
CONFIG = ModelConfig(slo=SLO, interval_s=INTERVAL_S, horizon_s=45.0)


def prefill(**changes: Any) -> PoolSignals:
    """A healthy prefill pool of 4 replicas at ~100k uncached prompt tokens/s (1000-token prompts)."""
    base = PoolSignals(
        role="prefill",
        desired=4,
        ready=4,
        request_rate=100.0,
        prompt_tokens_rate=100_000.0,
        uncached_tokens_rate=100_000.0,
        generated_tokens_rate=100.0,
        prompt_tokens_quantile=2000.0,
        running=4.0,
        waiting=0.0,
        engine_ttft_s=0.15,
        freshness_s=5.0,
        completeness=1.0,
    )
    return replace(base, **changes)


def decode(**changes: Any) -> PoolSignals:
    """A healthy decode pool of 4 replicas generating 20k tokens/s (200-token outputs)."""
    base = PoolSignals(
        role="decode",
        desired=4,
        ready=4,
        request_rate=100.0,
        prompt_tokens_rate=100_000.0,
        uncached_tokens_rate=100.0,
        generated_tokens_rate=20_000.0,
        running=400.0,
        waiting=0.0,
        waiting_capacity=0.0,
        waiting_deferred=0.0,
        kv_usage=0.3,
        engine_itl_s=0.02,
        queue_time_s=0.0,
        kv_transfer_s=0.005,
        freshness_s=5.0,
        completeness=1.0,
    )
    return replace(base, **changes)


def signals(
    at: float = 100.0,
    p: PoolSignals | None = None,
    d: PoolSignals | None = None,
    router: RouterSignals | None = None,
) -> ServiceSignals:
    return ServiceSignals(
        at=at,
        window_s=15.0,
        percentile=90,
        prefill=p or prefill(),
        decode=d or decode(),
        router=router or RouterSignals(ttft_s=0.3, ttft_pd_s=0.3, itl_s=0.02, request_rate=100.0),
    )


def run(*ticks: ServiceSignals, config: ModelConfig = CONFIG) -> tuple[ModelState, Estimates]:
    state = ModelState()
    result: Estimates | None = None
    for tick in ticks:
        state, result = estimate(config, state, tick)
    assert result is not None
    return state, result


def pods(count: int, load: float, latency: float, *, settled: bool = True) -> tuple[PodSample, ...]:
    return tuple(PodSample(f"p-{i}", load=load, latency_s=latency, settled=settled) for i in range(count))


# ------------------------------------------------------------------------------------------------- capacity


def test_prior_capacity_follows_the_engine_profile() -> None:
    _, est = run(signals())
    mu = H200_8B.prefill_saturation()
    assert est.prefill.curve.saturation == pytest.approx(mu)
    # Idle latency of a p90 prompt (2000 tokens) on the profile.
    assert est.prefill.curve.base_s == pytest.approx(H200_8B.prefill_latency_s(2000.0))
    budget = prefill_budget_s(CONFIG, 2000.0)
    expected = est.prefill.curve.capacity(budget * CONFIG.target_fraction, CONFIG.max_utilisation)
    assert est.prefill.capacity_per_replica == pytest.approx(expected)
    assert est.prefill.capacity_per_replica <= CONFIG.max_utilisation * mu
    assert est.prefill.basis == est.decode.basis == "prior"
    # Decode at an ITL target of 40 ms is bound by its sequence slots, and says so.
    assert any("max_num_seqs" in note for note in est.decode.notes)


@pytest.mark.parametrize(
    ("target", "utilisation"),
    [
        (0.2, 0.5),  # T/S = 2 with k = 1: u* = 1 / 2
        (0.4, 0.75),  # T/S = 4: u* = 3 / 4
        (10.0, 0.9),  # capped at max_utilisation
        (0.1, 0.25),  # even an idle replica misses: keep replicas lightly loaded
    ],
)
def test_curve_capacity(target: float, utilisation: float) -> None:
    curve = Curve(base_s=0.1, saturation=1000.0, queueing=1.0)
    assert curve.capacity(target, 0.9) == pytest.approx(1000.0 * utilisation)
    if utilisation < 0.9 and target > 0.1:
        assert curve.latency(curve.capacity(target, 0.9)) == pytest.approx(target)


def test_required_scales_with_demand() -> None:
    _, low = run(signals())
    _, high = run(signals(p=prefill(uncached_tokens_rate=200_000.0, request_rate=200.0)))
    assert low.prefill.required is not None and high.prefill.required is not None
    assert high.prefill.required == pytest.approx(2 * low.prefill.required, rel=0.01)


def test_slow_settled_replicas_teach_a_lower_capacity() -> None:
    # Loaded replicas (u ~ 0.6) whose TTFT is far above what the prior curve predicts: more queueing than
    # M/M/1, so the same replica carries less load at the target.
    slow = prefill(pods=pods(4, load=18_000.0, latency=1.2))
    _, prior = run(signals())
    _, learned = run(*(signals(at=100.0 + 15 * i, p=slow) for i in range(20)))
    assert learned.prefill.curve.queueing > 2.0
    assert learned.prefill.capacity_per_replica < 0.8 * prior.prefill.capacity_per_replica
    assert learned.prefill.basis == "learned"


def test_fast_lightly_loaded_replicas_teach_a_lower_idle_latency() -> None:
    fast = prefill(pods=pods(4, load=1000.0, latency=0.05))
    _, learned = run(*(signals(at=100.0 + 15 * i, p=fast) for i in range(20)))
    # The prior says 77 ms for a 2000-token prompt; these replicas answer in 50 ms.
    assert learned.prefill.curve.base_s == pytest.approx(0.05, rel=0.1)


def test_warm_up_samples_teach_nothing() -> None:
    # The same terrible latencies from pods still inside their warm-up period (first requests, compilation)
    # leave the prior in charge: Dynamo over-scaled decode on exactly such samples.
    warming = decode(pods=pods(4, load=5000.0, latency=0.5, settled=False))
    _, prior = run(signals())
    _, after = run(*(signals(at=100.0 + 15 * i, d=warming) for i in range(20)))
    assert after.decode.capacity_per_replica == pytest.approx(prior.decode.capacity_per_replica)
    assert after.decode.basis == "prior"


def test_learning_is_clamped() -> None:
    # k implied by these pairs is ~8 (u = 0.67, T/S = 17): the fit stops at 4 x the prior.
    steep = prefill(pods=pods(4, load=20_000.0, latency=1.3))
    _, est = run(*(signals(at=100.0 + 15 * i, p=steep) for i in range(200)))
    assert 3.0 < est.prefill.curve.queueing <= 4.0
    assert est.prefill.capacity_per_replica > 0


def test_overload_transients_teach_nothing() -> None:
    # A queue stuck on replicas after a burst: latency measures the queue, not the curve near the target.
    stuck = prefill(pods=pods(4, load=29_000.0, latency=40.0))
    _, prior = run(signals())
    _, after = run(*(signals(at=100.0 + 15 * i, p=stuck) for i in range(20)))
    assert after.prefill.curve == prior.prefill.curve


# --------------------------------------------------------------------------------------------------- demand


def test_missing_load_is_unknown_not_zero() -> None:
    _, est = run(signals(p=prefill(uncached_tokens_rate=None), d=decode(generated_tokens_rate=None)))
    assert est.prefill.required is None and est.prefill.demand is None
    assert est.decode.required is None


RAMP = [
    signals(at=100.0 + 15 * i, p=prefill(uncached_tokens_rate=100_000.0 + 10_000.0 * i, request_rate=100.0))
    for i in range(6)
]


def test_rising_demand_is_predicted_ahead_when_a_trend_is_allowed() -> None:
    _, est = run(*RAMP, config=replace(CONFIG, max_trend=0.5, prefill_surprise=0.0))
    now = 150_000.0
    assert est.prefill.demand is not None
    assert est.prefill.demand > now * 1.05


def test_by_default_the_trend_adds_nothing_over_the_horizon_the_surprise_headroom_does() -> None:
    # Without the peak bound (its own tests below), which would cap the steady demand at the ramp's top.
    config = replace(CONFIG, peak_half_life_s=0.0)
    state, est = run(*RAMP, config=config)
    forecast = state.prefill_demand
    assert forecast.ahead(config.horizon_s) > forecast.level * 1.05  # the filter sees the ramp...
    # ... and sizing does not extrapolate it: the level and the remembered surprise, no more.
    assert est.prefill.steady_demand == pytest.approx(forecast.level + config.prefill_surprise * forecast.deviation)
    assert est.prefill.demand == pytest.approx(
        max(150_000.0, forecast.level) + config.prefill_surprise * forecast.deviation
    )


def test_a_burst_trend_adds_at_most_max_trend_of_the_level() -> None:
    ticks = [signals(at=100.0, p=prefill(uncached_tokens_rate=1000.0))]
    ticks.append(signals(at=115.0, p=prefill(uncached_tokens_rate=400_000.0)))
    config = replace(CONFIG, max_trend=0.5, peak_half_life_s=0.0)
    state, est = run(*ticks, config=config)
    assert est.prefill.steady_demand is not None
    level = state.prefill_demand.level
    headroom = config.prefill_surprise * state.prefill_demand.deviation
    assert state.prefill_demand.ahead(config.horizon_s) > 1.5 * level  # the burst's slope, unbounded
    assert est.prefill.steady_demand == pytest.approx(1.5 * level + headroom)


def burst_then_lull(lull_ticks: int) -> list[ServiceSignals]:
    """Prefill at 100k uncached tokens/s, a burst to 1M for three ticks, then back to 100k for `lull_ticks`."""
    loads = [100_000.0] * 4 + [1_000_000.0] * 3 + [100_000.0] * lull_ticks
    return [signals(at=100.0 + 15 * i, p=prefill(uncached_tokens_rate=load)) for i, load in enumerate(loads)]


def test_after_a_burst_the_steady_demand_holds_the_burst_not_the_burst_plus_its_surprise() -> None:
    # One tick after the burst: the deviation is the burst's own jump, so level + headroom would be about twice
    # the burst (what the unbounded model holds); the bound keeps the reserve at the burst's size.
    _, unbounded = run(*burst_then_lull(1), config=replace(CONFIG, peak_half_life_s=0.0))
    state, est = run(*burst_then_lull(1))
    assert unbounded.prefill.steady_demand is not None and unbounded.prefill.steady_demand > 1_400_000.0
    assert state.prefill_demand.peak == pytest.approx(1_000_000.0 * 0.5 ** (15.0 / CONFIG.peak_half_life_s))
    assert est.prefill.steady_demand == pytest.approx(state.prefill_demand.peak)
    # Scaling up still adds the whole headroom to the latest window: a burst's ramp keeps its reserve.
    _, rising = run(*burst_then_lull(0)[:5])
    assert rising.prefill.demand is not None and rising.prefill.demand > 1_400_000.0


def test_the_peak_fades_with_its_half_life_and_the_level_is_never_cut() -> None:
    # 900 s (sixty ticks) after the burst its peak has halved; the reserve below it is the headroom's.
    state, est = run(*burst_then_lull(60))
    peak = state.prefill_demand.peak
    assert peak == pytest.approx(500_000.0, rel=0.02)
    forecast = state.prefill_demand
    assert est.prefill.steady_demand == pytest.approx(
        min(forecast.level + CONFIG.prefill_surprise * forecast.deviation, peak)
    )
    # A level above a faded peak (demand that stays up) is kept whole: the bound only trims the headroom.
    flat = [signals(at=100.0 + 15 * i, p=prefill(uncached_tokens_rate=200_000.0)) for i in range(3)]
    state, est = run(*flat, config=replace(CONFIG, peak_half_life_s=1e-6))
    assert est.prefill.steady_demand is not None
    assert est.prefill.steady_demand >= state.prefill_demand.level


def test_a_growing_prefill_queue_is_arriving_demand_a_standing_one_only_drains() -> None:
    # No smoothing and no headroom, so demand is exactly this tick's measurement.
    raw = replace(CONFIG, level_gain=1.0, trend_gain=0.0, prefill_surprise=0.0)
    first = signals(at=100.0, p=prefill(waiting=0.0))
    growing = signals(at=115.0, p=prefill(waiting=300.0))
    standing = signals(at=130.0, p=prefill(waiting=300.0))
    _, grew = run(first, growing, config=raw)
    _, stood = run(first, growing, standing, config=raw)
    # 300 queued 1000-token prompts, 300k tokens: they appeared within 15 s (20k tokens/s of arrivals the pool
    # did not serve), and they keep their engines busy for 300k / 45 s (the horizon) of its capacity.
    drain = 300_000.0 / raw.horizon_s
    assert grew.prefill.demand == pytest.approx(100_000.0 + 20_000.0 + drain)
    # The same queue a tick later is no new arrival: it still has to drain, but nothing more.
    assert stood.prefill.demand == pytest.approx(100_000.0 + drain)


def test_a_draining_prefill_queue_is_computed_on_top_of_arrivals_and_leaves_no_peak() -> None:
    raw = replace(CONFIG, level_gain=1.0, trend_gain=0.0, prefill_surprise=0.0)
    piled = signals(at=100.0, p=prefill(waiting=300.0))
    # New replicas work the 300 queued prompts off within a tick: the pool computes 120 prompts (120k tokens) a
    # second, 20 of them the backlog's, so 100 arrived.
    draining = signals(at=115.0, p=prefill(waiting=0.0, uncached_tokens_rate=120_000.0, request_rate=120.0))
    state, est = run(piled, draining, config=raw)
    assert est.prefill.offered == pytest.approx(100_000.0)
    assert est.prefill.arrival_rate == pytest.approx(100.0)
    assert est.prefill.demand == pytest.approx(100_000.0)
    # The backlog counted in the first tick's demand (what to drain), never in the forecast or its peak: once it
    # has drained, the reserve is bounded by what arrived, not by arrivals plus a spread backlog.
    assert state.prefill_demand.peak == pytest.approx(100_000.0)
    _, first = run(piled, config=raw)
    assert first.prefill.demand == pytest.approx(100_000.0 + 300_000.0 / raw.horizon_s)
    assert first.prefill.steady_demand == first.prefill.demand


def test_the_backlog_change_is_read_over_the_rate_window_not_one_tick() -> None:
    # Ticks every 2 s, rates over the last 6 s: 60 prompts queued within the last tick are 60k tokens over the
    # window the computed tokens are averaged over (10k tokens/s), not 30k/s over the tick.
    raw = replace(CONFIG, level_gain=1.0, trend_gain=0.0, prefill_surprise=0.0)
    ticks = [
        replace(signals(at=100.0 + 2 * i, p=prefill(waiting=60.0 if i == 4 else 0.0)), window_s=6.0) for i in range(5)
    ]
    state, est = run(*ticks, config=raw)
    assert est.prefill.offered == pytest.approx(100_000.0 + 10_000.0)
    # Only the ticks of the last window are kept (from the one at its start).
    assert [at for at, _ in state.prefill_backlog] == [102.0, 104.0, 106.0, 108.0]


def test_a_prefill_queue_in_the_routers_is_the_same_backlog_as_one_in_the_engines() -> None:
    # Late binding moves the queue from the engines (vllm:num_requests_waiting) to the routers
    # (pdserve_router_queue_prompt_tokens): the pool must be sized for it all the same.
    raw = replace(CONFIG, level_gain=1.0, trend_gain=0.0, prefill_surprise=0.0)
    first = signals(at=100.0)
    in_engines = signals(at=115.0, p=prefill(waiting=300.0))
    routed = RouterSignals(ttft_s=0.3, ttft_pd_s=0.3, itl_s=0.02, request_rate=100.0, queued_prefill_tokens=300_000.0)
    in_routers = signals(at=115.0, router=routed)
    _, engines = run(first, in_engines, config=raw)
    _, routers = run(first, in_routers, config=raw)
    assert engines.prefill.demand is not None and engines.prefill.demand > 100_000.0
    assert routers.prefill.demand == pytest.approx(engines.prefill.demand)


def test_requests_waiting_in_the_routers_for_a_decode_sequence_are_decode_demand() -> None:
    _, calm = run(signals())
    routed = RouterSignals(ttft_s=0.3, ttft_pd_s=0.3, itl_s=0.02, request_rate=100.0, queued_decode_requests=80.0)
    _, queued = run(signals(router=routed))
    assert calm.decode.demand is not None and queued.decode.demand is not None
    assert queued.decode.demand - calm.decode.demand == pytest.approx(2000.0)


def test_requests_waiting_for_a_decode_slot_are_decode_demand() -> None:
    _, calm = run(signals())
    _, queued = run(signals(d=decode(waiting_capacity=80.0, waiting=80.0)))
    assert calm.decode.demand is not None and queued.decode.demand is not None
    # Each would generate at the ITL target: 80 / 40 ms = 2000 tokens/s.
    assert queued.decode.demand - calm.decode.demand == pytest.approx(2000.0)


def test_kv_usage_from_waiting_on_handoffs_does_not_scale_decode() -> None:
    # llm-d's finding: decode KV usage read 0.72-0.98 while decode only waited on KV handoffs.
    idle = decode(generated_tokens_rate=2000.0, kv_usage=0.95, waiting_deferred=60.0, waiting=60.0)
    _, est = run(signals(d=idle))
    _, low = run(signals(d=decode(generated_tokens_rate=2000.0, kv_usage=0.1)))
    assert est.decode.required == pytest.approx(low.decode.required)
    assert est.decode.required is not None and est.decode.required < 1.0
    assert any("KV handoffs" in note for note in est.decode.notes)


# ---------------------------------------------------------------------------------------------- attribution


@dataclass(frozen=True)
class Attribution:
    case: str
    p: dict[str, Any]
    d: dict[str, Any]
    router: RouterSignals
    cause: Cause
    prefill_breach: bool
    decode_breach: bool


ATTRIBUTION = [
    Attribution("no breach", {}, {}, RouterSignals(ttft_s=0.3, ttft_pd_s=0.3, itl_s=0.02), Cause.NONE, False, False),
    Attribution(
        "prefill queueing",
        {"engine_ttft_s": 1.1},
        {},
        RouterSignals(ttft_s=1.2, ttft_pd_s=1.2, itl_s=0.02),
        Cause.PREFILL,
        True,
        False,
    ),
    Attribution(
        "waiting for a decode slot",
        {"engine_ttft_s": 0.2},
        {"waiting_capacity": 40.0, "queue_time_s": 0.9},
        RouterSignals(ttft_s=1.2, ttft_pd_s=1.2, itl_s=0.03),
        Cause.DECODE_SLOT,
        False,
        True,
    ),
    Attribution(
        "late binding: prefill requests wait in the routers, the engines' own TTFT is fine",
        {"engine_ttft_s": 0.2},
        {},
        RouterSignals(ttft_s=1.2, ttft_pd_s=1.2, itl_s=0.02, queued_prefill_requests=30.0),
        Cause.PREFILL,
        True,
        False,
    ),
    Attribution(
        "late binding: requests wait in the routers for a decode sequence",
        {"engine_ttft_s": 0.2},
        {},
        RouterSignals(ttft_s=1.2, ttft_pd_s=1.2, itl_s=0.02, queued_decode_requests=20.0),
        Cause.DECODE_SLOT,
        False,
        True,
    ),
    Attribution(
        "late binding: a queue in the routers but clients within target",
        {"engine_ttft_s": 0.2},
        {},
        RouterSignals(ttft_s=0.5, ttft_pd_s=0.5, itl_s=0.02, queued_prefill_requests=30.0),
        Cause.NONE,
        False,
        False,
    ),
    Attribution(
        "slow KV pulls",
        {"engine_ttft_s": 0.2},
        {"kv_transfer_s": 0.9},
        RouterSignals(ttft_s=1.2, ttft_pd_s=1.2, itl_s=0.02),
        Cause.KV_TRANSFER,
        False,
        False,
    ),
    Attribution(
        "slow decode steps",
        {"engine_ttft_s": 0.2},
        {"engine_itl_s": 0.06},
        RouterSignals(ttft_s=1.0, ttft_pd_s=1.0, itl_s=0.06),
        Cause.DECODE_ITL,
        False,
        True,
    ),
]


@pytest.mark.parametrize("case", ATTRIBUTION, ids=[c.case for c in ATTRIBUTION])
def test_ttft_breach_attribution(case: Attribution) -> None:
    _, est = run(signals(p=prefill(**case.p), d=decode(**case.d), router=case.router))
    assert est.ttft_cause is case.cause
    assert est.prefill.breach is case.prefill_breach
    assert est.decode.breach is case.decode_breach


def test_a_decode_caused_ttft_breach_leaves_prefill_demand_alone() -> None:
    calm = signals()
    breach = signals(
        d=decode(waiting_capacity=40.0, queue_time_s=0.9),
        router=RouterSignals(ttft_s=2.0, ttft_pd_s=2.0, itl_s=0.03),
    )
    _, before = run(calm)
    _, after = run(breach)
    assert after.ttft_cause is Cause.DECODE_SLOT
    assert after.prefill.required == pytest.approx(before.prefill.required)
    assert not after.prefill.breach


def test_prefill_budget_leaves_room_for_the_handoff() -> None:
    budget = prefill_budget_s(CONFIG, 2000.0)
    kv = H200_8B.kv_transfer_s(2000.0)
    assert budget == pytest.approx(SLO.ttft_s - kv - 2 * SLO.itl_s)
    assert math.isclose(kv, 2000 * 131072 / 50e9)


def test_decode_is_sized_for_what_prefill_is_being_sent() -> None:
    # Prefill now receives 200 requests/s (1000 uncached tokens each) while decode still sees the 100 requests/s
    # of before (200 output tokens each): decode's demand is what is coming, 200 x 200 tokens/s.
    jump = prefill(uncached_tokens_rate=200_000.0, prompt_tokens_rate=200_000.0, request_rate=200.0)
    raw = replace(CONFIG, level_gain=1.0, trend_gain=0.0, prefill_surprise=0.0, decode_surprise=0.0)
    _, est = run(signals(p=jump), config=raw)
    assert est.decode.demand == pytest.approx(200 * 200.0)
    assert any("arriving at prefill" in note for note in est.decode.notes)
    _, calm = run(signals(), config=raw)
    assert calm.decode.demand == pytest.approx(20_000.0)


# ------------------------------------------------------------------------ decode capacity with long outputs


def _true_decode_capacity(timing: TimingParams, context: float, target_s: float) -> float:
    """Tokens per second one decode replica of the simulator generates with its steps at `target_s`, when its
    running sequences hold `context` tokens each: the largest batch whose step (one that admits a request, as
    the tail steps under load do) fits the target, within max_num_seqs and the KV cache."""
    slots = min(timing.max_num_seqs, int(timing.num_kv_blocks * timing.block_size / context))
    batch = max(
        (b for b in range(1, slots + 1) if timing.step_seconds(1, b, round(b * context)) <= target_s), default=1
    )
    return batch / timing.step_seconds(1, batch, round(batch * context))


@dataclass
class _DecodeProbe:
    """A fixed-size service that runs the model every tick beside the simulator's own truth."""

    name: str
    size: tuple[int, int]
    config: ModelConfig
    replay: ReplayCluster | None = None
    state: ModelState = field(default_factory=ModelState)
    #: (time, model capacity per replica, true capacity per replica, required replicas, completions in window)
    ticks: list[tuple[float, float, float, float, float]] = field(default_factory=list)

    def tick(self, observation: Observation) -> tuple[int, int]:
        self.state, est = estimate(self.config, self.state, observation.signals)
        assert self.replay is not None
        engines = [r.engine for r in self.replay.replicas["decode"] if isinstance(r.engine, DecodeEngine)]
        batch = sum(e.batch for e in engines)
        pool = observation.signals.decode
        if batch and est.decode.required is not None and pool.request_rate is not None:
            context = sum(e.context for e in engines) / batch
            truth = _true_decode_capacity(H200_8B_TIMING, context, self.config.slo.itl_s * self.config.target_fraction)
            completions = pool.request_rate * observation.signals.window_s
            self.ticks.append(
                (observation.at, est.decode.capacity_per_replica, truth, est.decode.required, completions)
            )
        return self.size


def test_decode_capacity_holds_with_long_outputs_and_few_completions_per_window() -> None:
    # Long streams (16k output tokens on average, ~7 minutes each) at 0.3 requests/s on two decode replicas:
    # ~100 streams run at once, yet the replay's 30 s window sees about eight of them finish. Tokens per finished
    # request swings with those few completions; the batch decode holds does not. The simulator's truth is its
    # cost model at the context its running sequences actually hold.
    rng = random.Random(7)
    requests: list[Request] = []
    at = 0.0
    while at < 900.0:
        at += rng.expovariate(0.3)
        requests.append(Request(at, 1000, int(rng.uniform(8_000, 24_000))))
    profile = profile_from_timing(H200_8B_TIMING)
    config = ModelConfig(slo=SLO, interval_s=INTERVAL_S, prefill_profile=profile, decode_profile=profile)
    probe = _DecodeProbe("probe", (2, 2), config)
    replay = ReplayCluster(ReplayConfig(H200_8B_TIMING, H200_8B_TIMING, SLO, (2, 2)), requests, probe)
    probe.replay = replay
    outcome = replay.run()
    assert outcome.attainment(SLO) == 1.0  # two replicas are enough: the ITL stays in target throughout

    # The steady part: every stream of the first minutes has had time to finish, arrivals still come.
    steady = [t for t in probe.ticks if 600.0 <= t[0] <= 900.0]
    assert len(steady) >= 15
    assert sum(t[4] for t in steady) / len(steady) < 10  # few completions per window
    errors = [model / truth for _, model, truth, _, _ in steady]
    assert all(0.8 <= e <= 1.25 for e in errors), [f"{e:.2f}" for e in errors]
    # And the pool it asks for is the one that carries the load (2), not a multiple of it.
    assert max(t[3] for t in steady) <= 3.0, [f"{t[3]:.1f}" for t in steady]


def test_kv_held_for_handoffs_does_not_shrink_decode_capacity() -> None:
    # 100 sequences of ~2000 tokens per replica hold 200k tokens of KV; 60 more requests wait on their KV pull
    # with 1000-token prompts reserved. The batch is the same either way, so is the capacity.
    kv = H200_8B.kv_cache_tokens
    running = tuple(
        PodSample(f"d-{i}", load=4000.0, latency_s=0.02, running=100.0, kv_usage=200_000 / kv) for i in range(4)
    )
    waiting = tuple(replace(p, kv_usage=(200_000 + 15 * 1000) / kv) for p in running)
    _, calm = run(signals(d=decode(pods=running)))
    _, pulling = run(signals(d=decode(pods=waiting, waiting_deferred=60.0, waiting=60.0)))
    assert pulling.decode.capacity_per_replica == pytest.approx(calm.decode.capacity_per_replica, rel=1e-6)


def test_long_streams_are_sized_for_prefill_arrivals_by_decode_load_not_tokens_per_finished_request() -> None:
    # 200 streams of ~16k tokens: 8k tokens/s, and this window saw 1.5 of them finish where 7.5 were due.
    # Prefill's queue grew by 7.5 requests in 15 s: requests arrive at twice the rate it hands on, so decode's
    # load is heading for twice what it is, not for arrivals x 8000 / 0.1 tokens.
    raw = replace(CONFIG, level_gain=1.0, trend_gain=0.0, prefill_surprise=0.0, decode_surprise=0.0)
    slow = dict(request_rate=0.5, prompt_tokens_rate=500.0, uncached_tokens_rate=500.0, prompt_tokens_quantile=1000.0)
    long = decode(request_rate=0.1, prompt_tokens_rate=100.0, generated_tokens_rate=8000.0, running=200.0)
    _, est = run(
        signals(at=100.0, p=prefill(**slow, waiting=0.0), d=long),
        signals(at=115.0, p=prefill(**slow, waiting=7.5), d=long),
        config=raw,
    )
    assert est.prefill.arrival_rate == pytest.approx(1.0)
    assert est.decode.demand == pytest.approx(2 * 8000.0)
    assert any("arriving at prefill" in note for note in est.decode.notes)
