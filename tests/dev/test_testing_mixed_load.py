"""`MixedLoad` sorts what clients see correctly: complete answers, told failures, lost streams.

Against a real router (static discovery) over fast simulators, with the simulators' injected faults.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from pdserve.api.router_config import RouterConfig
from pdserve_dev.testing.mixed_load import MixedLoad, Shape, default_mix
from pdserve_dev.testing.net import free_port
from pdserve_dev.testing.sim import set_faults, sim_in_process
from pdserve_dev.testing.wait import wait_for_async
from pdserve_runtime.router.app import RouterApp

pytestmark = pytest.mark.timeout(60)


@asynccontextmanager
async def router(prefill: str, decode: str) -> AsyncIterator[str]:
    config = RouterConfig(
        served_model_name="sim-model",
        discovery="static",
        static_prefill=[prefill],
        static_decode=[decode],
        engine_metrics_interval_seconds=0.0,
    )
    app = RouterApp(config, access_log=False)
    port = await app.start("127.0.0.1", 0, metrics_port=0)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await app.stop()


async def test_every_answer_of_a_healthy_pool_counts_as_succeeded() -> None:
    async with (
        sim_in_process(role="prefill") as prefill,
        sim_in_process(role="decode") as decode,
        router(prefill.url, decode.url) as url,
    ):
        async with MixedLoad(url, "sim-model", concurrency=4, mix=default_mix((3, 17))) as load:
            await load.wait_succeeded(len(default_mix((3, 17))) * 2)
        results = load.results
    assert results.sent == results.succeeded > 0, results.summary()
    assert results.routes["pd"] > 0 and results.routes["decode-only"] > 0  # both paths were taken
    assert results.worst_ttft_seconds > 0
    # One first-token time per stream, the worst among them the one reported.
    streams = sum(1 for shape in default_mix((3, 17)) if shape.stream)
    assert len(results.ttfts) >= streams
    assert max(ttft for _, ttft in results.ttfts) == results.worst_ttft_seconds
    assert not results.failure_kinds


@pytest.mark.parametrize(
    ("faults", "outcome"),
    [
        ({"fail_next": 1000, "fail_status": 503}, "failed_told"),  # an HTTP error: the client is told
        ({"disconnect_after_tokens": 2}, "lost"),  # a stream cut without an error event
    ],
)
async def test_failures_are_sorted_by_what_the_client_saw(faults: dict[str, int], outcome: str) -> None:
    # Straight at an engine: a router would end a cut stream with an error event (a told failure).
    mix = [Shape(chat=False, stream=True, long=False, max_tokens=5)]
    async with sim_in_process() as engine:
        await set_faults(engine.url, **faults)
        async with MixedLoad(engine.url, "sim-model", concurrency=1, mix=mix) as load:

            async def counted() -> bool:
                return bool(getattr(load.results, outcome) >= 3)

            await wait_for_async(counted, within=20, message=load.results.summary)
        results = load.results
    assert results.succeeded == 0, results.summary()
    assert getattr(results, outcome) == results.sent, results.summary()
    if outcome == "failed_told":
        assert results.failure_kinds == {"http-503": results.failed_told}


async def test_a_stream_cut_behind_a_router_is_told_after_its_tokens() -> None:
    """The router ends a stream its decode engine cut with an error event: a told failure, of the one kind a
    router cannot hide by retrying (tokens were already sent)."""
    mix = [Shape(chat=False, stream=True, long=False, max_tokens=5)]
    async with (
        sim_in_process(role="prefill") as prefill,
        sim_in_process(role="decode") as decode,
        router(prefill.url, decode.url) as url,
    ):
        await set_faults(decode.url, disconnect_after_tokens=2)
        async with MixedLoad(url, "sim-model", concurrency=1, mix=mix) as load:

            async def counted() -> bool:
                return load.results.failed_told >= 3

            await wait_for_async(counted, within=20, message=load.results.summary)
        results = load.results
    assert results.failed_told == results.sent, results.summary()
    assert results.failure_kinds == {"stream-after-tokens": results.failed_told}


async def test_a_client_backs_off_after_each_failure() -> None:
    """Against a port that refuses connections at once, one client's sixth failure comes only after its five
    pauses (50, 100, 200, 400, 800 ms): it does not spin a core retrying."""
    port = free_port()  # nothing listens here
    started = time.monotonic()
    async with MixedLoad(f"http://127.0.0.1:{port}", "sim-model", concurrency=1) as load:

        async def six_lost() -> bool | None:
            return load.results.lost >= 6 or None

        await wait_for_async(six_lost, within=20, message=load.results.summary)
        elapsed = time.monotonic() - started
    assert elapsed >= 1.55, f"six failures in {elapsed:.2f} s"
    assert load.results.sent <= 7, load.results.summary()


async def test_a_paced_client_thinks_between_answers() -> None:
    """With `pause_seconds`, a client's fourth request starts only after three pauses: the lifecycle tests on real
    engines rely on it to leave a starting engine its share of the cores."""
    mix = [Shape(chat=False, stream=False, long=False, max_tokens=2)]
    async with sim_in_process() as engine:
        started = time.monotonic()
        async with MixedLoad(engine.url, "sim-model", concurrency=1, mix=mix, pause_seconds=0.4) as load:

            async def four_sent() -> bool:
                return load.results.sent >= 4

            await wait_for_async(four_sent, within=20, message=load.results.summary)
            elapsed = time.monotonic() - started
    assert elapsed >= 1.2, f"four requests in {elapsed:.2f} s"
    assert load.results.failed_told == load.results.lost == 0, load.results.summary()
