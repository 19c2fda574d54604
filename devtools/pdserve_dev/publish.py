"""Publish TCP services of a private network namespace on the loopback of another one, through unix sockets.

Why: `pdserve dev demo` runs its cluster in a network namespace of its own (`cluster.netns`): the pod addresses
(198.18.0.0/15) and every port the cluster opens exist only there, so nothing the demo starts can reach the
machine's network, and nothing on it can clash with the user's own servers. That also puts them out of reach of the
user's shell. kind answers the same problem by mapping node ports to host ports; here both namespaces share one
filesystem, and a unix socket bound to a path (unlike a TCP port or an abstract socket) is reachable from any
network namespace. So each published service is two relays:

    user's namespace                                     demo's namespace
    client -> 127.0.0.1:PORT -> [outer relay] -> <dir>/<name>.sock -> [inner relay] -> target (router, Prometheus,
                                                                                       the API server)

- The inner relay runs in the demo's process, inside. It listens on `<dir>/<name>.sock` (the directory is the
  demo's private 0700 working folder) and connects each accepted stream to the service's current address: a
  `Target` looks it up again when a connection to the last one is refused (the router's pod can be replaced).
- The outer relay runs in the `pdserve dev demo` process the user started, outside. It listens on 127.0.0.1 and
  connects each accepted stream to the socket.

Bytes pass through untouched (TLS to the API server stays end to end, streams stay streams); an end of stream is
passed on as a half-close, and a connection that cannot reach its target is closed at once. Both relays stop with
the demo.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("pdserve.dev.publish")

LOOPBACK = "127.0.0.1"
CHUNK = 64 * 1024

Address = tuple[str, int]
Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until end of stream, then half-close the other side (a client that shuts down its sending side still
    gets its answer)."""
    try:
        while chunk := await reader.read(CHUNK):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.transport.abort()  # the other direction ends too: one side is gone


async def splice(a: Streams, b: Streams) -> None:
    """Relay both directions between two connections until both have ended; then close both."""
    try:
        await asyncio.gather(_pipe(a[0], b[1]), _pipe(b[0], a[1]))
    finally:
        for writer in (a[1], b[1]):
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()


@dataclass
class Target:
    """Where connections to one service go: a fixed address, or one looked up (again) by `lookup`.

    A connection goes to the last address that worked; when that one refuses (the pod behind it was replaced),
    `lookup` runs once more (in a thread: it may call kubectl) and each address it gives is tried in turn: while a
    Deployment rolls, the pod going away can still be listed as Ready beside its successor (the demo's router rolls
    when the demo sets its TTFT target, which the router's admission reads)."""

    name: str
    address: Address | None = None
    lookup: Callable[[], Sequence[Address]] | None = None
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, repr=False)

    async def connect(self) -> Streams:
        address = self.address
        if address is not None:
            try:
                return await asyncio.open_connection(*address)
            except OSError:
                if self.lookup is None:
                    raise
        if self.lookup is None:
            raise ConnectionRefusedError(f"{self.name}: no address")
        async with self._lock:
            candidates = await asyncio.to_thread(self.lookup)
        refused: OSError = ConnectionRefusedError(f"{self.name}: no ready address")
        for candidate in candidates:
            try:
                streams = await asyncio.open_connection(*candidate)
            except OSError as exc:
                refused = exc
                continue
            self.address = candidate
            return streams
        raise refused


Connect = Callable[[], Awaitable[Streams]]


class Relays:
    """Listeners that relay each accepted connection to where `connect` leads, and the connections in flight.

    `close` stops listening and ends the connections in flight (their transports aborted, so each relay finishes
    as if the peer had gone); nothing is left to be cancelled when the event loop ends."""

    def __init__(self) -> None:
        self.servers: list[asyncio.Server] = []
        self.ports: dict[str, int] = {}
        """Name -> port on 127.0.0.1 (`serve_outer`)."""
        self.paths: dict[str, Path] = {}
        """Name -> unix socket (`serve_inner`)."""
        self._open: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[None]] = set()

    def url(self, name: str, scheme: str = "http") -> str:
        return f"{scheme}://{LOOPBACK}:{self.ports[name]}"

    def handler(
        self, name: str, connect: Connect
    ) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.current_task()
            assert task is not None
            self._handlers.add(task)
            self._open.add(writer)
            try:
                try:
                    upstream = await connect()
                except OSError as exc:
                    log.warning("Could not reach published service name=%s error=%s", name, exc)
                    writer.transport.abort()
                    return
                self._open.add(upstream[1])
                try:
                    await splice((reader, writer), upstream)
                finally:
                    self._open.discard(upstream[1])
            finally:
                self._open.discard(writer)
                self._handlers.discard(task)

        return handle

    async def close(self) -> None:
        for server in self.servers:
            server.close()
        for writer in list(self._open):
            writer.transport.abort()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        for server in self.servers:
            await server.wait_closed()


def _socket_paths(directory: Path, names: list[str]) -> dict[str, Path]:
    """`<directory>/<name>.sock` for each name, in a folder only its owner can enter; stale sockets removed."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    paths = {name: directory / f"{name}.sock" for name in names}
    for path in paths.values():
        path.unlink(missing_ok=True)
    return paths


async def serve_inner(targets: Mapping[str, Target], directory: Path) -> Relays:
    """Inside the private namespace: listen on `<directory>/<name>.sock` for each target (`Relays.paths`)."""
    relays = Relays()
    relays.paths = await asyncio.to_thread(_socket_paths, directory, list(targets))
    try:
        for name, target in targets.items():
            server = await asyncio.start_unix_server(relays.handler(name, target.connect), path=str(relays.paths[name]))
            relays.servers.append(server)
    except BaseException:
        await relays.close()
        raise
    return relays


async def serve_outer(sockets: Mapping[str, Path], ports: Mapping[str, int] | None = None) -> Relays:
    """In the user's namespace: listen on 127.0.0.1 (the port in `ports`, or any free one) for each socket
    (`Relays.ports`)."""

    def connect_to(path: Path) -> Connect:
        async def connect() -> Streams:
            return await asyncio.open_unix_connection(str(path))

        return connect

    return await _serve_tcp({name: connect_to(path) for name, path in sockets.items()}, ports or {})


async def serve_local(targets: Mapping[str, Target]) -> Relays:
    """In this namespace: listen on 127.0.0.1 (any free port, `Relays.ports`) for each target, one hop. What a
    Service gives a client on a cluster without a Service proxy (the local cluster): a load whose connections follow
    a Deployment through a rolling update instead of staying pinned to one pod's address."""
    return await _serve_tcp({name: target.connect for name, target in targets.items()}, {})


async def _serve_tcp(connects: Mapping[str, Connect], ports: Mapping[str, int]) -> Relays:
    relays = Relays()
    try:
        for name, connect in connects.items():
            server = await asyncio.start_server(
                relays.handler(name, connect), LOOPBACK, ports.get(name, 0), family=socket.AF_INET, reuse_address=True
            )
            relays.servers.append(server)
            relays.ports[name] = server.sockets[0].getsockname()[1]
    except BaseException:
        await relays.close()
        raise
    return relays
