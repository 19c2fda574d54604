"""An HTTP/1.1 server: asyncio protocols over llhttp (httptools), with the limits a shared proxy needs.

Why not a framework: a proxy is a byte relay on its hot path, and it must decide what a hostile client can cost
before any handler runs. A connection here is one `asyncio.Protocol`; the parser calls back per header and per
body piece; a complete request becomes one handler task; a streamed answer is written chunk by chunk straight to
the transport (no task switch per chunk), with flow control handed to whoever produces the chunks.

Limits (`ServerLimits`), each refusal answered with the body `error_body(status, message)` builds and
`Connection: close`, never echoing the input, logged as one line:

- connections at once: 503 and close;
- request line plus headers: 431. Headers within `header_timeout`, counted from the connection's start for its
  first request and from a request's first byte for later ones, never restarted: else 408 and close. Idle
  keep-alive: `keep_alive_timeout`;
- body within `body_timeout` of the headers: 408; size: 413, before reading it when Content-Length says so;
  chunk extensions and trailers of one request beyond `max_chunk_metadata_bytes`: 400 (trailers are read and
  dropped, never merged into the headers);
- memory: request bodies are charged as their bytes arrive, never as announced, to a `BodyBudget` (in total
  and per client address; bodies still arriving that trickle or hold more than their share give way to others:
  see `budget`): 503 / 429 / 408;
- `Transfer-Encoding` other than exactly `chunked`: 501; Content-Length with Transfer-Encoding, duplicate
  Content-Length, bad chunk framing, obsolete line folding: 400 (llhttp, strict);
- `Content-Encoding` other than identity: 415 (a small compressed bomb costs seconds of CPU); `Expect` other
  than `100-continue`: 417; protocol upgrades: 400;
- a client that stops reading an answer for `write_timeout` (its socket and the transport's bounded buffer full)
  has its connection cut: its handler is cancelled like a client that left.

Connection lifetime (RFC 9112 section 9): pipelined requests are answered in order. After a request that ends the
connection (`Connection: close`, HTTP/1.0 without keep-alive) no later request on it is processed: its answer
says `Connection: close`, and the connection closes in stages (the write side first, then input is read and
dropped for `_LINGER_SECONDS`), so the client reads the whole answer instead of a reset. A client that
half-closes after sending (shutdown of its write side) still gets its answers; to tell it from a client that
left for good, the server sends an interim `100 Continue` (which every HTTP/1.1 client must accept) and checks
for the reset a closed socket answers data with. An end of input once an answer is under way is a client that
left (`eof_received` says why). A client that goes away cancels its handler task (the
handler's `finally` blocks release what it held). Handlers see `Request` and answer through `Responder`;
`HttpServer` maps (method, path) to handlers and answers 404 / 405 itself.
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

from pdserve_runtime.transport.budget import BodyBudget, Hold

log = logging.getLogger("pdserve.transport.server")
access_log = logging.getLogger("pdserve.transport.access")

Handler = Callable[["Request", "Responder"], Awaitable[None]]
ErrorBody = Callable[[int, str], bytes]

# Pipelined requests buffered behind the one being handled before the connection stops reading.
_MAX_QUEUED = 8
# Below this size a chunk is copied into one write with its framing; above it is written without a copy.
_COPY_BELOW = 16 * 1024
# The first buffer of a body that arrives in more than one piece; each next one doubles, up to its length.
_FIRST_BUFFER = 64 * 1024
# Chunk framing itself (size in hex, CRLF after it and after the data) allowed per chunk besides extensions.
_CHUNK_FRAMING = 12
# After the last answer of a closing connection: how long (and how many bytes) input is read and dropped.
_LINGER_SECONDS = 2.0
_LINGER_BYTES = 1024 * 1024
# How often a half-closed client is checked for having gone (the reset after the interim answer).
_PEER_CHECK_SECONDS = 0.25
_TCP_CLOSE = 7  # tcpi_state of a socket the peer has reset (linux/tcp_states.h)
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """What one client may cost the server (see the module docstring). The composition root sets every field."""

    max_connections: int
    max_header_bytes: int
    max_body_bytes: int
    header_timeout: float
    body_timeout: float
    keep_alive_timeout: float
    max_buffered_bytes: int
    max_buffered_bytes_per_client: int
    min_body_rate: float
    max_chunk_metadata_bytes: int
    write_timeout: float


def plain_error_body(status: int, message: str) -> bytes:
    """The default error body: `{"error": {"message": ..., "code": ...}}`."""
    return orjson.dumps({"error": {"message": message, "code": status}})


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
    hold: Hold | None = None  # the body's bytes in the budget, released when the answer is complete
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


class Responder:
    """Writes one answer on a connection: whole (`send`) or streamed (`start`, `write`..., `end`)."""

    __slots__ = (
        "_conn", "_head", "_head_only", "_http10", "_on_pause", "_on_resume", "finished", "sent", "started", "status"
    )  # fmt: skip

    def __init__(self, conn: _Connection, head_only: bool, http10: bool) -> None:
        self._conn = conn
        self._head_only = head_only
        self._http10 = http10
        self.started = False
        self.finished = False
        self.sent = False  # bytes of the answer are on their way (no interim answer may come before them now)
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
        self.started = self.finished = self.sent = True
        self.status = status
        conn = self._conn
        extra = b"Content-Length: %d\r\n" % len(body)
        if not any(name.lower() == "content-type" for name, _ in headers):
            extra += b"Content-Type: application/json\r\n"
        if conn.last_answer:
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
        """An error answer in the server's error shape."""
        self.send(status, self._conn.server.error_body(status, message), headers)

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
            if conn.last_answer:
                extra += b"Connection: close\r\n"
        self._head = _head(status, headers, extra)

    def write(self, data: bytes) -> None:
        """One piece of a streamed answer, written now (the transport buffers what the client has not read)."""
        if not data or self.finished:
            return
        self.sent = True
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
        self.finished = self.sent = True
        head, self._head = self._head, b""
        if self._http10 or self._head_only:
            if head:
                self._conn.write(head)
        else:
            self._conn.write(head + b"0\r\n\r\n")
        self._conn.response_done(self.status)

    def flow_control(self, pause: Callable[[], None] | None, resume: Callable[[], None] | None) -> None:
        """Who to tell when the client stops reading and when it reads again (a relay pauses its source)."""
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

    hold: Hold
    header_deadline: float
    body_deadline: float = 0.0
    url: bytearray = field(default_factory=bytearray)
    headers: dict[str, str] = field(default_factory=dict)
    header_bytes: int = 0
    # The body: its first piece as it came (most bodies come in one), then a buffer that grows as bytes arrive,
    # doubling up to the announced length, never allocated from what headers announce.
    first: bytes = b""
    buffer: bytearray | None = None
    body_bytes: int = 0
    length: int | None = None
    chunked: bool = False
    chunks: int = 0
    framing: int = 0  # bytes of chunk sizes, extensions and trailers counted so far
    complete: bool = False


class _Connection(asyncio.Protocol):
    """One client connection: parse, enforce limits, run one handler at a time, write answers."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.limits = server.limits
        self.loop = server.loop
        self.transport: asyncio.Transport | None = None
        self.client = ""
        self.parser: httptools.HttpRequestParser | None = httptools.HttpRequestParser(self)
        self.message: _Message | None = None
        self.headers_done = False
        self.reject: _RefusedError | None = None
        self.queue: deque[Request] = deque()
        self.queued_bytes = 0
        self.handling: asyncio.Task[None] | None = None
        self.responder: Responder | None = None
        self.current: Request | None = None
        self.closing_after_response = False
        self.last_request_seen = False  # a request that ends the connection was parsed: nothing after it counts
        self.dropped = 0  # bytes read and dropped after it
        self.peer_eof = False
        self.lingering = False
        self.lost = False
        self.write_paused = False
        self.read_paused = False
        self.timer: asyncio.TimerHandle | None = None
        self.write_timer: asyncio.TimerHandle | None = None
        self.peer_timer: asyncio.TimerHandle | None = None
        self.pending_bytes = 0  # bytes of the request being received while its headers are incomplete
        self.first_deadline = 0.0  # the first request's headers are due by then (from the connection's start)

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
            self._answer_and_close(503, "the server is serving its maximum number of connections",
                                   (("Retry-After", "1"),))  # fmt: skip
            return
        # The first request's headers are due within the header timeout of the connection's start: a first byte
        # late in that time does not restart it.
        self.first_deadline = self.loop.time() + self.limits.header_timeout
        self._arm_at(self.first_deadline, self._header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.server.connections.discard(self)
        self._disarm()
        for timer in (self.write_timer, self.peer_timer):
            if timer is not None:
                timer.cancel()
        self.write_timer = self.peer_timer = None
        if self.handling is not None and not self.handling.done():
            self.handling.cancel()  # the client is gone: stop the work done for it
        self._release_all()
        # Let go of everything now rather than when the cyclic collector runs: the parser calls back into this
        # object (a reference cycle), and a body buffer of megabytes must not outlive its connection.
        self.parser = None
        self.message = None
        self.queue.clear()
        self.responder = None

    def eof_received(self) -> bool:
        """The client closed its side. With complete requests whose answers have not started, answer them (a
        half-close after sending is allowed); otherwise close, which cancels a handler under way.

        Once an answer is under way nothing more can be sent to ask whether the client is still there (HTTP/1.1
        has no no-op inside a body), and a stalled engine would keep a departed client's request for its whole
        read timeout: an end of input then means the client left, as it did before half-close was honoured."""
        responder = self.responder
        if self.lingering or (self.current is None and not self.queue) or (responder is not None and responder.sent):
            return False
        self.peer_eof = True
        self.closing_after_response = True
        if self.message is not None:  # a request cut off by the close can never complete
            self._release_message()
            self.message = None
        current = self.current
        if current is not None and not current.http10:
            # A client that closed its socket for good answers data with a reset; one that only shut its write
            # side reads an interim answer and waits for the final one. Ask, then look for the reset.
            self.write(_CONTINUE)
        self.peer_timer = self.loop.call_later(_PEER_CHECK_SECONDS, self._check_peer)
        return True

    def pause_writing(self) -> None:
        self.write_paused = True
        if self.write_timer is None:
            self.write_timer = self.loop.call_later(self.limits.write_timeout, self._write_timeout)
        if self.responder is not None:
            self.responder.paused()

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.write_timer is not None:
            self.write_timer.cancel()
            self.write_timer = None
        if self.responder is not None:
            self.responder.resumed()

    def data_received(self, data: bytes) -> None:
        if self.lost:
            return
        if self.lingering or (self.last_request_seen and self.message is None):
            self._drop(len(data))
            return
        if self.reject is not None:
            return
        parser = self.parser
        assert parser is not None
        message = self.message
        # Chunk framing is counted per read: every byte of a read that neither starts nor ends the message is
        # either body or framing (sizes, extensions, trailers), so framing is exact except in those two reads.
        counting = message is not None and message.chunked and self.headers_done
        body_before = framing_before = 0
        if counting:
            assert message is not None
            body_before, framing_before = message.body_bytes, message.framing
        elif not self.headers_done:
            self.pending_bytes += len(data)
        try:
            parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(_RefusedError(400, "protocol upgrades are not supported"))
            return
        except httptools.HttpParserCallbackError:
            if self.reject is None and self.last_request_seen:
                return  # a request after the last one: stopped on purpose, dropped
            if self.reject is not None:
                # Its traceback holds the callback's frame, which holds this connection and the body piece or
                # buffer it was handling: a reference cycle that would keep them until the cyclic collector runs.
                self.reject.__traceback__ = None
            self._fail(self.reject or _RefusedError(400, "the request could not be parsed"))
            return
        except httptools.HttpParserError as exc:
            if self.last_request_seen:
                self._drop(len(data))  # llhttp refuses data after `Connection: close`: it is dropped anyway
                return
            self._fail(_RefusedError(400, f"malformed HTTP request ({_parser_reason(exc)})"))
            return
        if counting and message is not None and not message.complete:
            message.framing += len(data) - (message.body_bytes - body_before) - (message.framing - framing_before)
            if message.framing > self._framing_allowance(message):
                self._fail(self._too_much_framing())
                return
        if not self.headers_done and self.message is not None and self.pending_bytes > self.limits.max_header_bytes:
            self._fail(_RefusedError(431, f"request headers exceed {self.limits.max_header_bytes} bytes"))

    # -- parser callbacks ------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.last_request_seen:
            raise _RefusedError(0, "a request after the connection's last one")  # stops the parser; dropped
        now = self.loop.time()
        deadline = now + self.limits.header_timeout
        if self.first_deadline:
            deadline, self.first_deadline = min(deadline, self.first_deadline), 0.0
        self.message = _Message(hold=self.server.budget.hold(self.client, self._evicted), header_deadline=deadline)
        self.headers_done = False
        if self.current is None and not self.queue:
            # A request on an idle connection: the keep-alive wait ends, the header deadline counts.
            self._arm_at(deadline, self._header_timeout)

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
        size = len(name) + len(value) + 4
        if self.headers_done:
            # A trailer (after a chunked body): counted with the chunk extensions, never merged into the headers
            # (it would bypass every check the headers passed).
            message.framing += size
            if message.framing > self._framing_allowance(message):
                self._stop(self._too_much_framing())
            return
        message.header_bytes += size
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
                self._stop(self._too_large())
            message.length = size
        if expect is not None and self.transport is not None and (length is None or int(length) > 0):
            self.transport.write(_CONTINUE)
        message.body_deadline = self.loop.time() + self.limits.body_timeout
        if self.current is None and not self.queue:
            self._arm_at(message.body_deadline, self._body_timeout)

    def on_chunk_header(self) -> None:
        message = self.message
        if message is not None:
            message.chunks += 1

    def on_body(self, body: bytes) -> None:
        message = self.message
        assert message is not None
        size = len(body)
        received = message.body_bytes + size
        if received > self.limits.max_body_bytes:
            self._stop(self._too_large())
        hold = message.hold
        hold.arrived(size, self.loop.time())
        buffer = message.buffer
        if received == size:
            self._charge(hold, size)  # the first piece, kept as it came
            message.first = body
        elif buffer is None or received > len(buffer):
            # Grow: a new buffer of twice what has arrived (at least _FIRST_BUFFER, at most the announced length),
            # charged before it is allocated; the old one is given back once copied.
            limit = message.length if message.length is not None else self.limits.max_body_bytes
            capacity = max(received, min(limit, max(2 * received, _FIRST_BUFFER)))
            old = len(buffer) if buffer is not None else len(message.first)
            self._charge(hold, capacity)
            grown = bytearray(capacity)
            view = memoryview(grown)
            if buffer is not None:
                view[: message.body_bytes] = memoryview(buffer)[: message.body_bytes]
            else:
                view[: message.body_bytes] = message.first
                message.first = b""
            view[message.body_bytes : received] = body
            message.buffer = grown
            self.server.budget.shrink(hold, old)
        else:
            memoryview(buffer)[message.body_bytes : received] = body
        message.body_bytes = received

    def on_message_complete(self) -> None:
        message = self.message
        assert message is not None
        message.complete = True
        self.message = None
        self.headers_done = False  # bytes from here on belong to the next request's headers
        self.pending_bytes = 0
        parser = self.parser
        assert parser is not None
        message.hold.receiving = False  # whole now: it is load, it never gives way
        url = bytes(message.url)
        path, _, query = url.partition(b"?")
        body: bytes | bytearray
        if message.buffer is not None:
            body = message.buffer
            if len(body) > message.body_bytes:
                del body[message.body_bytes :]  # a chunked body's buffer, trimmed (its charge stays until the end)
        else:
            body = message.first
        keep_alive = parser.should_keep_alive()
        request = Request(
            method=parser.get_method().decode("latin-1"),
            path=path.decode("latin-1"),
            query=query.decode("latin-1"),
            headers=message.headers,
            body=body,
            client=self.client,
            keep_alive=keep_alive,
            hold=message.hold,
            http10=parser.get_http_version() == "1.0",
        )
        if not keep_alive:
            self.last_request_seen = True  # RFC 9112 9.6: no further request on this connection is processed
        self.queue.append(request)
        self.queued_bytes += message.hold.held
        if self.current is None:
            self._next()
        elif (
            len(self.queue) >= _MAX_QUEUED or self.queued_bytes > self.limits.max_body_bytes
        ) and not self.read_paused and self.transport is not None:  # fmt: skip
            self.read_paused = True
            self.transport.pause_reading()

    # -- requests ---------------------------------------------------------------------------------------

    def _charge(self, hold: Hold, size: int) -> None:
        refused = self.server.budget.grow(hold, size)
        if refused is not None:
            self._stop(_budget_refusal(refused))

    def _evicted(self, status: int) -> None:
        """The budget took this connection's body back to make room for others: refuse it."""
        if not self.lost and self.message is not None:
            self._fail(_budget_refusal(status))

    def _next(self) -> None:
        """Start the handler of the next complete request, if any."""
        if not self.queue or self.lost:
            return
        request = self.queue.popleft()
        if request.hold is not None:
            self.queued_bytes -= request.hold.held
        if (
            self.read_paused and len(self.queue) < _MAX_QUEUED // 2 and self.queued_bytes <= self.limits.max_body_bytes
            and self.transport is not None
        ):  # fmt: skip
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
                responder.error(500, "the server failed to handle the request")
            elif not responder.finished:
                self._abort()
        finally:
            if not responder.finished and not self.lost:
                # A handler that returned without finishing its answer (a bug) must not hang the client.
                if not responder.started:
                    responder.error(500, "the server failed to handle the request")
                else:
                    self._abort()

    def response_done(self, status: int) -> None:
        """The current answer is complete: release its request, go on with the next one or close."""
        request = self.current
        self.current = None
        self.responder = None
        self.handling = None
        if request is not None:
            if request.hold is not None:
                self.server.budget.release(request.hold)
            if self.server.access_log:
                access_log.info('%s "%s %s" %d', request.client, request.method, request.path, status)
        if self.queue and self.reject is None and not self.server.stopping:
            # Requests that arrived whole are answered, also after the client half-closed.
            self.loop.call_soon(self._next)
        elif self.closing_after_response:
            self._close_after_answer()
        elif self.message is None:
            self._arm(self.limits.keep_alive_timeout, self._idle_timeout)
        elif not self.headers_done:
            self._arm_at(self.message.header_deadline, self._header_timeout)
        else:
            self._arm_at(self.message.body_deadline, self._body_timeout)

    @property
    def last_answer(self) -> bool:
        """The answer being written is the connection's last (it says `Connection: close`)."""
        return self.closing_after_response and not (self.queue and self.reject is None and not self.server.stopping)

    def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is not None and not self.lost:
            transport.write(data)

    def writelines(self, data: Iterable[bytes]) -> None:
        transport = self.transport
        if transport is not None and not self.lost:
            transport.writelines(data)

    # -- closing ----------------------------------------------------------------------------------------

    def _close_after_answer(self) -> None:
        """Close in stages (RFC 9112 9.6): the write side now, then read and drop input for a little while, so the
        client's later bytes do not make the kernel reset the connection before it has read the answer."""
        transport = self.transport
        if transport is None or self.lost:
            return
        if self.queue:
            log.info("Dropped requests after the connection's last request client=%s requests=%d", self.client,
                     len(self.queue))  # fmt: skip
        self._release_all()
        self._linger(transport)

    def _linger(self, transport: asyncio.Transport) -> None:
        if self.peer_eof or not transport.can_write_eof():
            transport.close()
            return
        self.lingering = True
        self._release_message()
        self.message = None
        transport.write_eof()
        if self.read_paused:
            self.read_paused = False
            transport.resume_reading()
        self._arm(_LINGER_SECONDS, self._linger_over)

    def _drop(self, size: int) -> None:
        """Input after the connection's last request: read and dropped, within a bound."""
        self.dropped += size
        if self.dropped <= _LINGER_BYTES or self.transport is None:
            return
        if self.lingering:
            self.transport.close()
        elif not self.read_paused:
            self.read_paused = True  # the last answer is still under way: stop reading until it is written
            self.transport.pause_reading()

    def _linger_over(self) -> None:
        self.timer = None
        if self.dropped:
            log.info("Dropped input after the connection's last request client=%s bytes=%d", self.client,
                     self.dropped)  # fmt: skip
        if self.transport is not None:
            self.transport.close()

    def _check_peer(self) -> None:
        """A half-closed client: has it answered the interim response with a reset (it is gone)?"""
        self.peer_timer = None
        if self.lost or self.transport is None:
            return
        sock = self.transport.get_extra_info("socket")
        try:
            state = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0] if sock is not None else None
        except (OSError, AttributeError):
            return  # no TCP_INFO here: the answer is written and the close tells
        if state == _TCP_CLOSE:
            log.info("Cancelled request client=%s reason=client_gone_after_half_close", self.client)
            self._abort()
            return
        self.peer_timer = self.loop.call_later(_PEER_CHECK_SECONDS, self._check_peer)

    # -- errors and timers ------------------------------------------------------------------------------

    def _stop(self, reject: _RefusedError) -> None:
        """Called from a parser callback: remember why and make the parser stop."""
        if self.reject is None:
            self.reject = reject
        raise reject

    def _fail(self, reject: _RefusedError) -> None:
        """Answer a request the server refuses before its handler runs, then close the connection."""
        self.reject = reject
        log.info("Refused request client=%s status=%d reason=%s", self.client, reject.status, reject.message)
        if self.current is not None:
            # An answer is under way on this connection: do not interleave; just stop reading and close after it.
            self._release_message()
            self.message = None
            self.closing_after_response = True
            if self.transport is not None:
                self.transport.pause_reading()
            return
        self._answer_and_close(reject.status, reject.message, reject.headers, linger=True)

    def _answer_and_close(
        self, status: int, message: str, headers: Iterable[tuple[str, str]] = (), *, linger: bool = False
    ) -> None:
        """Refuse with an error answer and close: in stages (`linger`) when the client may still be sending, so
        that it reads the refusal rather than a reset."""
        body = self.server.error_body(status, message)
        extra = b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n" % len(body)
        self.write(_head(status, headers, extra) + body)
        self._disarm()
        self._release_message()
        self.message = None
        if self.transport is None:
            return
        if linger:
            self._linger(self.transport)
        else:
            self.transport.close()

    def _too_large(self) -> _RefusedError:
        return _RefusedError(413, f"request body is larger than the server's limit of "
                                  f"{self.limits.max_body_bytes} bytes")  # fmt: skip

    def _framing_allowance(self, message: _Message) -> int:
        return self.limits.max_chunk_metadata_bytes + _CHUNK_FRAMING * (message.chunks + 1)

    def _too_much_framing(self) -> _RefusedError:
        return _RefusedError(400, f"chunk extensions and trailers exceed {self.limits.max_chunk_metadata_bytes} "
                                  "bytes")  # fmt: skip

    def _abort(self) -> None:
        """Cut the connection (an answer cannot be completed: the client must not take it as whole)."""
        if self.transport is not None:
            self.transport.abort()

    def _arm(self, delay: float, callback: Callable[[], None]) -> None:
        self._disarm()
        self.timer = self.loop.call_later(delay, callback)

    def _arm_at(self, when: float, callback: Callable[[], None]) -> None:
        self._disarm()
        self.timer = self.loop.call_at(when, callback)

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

    def _write_timeout(self) -> None:
        """The client has not read for the write timeout: end its connection (and so its handler)."""
        self.write_timer = None
        if self.write_paused and not self.lost:
            log.info("Cut connection client=%s reason=client_not_reading seconds=%g", self.client,
                     self.limits.write_timeout)  # fmt: skip
            self._abort()

    def _release_message(self) -> None:
        message = self.message
        if message is not None:
            self.server.budget.release(message.hold)
            message.first = b""
            message.buffer = None

    def _release_all(self) -> None:
        self._release_message()
        budget = self.server.budget
        for request in self.queue:
            if request.hold is not None:
                budget.release(request.hold)
        self.queue.clear()
        self.queued_bytes = 0
        current = self.current
        if current is None or current.hold is None:
            return
        hold = current.hold
        if self.handling is None or self.handling.done():
            budget.release(hold)
        else:
            # The handler still reads the body until its cancellation has wound up.
            self.handling.add_done_callback(lambda _task: budget.release(hold))


_SINGLETON_HEADERS = frozenset(
    {"content-length", "content-type", "content-encoding", "transfer-encoding", "authorization", "host", "expect"}
)


def _budget_refusal(status: int) -> _RefusedError:
    if status == 408:
        return _RefusedError(408, "the request body arrived too slowly while memory was short")
    if status == 429:
        return _RefusedError(429, "this client has too many request bytes in flight; retry later",
                             (("Retry-After", "1"),))  # fmt: skip
    return _RefusedError(503, "the server is holding its maximum of request bytes; retry later",
                         (("Retry-After", "1"),))  # fmt: skip


def _parser_reason(exc: Exception) -> str:
    """llhttp's reason, which names the rule broken and never quotes the input."""
    text = str(exc).strip() or type(exc).__name__
    return text[:100]


class HttpServer:
    """Listens, routes (method, path) to handlers, and tracks live connections."""

    def __init__(self, limits: ServerLimits, *, error_body: ErrorBody, access_log: bool) -> None:
        self.limits = limits
        self.error_body = error_body
        self.access_log = access_log
        self.budget = BodyBudget(limits.max_buffered_bytes, limits.max_buffered_bytes_per_client, limits.min_body_rate)
        self.routes: dict[str, dict[str, Handler]] = {}
        self.connections: set[_Connection] = set()
        self.stopping = False
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
        self.stopping = True
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
