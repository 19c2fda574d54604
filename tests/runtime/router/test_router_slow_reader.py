"""A client that stops reading a stream ends its own stream, never the engine's health (issue 18.7: six
non-reading streams ejected a healthy decode engine, the router counting the engine's silence, which the router
itself had caused by pausing, as an engine failure)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

import aiohttp
import orjson
import pytest

from pdserve.api.router_config import RouterConfig
from pdserve_dev.testing.metrics import metric_value, scrape, wait_for_metric
from pdserve_dev.testing.sim import sim_in_process

pytestmark = pytest.mark.timeout(90)


async def stalled_stream(url: str, body: dict[str, Any]) -> socket.socket:
    """Send a streaming request on a socket with a tiny receive buffer, and never read from it."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (host, int(port)))
    raw = orjson.dumps(body)
    await loop.sock_sendall(
        sock,
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
        % (len(raw), raw),
    )
    return sock


async def test_a_client_that_stops_reading_loses_its_stream_and_the_engine_stays_healthy(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    # Two decode engines, so an ejection is allowed; one failure would eject; engines stay silent for longer than
    # the read timeout while the router does not read them.
    breaker = {"failure_threshold": 1, "open_seconds": 60}
    async with sim_in_process(role="decode") as d1, sim_in_process(role="decode") as d2:
        config = make_config(
            [], [d1.url, d2.url], breaker=breaker, read_timeout_seconds=0.3, client_write_timeout_seconds=2.0
        )
        async with router_server(config) as (url, router):
            body = {"model": "sim-model", "prompt": "Tell me everything.", "max_tokens": 60_000, "stream": True,
                    "ignore_eos": True}  # fmt: skip
            sockets = [await stalled_stream(url, body) for _ in range(3)]
            try:
                # Each stalled client is cut off after the write timeout: its request ends as the client's.
                exposition = await wait_for_metric(
                    router.metrics_url, "pdserve_router_requests_total", 3, within=30, outcome="cancelled"
                )
            finally:
                for sock in sockets:
                    sock.close()
            assert metric_value(exposition, "pdserve_router_endpoint_errors_total") == 0
            assert metric_value(exposition, "pdserve_router_endpoint_ejections_total") == 0
            assert metric_value(exposition, "pdserve_router_endpoint_up", role="decode") == 2
            # And a client that reads is served as ever.
            async with aiohttp.ClientSession() as session:
                small = {"model": "sim-model", "prompt": "hi", "max_tokens": 3, "stream": True}
                async with session.post(url + "/v1/completions", json=small) as response:
                    assert response.status == 200
                    assert (await response.read()).endswith(b"data: [DONE]\n\n")
            assert metric_value(await scrape(router.metrics_url), "pdserve_router_endpoint_errors_total") == 0
