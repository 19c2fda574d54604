"""The replayed service: routing, replica lifecycle and GPU-seconds, and each policy of the benchmark at work."""

from __future__ import annotations

import random

import pytest

from pdserve_dev.replay.cluster import ReplayCluster, ReplayConfig
from pdserve_dev.replay.observe import Observation
from pdserve_dev.replay.scalers import (
    HpaBehavior,
    HpaScaler,
    LlmdSloScaler,
    PdserveScaler,
    StaticScaler,
    _HpaState,
    profile_from_timing,
    static_peak,
)
from pdserve_dev.replay.trace import Request
from pdserve_operator.autoscaler.core import AutoscalerConfig
from pdserve_operator.autoscaler.model import H200_8B as PROFILE
from pdserve_operator.autoscaler.model import ModelConfig, Slo
from pdserve_operator.autoscaler.policy import PolicyConfig, PoolBounds
from pdserve_operator.autoscaler.threshold import ThresholdConfig
from pdserve_sim.presets import H200_8B
from tests.dev.replay_support import Script

SLO = Slo(ttft_s=0.8, itl_s=0.04, percentile=90)


def steady(rate: float, seconds: float, seed: int = 1, start: float = 0.0) -> list[Request]:
    rng = random.Random(seed)
    out: list[Request] = []
    at = start
    while True:
        at += rng.expovariate(rate)
        if at >= start + seconds:
            return out
        out.append(Request(at, rng.choice([100, 600, 1200, 3000]), rng.randint(20, 300)))


def config(initial: tuple[int, int], **changes: float) -> ReplayConfig:
    return ReplayConfig(H200_8B, H200_8B, SLO, initial, **changes)  # type: ignore[arg-type]


def test_profile_matches_the_simulator_preset() -> None:
    # The operator cannot import the simulator; this keeps its built-in prior and the preset in step.
    assert profile_from_timing(H200_8B) == PROFILE


def test_static_service_serves_everything_and_pays_for_every_second() -> None:
    requests = steady(40.0, 120.0)
    outcome = ReplayCluster(config((3, 2)), requests, StaticScaler(3, 2)).run()
    assert all(job.finished is not None for job in outcome.jobs)
    assert outcome.gpu_seconds == pytest.approx(5 * outcome.end_s)
    assert outcome.attainment(SLO) > 0.99
    routes = {job.route for job in outcome.jobs}
    assert routes == {"pd", "decode-only"}, "short prompts go straight to decode"


def test_new_replicas_cost_from_creation_and_drained_ones_until_idle() -> None:
    requests = steady(40.0, 240.0)
    script = Script([(0.0, (2, 2)), (60.0, (6, 2)), (150.0, (2, 2))])
    outcome = ReplayCluster(config((2, 2), startup_s=30.0), requests, script).run()
    assert all(job.finished is not None for job in outcome.jobs), "scale-down loses no request"
    assert outcome.actions == 2
    # 4 extra prefill replicas from t=60 (starting 30 s, then serving) until drained at or after t=150.
    base = 4 * outcome.end_s
    assert 4 * 90 - 1e-6 <= outcome.gpu_seconds - base <= 4 * 100
    ready_after_start = [t for t in outcome.timeline if 60 < t[0] < 90]
    assert all(row[3] == 2 for row in ready_after_start), "new replicas serve only after start-up"
    assert any(row[3] == 6 for row in outcome.timeline if 90 <= row[0] < 150)


def test_signals_are_the_autoscalers_own_types() -> None:
    script = Script([(0.0, (2, 2))])
    ReplayCluster(config((2, 2), window_s=15.0, warmup_s=30.0), steady(40.0, 90.0), script).run()
    late = script.seen[4].signals  # t = 75 s
    assert late.prefill.ready == 2 and late.decode.ready == 2
    assert late.prefill.uncached_tokens_rate and late.decode.generated_tokens_rate
    assert late.router.ttft_s is not None and late.router.itl_s is not None
    assert all(pod.settled for pod in late.prefill.pods), "ready 75 s > 30 s warm-up"
    assert not any(pod.settled for pod in script.seen[0].signals.decode.pods), "ready 15 s < 30 s warm-up"


def test_hpa_behavior_stabilizes_and_rate_limits() -> None:
    state = _HpaState(HpaBehavior())
    assert state.desired(0.0, 20, 2) == 6  # up: max(+100%, +4 pods) per 15 s
    assert state.desired(15.0, 3, 6) == 6  # down: the highest recommendation of the last 300 s
    assert state.desired(330.0, 3, 6) == 3
    llmd = _HpaState(HpaBehavior(down_window_s=0.0, down_percent=0.0, down_pods=1, down_period_s=120.0))
    assert llmd.desired(0.0, 1, 6) == 5
    assert llmd.desired(60.0, 1, 5) == 5, "one pod per 120 s"
    assert llmd.desired(121.0, 1, 5) == 4


def test_every_policy_runs_a_step_of_load() -> None:
    requests = steady(30.0, 200.0) + steady(90.0, 250.0, seed=2, start=200.0)
    requests.sort(key=lambda r: r.arrival)
    profile = profile_from_timing(H200_8B)
    replay = config((1, 1))
    model = ModelConfig(
        slo=SLO, interval_s=replay.interval_s, prefill_profile=profile, decode_profile=profile, horizon_s=45.0
    )
    peak = static_peak(model, requests, 60.0, 256)
    assert peak[0] >= 3 and peak[2] >= 180.0
    bounds = PolicyConfig(prefill=PoolBounds(1, 4 * peak[0]), decode=PoolBounds(1, 4 * peak[1]))
    results = {}
    for scaler in (
        HpaScaler(bounds),
        LlmdSloScaler(bounds, SLO.ttft_s, SLO.itl_s),
        PdserveScaler(AutoscalerConfig(model=model, policy=bounds, warmup_s=replay.warmup_s, window_s=replay.window_s)),
    ):
        outcome = ReplayCluster(replay, requests, scaler).run()
        assert all(job.finished is not None for job in outcome.jobs)
        assert max(row[1] for row in outcome.timeline) > 1, f"{scaler.name} never scaled prefill up"
        results[scaler.name] = outcome
    pdserve = results["pdserve"]
    # The step at 200 s triples the load: pdserve scales up on the first tick that sees it, and once the new
    # replicas serve (30 s start-up) requests meet the SLO again.
    sizes = {row[0]: row[1] + row[2] for row in pdserve.timeline}
    assert sizes[210.0] > sizes[195.0]
    late = [job for job in pdserve.jobs if job.arrival > 300.0]
    good = [j for j in late if j.first_token is not None and j.first_token - j.arrival <= SLO.ttft_s]
    assert len(good) / len(late) > 0.95


def test_attainment_is_the_clients_ttft_and_counts_shed_requests_as_misses() -> None:
    requests = steady(40.0, 60.0)
    outcome = ReplayCluster(config((3, 2)), requests, StaticScaler(3, 2)).run()
    good = outcome.attainment(SLO)
    # The TTFT judged is the client's: from the request's arrival at the router, not from an engine's admission.
    assert all(job.arrival == request.arrival for job, request in zip(outcome.jobs, requests, strict=True))
    slow = Slo(ttft_s=min(j.first_token - j.arrival for j in outcome.jobs if j.first_token) - 1e-9, itl_s=1.0)
    assert outcome.attainment(slow) == 0.0
    outcome.shed = len(outcome.jobs)
    assert outcome.attainment(SLO) == pytest.approx(good / 2), "a shed request is a miss"


class Publishing(Script):
    """A scripted scaler that also publishes a disaggregation threshold from a given time on."""

    def __init__(self, size: tuple[int, int], at: float, threshold: int) -> None:
        super().__init__([(0.0, size)])
        self.at, self.published = at, threshold
        self.threshold = 256

    def tick(self, observation: Observation) -> tuple[int, int]:
        if observation.at >= self.at:
            self.threshold = self.published
        return super().tick(observation)


def test_the_router_routes_by_the_threshold_a_scaler_published_at_its_last_tick() -> None:
    requests = steady(20.0, 120.0)
    outcome = ReplayCluster(config((2, 2)), requests, Publishing((2, 2), 60.0, 1000)).run()
    # Ticks every 15 s: the one at 60 s publishes 1000; 600-token prompts go decode-only from then on.
    assert outcome.thresholds == [(0.0, 256), (60.0, 1000)]
    middling = [job for job in outcome.jobs if job.prompt == 600]
    assert {job.route for job in middling if job.arrival < 60.0} == {"pd"}
    assert {job.route for job in middling if job.arrival > 60.0} == {"decode-only"}
    assert {job.route for job in outcome.jobs if job.prompt == 3000} == {"pd"}


def test_ticks_come_at_the_given_phase_and_the_router_uses_a_threshold_after_the_control_delay() -> None:
    # The closed loop's operator ticks at a phase of its own, and its routers see a new threshold a moment later:
    # the replay takes both. Ticks at 7, 22, 37, 52, 67 s; the one at 67 s publishes 1000, used from 67.4 s.
    requests = steady(20.0, 120.0)
    replay = config((2, 2), tick_phase_s=7.0, control_delay_s=0.4)
    outcome = ReplayCluster(replay, requests, Publishing((2, 2), 60.0, 1000)).run()
    assert [at for at, *_ in outcome.timeline][:3] == [7.0, 22.0, 37.0]
    assert outcome.thresholds == [(0.0, 256), (pytest.approx(67.4), 1000)]
    middling = [job for job in outcome.jobs if job.prompt == 600]
    assert {job.route for job in middling if job.arrival < 67.4} == {"pd"}
    assert {job.route for job in middling if job.arrival > 67.4} == {"decode-only"}


def test_a_tick_reads_what_prometheus_holds_a_moment_before_it() -> None:
    # A tick decides at its time from data metrics_lag_s old (the latest scrapes). Ticks at 7, 22, ... observe at
    # 6.5, 21.5, ...; a tick whose lag would reach before time 0 observes at 0.
    requests = steady(20.0, 60.0)
    script = Script([(0.0, (2, 2))])
    outcome = ReplayCluster(config((2, 2), tick_phase_s=7.0, metrics_lag_s=0.5), requests, script).run()
    assert [o.at for o in script.seen][:3] == [6.5, 21.5, 36.5]
    assert [at for at, *_ in outcome.timeline][:3] == [7.0, 22.0, 37.0]
    assert script.seen[1].signals.at == 21.5
    early = Script([(0.0, (2, 2))])
    ReplayCluster(config((2, 2), tick_phase_s=0.2, metrics_lag_s=0.5), requests, early).run()
    assert [o.at for o in early.seen][:2] == [0.0, 14.7]


def test_pdserve_with_threshold_bounds_moves_short_prompts_to_decode_while_prefill_is_short() -> None:
    # Prefill held at one replica (bounds 1-1) under more long prompts than it computes: the autoscaler's only
    # lever is the threshold, which it raises while decode's ITL has room for the local prefills.
    requests = steady(60.0, 180.0)
    profile = profile_from_timing(H200_8B)
    replay = config((1, 2))
    model = ModelConfig(slo=SLO, interval_s=replay.interval_s, prefill_profile=profile, decode_profile=profile)
    bounds = PolicyConfig(prefill=PoolBounds(1, 1), decode=PoolBounds(2, 2))
    limits = ThresholdConfig(base=256, minimum=256, maximum=2048)
    scaler = PdserveScaler(
        AutoscalerConfig(
            model=model, policy=bounds, warmup_s=replay.warmup_s, window_s=replay.window_s, threshold=limits
        )
    )
    outcome = ReplayCluster(replay, requests, scaler).run()
    assert max(value for _, value in outcome.thresholds) > 256, outcome.thresholds
    raised = outcome.thresholds[1][0]
    assert any(job.route == "decode-only" and job.prompt >= 256 for job in outcome.jobs if job.arrival > raised)
    assert all(256 <= value <= 2048 for _, value in outcome.thresholds)
