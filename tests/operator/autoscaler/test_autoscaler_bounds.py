"""The autoscaler under hostile or broken inputs: every value bounded by what the replicas can physically do.

Issue 18 item 4: one tick reading 1e6 / 1e8 / 1e12 tok/s held prefill at maxReplicas for 11 / 34 / 79 minutes
(the demand filter remembered the surprise), and finite extremes (1e308) raised inside a tick. The table tests
drive `Autoscaler.step` (bounds, model and policy together, as the operator's loop does) through a steady service
with one absurd tick; the property test feeds every field anything a float can be.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve_operator.autoscaler.bounds import MARGIN, bounded, limits_of
from pdserve_operator.autoscaler.core import Autoscaler, AutoscalerConfig
from pdserve_operator.autoscaler.decision import Decision, Reason
from pdserve_operator.autoscaler.model import H200_8B, ModelConfig, Slo
from pdserve_operator.autoscaler.policy import PolicyConfig, PoolBounds
from pdserve_operator.autoscaler.signals import PodSample, PoolSignals, RouterSignals, ServiceSignals

INTERVAL_S = 15.0
START = 1_800_000_000.0
CONFIG = AutoscalerConfig(
    model=ModelConfig(slo=Slo(ttft_s=0.8, itl_s=0.04), interval_s=INTERVAL_S),
    policy=PolicyConfig(prefill=PoolBounds(1, 8), decode=PoolBounds(1, 16)),
    warmup_s=60.0,
    window_s=INTERVAL_S,
)
STEADY = 10_000.0  # uncached prompt tok/s: one prefill replica's worth


def service(at: float, prefill_load: float, prefill_replicas: int, decode_replicas: int = 2) -> ServiceSignals:
    """A chat service at `at`: prefill computing `prefill_load` tok/s over its replicas (2000-token prompts, 200
    tokens out), decode generating for it, every pod settled and fresh."""
    requests = STEADY / 2000
    pods = tuple(
        PodSample(f"p-{i}", load=prefill_load / prefill_replicas, latency_s=0.2, running=1.0, waiting=0.0,
                  kv_usage=0.1, sample_age_s=1.0, settled=True)
        for i in range(prefill_replicas)
    )  # fmt: skip
    prefill = PoolSignals(
        "prefill",
        prefill_replicas,
        ready=prefill_replicas,
        pods=pods,
        request_rate=requests,
        prompt_tokens_rate=STEADY,
        uncached_tokens_rate=prefill_load,
        generated_tokens_rate=requests,
        prompt_tokens_quantile=2000.0,
        running=float(prefill_replicas),
        waiting=0.0,
        waiting_capacity=0.0,
        waiting_deferred=0.0,
        kv_usage=0.1,
        engine_ttft_s=0.2,
        freshness_s=1.0,
        completeness=1.0,
    )
    decode = PoolSignals(
        "decode",
        decode_replicas,
        ready=decode_replicas,
        request_rate=requests,
        prompt_tokens_rate=STEADY,
        uncached_tokens_rate=1.0,
        generated_tokens_rate=requests * 200,
        running=40.0,
        waiting=0.0,
        waiting_capacity=0.0,
        waiting_deferred=0.0,
        kv_usage=0.2,
        engine_itl_s=0.02,
        freshness_s=1.0,
        completeness=1.0,
    )
    router = RouterSignals(ttft_s=0.3, ttft_pd_s=0.3, itl_s=0.02, request_rate=requests, freshness_s=1.0)
    return ServiceSignals(at, INTERVAL_S, 90, prefill, decode, router)


def run(ticks: int, spike: tuple[int, float] | None = None) -> list[Decision]:
    """`ticks` ticks of the steady service, the replicas following each decision; at tick `spike[0]` prefill
    reads `spike[1]` tok/s instead."""
    autoscaler, prefill, decode, decisions = Autoscaler(CONFIG), 1, 2, []
    for tick in range(ticks):
        load = spike[1] if spike is not None and tick == spike[0] else STEADY
        decision = autoscaler.step(service(START + INTERVAL_S * tick, load, prefill, decode))
        prefill, decode = decision.prefill.desired, decision.decode.desired
        decisions.append(decision)
    return decisions


@pytest.mark.parametrize("load", [1e6, 1e8, 1e12, 1e308])
def test_one_absurd_tick_moves_no_pool(load: float) -> None:
    """One prefill replica cannot compute `load` tok/s: the tick holds both pools' sizes and says why, and every
    later tick decides exactly what it would have without that tick (the demand filter never saw it)."""
    baseline, spiked = run(80), run(80, spike=(20, load))
    decision = spiked[20].prefill
    assert (decision.reason, decision.desired, decision.current) == (Reason.METRICS_UNAVAILABLE, 1, 1)
    ceiling = limits_of(H200_8B, CONFIG.model.horizon_s).tokens_per_s
    assert f"uncached_tokens_rate: {load:.3g} tok/s is beyond what 1 replica(s) can compute" in decision.message
    assert f"({ceiling:.3g} tok/s at most)" in decision.message
    sizes = [(d.prefill.desired, d.decode.desired) for d in spiked]
    assert sizes == [(d.prefill.desired, d.decode.desired) for d in baseline]
    assert max(prefill for prefill, _ in sizes) == 1


def test_a_value_past_the_bound_is_dropped_and_named_one_within_it_is_kept() -> None:
    limits = limits_of(H200_8B, CONFIG.model.horizon_s)
    assert limits.tokens_per_s == MARGIN * H200_8B.prefill_saturation()  # prefill's ceiling is the larger one
    signals = service(START, STEADY, 2)
    within = replace(signals, prefill=replace(signals.prefill, uncached_tokens_rate=2 * limits.tokens_per_s * 0.99))
    assert bounded(within, CONFIG.model) == within  # nothing to remove
    beyond = replace(
        signals,
        prefill=replace(signals.prefill, uncached_tokens_rate=2.01 * limits.tokens_per_s, kv_usage=1.5),
        decode=replace(signals.decode, running=-1.0, engine_itl_s=math.nan, waiting=math.inf),
        router=replace(signals.router, ttft_s=1e9),
    )
    checked = bounded(beyond, CONFIG.model)
    assert checked.prefill.uncached_tokens_rate is None and checked.prefill.kv_usage is None
    assert checked.decode.running is None and checked.decode.engine_itl_s is None and checked.decode.waiting is None
    assert checked.router.ttft_s is None
    assert checked.prefill.prompt_tokens_rate == STEADY  # the rest is untouched
    # Out of range values are named; a missing or non-finite one is simply not observed.
    assert [error.split(":")[0] for error in checked.errors] == [
        "prefill uncached_tokens_rate",
        "prefill kv_usage",
        "decode running",
        "router ttft_s",
    ]
    assert checked.failed_queries == ()  # not a query failure: the loop does not back off for it


def test_a_pod_sample_past_one_replicas_bound_teaches_the_model_nothing() -> None:
    signals = service(START, STEADY, 1)
    forged = replace(signals.prefill.pods[0], load=1e9)
    checked = bounded(replace(signals, prefill=replace(signals.prefill, pods=(forged,))), CONFIG.model)
    assert checked.prefill.pods[0].load is None and checked.prefill.settled_pairs() == []
    assert any(error.startswith("prefill pod p-0 load: 1e+09 tok/s") for error in checked.errors)


# ---------------------------------------------------------------------------------------------- any input at all

ANY = st.one_of(
    st.none(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 1e308, -1e308, 1e12, math.inf, -math.inf, math.nan]),
)
SIZES = st.integers(min_value=0, max_value=64)


@st.composite
def pools(draw: st.DrawFn, role: str) -> PoolSignals:
    pods = tuple(
        PodSample(f"{role}-{i}", load=draw(ANY), latency_s=draw(ANY), running=draw(ANY), waiting=draw(ANY),
                  kv_usage=draw(ANY), sample_age_s=draw(ANY), settled=draw(st.booleans()))
        for i in range(draw(st.integers(min_value=0, max_value=3)))
    )  # fmt: skip
    fields = (
        "request_rate", "prompt_tokens_rate", "uncached_tokens_rate", "generated_tokens_rate",
        "prompt_tokens_quantile", "running", "waiting", "waiting_capacity", "waiting_deferred", "kv_usage",
        "engine_ttft_s", "engine_itl_s", "queue_time_s", "kv_transfer_s", "freshness_s",
    )  # fmt: skip
    values = {name: draw(ANY) for name in fields}
    completeness = draw(st.floats(allow_nan=True, allow_infinity=True))
    return PoolSignals(
        role,  # type: ignore[arg-type]
        draw(SIZES),
        ready=draw(SIZES),
        starting=draw(SIZES),
        pending=draw(st.integers(min_value=0, max_value=2)),
        pods=pods,
        completeness=completeness,
        **values,
    )


@st.composite
def ticks(draw: st.DrawFn) -> ServiceSignals:
    router = RouterSignals(*(draw(ANY) for _ in range(5)))
    return ServiceSignals(0.0, INTERVAL_S, 90, draw(pools("prefill")), draw(pools("decode")), router)


@settings(max_examples=400, deadline=None)
@given(st.lists(ticks(), min_size=1, max_size=4))
def test_no_input_raises_inside_a_tick_and_every_size_stays_within_bounds(inputs: list[ServiceSignals]) -> None:
    autoscaler = Autoscaler(CONFIG)
    for index, signals in enumerate(inputs):
        decision = autoscaler.step(replace(signals, at=START + INTERVAL_S * index))
        for pool, bounds in ((decision.prefill, CONFIG.policy.prefill), (decision.decode, CONFIG.policy.decode)):
            assert isinstance(pool.desired, int)
            assert bounds.min_replicas <= pool.desired <= bounds.max_replicas or pool.desired == pool.current
            assert pool.message.isprintable()
