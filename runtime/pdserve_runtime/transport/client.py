"""An HTTP/1.1 client to upstream servers (engines): pooled keep-alive connections, asyncio protocols over llhttp.

One `Exchange` is one request to one engine. The caller sends, then waits for what it needs and no more:

- `head()`: the status line and headers;
- `first_chunk()`: the first piece of the body (a stream's first event, a prefill answer's first bytes);
- `read_all(limit)`: the rest, refusing an answer larger than `limit` (a prefill answer is parsed; an engine must
  not be able to make the router buffer without bound);
- `relay(sink)`: every further piece handed to `sink` from the protocol callback itself, so a relayed stream costs
  no task switch and no intermediate buffer per chunk; it completes when the body ends. While the sink's own
  reader is slow, the caller pauses the exchange (`pause_reading`): the engine's silence then is the router's
  doing, so the idle timeout does not run until `resume_reading`.

Timeouts are deadlines the caller passes in (first byte, silence between chunks); connect has its own. Failures
raise `UpstreamError` with a kind: connect, timeout, protocol (unparseable answer, too large), stream (the engine
closed the connection mid-answer). `close()` either returns a finished connection to the pool or, when the answer
is unfinished (client gone, relay failed), closes it, which is how an engine learns to abort the request.

Engines close idle keep-alive connections after a few seconds (vLLM: 5 s), so pooled connections idle for longer
than `idle_seconds` are not reused, and a request that fails on a reused connection before any byte of an answer
arrived is sent once more on a fresh one (the engine never saw it or closed it unread).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeAlias, cast
from urllib.parse import urlsplit

import httptools

# What a waiting task needs: the head, some of the body, the end (or an error, or a body past read_all's bound).
_HEAD, _BODY, _DONE = 1, 2, 3

# Kinds of UpstreamError, also the `kind` label of pdserve_router_endpoint_errors_total.
CONNECT, TIMEOUT, STATUS, PROTOCOL, STREAM = "connect", "timeout", "status", "protocol", "stream"


# A request body as buffers written with one writelines (the client's bytes are never copied into one).
Parts: TypeAlias = Sequence[bytes | bytearray | memoryview]


class UpstreamError(Exception):
    """An engine could not serve: connect error, timeout, error status, malformed answer, broken stream."""

    def __init__(self, kind: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status


@dataclass(frozen=True, slots=True)
class Origin:
    """Where an engine listens, parsed once from its base URL."""

    host: str
    port: int
    tls: bool
    host_header: str

    @staticmethod
    def parse(url: str) -> Origin:
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        host = parts.hostname or "localhost"
        port = parts.port or (443 if tls else 80)
        return Origin(host, port, tls, parts.netloc)


class _Connection(asyncio.Protocol):
    """One keep-alive connection to an engine, carrying one exchange at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.lost = False
        self.idle_since = 0.0
        self.reused = False
        self.paused = False  # reading paused by the caller (its own reader is slow)
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.head_done = False
        self.complete = False
        self.keep_alive = False
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.received_any = False
        self.error: UpstreamError | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.wanted = _HEAD  # what the waiting task needs before it is worth waking it
        self.sink: Callable[[bytes], None] | None = None
        self.last_activity = 0.0
        self.limit = 1 << 62  # read_all's bound: buffering past it wakes the reader to refuse the answer
        self.framed = False  # the answer has Content-Length or chunked framing (else it ends at close)

    # -- protocol ----------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        transport = self.transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if not self.complete and self.error is None:
            if self.head_done and not self.framed:
                self.complete = True  # an answer delimited by the close itself
            else:
                self.error = UpstreamError(STREAM, "the engine closed the connection before the answer ended")
        self._wake(_DONE)

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        self.last_activity = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.error is None:
                self.error = UpstreamError(PROTOCOL, f"the engine's answer is not valid HTTP ({exc})")
            self._wake(_DONE)
            if self.transport is not None:
                self.transport.abort()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.head_done = True
        headers = self.headers
        self.framed = "content-length" in headers or "transfer-encoding" in headers
        self._wake(_HEAD)

    def on_body(self, body: bytes) -> None:
        sink = self.sink
        if sink is not None:
            sink(body)
            return
        self.chunks.append(body)
        self.buffered += len(body)
        self._wake(_DONE if self.buffered > self.limit else _BODY)

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        self.complete = True
        self._wake(_DONE)

    def _wake(self, level: int) -> None:
        """Wake the waiting task if this news is what it waits for: each wake-up is a task switch, and a prefill
        answer or a stream's first event often arrives in more than one piece."""
        waiter = self.waiter
        if waiter is not None and level >= self.wanted and not waiter.done():
            waiter.set_result(None)

    async def wait(self, deadline: float | None, wanted: int = 0) -> None:
        """Until the protocol has news of at least `wanted` (_HEAD, _BODY, _DONE; errors always count)."""
        self.wanted = wanted
        waiter = self.waiter = self.loop.create_future()
        try:
            if deadline is None:
                await waiter
            else:
                async with asyncio.timeout_at(deadline):
                    await waiter
        finally:
            self.waiter = None


class Exchange:
    """One request to one engine and its answer (see the module docstring)."""

    __slots__ = ("_client", "_conn", "_head", "_origin", "_parts", "_retried")

    def __init__(self, client: EngineClient, origin: Origin, conn: _Connection, head: bytes, parts: Parts) -> None:
        self._client = client
        self._origin = origin
        self._conn = conn
        self._head = head
        self._parts = parts
        self._retried = False

    @property
    def status(self) -> int:
        return self._conn.status

    @property
    def headers(self) -> dict[str, str]:
        return self._conn.headers

    async def head(self, deadline: float | None) -> int:
        """Wait for the status and headers; returns the status."""
        conn = self._conn
        while not conn.head_done:
            error = conn.error
            if error is not None:
                if conn.reused and not conn.received_any and not self._retried:
                    # A pooled connection the engine had closed: the request was never read. Send it again.
                    self._retried = True
                    await self._resend(deadline)
                    conn = self._conn
                    continue
                raise error
            if conn.lost:  # pragma: no cover (connection_lost always sets an error while the head is missing)
                raise UpstreamError(STREAM, "the engine closed the connection before answering")
            await self._wait(deadline, "the engine sent no answer in time", _HEAD)
        return conn.status

    async def first_chunk(self, deadline: float | None) -> bytes:
        """The first piece of the body (b"" when the body is empty), with the status and headers before it."""
        conn = self._conn
        while not conn.chunks and not conn.complete:
            error = conn.error
            if error is not None:
                if not conn.head_done:
                    await self.head(deadline)  # raises, or sends again when a pooled connection was stale
                    conn = self._conn
                    continue
                raise error
            await self._wait(deadline, "the engine sent no data in time", _BODY)
        return self._take()

    async def read_all(self, limit: int, deadline: float | None) -> bytes:
        """The whole body; UpstreamError(protocol) when it is larger than `limit` bytes."""
        conn = self._conn
        conn.limit = limit
        while not conn.complete:
            error = conn.error
            if error is not None:
                if not conn.head_done:
                    await self.head(deadline)  # raises, or sends again when a pooled connection was stale
                    conn = self._conn
                    conn.limit = limit
                    continue
                raise error
            if conn.buffered > limit:
                raise UpstreamError(PROTOCOL, f"the engine's answer is larger than {limit} bytes")
            await self._wait(deadline, "the engine's answer did not arrive in time", _DONE)
        if conn.buffered > limit:
            raise UpstreamError(PROTOCOL, f"the engine's answer is larger than {limit} bytes")
        return self._take()

    async def relay(self, sink: Callable[[bytes], None], idle_timeout: float | None) -> None:
        """Hand every further piece of the body to `sink` until it ends; raises UpstreamError if it breaks off or
        stays silent for `idle_timeout` seconds."""
        conn = self._conn
        rest = self._take()
        if rest:
            sink(rest)
        if conn.complete:
            return
        conn.sink = sink
        conn.last_activity = conn.loop.time()
        try:
            while not conn.complete:
                if conn.error is not None:
                    raise conn.error
                if idle_timeout is None or conn.paused:
                    await conn.wait(None, _DONE)  # the end, an error, or (when paused) reading resumed
                    continue
                quiet_until = conn.last_activity + idle_timeout
                if conn.loop.time() >= quiet_until:
                    raise UpstreamError(TIMEOUT, f"the engine sent nothing for {idle_timeout:g} s mid-answer")
                with contextlib.suppress(TimeoutError):
                    await conn.wait(quiet_until, _DONE)
            if conn.error is not None:
                raise conn.error
        finally:
            conn.sink = None

    def pause_reading(self) -> None:
        """Stop reading the answer (whoever it is relayed to does not keep up); the idle timeout stops too."""
        conn = self._conn
        transport = conn.transport
        if transport is not None and not conn.lost and not conn.paused:
            conn.paused = True
            transport.pause_reading()

    def resume_reading(self) -> None:
        """Read again; the idle timeout counts afresh from now."""
        conn = self._conn
        transport = conn.transport
        if transport is not None and not conn.lost and conn.paused:
            conn.paused = False
            conn.last_activity = conn.loop.time()
            transport.resume_reading()
            conn._wake(_DONE)

    def close(self) -> None:
        """Give the connection back to the pool when the answer is complete, else close it (aborting the
        engine's request)."""
        conn = self._conn
        if conn.complete and conn.keep_alive and conn.error is None and not conn.lost:
            if conn.paused and conn.transport is not None:
                conn.paused = False
                conn.transport.resume_reading()  # a pooled connection reads (the engine may close it)
            self._client.release(self._origin, conn)
        elif conn.transport is not None:
            conn.transport.close()

    def _take(self) -> bytes:
        conn = self._conn
        chunks = conn.chunks
        if not chunks:
            return b""
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        conn.chunks = []
        conn.buffered = 0
        return data

    async def _wait(self, deadline: float | None, what: str, wanted: int) -> None:
        try:
            await self._conn.wait(deadline, wanted)
        except TimeoutError:
            raise UpstreamError(TIMEOUT, what) from None

    async def _resend(self, deadline: float | None) -> None:
        conn = await self._client.connect(self._origin, fresh=True)
        conn.transport.writelines([self._head, *self._parts])  # type: ignore[union-attr]
        self._conn = conn


class EngineClient:
    """Connections to every engine, pooled per origin."""

    def __init__(self, *, connect_timeout: float, idle_seconds: float = 4.0, max_idle_per_origin: int = 256) -> None:
        self._connect_timeout = connect_timeout
        self._idle_seconds = idle_seconds
        self._max_idle = max_idle_per_origin
        self._idle: dict[Origin, list[_Connection]] = {}
        self._origins: dict[str, Origin] = {}
        self._tls: ssl.SSLContext | None = None
        self._closed = False

    def origin(self, base_url: str) -> Origin:
        origin = self._origins.get(base_url)
        if origin is None:
            origin = self._origins[base_url] = Origin.parse(base_url)
        return origin

    async def send(self, base_url: str, method: str, path: str, headers: bytes, parts: Parts) -> Exchange:
        """Connect (or reuse a connection) and write the request; `headers` are complete header lines."""
        origin = self.origin(base_url)
        length = sum(len(part) for part in parts)
        head = b"%s %s HTTP/1.1\r\nhost: %s\r\ncontent-length: %d\r\n%s\r\n" % (
            method.encode(), path.encode(), origin.host_header.encode(), length, headers
        )  # fmt: skip
        conn = await self.connect(origin)
        conn.transport.writelines([head, *parts])  # type: ignore[union-attr]
        return Exchange(self, origin, conn, head, parts)

    async def connect(self, origin: Origin, *, fresh: bool = False) -> _Connection:
        """A pooled connection young enough to trust, or a new one."""
        loop = asyncio.get_running_loop()
        idle = self._idle.get(origin)
        if idle and not fresh:
            now = loop.time()
            while idle:
                conn = idle.pop()
                if not conn.lost and now - conn.idle_since < self._idle_seconds:
                    conn._reset()
                    conn.reused = True
                    return conn
                if conn.transport is not None:
                    conn.transport.close()
        conn = _Connection(loop)
        tls = None
        if origin.tls:
            tls = self._tls = self._tls or ssl.create_default_context()
        try:
            async with asyncio.timeout(self._connect_timeout):
                await loop.create_connection(lambda: conn, origin.host, origin.port, ssl=tls)
        except TimeoutError:
            raise UpstreamError(CONNECT, f"connecting to the engine took over {self._connect_timeout:g} s") from None
        except OSError as exc:
            raise UpstreamError(CONNECT, f"the engine refused or is unreachable ({exc.strerror or exc})") from None
        return conn

    def release(self, origin: Origin, conn: _Connection) -> None:
        if self._closed:
            if conn.transport is not None:
                conn.transport.close()
            return
        idle = self._idle.setdefault(origin, [])
        if len(idle) >= self._max_idle:
            if conn.transport is not None:
                conn.transport.close()
            return
        conn.idle_since = conn.loop.time()
        idle.append(conn)

    def forget(self, base_url: str) -> None:
        """An engine left the table: close its idle connections and drop what was kept for it."""
        origin = self._origins.pop(base_url, None)
        for conn in self._idle.pop(origin, []) if origin is not None else []:
            if conn.transport is not None:
                conn.transport.close()

    async def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                if conn.transport is not None:
                    conn.transport.close()
        self._idle.clear()

    async def get(self, base_url: str, path: str, *, limit: int, within: float) -> tuple[int, bytes, str]:
        """A small GET (health probes, metrics, model lists): (status, body, content type)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        async with asyncio.timeout_at(deadline):
            exchange = await self.send(base_url, "GET", path, b"accept-encoding: identity\r\n", ())
        try:
            body = await exchange.read_all(limit, deadline)
            return exchange.status, body, exchange.headers.get("content-type", "")
        finally:
            exchange.close()
