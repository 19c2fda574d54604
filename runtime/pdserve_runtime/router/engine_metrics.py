"""Engine-reported load: scrape engines' Prometheus /metrics for KV-cache usage and the requests they hold.

The router's own in-flight counts miss what it cannot see: long prompts that filled an engine's KV cache, other
routers sharing the pool, preemptions. vLLM exports `vllm:kv_cache_usage_perc` (0..1) per engine; an engine
close to full will queue or preempt new requests, so the decode profile scores headroom (1 - usage). It also
exports `vllm:num_requests_running` and `vllm:num_requests_waiting`: the admission gate compares their sum with
the requests this router had in flight there when it read them, and counts the difference as someone else's load
(another router replica, a client going around the router), which shrinks this replica's share of the engine's
budget (`admission.has_room`).

`parse_kv_usage` and `parse_requests` are pure (line scans, not a full exposition parser: the scrape runs every
couple of seconds per engine and an engine's exposition is large). `EngineMetricsScraper` polls the usable decode
engines (and prefill engines, when the gate budgets them) every `interval` seconds with a short timeout; a failed
or slow scrape leaves the previous values, which go stale (ignored) after `stale_after` seconds. Scraping never
affects the circuit breaker: a metrics endpoint is not the serving path.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Callable
from time import monotonic

from pdserve_runtime.router.endpoints import EndpointState, EndpointTable
from pdserve_runtime.router.engine_poller import EnginePoller
from pdserve_runtime.transport.client import EngineClient

# Largest exposition read from an engine (vLLM's is tens of kilobytes).
_EXPOSITION_LIMIT = 4 * 1024 * 1024
_KV_USAGE = re.compile(rb"^vllm:kv_cache_usage_perc(?:\{[^}]*\})?\s+([0-9.eE+-]+|NaN)\s*$", re.MULTILINE)
# Requests running and waiting (`_by_reason` is a different name: the `{` or space after it excludes it).
_REQUESTS = re.compile(rb"^vllm:num_requests_(?:running|waiting)(?:\{[^}]*\})?\s+([0-9.eE+-]+|NaN)\s*$", re.MULTILINE)


def parse_kv_usage(exposition: bytes) -> float | None:
    """The engine's KV-cache usage in [0, 1] (the highest of its series, e.g. across DP ranks), or None."""
    values = []
    for match in _KV_USAGE.finditer(exposition):
        with contextlib.suppress(ValueError):
            value = float(match.group(1))
            if not math.isnan(value):
                values.append(min(1.0, max(0.0, value)))
    return max(values) if values else None


def parse_requests(exposition: bytes) -> int | None:
    """Requests the engine holds (running + waiting, summed over its series, e.g. data-parallel ranks), or None
    when it exports neither gauge."""
    total, found = 0.0, False
    for match in _REQUESTS.finditer(exposition):
        with contextlib.suppress(ValueError):
            value = float(match.group(1))
            if not math.isnan(value):
                total += max(0.0, value)
                found = True
    return round(total) if found else None


class EngineMetricsScraper(EnginePoller):
    """Background task keeping the engine-reported fields of `EndpointState` fresh: KV-cache usage of decode
    engines, and the requests every scraped engine holds. `prefill`: scrape prefill engines too (the gate budgets
    them); `on_scraped`: called after each engine read (the gate looks at its room again)."""

    name = "pdserve-router-engine-metrics"

    def __init__(
        self,
        table: EndpointTable,
        interval: float,
        timeout: float = 1.0,
        *,
        prefill: bool = False,
        on_scraped: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(interval)
        self._table = table
        self._timeout = timeout
        self._prefill = prefill
        self._on_scraped = on_scraped

    def due(self) -> list[EndpointState]:
        decode = self._table.usable("decode")
        return [*self._table.usable("prefill"), *decode] if self._prefill else decode

    async def poll(self, client: EngineClient, state: EndpointState) -> None:
        await self.scrape(client, state)

    async def scrape(self, client: EngineClient, state: EndpointState) -> None:
        """Read one engine's KV-cache usage and requests into its state (errors keep the old values)."""
        body = await self.get(client, state, "/metrics", _EXPOSITION_LIMIT, self._timeout)
        if body is None:
            return
        now = monotonic()
        usage = parse_kv_usage(body) if state.endpoint.role == "decode" else None
        if usage is not None:
            state.kv_cache_usage = usage
            state.kv_cache_usage_at = now
        requests = parse_requests(body)
        if requests is not None:
            state.reported_requests = requests
            state.reported_at = now
            state.own_at_report = state.in_flight
        if self._on_scraped is not None:
            self._on_scraped()
