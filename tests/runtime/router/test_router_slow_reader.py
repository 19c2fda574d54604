"""A client that stops reading a stream ends its own stream, never the engine's health (issue 18.7: six
non-reading streams ejected a healthy decode engine, the router counting the engine's silence, which the router
itself had caused by pausing, as an engine failure)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson
import pytest

from pdserve.api.router_config import RouterConfig
from pdserve_dev.testing.metrics import metric_value, scrape, wait_for_metric

pytestmark = pytest.mark.timeout(90)

EVENT = (
    b'data: {"id":"cmpl-burst","object":"text_completion","created":0,"model":"sim-model","choices":[{"index":0,'
    b'"text":" word","logprobs":null,"finish_reason":null,"stop_reason":null}]}\n\n'
)
STREAM_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
#: A long stream's answer: far more than the router reads before it stops, all sent at once.
BURST = EVENT * (4 * 1024 * 1024 // len(EVENT))
#: A non-streaming answer small enough to reach the router in one read (so it is whole before anything can pause
#: it); four of them overfill what the kernel and the router's transport hold for a client that does not read.
FILLER = orjson.dumps({"id": "cmpl-filler", "object": "text_completion", "choices": [{"text": "x" * 48_000}]})
FILLERS = 4


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


@contextlib.asynccontextmanager
async def bursting_engine() -> AsyncIterator[str]:
    """A decode engine that answers in single writes: a long stream with one burst of events after which it stays
    silent and open, a short stream (max_tokens up to 16) or a non-streaming request completely.

    Not the simulator on purpose: the simulator paces tokens through the event loop it shares with the router, so
    on a starved CPU it can stay silent longer than a short read timeout while the router still reads it: the
    engine then fails for real (issue 23 saw it). Here the only silence the router meets is the one it causes by
    pausing, which is what the test is about."""
    silent = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).lower()
                length = 0
                for line in head.split(b"\r\n"):
                    if line.startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = orjson.loads(await reader.readexactly(length)) if length else {}
                if not head.startswith(b"post "):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                elif not body.get("stream"):
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                                 % (len(FILLER), FILLER))  # fmt: skip
                elif int(body.get("max_tokens", 16)) <= 16:
                    writer.write(STREAM_HEAD + _chunk(EVENT * 3 + b"data: [DONE]\n\n") + b"0\r\n\r\n")
                else:
                    writer.write(STREAM_HEAD + _chunk(BURST))
                    await silent.wait()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    finally:
        silent.set()
        server.close()


def _post(body: dict[str, Any]) -> bytes:
    raw = orjson.dumps(body)
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b"
        % (
            len(raw),
            raw,
        )
    )


async def stalled_stream(url: str, body: dict[str, Any]) -> socket.socket:
    """A client that has stopped reading, then asks for a stream: never reads from its socket.

    It pipelines non-streaming requests first, whose answers (each whole in one read, so nothing can stall them)
    fill what the kernel and the router hold for it, then the stream. So the router's transport to this client is
    already full when the stream's first chunk comes: the router stops reading the engine before it ever reads it
    with a read timeout running. (A small receive buffer and segment size keep the kernel's share small: the
    router's send buffer grows with the segment size.)"""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, 536)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (host, int(port)))
    filler = _post({"model": "sim-model", "prompt": "Fill.", "max_tokens": 1})
    await loop.sock_sendall(sock, filler * FILLERS + _post(body))
    return sock


async def test_a_client_that_stops_reading_loses_its_stream_and_the_engine_stays_healthy(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    # Two decode engines, so an ejection is allowed; one failure would eject. Each stalled stream's relay is
    # paused from its first chunk on, and the engines stay silent for longer than the read timeout while it is: a
    # router that counted its own pause as the engine's silence fails them.
    breaker = {"failure_threshold": 1, "open_seconds": 60}
    read_timeout = 0.3
    async with bursting_engine() as e1, bursting_engine() as e2:
        # The write timeout lies beyond the test's own (the test ends the stalled clients itself): it runs from
        # the first filler's pause, so on a starved CPU it could end a client before its stream was relayed.
        config = make_config([], [e1, e2], breaker=breaker, read_timeout_seconds=read_timeout,
                             client_write_timeout_seconds=120.0)  # fmt: skip
        async with router_server(config) as (url, router):
            body = {"model": "sim-model", "prompt": "Tell me everything.", "max_tokens": 60_000, "stream": True,
                    "ignore_eos": True}  # fmt: skip
            sockets = [await stalled_stream(url, body) for _ in range(3)]
            try:
                # The counted event: every answer's first chunk went to its client (fillers and streams alike), so
                # each stream's relay is under way, paused. Its read deadline, had it one, was set before that.
                await wait_for_metric(
                    router.metrics_url, "pdserve_router_time_to_first_token_seconds_count", 3 * (FILLERS + 1), within=60
                )
                # Not a guess at timing: a read deadline would be a timer of this same event loop set earlier and
                # shorter, and the loop runs due timers in deadline order, so it would have fired before this one.
                await asyncio.sleep(2 * read_timeout)
            finally:
                for sock in sockets:
                    sock.close()
            # Each stalled client's request ends as the client's.
            exposition = await wait_for_metric(
                router.metrics_url, "pdserve_router_requests_total", 3, within=30, outcome="cancelled"
            )
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
