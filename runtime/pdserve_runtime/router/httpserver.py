"""The router's HTTP/1.1 server: asyncio protocols over llhttp (httptools), with the limits a shared proxy needs.

Why not a framework: the router is a byte relay on its hot path, and it must decide what a hostile client can cost
before any handler runs. A connection here is one `asyncio.Protocol`; the parser calls back per header and per
body piece; a complete request becomes one handler task; a streamed answer is written chunk by chunk straight to
the transport (no task switch per chunk), with flow control handed to whoever produces the chunks.

Limits, all from `RouterConfig`, each answered in OpenAI error shape (`errors.error_payload`) with
`Connection: close`, never echoing the input, logged as one line:

- connections at once (`maxConnections`): 503 and close;
- request line plus headers (`maxRequestHeaderBytes`): 431; headers within `headerTimeoutSeconds` of the request's
  first byte (or of the connection's start), else 408 and close; idle keep-alive `keepAliveTimeoutSeconds`;
- body within `bodyTimeoutSeconds` of the headers: 408; size (`maxRequestBodyBytes`): 413, before reading it when
  Content-Length says so;
- memory: request bodies held at once, across clients and per client address (`BodyBudget`): 503 / 429;
- `Transfer-Encoding` other than exactly `chunked`: 501 (a coding the router would have to undo); Content-Length
  with Transfer-Encoding, duplicate Content-Length, bad chunk framing, obsolete line folding: 400 (llhttp, strict);
- `Content-Encoding` other than identity: 415 (a compressed body would have to be inflated first, and a small
  bomb costs seconds of CPU); `Expect` other than `100-continue`: 417; protocol upgrades: 400.

A client that goes away cancels its handler task (the handler's `finally` blocks release engines and close
upstream requests). Pipelined requests are answered in order. Handlers see `Request` and answer through
`Responder`; `HttpServer` maps (method, path) to handlers and answers 404 / 405 itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus
from typing import cast

import httptools
import orjson

from pdserve_runtime.router.errors import error_payload

log = logging.getLogger("pdserve.router.http")
access_log = logging.getLogger("pdserve.router.access")

Handler = Callable[["Request", "Responder"], Awaitable[None]]

# Pipelined requests buffered behind the one being handled before the connection stops reading.
_MAX_QUEUED = 8
# Below this size a chunk is copied into one write with its framing; above it is written without a copy.
_COPY_BELOW = 16 * 1024
# Bodies with a Content-Length above this are received into one preallocated buffer.
_PREALLOCATE_ABOVE = 256 * 1024
_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one client may cost the server (see the module docstring)."""

    max_connections: int = 4096
    max_header_bytes: int = 16 * 1024
    max_body_bytes: int = 8 * 1024 * 1024
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive_timeout: float = 75.0
    max_buffered_bytes: int = 512 * 1024 * 1024
    max_buffered_bytes_per_client: int = 64 * 1024 * 1024


class BodyBudget:
    """Bytes of request bodies held in memory, in total and per client address.

    A request reserves its Content-Length when its headers arrive (a chunked body reserves as it arrives) and gives
    it back when its answer is complete: a body is held while it is proxied, too (retries resend it).
    """

    def __init__(self, total: int, per_client: int) -> None:
        self.total_limit = total
        self.per_client_limit = per_client
        self.total = 0
        self.by_client: dict[str, int] = {}

    def reserve(self, client: str, size: int) -> int | None:
        """Take `size` bytes for `client`; None when granted, else the HTTP status to refuse with."""
        held = self.by_client.get(client, 0)
        if held + size > self.per_client_limit:
            return 429
        if self.total + size > self.total_limit:
            return 503
        self.by_client[client] = held + size
        self.total += size
        return None

    def release(self, client: str, size: int) -> None:
        if size <= 0:
            return
        held = self.by_client.get(client, 0) - size
        if held > 0:
            self.by_client[client] = held
        else:
            self.by_client.pop(client, None)
        self.total -= size


@dataclass(slots=True)
class Request:
    """One complete request. Header names are lower case; `body` is the whole body."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes | bytearray
    client: str
    keep_alive: bool = True
    reserved: int = 0
    http10: bool = False


class _RefusedError(Exception):
    """Stops parsing a request and answers it with an error (then closes the connection)."""

    def __init__(self, status: int, message: str, headers: Iterable[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = tuple(headers)


class _DateHeader:
    """The Date header value, formatted once per second."""

    second = 0
    value = b""

    @classmethod
    def now(cls) -> bytes:
        second = int(time.time())
        if second != cls.second:
            cls.second = second
            cls.value = formatdate(second, usegmt=True).encode()
        return cls.value


def _head(status: int, headers: Iterable[tuple[str, str]], extra: bytes) -> bytes:
    lines = [b"HTTP/1.1 %d %s\r\nDate: %s\r\n" % (status, _REASONS.get(status, b"Unknown"), _DateHeader.now())]
    for name, value in headers:
        lines.append(f"{name}: {value}\r\n".encode("latin-1", "replace"))
    lines.append(extra)
    lines.append(b"\r\n")
    return b"".join(lines)


def error_body(status: int, message: str) -> bytes:
    return orjson.dumps(error_payload(status, message))


class Responder:
    """Writes one answer on a connection: whole (`send`) or streamed (`start`, `write`..., `end`)."""

    __slots__ = ("_conn", "_head", "_head_only", "_http10", "_on_pause", "_on_resume", "finished", "started", "status")

    def __init__(self, conn: _Connection, head_only: bool, http10: bool) -> None:
        self._conn = conn
        self._head_only = head_only
        self._http10 = http10
        self.started = False
        self.finished = False
        self.status = 0
        self._head = b""  # a streamed answer's head, sent with its first piece (one write, one segment)
        self._on_pause: Callable[[], None] | None = None
        self._on_resume: Callable[[], None] | None = None

    @property
    def connected(self) -> bool:
        return not self._conn.lost

    def send(self, status: int, body: bytes, headers: Iterable[tuple[str, str]] = ()) -> None:
        """The whole answer at once (JSON unless `headers` name another content-type)."""
        if self.started:
            return
        self.started = self.finished = True
        self.status = status
        conn = self._conn
        extra = b"Content-Length: %d\r\n" % len(body)
        if not any(name.lower() == "content-type" for name, _ in headers):
            extra += b"Content-Type: application/json\r\n"
        if conn.closing_after_response:
            extra += b"Connection: close\r\n"
        head = _head(status, headers, extra)
        if self._head_only:
            conn.write(head)
        elif len(body) < _COPY_BELOW:
            conn.write(head + body)
        else:
            conn.writelines((head, body))
        conn.response_done(status)

    def error(self, status: int, message: str, headers: Iterable[tuple[str, str]] = ()) -> None:
        """An OpenAI-shaped error answer."""
        self.send(status, error_body(status, message), headers)

    def start(self, status: int, headers: Iterable[tuple[str, str]]) -> None:
        """Begin a streamed answer (chunked transfer coding; HTTP/1.0 clients get the body until close)."""
        if self.started:
            return
        self.started = True
        self.status = status
        conn = self._conn
        if self._http10:
            conn.closing_after_response = True
            extra = b"Connection: close\r\n"
        else:
            extra = b"Transfer-Encoding: chunked\r\n"
            if conn.closing_after_response:
                extra += b"Connection: close\r\n"
        self._head = _head(status, headers, extra)

    def write(self, data: bytes) -> None:
        """One piece of a streamed answer, written now (the transport buffers what the client has not read)."""
        if not data or self.finished:
            return
        head, self._head = self._head, b""
        conn = self._conn
        if self._head_only:
            if head:
                conn.write(head)
        elif self._http10:
            conn.write(head + data)
        elif len(data) < _COPY_BELOW:
            conn.write(b"%b%x\r\n%b\r\n" % (head, len(data), data))
        else:
            conn.writelines((b"%b%x\r\n" % (head, len(data)), data, b"\r\n"))

    def end(self, last: bytes = b"") -> None:
        """Finish a streamed answer (optionally with a last piece)."""
        if self.finished:
            return
        if last:
            self.write(last)
        self.finished = True
        head, self._head = self._head, b""
        if self._http10 or self._head_only:
            if head:
                self._conn.write(head)
        else:
            self._conn.write(head + b"0\r\n\r\n")
        self._conn.response_done(self.status)

    def flow_control(self, pause: Callable[[], None] | None, resume: Callable[[], None] | None) -> None:
        """Who to tell when the client stops reading and when it reads again (the relay pauses its engine)."""
        self._on_pause, self._on_resume = pause, resume
        if pause is not None and self._conn.write_paused:
            pause()

    def paused(self) -> None:
        if self._on_pause is not None:
            self._on_pause()

    def resumed(self) -> None:
        if self._on_resume is not None:
            self._on_resume()


@dataclass(slots=True)
class _Message:
    """A request while it is being parsed."""

    url: bytearray = field(default_factory=bytearray)
    headers: dict[str, str] = field(default_factory=dict)
    header_bytes: int = 0
    body: list[bytes] = field(default_factory=list)
    # With a Content-Length the body is received straight into one buffer of that size (no join at the end, which
    # for a body of megabytes would stall the event loop in one copy).
    buffer: bytearray | None = None
    body_bytes: int = 0
    reserved: int = 0
    chunked: bool = False


_SINGLETON_HEADERS = frozenset(
    {"content-length", "content-type", "content-encoding", "transfer-encoding", "authorization", "host", "expect"}
)


class _Connection(asyncio.Protocol):
    """One client connection: parse, enforce limits, run one handler at a time, write answers."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.limits = server.limits
        self.transport: asyncio.Transport | None = None
        self.client = ""
        self.parser = httptools.HttpRequestParser(self)
        self.message: _Message | None = None
        self.headers_done = False
        self.reject: _RefusedError | None = None
        self.queue: deque[Request] = deque()
        self.handling: asyncio.Task[None] | None = None
        self.responder: Responder | None = None
        self.current: Request | None = None
        self.closing_after_response = False
        self.lost = False
        self.write_paused = False
        self.read_paused = False
        self.timer: asyncio.TimerHandle | None = None
        self.pending_bytes = 0  # bytes of the request being received while its headers are incomplete
        self.loop = server.loop

    # -- transport events ------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass it
        transport = self.transport
        peer = transport.get_extra_info("peername")
        self.client = str(peer[0]) if isinstance(peer, tuple) and peer else "unknown"
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        server = self.server
        server.connections.add(self)
        if len(server.connections) > self.limits.max_connections:
            log.warning("Refused connection client=%s reason=connection_limit limit=%d", self.client,
                        self.limits.max_connections)  # fmt: skip
            self.closing_after_response = True
            self._answer_and_close(503, "the router is serving its maximum number of connections",
                                   (("Retry-After", "1"),))  # fmt: skip
            return
        # The first request's headers must come within the header timeout, like every later one's.
        self._arm(self.limits.header_timeout, self._header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.server.connections.discard(self)
        self._disarm()
        if self.handling is not None and not self.handling.done():
            self.handling.cancel()  # the client is gone: stop the work done for it
        self._release_all()

    def eof_received(self) -> bool:
        return False  # a half-closed client is a gone client: close, which cancels its handler

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.responder is not None:
            self.responder.paused()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.responder is not None:
            self.responder.resumed()

    def data_received(self, data: bytes) -> None:
        if self.reject is not None or self.lost:
            return
        if not self.headers_done:
            self.pending_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(_RefusedError(400, "protocol upgrades are not supported"))
            return
        except httptools.HttpParserCallbackError:
            self._fail(self.reject or _RefusedError(400, "the request could not be parsed"))
            return
        except httptools.HttpParserError as exc:
            self._fail(_RefusedError(400, f"malformed HTTP request ({_parser_reason(exc)})"))
            return
        if not self.headers_done and self.message is not None and self.pending_bytes > self.limits.max_header_bytes:
            self._fail(_RefusedError(431, f"request headers exceed {self.limits.max_header_bytes} bytes"))

    # -- parser callbacks ------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.message = _Message()
        self.headers_done = False
        if self.current is None and not self.queue:
            # A new request on an idle connection: the keep-alive wait ends, the header timeout starts.
            self._arm(self.limits.header_timeout, self._header_timeout)

    def on_url(self, url: bytes) -> None:
        message = self.message
        assert message is not None
        message.url += url
        message.header_bytes += len(url)
        if message.header_bytes > self.limits.max_header_bytes:
            self._stop(_RefusedError(431, f"request headers exceed {self.limits.max_header_bytes} bytes"))

    def on_header(self, name: bytes, value: bytes) -> None:
        message = self.message
        assert message is not None
        message.header_bytes += len(name) + len(value) + 4
        if message.header_bytes > self.limits.max_header_bytes:
            self._stop(_RefusedError(431, f"request headers exceed {self.limits.max_header_bytes} bytes"))
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        headers = message.headers
        if key in headers:
            if key in _SINGLETON_HEADERS:
                self._stop(_RefusedError(400, f"header {key} appears more than once"))
            headers[key] += ", " + text
        else:
            headers[key] = text

    def on_headers_complete(self) -> None:
        message = self.message
        assert message is not None
        self.headers_done = True
        self.pending_bytes = 0
        headers = message.headers
        if "upgrade" in headers and "upgrade" in headers.get("connection", "").lower():
            self._stop(_RefusedError(400, "protocol upgrades are not supported"))
        coding = headers.get("transfer-encoding")
        if coding is not None:
            if coding.strip().lower() != "chunked":
                self._stop(_RefusedError(501, "only the chunked transfer coding is supported"))
            message.chunked = True
        content_coding = headers.get("content-encoding", "identity").strip().lower()
        if content_coding not in ("", "identity"):
            self._stop(
                _RefusedError(415, "compressed request bodies are not accepted (send Content-Encoding: identity)")
            )
        expect = headers.get("expect")
        if expect is not None and expect.strip().lower() != "100-continue":
            self._stop(_RefusedError(417, "only Expect: 100-continue is supported"))
        length = headers.get("content-length")
        if length is not None:
            size = int(length)  # llhttp has checked it is a number
            if size > self.limits.max_body_bytes:
                self._stop(_RefusedError(413, f"request body is larger than the router's limit of "
                                        f"{self.limits.max_body_bytes} bytes"))  # fmt: skip
            self._reserve(message, size)
            if size > _PREALLOCATE_ABOVE:
                message.buffer = bytearray(size)
        if expect is not None and self.transport is not None and (length is None or int(length) > 0):
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if self.current is None and not self.queue:
            self._arm(self.limits.body_timeout, self._body_timeout)

    def on_body(self, body: bytes) -> None:
        message = self.message
        assert message is not None
        message.body_bytes += len(body)
        if message.body_bytes > self.limits.max_body_bytes:
            self._stop(_RefusedError(413, f"request body is larger than the router's limit of "
                                    f"{self.limits.max_body_bytes} bytes"))  # fmt: skip
        if message.chunked:
            self._reserve(message, len(body))
        buffer = message.buffer
        if buffer is not None:
            end = message.body_bytes
            memoryview(buffer)[end - len(body) : end] = body
        else:
            message.body.append(body)

    def on_message_complete(self) -> None:
        message = self.message
        assert message is not None
        self.message = None
        self.headers_done = False  # bytes from here on belong to the next request's headers
        self.pending_bytes = 0
        parser = self.parser
        url = bytes(message.url)
        path, _, query = url.partition(b"?")
        body: bytes | bytearray
        if message.buffer is not None:
            body = message.buffer
        else:
            body = message.body[0] if len(message.body) == 1 else b"".join(message.body)
        request = Request(
            method=parser.get_method().decode("latin-1"),
            path=path.decode("latin-1"),
            query=query.decode("latin-1"),
            headers=message.headers,
            body=body,
            client=self.client,
            keep_alive=parser.should_keep_alive(),
            reserved=message.reserved,
            http10=parser.get_http_version() == "1.0",
        )
        self.queue.append(request)
        if self.current is None:
            self._next()
        elif len(self.queue) >= _MAX_QUEUED and not self.read_paused and self.transport is not None:
            self.read_paused = True
            self.transport.pause_reading()

    # -- requests ---------------------------------------------------------------------------------------

    def _reserve(self, message: _Message, size: int) -> None:
        refused = self.server.budget.reserve(self.client, size)
        if refused is not None:
            if refused == 429:
                self._stop(_RefusedError(429, "this client has too many request bytes in flight; retry later",
                                   (("Retry-After", "1"),)))  # fmt: skip
            self._stop(_RefusedError(503, "the router is holding its maximum of request bytes; retry later",
                               (("Retry-After", "1"),)))  # fmt: skip
        message.reserved += size

    def _next(self) -> None:
        """Start the handler of the next complete request, if any."""
        if not self.queue or self.lost:
            return
        request = self.queue.popleft()
        if self.read_paused and len(self.queue) < _MAX_QUEUED // 2 and self.transport is not None:
            self.read_paused = False
            self.transport.resume_reading()
        self._disarm()
        self.current = request
        if not request.keep_alive:
            self.closing_after_response = True
        responder = Responder(self, request.method == "HEAD", request.http10)
        self.responder = responder
        self.handling = self.loop.create_task(self._run(request, responder))

    async def _run(self, request: Request, responder: Responder) -> None:
        try:
            await self.server.dispatch(request, responder)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug must cost one request, never the connection loop
            log.error("Failed handling request method=%s path=%s error=%s: %s", request.method, request.path,
                      type(exc).__name__, exc)  # fmt: skip
            if not responder.started:
                self.closing_after_response = True
                responder.error(500, "the router failed to handle the request")
            elif not responder.finished:
                self._abort()
        finally:
            if not responder.finished and not self.lost:
                # A handler that returned without finishing its answer (a bug) must not hang the client.
                if not responder.started:
                    responder.error(500, "the router failed to handle the request")
                else:
                    self._abort()

    def response_done(self, status: int) -> None:
        """The current answer is complete: release its request, go on with the next one or close."""
        request = self.current
        self.current = None
        self.responder = None
        if request is not None:
            self.server.budget.release(request.client, request.reserved)
            request.reserved = 0
            if self.server.access_log:
                access_log.info('%s "%s %s" %d', request.client, request.method, request.path, status)
        if self.closing_after_response:
            if self.transport is not None:
                self.transport.close()
            return
        if self.queue:
            self.loop.call_soon(self._next)
        elif self.message is None:
            self._arm(self.limits.keep_alive_timeout, self._idle_timeout)
        elif not self.headers_done:
            self._arm(self.limits.header_timeout, self._header_timeout)
        else:
            self._arm(self.limits.body_timeout, self._body_timeout)

    def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is not None and not self.lost:
            transport.write(data)

    def writelines(self, data: Iterable[bytes]) -> None:
        transport = self.transport
        if transport is not None and not self.lost:
            transport.writelines(data)

    # -- errors and timers ------------------------------------------------------------------------------

    def _stop(self, reject: _RefusedError) -> None:
        """Called from a parser callback: remember why and make the parser stop."""
        if self.reject is None:
            self.reject = reject
        raise reject

    def _fail(self, reject: _RefusedError) -> None:
        """Answer a request the router refuses before its handler runs, then close the connection."""
        self.reject = reject
        log.info("Refused request client=%s status=%d reason=%s", self.client, reject.status, reject.message)
        if self.current is not None:
            # An answer is under way on this connection: do not interleave; just stop reading and close after it.
            self.closing_after_response = True
            if self.transport is not None:
                self.transport.pause_reading()
            return
        self._answer_and_close(reject.status, reject.message, reject.headers)

    def _answer_and_close(self, status: int, message: str, headers: Iterable[tuple[str, str]] = ()) -> None:
        body = error_body(status, message)
        extra = b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n" % len(body)
        self.write(_head(status, headers, extra) + body)
        self._disarm()
        self._release_message()
        if self.transport is not None:
            self.transport.close()

    def _abort(self) -> None:
        """Cut the connection (an answer cannot be completed: the client must not take it as whole)."""
        if self.transport is not None:
            self.transport.abort()

    def _arm(self, delay: float, callback: Callable[[], None]) -> None:
        self._disarm()
        self.timer = self.loop.call_later(delay, callback)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _idle_timeout(self) -> None:
        self.timer = None
        if self.transport is not None and self.current is None and self.message is None:
            self.transport.close()

    def _header_timeout(self) -> None:
        self.timer = None
        if self.current is None:
            log.info("Refused request client=%s status=408 reason=header_timeout", self.client)
            self.reject = _RefusedError(408, "request headers took too long")
            self._answer_and_close(408, "the request headers did not arrive in time")

    def _body_timeout(self) -> None:
        self.timer = None
        if self.current is None and self.message is not None:
            log.info("Refused request client=%s status=408 reason=body_timeout", self.client)
            self.reject = _RefusedError(408, "request body took too long")
            self._answer_and_close(408, "the request body did not arrive in time")

    def _release_message(self) -> None:
        message = self.message
        if message is not None and message.reserved:
            self.server.budget.release(self.client, message.reserved)
            message.reserved = 0

    def _release_all(self) -> None:
        self._release_message()
        budget = self.server.budget
        for request in self.queue:
            budget.release(request.client, request.reserved)
            request.reserved = 0
        self.queue.clear()
        if self.current is not None and self.handling is None:
            budget.release(self.current.client, self.current.reserved)
            self.current.reserved = 0
        elif self.current is not None:
            current = self.current

            def release(_task: asyncio.Task[None]) -> None:
                budget.release(current.client, current.reserved)
                current.reserved = 0

            self.handling.add_done_callback(release)  # type: ignore[union-attr]


def _parser_reason(exc: Exception) -> str:
    """llhttp's reason, which names the rule broken and never quotes the input."""
    text = str(exc).strip() or type(exc).__name__
    return text[:100]


class HttpServer:
    """Listens, routes (method, path) to handlers, and tracks live connections."""

    def __init__(self, limits: ServerLimits, *, access_log: bool) -> None:
        self.limits = limits
        self.access_log = access_log
        self.budget = BodyBudget(limits.max_buffered_bytes, limits.max_buffered_bytes_per_client)
        self.routes: dict[str, dict[str, Handler]] = {}
        self.connections: set[_Connection] = set()
        self._server: asyncio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        assert self._loop is not None, "HttpServer.start() was not called"
        return self._loop

    def route(self, method: str, path: str, handler: Handler) -> None:
        self.routes.setdefault(path, {})[method] = handler
        if method == "GET":
            self.routes[path]["HEAD"] = handler

    async def dispatch(self, request: Request, responder: Responder) -> None:
        methods = self.routes.get(request.path)
        if methods is None:
            responder.error(404, "not found")
            return
        handler = methods.get(request.method)
        if handler is None:
            responder.error(405, f"method {request.method} is not allowed here",
                            (("Allow", ", ".join(sorted(methods))),))  # fmt: skip
            return
        await handler(request, responder)

    async def start(self, host: str, port: int, *, backlog: int = 2048, reuse_port: bool = False) -> int:
        """Listen; returns the bound port (useful with port 0)."""
        self._loop = asyncio.get_running_loop()
        self._server = await self._loop.create_server(
            lambda: _Connection(self), host, port, backlog=backlog, reuse_address=True, reuse_port=reuse_port
        )
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self, grace: float) -> None:
        """Stop listening, let requests being handled finish for up to `grace` seconds, then close everything."""
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.closing_after_response = True
            if conn.current is None and conn.transport is not None:
                conn.transport.close()
        handling = [conn.handling for conn in self.connections if conn.handling is not None]
        pending = [task for task in handling if not task.done()]
        if pending and grace > 0:
            await asyncio.wait(pending, timeout=grace)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.abort()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
