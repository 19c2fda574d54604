"""A stand-in for Prometheus' instant-query API on a real loopback socket, for what a real Prometheus will not do.

The collector's tests run against the local cluster's real Prometheus; this stand-in exists for the failures a
real one cannot be made to show on demand: an answer trickled a byte at a time (a hung Prometheus or a slow proxy
in front of it, the headers or the body), answers scripted query by query (a metric that is missing while its
target is up), and each answer held back (every query slow, none past a per-query timeout). It speaks HTTP/1.1
over asyncio streams, answers `POST /api/v1/query` (form-encoded `query` and `time`) with `answer(promql)` as a
success vector, and counts what happened in a way tests can wait for: requests received, connections the client
closed before the answer was complete.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

Trickle = Literal["headers", "body"]


@dataclass
class FakePrometheus:
    """One server: `answer(promql)` gives each query's result vector; `trickle` sends the answer one byte every
    `trickle_s` seconds (the status line and headers, or only the body), never finishing; `delay_s` holds each
    whole answer back that long (a slow Prometheus that does answer)."""

    answer: Callable[[str], list[dict[str, Any]]] = lambda promql: []
    trickle: Trickle | None = None
    trickle_s: float = 0.2
    delay_s: float = 0.0
    queries: list[str] = field(default_factory=list)
    #: Connections the client closed while the server was still sending: set when the first one happens.
    abandoned: asyncio.Event = field(default_factory=asyncio.Event)
    abandoned_count: int = 0
    url: str = ""
    _server: asyncio.Server | None = None

    async def start(self) -> FakePrometheus:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                promql = await _read_query(reader)
                if promql is None:
                    return
                self.queries.append(promql)
                body = json.dumps(
                    {"status": "success", "data": {"resultType": "vector", "result": self.answer(promql)}}
                )
                if self.trickle is None:
                    await asyncio.sleep(self.delay_s)
                    writer.write(_response(body.encode()))
                    await writer.drain()
                    continue
                await self._trickle(reader, writer, body.encode())
                return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()

    async def _trickle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes) -> None:
        """Send the answer a byte at a time and never finish (it announces 10 MB more than it sends, then pads
        with spaces): only the client can end it; when it does, count the connection as abandoned."""
        whole = _response(body, missing=10_000_000)
        head = b"" if self.trickle == "headers" else whole[: len(whole) - len(body)]
        writer.write(head)
        try:
            for byte in _endless(whole[len(head) :]):
                writer.write(byte)
                await writer.drain()
                if reader.at_eof() or writer.is_closing():
                    break
                await asyncio.sleep(self.trickle_s)
        except ConnectionError:
            pass
        self.abandoned_count += 1
        self.abandoned.set()


def _endless(first: bytes) -> Iterator[bytes]:
    yield from (first[i : i + 1] for i in range(len(first)))
    while True:
        yield b" "


def _response(body: bytes, missing: int = 0) -> bytes:
    """The HTTP answer carrying `body`, its Content-Length `missing` bytes more than the body (a trickle)."""
    head = f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body) + missing}\r\n\r\n"
    return head.encode() + body


async def _read_query(reader: asyncio.StreamReader) -> str | None:
    """The PromQL of one `/api/v1/query` request (in the form-encoded body or the URL, as clients send it), None
    when the client closed the connection."""
    line = await reader.readline()
    if not line:
        return None
    target = line.decode("latin-1").split(" ")[1] if line.count(b" ") >= 2 else ""
    length = 0
    while True:
        header = await reader.readline()
        if header in (b"\r\n", b"\n", b""):
            break
        name, _, value = header.decode("latin-1").partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    form = urllib.parse.parse_qs((await reader.readexactly(length)).decode())
    form.update(urllib.parse.parse_qs(urllib.parse.urlsplit(target).query))
    return form.get("query", [""])[0]


@contextlib.asynccontextmanager
async def fake_prometheus(**options: Any) -> AsyncIterator[FakePrometheus]:
    """A started `FakePrometheus(**options)`, stopped on exit."""
    server = await FakePrometheus(**options).start()
    try:
        yield server
    finally:
        await server.stop()
