"""Dynamo's SLA planner as a replay policy: each of its rules, on hand-built ticks, and the policy in a replay.

The engine profile is the benchmark's (H200 8B): a prefill pass costs 13 ms + 32 us per token, at most 8192 tokens
(a full pass 0.275 s); a decode step 5 ms + 40 us per sequence + 0.027 us per KV token. With a mean prompt of 1000
tokens a prefill engine's estimated TTFT is 45 ms idle and crosses the 800 ms SLA past ~23.6k queued tokens.
"""

from __future__ import annotations

import random

from pdserve_dev.replay.cluster import ReplayCluster, ReplayConfig
from pdserve_dev.replay.dynamo import ArimaPredictor, DecodeRegression, DynamoPlannerScaler
from pdserve_dev.replay.observe import EngineSample, FrontendTotals, Observation
from pdserve_dev.replay.trace import Request
from pdserve_operator.autoscaler.model import H200_8B as PROFILE
from pdserve_operator.autoscaler.model import Slo
from pdserve_operator.autoscaler.policy import PolicyConfig, PoolBounds
from pdserve_operator.autoscaler.signals import PoolSignals, Role, ServiceSignals
from pdserve_sim.presets import H200_8B

TTFT_S, ITL_S = 0.8, 0.040
BOUNDS = PolicyConfig(prefill=PoolBounds(1, 20), decode=PoolBounds(1, 20))


def planner() -> DynamoPlannerScaler:
    return DynamoPlannerScaler(BOUNDS, PROFILE, PROFILE, TTFT_S, ITL_S)


def prefill(queued_tokens: int, name: str = "p") -> EngineSample:
    return EngineSample(
        name, scheduled_requests=1, queued_requests=queued_tokens // 1000, queued_prefill_tokens=queued_tokens
    )


def decode(requests: int, kv_tokens: int, queued: int = 0, queued_kv: int = 0, name: str = "d") -> EngineSample:
    return EngineSample(name, requests, kv_tokens, queued, queued_kv_tokens=queued_kv)


def tick(
    at: float,
    prefills: list[EngineSample],
    decodes: list[EngineSample],
    *,
    starting: tuple[int, int] = (0, 0),
    frontend: FrontendTotals | None = None,
) -> Observation:
    """One tick: the given ready engines, a prefill pool whose requests averaged 1000 prompt tokens."""
    signals = ServiceSignals(
        at=at,
        window_s=15.0,
        percentile=90,
        prefill=PoolSignals(
            "prefill",
            desired=len(prefills) + starting[0],
            ready=len(prefills),
            starting=starting[0],
            request_rate=10.0,
            prompt_tokens_rate=10_000.0,
        ),
        decode=PoolSignals("decode", desired=len(decodes) + starting[1], ready=len(decodes), starting=starting[1]),
    )
    engines: dict[Role, tuple[EngineSample, ...]] = {"prefill": tuple(prefills), "decode": tuple(decodes)}
    return Observation(
        at, signals, {"prefill": None, "decode": None}, None, None, engines, frontend or FrontendTotals()
    )


# Two light decode engines (one may go), and two that hold: one engine could not carry both within the margin.
QUIET_DECODE = [decode(100, 150_000, name="d0"), decode(100, 150_000, name="d1")]
HOLD_DECODE = [decode(200, 300_000, name="d0"), decode(200, 300_000, name="d1")]


def test_prefill_grows_only_when_every_engine_is_over_the_ttft_sla() -> None:
    scaler = planner()
    # One engine drowning (31k tokens ahead: ~1.05 s), the other idle: Dynamo does not add a replica.
    assert scaler.tick(tick(15.0, [prefill(30_000, "p0"), prefill(0, "p1")], HOLD_DECODE)) == (2, 2)
    assert scaler.prefill_ttft_s(30_000) > TTFT_S > scaler.prefill_ttft_s(0)
    # Both over: one more.
    assert scaler.tick(tick(30.0, [prefill(30_000, "p0"), prefill(25_000, "p1")], HOLD_DECODE)) == (3, 2)


def test_decode_grows_only_when_every_engine_is_over_the_itl_sla() -> None:
    scaler = planner()
    # 556 requests and 834k KV tokens on one engine: a step of ~50 ms; the other engine is light.
    heavy = decode(256, 384_000, queued=300, queued_kv=450_000, name="d0")
    light = decode(100, 150_000, name="d1")
    assert (scaler.decode_itl_s(556, 834_000) or 0.0) > ITL_S
    assert scaler.tick(tick(15.0, [prefill(0)], [heavy, light])) == (1, 2)
    assert scaler.tick(tick(30.0, [prefill(0)], [heavy, decode(256, 384_000, 300, 450_000, "d1")])) == (1, 3)


def test_the_consolidation_check_refuses_a_prefill_scale_down_the_survivors_could_not_absorb() -> None:
    scaler = planner()
    # Three engines with 13k tokens queued each: every TTFT estimate (0.47 s) is under the SLA, but on two
    # engines the queue would be 19.5k tokens: 0.65 s of queueing over the (0.8 - 0.045) x 80% = 0.604 s budget.
    loaded = [prefill(13_000, f"p{i}") for i in range(3)]
    assert scaler.prefill_ttft_s(13_000) < TTFT_S
    assert scaler.tick(tick(15.0, loaded, HOLD_DECODE)) == (3, 2)
    # With 4k tokens each the survivors stay well inside the budget: one replica goes.
    light = [prefill(4_000, f"p{i}") for i in range(3)]
    assert scaler.tick(tick(30.0, light, HOLD_DECODE)) == (2, 2)


def test_the_consolidation_check_refuses_a_decode_scale_down_over_the_itl_margin_or_the_kv_cache() -> None:
    scaler = planner()
    # 200 requests / 300k KV tokens each: 21 ms now, 37 ms on one engine (over 80% of 40 ms).
    assert scaler.tick(tick(15.0, [prefill(0)], HOLD_DECODE)) == (1, 2)
    # 10 long requests holding 420k KV tokens each: the survivor would need 840k tokens of an 832k-token cache,
    # although its ITL would stay inside the margin.
    full = [decode(10, 420_000, name="d0"), decode(10, 420_000, name="d1")]
    assert scaler.tick(tick(30.0, [prefill(0)], full)) == (1, 2)
    assert (scaler.decode_itl_s(20, 840_000) or 1.0) < ITL_S * 0.8, "only the cache refuses this one"
    assert scaler.tick(tick(45.0, [prefill(0)], QUIET_DECODE)) == (1, 1)


def test_nothing_moves_while_either_pool_has_replicas_starting() -> None:
    scaler = planner()
    drowning = [prefill(30_000, "p0"), prefill(30_000, "p1")]
    assert scaler.tick(tick(15.0, drowning, HOLD_DECODE, starting=(0, 1))) == (2, 3)
    assert scaler.tick(tick(30.0, drowning, HOLD_DECODE)) == (3, 2)


def test_the_throughput_path_sizes_pools_from_the_engines_rates_at_the_sla() -> None:
    scaler = planner()
    # 100 requests/s of 1000-token prompts: one prefill engine serves 1 / 45 ms = 22.2 requests/s -> 5 replicas.
    # Decode at context 1100: the whole 256-sequence batch steps in 22.8 ms (under 40 ms), so an engine serves
    # 256 / (200 x 22.8 ms) = 56 requests/s -> 2 replicas.
    assert scaler.replicas_for(100.0, 1000.0, 200.0) == (5, 2)
    # One 30k-token prompt alone takes 1.05 s: a latency floor of ceil(1.05 / 0.8) = 2 replicas at any rate.
    assert scaler.replicas_for(0.01, 30_000.0, 200.0)[0] == 2


def test_the_predicted_demand_is_a_lower_bound_the_load_path_cannot_go_under() -> None:
    scaler = planner()
    idle = [prefill(0, f"p{i}") for i in range(8)]
    # Before any prediction, idle engines consolidate one at a time.
    assert scaler.tick(tick(15.0, idle, QUIET_DECODE)) == (7, 1)
    # 180 s at 100 requests/s (1000 prompt, 200 output tokens): the bounds become 5 prefill, 2 decode.
    frontend = FrontendTotals(18_000, 18_000_000, 3_600_000)
    assert scaler.tick(tick(180.0, idle[:7], QUIET_DECODE, frontend=frontend)) == (6, 1)
    assert scaler.lower_bound == {"prefill": 5, "decode": 2}
    # The load path would shed a prefill replica and keep decode at 1; the bounds hold prefill at 5 and lift decode.
    assert scaler.tick(tick(195.0, idle[:5], [decode(10, 10_000)], frontend=frontend)) == (5, 2)


def test_the_arima_predictor_follows_dynamos_rules() -> None:
    predictor = ArimaPredictor()
    for value in (0.0, 0.0, 40.0, 50.0):
        predictor.add(value)
    assert predictor.values == [40.0, 50.0], "the idle stretch before traffic is skipped"
    assert predictor.predict() == 50.0, "fewer than 5 points: the last one"
    constant = ArimaPredictor()
    for _ in range(6):
        constant.add(7.0)
    assert constant.predict() == 7.0
    rising = ArimaPredictor()
    for value in range(10, 101, 10):
        rising.add(float(value))
    assert 100.0 < rising.predict() < 125.0
    assert rising.order is not None
    rng = random.Random(3)
    noisy = ArimaPredictor()
    for _ in range(40):
        noisy.add(max(0.0, 100.0 + rng.gauss(0.0, 10.0)))
    assert 80.0 < noisy.predict() < 120.0


def test_the_planner_follows_a_step_of_load_in_the_replay() -> None:
    rng = random.Random(1)
    requests: list[Request] = []
    for rate, start, seconds in ((30.0, 0.0, 240.0), (120.0, 240.0, 360.0)):
        at = start
        while (at := at + rng.expovariate(rate)) < start + seconds:
            requests.append(Request(at, rng.choice([600, 1200, 3000]), rng.randint(20, 300)))
    bounds = PolicyConfig(prefill=PoolBounds(1, 30), decode=PoolBounds(1, 30))
    scaler = DynamoPlannerScaler(bounds, PROFILE, PROFILE, TTFT_S, ITL_S)
    config = ReplayConfig(H200_8B, H200_8B, Slo(ttft_s=TTFT_S, itl_s=ITL_S, percentile=90), (2, 1))
    outcome = ReplayCluster(config, requests, scaler).run()
    assert all(job.finished is not None for job in outcome.jobs)
    assert outcome.shed == 0
    before = max(row[1] for row in outcome.timeline if row[0] < 240.0)
    after = max(row[1] for row in outcome.timeline if row[0] > 300.0)
    assert after > before, "the step quadruples prefill work: the planner adds prefill replicas"
    assert scaler.lower_bound["prefill"] > 1, "the throughput path set a floor from the predicted demand"


def test_a_single_replica_never_shrinks() -> None:
    scaler = planner()
    assert scaler.prefill_decision([prefill(0)], 1) is None
    assert scaler.decode_decision([decode(0, 0)], 1) is None


def test_the_replay_reports_what_dynamos_planner_reads() -> None:
    """Each tick's engine samples are the ready engines' queues and batches; the frontend counts finished
    requests and their tokens."""
    seen: list[Observation] = []

    class Watch:
        name = "watch"

        def tick(self, observation: Observation) -> tuple[int, int]:
            seen.append(observation)
            return 2, 1

    rng = random.Random(2)
    requests = sorted(
        (Request(rng.uniform(0.0, 60.0), rng.choice([100, 2000, 9000]), rng.randint(2, 50)) for _ in range(3000)),
        key=lambda r: r.arrival,
    )
    config = ReplayConfig(H200_8B, H200_8B, Slo(ttft_s=TTFT_S, itl_s=ITL_S, percentile=90), (2, 1))
    outcome = ReplayCluster(config, requests, Watch()).run()
    busy = [o for o in seen if any(e.queued_prefill_tokens for e in o.engines["prefill"])]
    assert busy, "50 requests/s of long prompts queue on two prefill engines"
    for observation in seen:
        assert len(observation.engines["prefill"]) == observation.signals.prefill.ready
        assert len(observation.engines["decode"]) == observation.signals.decode.ready
        for engine in observation.engines["prefill"]:
            assert engine.queued_prefill_tokens >= engine.queued_requests * 100
        for engine in observation.engines["decode"]:
            assert engine.scheduled_kv_tokens >= engine.scheduled_requests * 100
    last = seen[-1].frontend
    finished = [j for j in outcome.jobs if j.finished is not None and j.finished <= seen[-1].at]
    assert last.requests == len(finished)
    assert last.prompt_tokens == sum(j.prompt for j in finished)
    assert last.output_tokens == sum(j.output for j in finished)


def test_the_decode_regression_learns_what_live_passes_cost() -> None:
    """Bootstrapped from the profile, the fit moves toward the engines' own passes: passes that cost 8 ms more than
    the profile's pure decode pass (a joining request's prefill in every step) raise the ITL estimate (by less
    than 8 ms: the sweep's points outside the live range stay in their cells), and the load path then grows
    decode at a load the profile alone called fine."""
    scaler = planner()
    busy = [decode(320, 480_000, queued=60, queued_kv=90_000, name=f"d{i}") for i in range(2)]
    assert scaler.tick(tick(15.0, [prefill(0)], busy)) == (1, 2)
    before = scaler.decode_itl_s(380, 570_000)
    assert before is not None and before < ITL_S
    for step in range(200):
        requests = 20 + step
        kv = requests * 1500
        wall = scaler.model.profile_decode_pass_s(requests, kv) + 0.008
        learnt = [
            EngineSample(f"d{i}", 320, 480_000, 60, queued_kv_tokens=90_000, last_pass=(requests, kv, wall))
            for i in range(2)
        ]
        scaler.tick(tick(30.0 + 15 * step, [prefill(0)], learnt))
    after = scaler.decode_itl_s(380, 570_000)
    assert after is not None and 0.004 < after - before <= 0.008
    assert scaler.tick(tick(5000.0, [prefill(0)], busy)) == (1, 3)


def test_a_decode_fit_that_says_more_kv_costs_less_is_rejected() -> None:
    fit = DecodeRegression()
    for requests in range(1, 9):
        for kv in (10_000, 50_000, 90_000):
            fit.add(requests, kv, 0.03 + requests * 0.001 - kv * 1e-7)
    assert fit.predict(10, 50_000) is None
    fit.add(8, 1_000_000, 0.5)
    assert fit.predict(10, 50_000) is not None
