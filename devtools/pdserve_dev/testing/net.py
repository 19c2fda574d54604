"""Free TCP ports for servers a test or the local cluster starts (bound to loopback by default)."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct free TCP ports on `host` (held open together so they differ; a small race remains until
    the caller binds them)."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
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
