"""Fault injection, from flags and from the /sim/faults admin endpoint."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from pdserve_dev.testing.sim import sim_in_process, sim_process
from pdserve_sim.config import FaultConfig

pytestmark = pytest.mark.timeout(30)

BODY = {"prompt": "fault injection test prompt", "max_tokens": 10}


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


async def test_fail_next_requests_from_flags(http: aiohttp.ClientSession) -> None:
    async with sim_in_process(faults=FaultConfig(fail_next=2, fail_status=503)) as sim:
        for _ in range(2):
            async with http.post(sim.url + "/v1/completions", json=BODY) as resp:
                assert resp.status == 503
                error = (await resp.json())["error"]
                assert error["code"] == 503 and "Injected" in error["message"]
        async with http.post(sim.url + "/v1/completions", json=BODY) as resp:
            assert resp.status == 200


async def test_admin_endpoint_sets_reads_and_clears_faults(http: aiohttp.ClientSession) -> None:
    async with sim_in_process() as sim:
        async with http.post(sim.url + "/sim/faults", json={"fail_next": 1, "fail_status": 429}) as resp:
            assert (await resp.json())["fail_next"] == 1
        async with http.post(
            sim.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}
        ) as resp:
            assert resp.status == 429
        async with http.post(sim.url + "/sim/faults", json={"latency_s": 0.3}) as resp:
            assert resp.status == 200
        started = time.monotonic()
        async with http.post(sim.url + "/v1/completions", json=BODY) as resp:
            assert resp.status == 200
        assert time.monotonic() - started >= 0.3
        async with http.delete(sim.url + "/sim/faults") as resp:
            assert (await resp.json())["latency_s"] == 0
        for bad in ({"nope": 1}, {"fail_next": -1}, {"fail_status": 200}, {"unready": "yes"}):
            async with http.post(sim.url + "/sim/faults", json=bad) as resp:
                assert resp.status == 400


async def test_unready_makes_health_fail(http: aiohttp.ClientSession) -> None:
    async with sim_in_process(faults=FaultConfig(unready=True)) as sim:
        async with http.get(sim.url + "/health") as resp:
            assert resp.status == 503
        async with http.post(sim.url + "/sim/faults", json={"unready": False}):
            pass
        async with http.get(sim.url + "/health") as resp:
            assert resp.status == 200


async def test_stall_stream_after_k_tokens(http: aiohttp.ClientSession) -> None:
    async with sim_in_process() as sim:
        async with http.post(sim.url + "/sim/faults", json={"stall_after_tokens": 3}):
            pass
        async with http.post(sim.url + "/v1/completions", json=dict(BODY, stream=True)) as resp:
            for _ in range(3):
                await resp.content.readuntil(b"\n\n")
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 0.3)
            async with http.delete(sim.url + "/sim/faults"):
                pass
            rest = (await resp.read()).decode()
        assert rest.count('"text"') == 7 and rest.endswith("data: [DONE]\n\n")


async def test_dropped_side_channel_fails_the_pull_after_the_timeout(http: aiohttp.ClientSession) -> None:
    prefill_params = {"do_remote_decode": True, "do_remote_prefill": False}
    async with (
        sim_in_process(role="prefill", faults=FaultConfig(drop_side_channel=True)) as prefill,
        sim_in_process(role="decode", kv_transfer_timeout_s=0.4) as decode,
    ):
        body = dict(BODY, max_tokens=1, kv_transfer_params=prefill_params)
        async with http.post(prefill.url + "/v1/completions", json=body) as resp:
            params = (await resp.json())["kv_transfer_params"]
        started = time.monotonic()
        async with http.post(decode.url + "/v1/completions", json=dict(BODY, kv_transfer_params=params)) as resp:
            assert resp.status == 500
        assert time.monotonic() - started >= 0.35


async def test_crash_fault_exits_the_process(http: aiohttp.ClientSession) -> None:
    async with sim_process(fast=True) as sim:
        async with http.post(sim.url + "/sim/faults", json={"crash": True}) as resp:
            assert resp.status == 200
        assert await asyncio.wait_for(sim.process.wait(), 5) == 70


async def test_crash_after_n_requests_flag(http: aiohttp.ClientSession) -> None:
    async with sim_process(fast=True, fault_crash_after_requests=2) as sim:
        async with http.post(sim.url + "/v1/completions", json=BODY) as resp:
            assert resp.status == 200
        with pytest.raises(aiohttp.ClientError):
            async with http.post(sim.url + "/v1/completions", json=BODY) as resp:
                await resp.read()
        assert await asyncio.wait_for(sim.process.wait(), 5) == 70


async def test_disconnect_mid_stream(http: aiohttp.ClientSession) -> None:
    async with sim_in_process(faults=FaultConfig(disconnect_after_tokens=3)) as sim:
        async with http.post(sim.url + "/v1/completions", json=dict(BODY, stream=True)) as resp:
            assert resp.status == 200
            received = b""
            with pytest.raises(aiohttp.ClientPayloadError):
                async for chunk in resp.content.iter_any():
                    received += chunk
        assert received.count(b'"text"') == 3 and b"[DONE]" not in received
        async with http.delete(sim.url + "/sim/faults"):
            pass
        async with http.post(sim.url + "/v1/completions", json=dict(BODY, stream=True)) as resp:
            assert (await resp.read()).endswith(b"data: [DONE]\n\n")
        async with http.get(sim.url + "/sim/state") as resp:
            assert (await resp.json())["running"] == 0
