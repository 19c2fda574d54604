"""The timing model: the scheduler's modelled costs show up in measured latencies the way vLLM's do."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import pytest

from pdserve_sim.config import SimConfig
from pdserve_sim.engine import Engine, EngineRequest
from pdserve_sim.metrics import SimMetrics
from pdserve_sim.presets import CPU_TINY, H200_8B, TimingParams

pytestmark = pytest.mark.timeout(30)

BASE = TimingParams(
    step_overhead=0.002,
    prefill_fixed=0.0,
    prefill_per_token=0.0001,
    decode_per_seq=0.0,
    decode_per_context_token=0.0,
    max_num_batched_tokens=4096,
    max_num_seqs=64,
    num_kv_blocks=4096,
    block_size=16,
    max_model_len=8192,
    kv_payload_bytes_per_token=16,
    kv_model_bytes_per_token=16,
    kv_link_bytes_per_second=0.0,
)


@pytest.fixture
def timing() -> TimingParams:
    return BASE


@pytest.fixture
async def engine(timing: TimingParams) -> AsyncIterator[Engine]:
    config = SimConfig(timing=timing, fast=False)
    eng = Engine(config, SimMetrics("m", timing.max_model_len))
    eng.start()
    try:
        yield eng
    finally:
        await eng.stop()


def prompt(n: int, salt: int = 0) -> list[int]:
    return [1000 + salt * 7919 + i for i in range(n)]


async def run(engine: Engine, req: EngineRequest) -> EngineRequest:
    engine.add(req)
    while not req.finished:
        await req.wait_beyond(req.outputs)
    return req


def ttft(req: EngineRequest) -> float:
    assert req.first_token_at is not None
    return req.first_token_at - req.arrival


def mean_itl(req: EngineRequest) -> float:
    assert req.first_token_at is not None and req.last_token_at is not None
    return (req.last_token_at - req.first_token_at) / (req.outputs - 1)


def test_step_cost_formula() -> None:
    t = dataclasses.replace(BASE, prefill_fixed=0.01, decode_per_seq=0.001, decode_per_context_token=1e-6)
    assert t.step_seconds(0, 0, 0) == 0
    assert t.step_seconds(100, 0, 0) == pytest.approx(0.002 + 0.01 + 0.01)
    assert t.step_seconds(0, 8, 1000) == pytest.approx(0.002 + 0.008 + 0.001)
    assert t.step_seconds(0, 16, 1000) > t.step_seconds(0, 8, 1000)


def test_cpu_tiny_preset_matches_the_measured_vllm_cpu_numbers() -> None:
    # KNOWLEDGE.md: a 401-token prompt prefills in 28-50 ms, 16 decode tokens take 0.16-0.28 s.
    t = CPU_TINY
    assert 0.028 <= t.step_seconds(401, 0, 0) <= 0.050
    decode_16 = sum(t.step_seconds(0, 1, 401 + i) for i in range(16))
    assert 0.16 <= decode_16 <= 0.28


def test_h200_preset_is_in_the_published_range() -> None:
    t = H200_8B
    assert 0.02 <= t.step_seconds(1000, 0, 0) <= 0.08  # TTFT of a 1k prompt
    assert 0.004 <= t.step_seconds(0, 1, 1000) <= 0.010  # ITL at batch 1
    assert t.step_seconds(0, 128, 128 * 2000) > 1.5 * t.step_seconds(0, 1, 2000)


async def test_prefill_time_grows_with_uncached_tokens(engine: Engine) -> None:
    short = await run(engine, EngineRequest("a", prompt(50, 1), 1))
    long = await run(engine, EngineRequest("b", prompt(1000, 2), 1))
    # 50 tokens -> 2 + 5 ms; 1000 tokens -> 2 + 100 ms.
    assert ttft(long) - ttft(short) >= 0.08
    assert ttft(long) >= 0.1


async def test_prefix_cache_hits_cut_ttft(engine: Engine) -> None:
    first = await run(engine, EngineRequest("a", prompt(1000, 3), 1))
    again = await run(engine, EngineRequest("b", [*prompt(1000, 3), 5, 6, 7], 1))
    assert again.num_cached_tokens == 992  # 62 full blocks of 16 were reused
    assert ttft(again) < ttft(first) / 3
    m = engine.metrics
    assert m.prefix_hits._value.get() == 992
    assert m.tokens_by_source["local_cache_hit"]._value.get() == 992


@pytest.mark.parametrize("timing", [dataclasses.replace(BASE, decode_per_seq=0.002)])
async def test_decode_step_time_grows_with_batch_size(engine: Engine) -> None:
    alone = await run(engine, EngineRequest("solo", prompt(20, 4), 10))
    batch = [EngineRequest(f"r{i}", prompt(20, 10 + i), 10) for i in range(12)]
    await asyncio.gather(*(run(engine, r) for r in batch))
    # ITL ~ 2 + 2 ms alone, ~ 2 + 24 ms in a batch of 12.
    assert mean_itl(alone) < 0.012
    assert min(mean_itl(r) for r in batch) > 0.018


@pytest.mark.parametrize("timing", [dataclasses.replace(BASE, num_kv_blocks=4, step_overhead=0.001)])
async def test_requests_queue_when_the_kv_cache_is_full(engine: Engine) -> None:
    # Each request needs 4 blocks of 16 tokens (40 prompt + 10 output tokens): only one fits at a time.
    first = EngineRequest("a", prompt(40, 5), 10)
    second = EngineRequest("b", prompt(40, 6), 10)
    engine.add(first)
    engine.add(second)
    await asyncio.sleep(0.005)
    assert engine.metrics.waiting._value.get() >= 1
    await asyncio.gather(run(engine, first), run(engine, second))
    assert second.first_scheduled is not None and first.finished_at is not None
    assert second.first_scheduled >= first.finished_at - 0.002
    assert second.outputs == 10 and first.outputs == 10


@pytest.mark.parametrize("timing", [dataclasses.replace(BASE, num_kv_blocks=5, step_overhead=0.0005)])
async def test_decode_growth_past_capacity_preempts_and_recomputes(engine: Engine) -> None:
    # Both fit at admission (2 blocks each) but need 3 blocks each by the end: one gets preempted.
    reqs = [EngineRequest(f"r{i}", prompt(20, 20 + i), 30) for i in range(2)]
    await asyncio.gather(*(run(engine, r) for r in reqs))
    assert [r.outputs for r in reqs] == [30, 30]
    assert all(r.finish_reason == "length" for r in reqs)
    assert engine.metrics.preemptions._value.get() >= 1
    assert engine.pool.num_free == 5


@pytest.mark.parametrize("timing", [dataclasses.replace(BASE, max_num_batched_tokens=64)])
async def test_long_prompts_are_prefilled_in_chunks(engine: Engine) -> None:
    req = await run(engine, EngineRequest("a", prompt(256, 7), 1))
    # 4 chunks of 64 tokens, each a step of 2 + 6.4 ms.
    assert ttft(req) >= 4 * 0.0084 * 0.95
    assert engine.metrics.iteration_tokens.sum == 256


async def test_speed_multiplier_divides_modelled_time(timing: TimingParams) -> None:
    slow_cfg = SimConfig(timing=timing, fast=False, speed=1.0)
    fast_cfg = SimConfig(timing=timing, fast=False, speed=10.0)
    results = []
    for cfg in (slow_cfg, fast_cfg):
        eng = Engine(cfg, SimMetrics("m", timing.max_model_len))
        eng.start()
        try:
            results.append(ttft(await run(eng, EngineRequest("a", prompt(1000, 8), 1))))
        finally:
            await eng.stop()
    assert results[1] < results[0] / 4


async def test_cpu_tiny_preset_over_http_reproduces_real_vllm_on_this_cpu() -> None:
    """KNOWLEDGE.md: real vLLM with the tiny model prefills a 401-token prompt in 28-50 ms and decodes 16
    tokens in 0.16-0.28 s; the simulator with the cpu-tiny preset shows the same through its API."""
    import time

    import aiohttp

    from pdserve_dev.testing.sim import sim_in_process

    async with (
        sim_in_process(timing=CPU_TINY, fast=False) as sim,
        aiohttp.ClientSession() as http,
    ):
        body = {"prompt": [200 + i for i in range(401)], "max_tokens": 17, "stream": True}
        started = time.monotonic()
        async with http.post(sim.url + "/v1/completions", json=body) as resp:
            await resp.content.readuntil(b"\n\n")
            first = time.monotonic()
            await resp.read()
            done = time.monotonic()
    # Loose upper bounds: HTTP and a shared CPU add a few ms to the modelled time.
    assert 0.028 <= first - started <= 0.050 + 0.03
    assert 0.16 <= done - first <= 0.28 + 0.05
