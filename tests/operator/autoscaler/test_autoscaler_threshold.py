"""The disaggregation threshold as the autoscaler's output: up while prefill is short and decode can take the
local prefills, down when decode's ITL nears its target, back to the configured value, always within the bounds."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.api.defaults import effective
from pdserve.api.router_config import RouterControl
from pdserve.api.v1alpha1 import PDService
from pdserve_operator.autoscaler.core import Autoscaler
from pdserve_operator.autoscaler.model import H200_8B, ModelConfig, Slo
from pdserve_operator.autoscaler.report import ScalingReport, ThresholdReport, threshold_view
from pdserve_operator.autoscaler.signals import PoolSignals, RouterSignals, ServiceSignals
from pdserve_operator.autoscaler.threshold import ThresholdConfig, ThresholdReason, local_prefill_cost_s
from tests.operator.autoscaler.test_autoscaler_core import configure, service

ITL_TARGET_S = 0.040


def bounded(low: int | None, high: int | None, configured: int = 256) -> PDService:
    """Both pools autoscaled, the threshold `configured` and free to move within [low, high]."""
    bounds = {key: value for key, value in (("minTokens", low), ("maxTokens", high)) if value is not None}
    return service(
        prefill={"autoscaling": {"enabled": True}},
        decode={"autoscaling": {"enabled": True}},
        router={"routing": {"disaggregationThreshold": configured}},
        autoscaling={"disaggregationThreshold": bounds},
    )


def autoscaler(low: int | None = 256, high: int | None = 2048, configured: int = 256) -> Autoscaler:
    return Autoscaler(configure(bounded(low, high, configured)))


def signals(at: float, *, itl_s: float | None = 0.010, queued: float = 0.0, **prefill: Any) -> ServiceSignals:
    """A tick with decode's ITL at `itl_s` and `queued` requests held in the routers for a prefill engine."""
    return ServiceSignals(
        at=at,
        window_s=15.0,
        percentile=90,
        prefill=PoolSignals(role="prefill", desired=1, ready=1, **prefill),
        decode=PoolSignals(role="decode", desired=1, ready=1),
        router=RouterSignals(itl_s=itl_s, queued_prefill_requests=queued),
    )


def run(scaler: Autoscaler, ticks: list[ServiceSignals]) -> list[tuple[int, ThresholdReason]]:
    trace = []
    for tick in ticks:
        decision = scaler.step(tick)
        assert decision.threshold is not None
        trace.append((decision.threshold.desired, decision.threshold.reason))
    return trace


def test_prefill_short_doubles_it_up_to_the_bound_then_it_comes_back() -> None:
    scaler = autoscaler()
    burst = run(scaler, [signals(15.0 * i, queued=40) for i in range(3)])
    # 1024 -> 2048 tokens would add 1024 x 32 us = 33 ms to decode's 10 ms steps: past 0.9 x 40 ms.
    assert burst == [
        (512, ThresholdReason.PREFILL_SHORT),
        (1024, ThresholdReason.PREFILL_SHORT),
        (1024, ThresholdReason.NO_DECODE_HEADROOM),
    ]
    calm = run(scaler, [signals(45.0 + 15.0 * i) for i in range(3)])
    assert calm == [(512, ThresholdReason.STEADY), (256, ThresholdReason.RECOVERED), (256, ThresholdReason.CONFIGURED)]


def test_up_to_the_upper_bound_and_held_there() -> None:
    scaler = autoscaler(high=1024)
    trace = run(scaler, [signals(15.0 * i, itl_s=0.002, queued=40) for i in range(3)])
    assert trace == [
        (512, ThresholdReason.PREFILL_SHORT),
        (1024, ThresholdReason.PREFILL_SHORT),
        (1024, ThresholdReason.STEADY),
    ]


def test_a_prefill_ttft_breach_and_demand_beyond_the_ready_replicas_are_prefill_short() -> None:
    [(value, reason)] = run(autoscaler(), [signals(0.0, engine_ttft_s=5.0)])
    assert (value, reason) == (512, ThresholdReason.PREFILL_SHORT)
    decision = autoscaler().step(
        signals(0.0, uncached_tokens_rate=60_000.0, request_rate=15.0, prompt_tokens_rate=60_000.0)
    )
    assert decision.threshold is not None and decision.threshold.desired == 512, decision.threshold
    assert "replicas, 1 ready" in decision.threshold.message


def test_decode_itl_near_its_target_halves_it_even_while_prefill_is_short() -> None:
    scaler = autoscaler(low=128)
    run(scaler, [signals(15.0 * i, queued=40) for i in range(2)])  # 1024
    at_risk = ITL_TARGET_S * 0.95
    trace = run(scaler, [signals(30.0 + 15.0 * i, itl_s=at_risk, queued=40) for i in range(5)])
    assert [value for value, _ in trace] == [512, 256, 128, 128, 128]
    assert trace[0][1] is ThresholdReason.DECODE_ITL_AT_RISK
    # At the lower bound, below the configured 256: prefill is short, but decode has no room to go back.
    assert trace[-1][1] is ThresholdReason.NO_DECODE_HEADROOM


def test_no_raise_when_the_local_prefills_would_take_decode_past_its_target() -> None:
    # 256 -> 512 tokens adds 256 x 32 us = 8.2 ms to the steps that carry them: 30 ms + 8.2 ms > 0.9 x 40 ms.
    assert local_prefill_cost_s(ModelConfig(slo=Slo(0.8, 0.04), interval_s=15.0), 256, 512) == pytest.approx(
        256 * H200_8B.prefill_per_token_s
    )
    decision = autoscaler().step(signals(0.0, itl_s=0.030, queued=40))
    assert decision.threshold is not None
    assert (decision.threshold.desired, decision.threshold.reason) == (256, ThresholdReason.NO_DECODE_HEADROOM)
    assert "would pass 36 ms" in decision.threshold.message, decision.threshold.message
    # With 25 ms there is room: 25 + 8.2 < 36.
    decision = autoscaler().step(signals(0.0, itl_s=0.025, queued=40))
    assert decision.threshold is not None and decision.threshold.desired == 512


def test_the_chunk_budget_caps_the_charge() -> None:
    model = ModelConfig(slo=Slo(0.8, 0.04), interval_s=15.0)
    budget = H200_8B.max_num_batched_tokens
    assert local_prefill_cost_s(model, budget, 4 * budget) == 0.0
    assert local_prefill_cost_s(model, budget // 2, 4 * budget) == pytest.approx(
        budget / 2 * H200_8B.prefill_per_token_s
    )


def test_unknown_decode_itl_raises_nothing_but_still_comes_back() -> None:
    scaler = autoscaler()
    [(value, reason)] = run(scaler, [signals(0.0, itl_s=None, queued=40)])
    assert (value, reason) == (256, ThresholdReason.METRICS_UNAVAILABLE)
    run(scaler, [signals(15.0, queued=40)])  # 512
    [(value, reason)] = run(scaler, [signals(30.0, itl_s=None)])
    assert (value, reason) == (256, ThresholdReason.RECOVERED)


def test_fixed_bounds_decide_nothing_and_a_configured_value_outside_them_is_clamped() -> None:
    assert autoscaler(low=None, high=None).step(signals(0.0, queued=40)).threshold is None
    assert autoscaler(low=512, high=512).step(signals(0.0, queued=40)).threshold is None
    assert configure(bounded(512, 4096)).threshold == ThresholdConfig(base=512, minimum=512, maximum=4096)
    assert configure(bounded(None, 1024)).threshold == ThresholdConfig(base=256, minimum=256, maximum=1024)
    assert configure(bounded(0, 1024, configured=8192)).threshold == ThresholdConfig(1024, 0, 1024)


def test_a_previous_leaders_value_is_where_it_starts() -> None:
    pds = service(
        prefill={"autoscaling": {"enabled": True}},
        autoscaling={"disaggregationThreshold": {"maxTokens": 4096}},
    )
    config = configure(pds)
    assert Autoscaler(config, threshold=1024).threshold == 1024
    assert Autoscaler(config, threshold=100_000).threshold == 4096
    decision = Autoscaler(config, threshold=1024).step(signals(0.0))
    assert decision.threshold is not None
    assert (decision.threshold.current, decision.threshold.desired) == (1024, 512)
    assert decision.threshold.event() == (
        "Disaggregation threshold 1024 -> 512 tokens: prefill has capacity again: back toward the configured 256 tokens"
    )


def test_status_says_the_threshold_and_why_the_autoscaler_does_not_choose_it() -> None:
    spec = effective(bounded(512, 4096).spec)
    assert threshold_view(effective(service().spec), None) is None  # no bounds: nothing to report
    waiting = threshold_view(spec, None)
    assert waiting is not None and (waiting["tokens"], waiting["reason"]) == (512, "Configured")
    assert waiting["message"].endswith("the autoscaler has not decided yet")
    blind = threshold_view(spec, None, configured=False)
    assert blind is not None and "--prometheus-url" in blind["message"]
    unscaled = threshold_view(
        effective(service(autoscaling={"disaggregationThreshold": {"maxTokens": 1024}}).spec), None
    )
    assert unscaled is not None and "no pool is scaled by pdserve" in unscaled["message"]
    # A previous leader's report is kept while the bounds are the same, not once they changed.
    previous = {"disaggregationThreshold": {**waiting, "tokens": 2048, "reason": "PrefillShort"}}
    assert threshold_view(spec, None, previous) == previous["disaggregationThreshold"]
    moved = threshold_view(effective(bounded(512, 1024).spec), None, previous)
    assert moved is not None and moved["tokens"] == 512
    report = ScalingReport({}, (), ThresholdReport(1024, 512, 4096, "PrefillShort", "prefill short", "t", "why"))
    decided = threshold_view(spec, report)
    assert decided == {
        "tokens": 1024,
        "minTokens": 512,
        "maxTokens": 4096,
        "reason": "PrefillShort",
        "message": "prefill short",
        "lastChangeTime": "t",
    }
    assert report.threshold is not None
    assert report.threshold.control() == RouterControl(disaggregation_threshold=1024, reason="why", decided_at="t")
