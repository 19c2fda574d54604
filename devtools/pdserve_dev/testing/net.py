"""Free TCP ports for servers a test or the local cluster starts (bound to loopback by default), and a TCP
forwarder a test can cut (`TcpForwarder`)."""

from __future__ import annotations

import contextlib
import errno
import random
import socket
import threading
import urllib.error
import urllib.request
from pathlib import Path

# Where the kernel takes ports for bind(0) and for the source port of every outgoing connection.
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# How many ports below that range to choose from, and the lowest port ever chosen.
_SPAN, _LOWEST = 12_000, 10_000
# Tries in that range before the kernel chooses (bind(0)): a range whose ports are all taken must not spin forever.
_TRIES = 64
_random = random.Random()  # its own generator: a test that seeds `random` must not make every run pick the same


def _chosen_range() -> range | None:
    """Ports below the kernel's ephemeral range, or None when that range leaves too few below it."""
    try:
        low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    start = max(_LOWEST, low - _SPAN)
    return range(start, low) if low - start >= 1000 else None


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports on `host` that are free now, held open together so they differ.

    Chosen below the kernel's ephemeral port range: a port from bind(0) is one the kernel also hands out as the
    source port of outgoing connections, and in the gap before the server binds it one of the suite's thousands of
    connections took it (a store server could not listen on its port and the test waited 30 s for its /health).
    Below that range only another listener that chose the same port can take it; after `_TRIES` taken ports
    there, the kernel chooses."""
    sockets: list[socket.socket] = []
    chosen = _chosen_range()
    misses = 0
    try:
        while len(sockets) < count:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            in_range = chosen is not None and misses < _TRIES
            try:
                sock.bind((host, _random.choice(chosen) if chosen is not None and in_range else 0))
            except OSError as exc:
                sock.close()
                if not in_range or exc.errno != errno.EADDRINUSE:
                    raise
                misses += 1
                continue
            sockets.append(sock)
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def free_port(host: str = "127.0.0.1") -> int:
    """One free TCP port on `host`."""
    return free_ports(1, host)[0]


def listening(port: int, host: str = "127.0.0.1") -> bool:
    """Whether something accepts TCP connections on `host:port` now."""
    with socket.socket() as sock:
        sock.settimeout(1)
        return sock.connect_ex((host, port)) == 0


def http_ok(url: str, timeout: float = 1.0) -> bool:
    """Whether a GET of `url` answers 200 now (connection errors and other statuses are False): a predicate
    for `wait_for`, e.g. `wait_for(lambda: http_ok(base + "/health"))`."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


class TcpForwarder:
    """A TCP forwarder on loopback that a test can cut and restore: `port` forwards to `target` while open;
    `close()` closes the listener and every forwarded connection (clients then get "connection refused", as from a
    stopped server), `open()` listens on the same port again. It stands in for a dependency going away (the
    autoscaler's Prometheus) without stopping the real one, which other tests share.

    Threads, not asyncio: its users' clients are synchronous or run on the test's own event loop."""

    def __init__(self, target: tuple[str, int], host: str = "127.0.0.1", port: int | None = None) -> None:
        self.target, self.host = target, host
        self.port = port if port is not None else free_port(host)
        self._listener: socket.socket | None = None
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def open(self) -> TcpForwarder:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), name="tcp-forwarder", daemon=True).start()
        return self

    def close(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            with contextlib.suppress(OSError):
                listener.shutdown(socket.SHUT_RDWR)
            listener.close()
        with self._lock:
            connections, self._connections = self._connections, set()
        for conn in connections:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def __enter__(self) -> TcpForwarder:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:
                    client.close()
                    upstream.close()
                    return
                self._connections |= {client, upstream}
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()  # the other direction's pump then ends too
            with self._lock:
                self._connections -= {source, sink}
