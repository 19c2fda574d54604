"""Static discovery: fixed engine URLs from flags or the config file (local runs, benchmarks, tests).

A URL may name its engine by host name; the addresses it resolves to when the router starts are what the engine
may advertise as its KV side-channel host (`Endpoint.addresses`), besides the name itself.

Readiness: nothing like an EndpointSlice says when a static engine goes away, so discovery asks the engines
themselves. Every `interval` seconds (`staticHealthIntervalSeconds`) it reads each engine's health path (`health`,
the circuit breaker's `healthPath`): an engine that answers anything but 200 (vLLM answers 503 from the moment it
starts draining on SIGTERM) is made not ready at once, so new requests go elsewhere while the ones it has finish;
a 200 makes it ready again. An engine that does not answer at all is left as it is: connection failures are the
circuit breaker's business, which ejects after consecutive failures and probes the engine back in.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from urllib.parse import urlsplit

from pdserve_runtime.router.endpoints import Endpoint, EndpointTable, KvEventSource, Role

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


#: The status an engine's health path answers, or None when it could not be reached.
HealthCheck = Callable[[str], Awaitable[int | None]]


def with_health(endpoint: Endpoint, status: int | None) -> Endpoint:
    """The endpoint as one health answer leaves it (pure): 200 ready, another answer not ready, none unchanged."""
    if status is None:
        return endpoint
    return dataclasses.replace(endpoint, ready=status == 200)


class StaticDiscovery:
    """Puts the configured URLs in the table, then keeps their readiness in step with their health path."""

    def __init__(
        self,
        table: EndpointTable,
        prefill: Sequence[str],
        decode: Sequence[str],
        *,
        health: HealthCheck | None = None,
        interval: float = 1.0,
        kv_events: Mapping[str, Sequence[KvEventSource]] | None = None,
    ) -> None:
        self._table = table
        self._kv_events = {url.rstrip("/"): tuple(sources) for url, sources in (kv_events or {}).items()}
        self._prefill = [url.rstrip("/") for url in prefill]
        self._decode = [url.rstrip("/") for url in decode]
        self._health = health
        self._interval = interval
        self._pools: dict[Role, list[Endpoint]] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        for role, urls in (("prefill", self._prefill), ("decode", self._decode)):
            pool: Role = "prefill" if role == "prefill" else "decode"
            endpoints = [
                Endpoint(url=url, role=pool, addresses=await _addresses(url), kv_events=self._kv_events.get(url, ()))
                for url in urls
            ]
            self._pools[pool] = endpoints
            self._table.replace(pool, endpoints)
        if self._health is not None:
            self._task = asyncio.create_task(self._watch_health(self._health), name="pdserve-router-static-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _watch_health(self, health: HealthCheck) -> None:
        while True:
            await asyncio.sleep(self._interval)
            for role, endpoints in self._pools.items():
                statuses = await asyncio.gather(*(health(endpoint.url) for endpoint in endpoints))
                checked = [with_health(endpoint, status) for endpoint, status in zip(endpoints, statuses, strict=True)]
                if checked == endpoints:
                    continue
                for before, after, status in zip(endpoints, checked, statuses, strict=True):
                    if before.ready != after.ready:
                        log.info("Engine %s role=%s endpoint=%s health=%s", "ready" if after.ready else "not ready",
                                 role, after.label, status)  # fmt: skip
                self._pools[role] = checked
                self._table.replace(role, checked)
