"""Static discovery: fixed engine URLs from flags or the config file (local runs, benchmarks, tests).

A URL may name its engine by host name; the addresses it resolves to when the router starts are what the engine
may advertise as its KV side-channel host (`Endpoint.addresses`), besides the name itself.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Sequence
from urllib.parse import urlsplit

from pdserve_runtime.router.endpoints import Endpoint, EndpointTable, Role

log = logging.getLogger("pdserve.router.discovery")


async def _addresses(url: str) -> frozenset[str]:
    host = urlsplit(url).hostname or ""
    try:
        ipaddress.ip_address(host)
        return frozenset({host})
    except ValueError:
        pass
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError as exc:
        log.warning("Failed resolving engine host=%s error=%s", host, exc)
        return frozenset({host})
    return frozenset({host, *(str(info[4][0]) for info in infos)})


class StaticDiscovery:
    """Puts the configured URLs in the table once; health is then the circuit breaker's business."""

    def __init__(self, table: EndpointTable, prefill: Sequence[str], decode: Sequence[str]) -> None:
        self._table = table
        self._prefill = [url.rstrip("/") for url in prefill]
        self._decode = [url.rstrip("/") for url in decode]

    async def start(self) -> None:
        for role, urls in (("prefill", self._prefill), ("decode", self._decode)):
            pool: Role = "prefill" if role == "prefill" else "decode"
            endpoints = [Endpoint(url=url, role=pool, addresses=await _addresses(url)) for url in urls]
            self._table.replace(pool, endpoints)

    async def stop(self) -> None:
        return None
