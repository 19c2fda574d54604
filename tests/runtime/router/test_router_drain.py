"""Draining engines in static discovery: an engine that starts draining (vLLM answers /health with 503 from SIGTERM
on, under --shutdown-timeout) is taken out of routing by the router's own health reads, and the stream it already
serves finishes there. Kubernetes discovery gets the same from EndpointSlice conditions (test_router_k8s_slices).
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from pdserve.api.router_config import RouterConfig
from pdserve_dev.testing.metrics import metric_value, wait_for_metric
from pdserve_dev.testing.sim import sim_in_process, sim_process
from pdserve_dev.testing.wait import wait_for_async
from pdserve_runtime.router.discovery.static import with_health
from pdserve_runtime.router.endpoints import Endpoint

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("ready", "status", "expected"),
    [
        (True, 200, True),
        (True, 503, False),  # draining (or an engine vLLM itself reports unhealthy)
        (True, 500, False),
        (False, 200, True),  # answering 200 again: back in
        (False, None, False),  # no answer: unchanged, the circuit breaker's business
        (True, None, True),
    ],
)
def test_one_health_answer(ready: bool, status: int | None, expected: bool) -> None:
    endpoint = Endpoint(url="http://10.0.0.1:8000", role="decode", ready=ready)
    assert with_health(endpoint, status).ready is expected


async def test_a_draining_static_engine_takes_no_new_requests_and_finishes_its_stream(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    tokens = 300  # ~4 s on the cpu-tiny-shared timing: the stream outlives the checks below
    body = {"model": "sim-model", "prompt": "Say hi.", "max_tokens": tokens, "stream": True}
    body["stream_options"] = {"include_usage": True}
    async with (
        sim_process(role="decode", preset="cpu-tiny-shared", shutdown_timeout=30) as draining,
        sim_in_process(role="decode") as other,
    ):
        config = make_config([], [draining.url, other.url], static_health_interval_seconds=0.1)
        async with router_server(config) as (url, router), aiohttp.ClientSession() as session:
            [state] = [s for s in router.table.states("decode") if s.url == draining.url]
            for s in router.table.states("decode"):  # the stream goes to the engine that will drain
                s.in_flight += 0 if s is state else 1000
            async with session.post(url + "/v1/completions", json=body) as stream:
                raw = await stream.content.readuntil(b"\n\n")
                draining.process.send_signal(signal.SIGTERM)

                async def taken_out() -> bool:
                    return not state.usable

                await wait_for_async(taken_out, within=10, message="the router taking the draining engine out")
                for _ in range(5):
                    short = {"model": "sim-model", "prompt": "Hello there.", "max_tokens": 2}
                    async with session.post(url + "/v1/completions", json=short) as answer:
                        assert answer.status == 200, await answer.text()
                raw += await stream.read()
            exposition = await wait_for_metric(router.metrics_url, "pdserve_router_requests_total", 6)
        events = [e.removeprefix("data: ") for e in raw.decode().split("\n\n") if e]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert sum(1 for c in chunks if c["choices"]) == tokens
        assert chunks[-1]["usage"]["completion_tokens"] == tokens
        # No request was sent to the draining engine (it would have answered 503 and been retried elsewhere).
        assert metric_value(exposition, "pdserve_router_retries_total") == 0
        assert metric_value(exposition, "pdserve_router_endpoint_errors_total") == 0
        # Its drain over, the engine exits cleanly.
        assert await asyncio.wait_for(draining.process.wait(), 20) == 0
