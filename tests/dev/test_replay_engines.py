"""The replay's engines against the simulator's real `Engine`: the same requests, the same step times.

The real engine sleeps its modelled step times on the wall clock; here it runs on a virtual clock instead (its
module's `time` is replaced by a fake, the one stand-in in this test), and the test plays its scheduler loop:
add what has arrived, plan a step, advance the clock by `TimingParams.step_seconds` of the plan, apply it. The
replay's engines get the same arrivals through their own event heap. Every request's first-token and finish
times must agree: the replay reproduces the engine's scheduling, not an approximation of it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
import itertools
import random
from collections.abc import Callable
from types import SimpleNamespace

import pytest

import pdserve_sim.engine as engine_module
from pdserve_dev.replay.engines import DecodeEngine, Job, PrefillEngine
from pdserve_dev.replay.trace import Request
from pdserve_sim.config import SimConfig
from pdserve_sim.engine import Engine, EngineRequest, RemotePrefill
from pdserve_sim.metrics import SimMetrics
from pdserve_sim.presets import H200_8B

# No modelled KV link time: the real engine's pull is a coroutine the test completes at once.
TIMING = H200_8B.with_overrides(kv_link_bytes_per_second=0.0)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


def workload(count: int, seed: int, short: bool = False) -> list[Request]:
    rng = random.Random(seed)
    at = 0.0
    out = []
    for _ in range(count):
        at += rng.expovariate(40.0)
        prompt = rng.randint(20, 200) if short else rng.choice([300, 900, 2500, 9000, 20000])
        out.append(Request(at, prompt, rng.randint(1, 60)))
    return out


def replay(requests: list[Request], make: Callable[..., PrefillEngine | DecodeEngine], route: str) -> list[Job]:
    """Run the replay's engine over `requests` with a minimal event heap."""
    events: list[tuple[float, int, Callable[[float], None]]] = []
    seq = itertools.count()

    def schedule(at: float, callback: Callable[[float], None]) -> None:
        heapq.heappush(events, (at, next(seq), callback))

    engine = make(schedule)
    jobs = [Job(r, route) for r in requests]

    def arrive(job: Job) -> Callable[[float], None]:
        return lambda now: engine.add(job, now)

    for job in jobs:
        schedule(job.arrival, arrive(job))
    while events:
        at, _, callback = heapq.heappop(events)
        callback(at)
    return jobs


async def drive(engine: Engine, clock: Clock, requests: list[EngineRequest], arrivals: list[float]) -> None:
    """The real engine's scheduler loop on the virtual clock (Engine._run without the sleeps)."""
    pending = list(zip(arrivals, requests, strict=True))
    while pending or engine.running or engine.waiting or engine.remote_waiting:
        while pending and pending[0][0] <= clock.now:
            engine.add(pending.pop(0)[1])
        plan = engine._schedule()
        for _ in range(3):
            await asyncio.sleep(0)  # KV pulls started by the plan finish (instantly) before the step ends
        if not plan.items:
            if engine.waiting:
                continue  # pulled requests are back in the queue: plan again at the same instant
            if pending:
                clock.now = max(clock.now, pending[0][0])
            continue
        clock.now += TIMING.step_seconds(plan.prefill_tokens, plan.decode_batch, plan.decode_context)
        engine._apply(plan)


def real_engine(monkeypatch: pytest.MonkeyPatch, role: str) -> tuple[Engine, Clock]:
    clock = Clock()
    monkeypatch.setattr(engine_module, "time", SimpleNamespace(monotonic=clock.monotonic))
    config = SimConfig(role=role, timing=TIMING, fast=False)  # type: ignore[arg-type]
    engine = Engine(config, SimMetrics("m", TIMING.max_model_len))

    async def pull(req: EngineRequest) -> int:
        return 0

    engine.pull = pull
    return engine, clock


def prompt_ids(rng: random.Random, length: int) -> list[int]:
    # Distinct random prompts: no prefix-cache hits (the replay does not model prefix caching).
    return [rng.randrange(1, 100_000) for _ in range(length)]


async def test_prefill_engine_matches_the_simulator(monkeypatch: pytest.MonkeyPatch) -> None:
    requests = workload(120, seed=1)
    engine, clock = real_engine(monkeypatch, "prefill")
    rng = random.Random(7)
    real = [EngineRequest(f"r{i}", prompt_ids(rng, r.prompt), 1) for i, r in enumerate(requests)]
    await drive(engine, clock, real, [r.arrival for r in requests])

    jobs = replay(requests, lambda schedule: PrefillEngine(TIMING, schedule, lambda job, now: None), "pd")
    for job, ours in zip(jobs, real, strict=True):
        assert ours.first_token_at is not None
        assert job.prefill_done == pytest.approx(ours.first_token_at, abs=1e-9)
    # Long prompts were chunked over several steps and short ones queued behind them: not a trivial schedule.
    assert max(j.prefill_done - j.arrival for j in jobs) > 5 * TIMING.step_seconds(TIMING.max_num_batched_tokens, 0, 0)


@pytest.mark.parametrize("route", ["pd", "decode-only"])
async def test_decode_engine_matches_the_simulator(monkeypatch: pytest.MonkeyPatch, route: str) -> None:
    requests = workload(150, seed=2, short=route == "decode-only")
    engine, clock = real_engine(monkeypatch, "decode")
    rng = random.Random(8)
    real = []
    for i, r in enumerate(requests):
        remote = RemotePrefill("p", f"r{i}", "127.0.0.1", 1, (), r.prompt) if route == "pd" else None
        real.append(EngineRequest(f"r{i}", prompt_ids(rng, r.prompt), r.output, remote_prefill=remote))
    await drive(engine, clock, real, [r.arrival for r in requests])

    finished: list[Job] = []
    jobs = replay(
        requests,
        lambda schedule: DecodeEngine(TIMING, schedule, lambda job, now: finished.append(job), lambda j, n: None, _itl),
        route,
    )
    assert len(finished) == len(requests)
    for job, ours in zip(jobs, real, strict=True):
        assert ours.first_token_at is not None and ours.finished_at is not None
        assert job.first_token == pytest.approx(ours.first_token_at, abs=1e-9)
        assert job.finished == pytest.approx(ours.finished_at, abs=1e-9)
    # Batches grew large enough for attention over the context to matter.
    assert max(j.tpot for j in jobs) > 1.5 * min(j.tpot for j in jobs if j.output > 1)


def _itl(gap: float, times: int) -> None:
    pass


def test_decode_kv_transfer_takes_the_modelled_link_time() -> None:
    timing = dataclasses.replace(H200_8B)
    requests = [Request(0.0, 4000, 2)]
    jobs = replay(requests, lambda s: DecodeEngine(timing, s, lambda j, n: None, lambda j, n: None, _itl), "pd")
    pull = 4000 * timing.kv_model_bytes_per_token / timing.kv_link_bytes_per_second
    # Pull, then one step recomputing the last prompt token (first token), then one decode step.
    first = pull + timing.step_seconds(1, 0, 0)
    assert jobs[0].first_token == pytest.approx(first)
    assert jobs[0].finished == pytest.approx(first + timing.step_seconds(0, 1, 4000))


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_requests_reach_an_engine_in_the_order_they_were_sent(role: str) -> None:
    # A 636-token prompt sent 1 ms after a 2275-token one costs fewer hop milliseconds, yet reaches the engine after
    # it, as on the closed loop's engines (one event loop reads and tokenizes them in turn). Both stay in transit
    # until they arrive; a request due later than the last one keeps its own time.
    events: list[tuple[float, int, Callable[[float], None]]] = []
    seq = itertools.count()

    def schedule(at: float, callback: Callable[[float], None]) -> None:
        heapq.heappush(events, (at, next(seq), callback))

    arrived: list[tuple[int, float]] = []
    engine: PrefillEngine | DecodeEngine
    if role == "prefill":
        engine = PrefillEngine(TIMING, schedule, lambda job, now: None)
        engine._arrive = lambda job, now: arrived.append((job.prompt, now))  # type: ignore[method-assign]
    else:
        engine = DecodeEngine(TIMING, schedule, lambda j, n: None, lambda j, n: None, _itl)
        engine.add = lambda job, now: arrived.append((job.prompt, now))  # type: ignore[method-assign]
    long, short, later = (Job(Request(at, tokens, 8), "pd") for at, tokens in ((0.0, 2275), (0.001, 636), (1.0, 100)))
    engine.send(long, 0.0, 0.010)
    engine.send(short, 0.001, 0.004)
    engine.send(later, 1.0, 0.002)
    assert engine.in_transit == 3
    while events:
        at, _, callback = heapq.heappop(events)
        callback(at)
    assert [tokens for tokens, _ in arrived] == [2275, 636, 100]
    assert [at for _, at in arrived] == pytest.approx([0.010, 0.010, 1.002])
    assert engine.in_transit == 0
