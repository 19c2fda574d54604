"""The transport's tests run on both event loops the project uses: asyncio's (tests, tools) and uvloop (the
router process), since transports, socket access and close semantics differ between them."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import orjson
import pytest
import uvloop

from pdserve_runtime.transport.server import HttpServer, Request, Responder, ServerLimits, plain_error_body

MIB = 1024 * 1024

# Limits as a router runs with by default; each test changes what it exercises.
LIMITS = ServerLimits(
    max_connections=256,
    max_header_bytes=16 * 1024,
    max_body_bytes=8 * MIB,
    header_timeout=10.0,
    body_timeout=30.0,
    keep_alive_timeout=75.0,
    max_buffered_bytes=512 * MIB,
    max_buffered_bytes_per_client=64 * MIB,
    min_body_rate=64 * 1024,
    max_chunk_metadata_bytes=4096,
    write_timeout=30.0,
)


def pytest_asyncio_loop_factories(config: pytest.Config, item: pytest.Item) -> Mapping[str, Callable[[], Any]]:
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


class App:
    """Handlers whose every call is counted, and the events a test waits on."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self.bodies: list[bytes] = []
        self.headers: list[dict[str, str]] = []
        self.waiting = asyncio.Event()  # a /wait handler is running
        self.release = asyncio.Event()  # lets /wait handlers answer
        self.cancelled = 0
        self.streamed = 0  # bytes written by /stream handlers

    def count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    async def health(self, _request: Request, responder: Responder) -> None:
        self.count("health")
        responder.send(200, b'{"status":"ok"}')

    async def echo(self, request: Request, responder: Responder) -> None:
        self.count("echo")
        self.bodies.append(bytes(request.body))
        self.headers.append(dict(request.headers))
        responder.send(200, orjson.dumps({"size": len(request.body)}))

    async def wait(self, _request: Request, responder: Responder) -> None:
        self.count("wait")
        self.waiting.set()
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        responder.send(200, b'{"waited":true}')

    async def stream(self, _request: Request, responder: Responder) -> None:
        """64 KiB pieces for as long as the client reads, honouring flow control like the router's relay."""
        self.count("stream")
        flowing = asyncio.Event()
        flowing.set()
        responder.start(200, [("Content-Type", "text/plain")])
        responder.flow_control(flowing.clear, flowing.set)
        piece = b"x" * 65536
        try:
            while True:
                await flowing.wait()
                responder.write(piece)
                self.streamed += len(piece)
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


@asynccontextmanager
async def serving(**limits: Any) -> AsyncIterator[tuple[str, HttpServer, App]]:
    """An HttpServer with the test app on a free loopback port; `limits` override LIMITS fields."""
    app = App()
    server = HttpServer(replace(LIMITS, **limits), error_body=plain_error_body, access_log=False)
    server.route("GET", "/health", app.health)
    server.route("POST", "/echo", app.echo)
    server.route("POST", "/wait", app.wait)
    server.route("GET", "/stream", app.stream)
    port = await server.start("127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}", server, app
    finally:
        app.release.set()
        await server.stop(0.0)


Serve = Callable[..., Any]


@pytest.fixture
def serve() -> Serve:
    """`async with serve(header_timeout=1.0) as (url, server, app): ...`"""
    return serving
