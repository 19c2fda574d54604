"""The replayed router's late binding: the product's admission rule over virtual time (`pdserve_dev.replay.gate`)."""

from __future__ import annotations

from dataclasses import replace

from pdserve_dev.replay.cluster import ReplayCluster, ReplayConfig
from pdserve_dev.replay.engines import DecodeEngine, PrefillEngine
from pdserve_dev.replay.gate import LateBinding
from pdserve_dev.replay.observe import Observation
from pdserve_dev.replay.scalers import StaticScaler
from pdserve_dev.replay.trace import Request
from pdserve_operator.autoscaler.model import Slo
from pdserve_sim.presets import H200_8B
from tests.dev.replay_support import Script

SLO = Slo(ttft_s=0.8, itl_s=0.04, percentile=90)
BUDGET = LateBinding.rendered(H200_8B, H200_8B)


def burst(count: int, at: float = 1.0, prompt: int = 4000, output: int = 50, spread_s: float = 1.0) -> list[Request]:
    """`count` long prompts arriving evenly over `spread_s` seconds from `at`."""
    return [Request(at + spread_s * i / count, prompt, output) for i in range(count)]


def config(initial: tuple[int, int], late: LateBinding | None = BUDGET, **changes: float) -> ReplayConfig:
    return ReplayConfig(H200_8B, H200_8B, SLO, initial, late_binding=late, **changes)  # type: ignore[arg-type]


def every(cluster: ReplayCluster, step_s: float, until_s: float, check: object) -> list[float]:
    """Schedule `check(now)` every `step_s` of virtual time; returns the times it ran (a counted event)."""
    ran: list[float] = []

    def probe(now: float) -> None:
        ran.append(now)
        check(now)  # type: ignore[operator]
        if now + step_s <= until_s:
            cluster.schedule(now + step_s, probe)

    cluster.schedule(step_s, probe)
    return ran


def test_no_prefill_engine_holds_more_than_its_budget_and_the_rest_waits_in_the_router() -> None:
    requests = burst(150, spread_s=1.0)  # 600k tokens: 10 s of two engines, within the longest wait
    cluster = ReplayCluster(config((2, 1)), requests, StaticScaler(2, 1))
    seen: list[tuple[int, int]] = []

    def check(now: float) -> None:
        for replica in cluster.replicas["prefill"]:
            engine = replica.engine
            assert isinstance(engine, PrefillEngine)
            held = len(engine.waiting) + len(engine.running)
            assert held <= 1 or engine.outstanding_tokens <= BUDGET.prefill_tokens, (now, engine.outstanding_tokens)
        assert cluster.gate is not None
        seen.append((cluster.gate.waiting("prefill"), cluster.gate.waiting_tokens("prefill")))

    ran = every(cluster, 0.05, 3.0, check)
    outcome = cluster.run()
    assert len(ran) == 60
    assert max(waiting for waiting, _ in seen) > 100, "the burst waits in the router, not in the engines"
    assert all(tokens == 4000 * waiting for waiting, tokens in seen)
    assert outcome.shed == 0 and len(outcome.jobs) == 150 and all(job.finished is not None for job in outcome.jobs)
    assert {job.route for job in outcome.jobs} == {"pd"}


def test_a_replica_that_becomes_ready_takes_waiting_requests_at_once() -> None:
    # One prefill engine faces a burst; a second, asked for at the first tick, serves 5 s later. Without late
    # binding the whole burst is already queued on the first engine and the new one takes only new arrivals.
    requests = burst(600, spread_s=1.0)
    plan = [(0.0, (1, 1)), (1.0, (2, 1))]
    late = ReplayCluster(config((1, 1), interval_s=1.0, startup_s=5.0), requests, Script(plan)).run()
    ready_at = 1.0 + 5.0
    taken = [job for job in late.jobs if job.prefill_arrival == ready_at]
    assert taken and all(job.arrival < 2.0 for job in taken), "queued requests went to the new engine on Ready"
    early = ReplayCluster(config((1, 1), None, interval_s=1.0, startup_s=5.0), requests, Script(plan)).run()
    assert not [job for job in early.jobs if job.prefill_arrival == ready_at]
    assert max(j.first_token or 0.0 for j in late.jobs) < max(j.first_token or 0.0 for j in early.jobs)


def test_decode_sequences_stay_within_the_budget_reservations_included() -> None:
    budget = replace(BUDGET, decode_sequences=8, max_wait_s=120.0)
    requests = burst(120, spread_s=1.0, prompt=600, output=400)
    cluster = ReplayCluster(config((4, 2), budget), requests, StaticScaler(4, 2))
    peak: list[int] = [0]

    def check(now: float) -> None:
        gate = cluster.gate
        assert gate is not None
        for replica in cluster.replicas["decode"]:
            engine = replica.engine
            assert isinstance(engine, DecodeEngine)
            held = engine.load + gate._reserved.get(replica.name, 0)
            assert held <= 8, (now, replica.name, held)
            peak[0] = max(peak[0], held)

    ran = every(cluster, 0.02, 20.0, check)
    outcome = cluster.run()
    assert len(ran) > 100
    assert peak[0] == 8, "the budget was reached and held"
    assert len(outcome.jobs) == 120 and all(job.finished is not None for job in outcome.jobs)


def test_requests_that_wait_past_the_longest_useful_wait_are_shed_and_counted_as_misses() -> None:
    budget = replace(BUDGET, max_wait_s=0.5)
    requests = burst(300, spread_s=0.5)
    outcome = ReplayCluster(config((1, 1), budget), requests, StaticScaler(1, 1)).run()
    assert outcome.shed > 0
    assert len(outcome.jobs) + outcome.shed == len(requests), "every request is served or shed, none lost"
    assert all(job.finished is not None for job in outcome.jobs)
    assert outcome.attainment(SLO) <= len(outcome.jobs) / len(requests)


def test_fresh_requests_go_before_late_ones_so_a_burst_makes_only_its_excess_late() -> None:
    # Steady traffic at two thirds of one prefill engine's capacity, and a burst of 40 prompts at 5 s that the
    # engine needs ~2.7 s to compute. First come first served makes every request behind the burst late until the
    # spare third has drained it (~8 s of arrivals); the admission order serves the arrivals that can still make
    # their deadline first and the burst's late excess in the spare capacity.
    steady = [Request(0.1 * i, 2000, 20) for i in range(400)]
    requests = sorted([*steady, *burst(40, at=5.0, prompt=2000, output=20, spread_s=0.1)], key=lambda r: r.arrival)
    late = ReplayCluster(config((1, 1)), requests, StaticScaler(1, 1)).run()
    fifo = ReplayCluster(config((1, 1), None), requests, StaticScaler(1, 1)).run()
    assert late.attainment(SLO) > fifo.attainment(SLO) + 0.05, (late.attainment(SLO), fifo.attainment(SLO))


def test_the_routers_queue_is_in_the_autoscalers_signals() -> None:
    seen: list[Observation] = []

    class Watch(StaticScaler):
        def tick(self, observation: Observation) -> tuple[int, int]:
            seen.append(observation)
            return super().tick(observation)

    requests = burst(3000, spread_s=4.0)
    ReplayCluster(config((1, 1), interval_s=1.0), requests, Watch(1, 1)).run()
    routed = [o.signals.router for o in seen]
    assert any((r.queued_prefill_requests or 0) > 100 for r in routed)
    assert all(r.queued_prefill_tokens == 4000 * (r.queued_prefill_requests or 0) for r in routed)
    assert routed[-1].queued_prefill_requests == 0


def test_under_an_overload_the_queue_takes_requests_that_can_still_make_their_deadline() -> None:
    # 2000-token prompts at twice one prefill engine's rate for 20 s. The path behind lateness is learned from the
    # replay's own prefills (the product's rule): about the wait behind a full engine budget plus the prompt's own
    # compute, so a request taken from the queue has the slack to make it, and about half the arrivals (the
    # engine's share) do. The idle engine's path (what the replay charged before) let the queue take requests
    # with only the idle path's slack left: nearly every one reached its first token just too late (2.8%).
    requests = [Request(0.01 + i / 30, 2000, 20) for i in range(600)]
    cluster = ReplayCluster(config((1, 1)), requests, StaticScaler(1, 1))
    outcome = cluster.run()
    assert outcome.attainment(SLO) > 0.4
    assert cluster.gate is not None
    fixed, _ = cluster.gate.path.prefill_line()
    assert 0.2 < fixed < SLO.ttft_s, "the wait behind a busy engine's budget (~0.4 s) is learned"
