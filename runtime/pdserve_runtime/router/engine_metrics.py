"""Engine-reported load: scrape decode engines' Prometheus /metrics for KV-cache usage.

The router's own in-flight counts miss what it cannot see: long prompts that filled an engine's KV cache, other
routers sharing the pool, preemptions. vLLM exports `vllm:kv_cache_usage_perc` (0..1) per engine; an engine
close to full will queue or preempt new requests, so the decode profile scores headroom (1 - usage).

`parse_kv_usage` is pure (a line scan, not a full exposition parser: the scrape runs every couple of seconds
per engine and an engine's exposition is large). `EngineMetricsScraper` polls the usable decode engines every
`interval` seconds with a short timeout; a failed or slow scrape leaves the previous value, which goes stale
(ignored by the scorer) after `stale_after` seconds. Scraping never affects the circuit breaker: a metrics
endpoint is not the serving path.
"""

from __future__ import annotations

import contextlib
import math
import re
from time import monotonic

from pdserve_runtime.router.endpoints import EndpointState, EndpointTable
from pdserve_runtime.router.engine_poller import EnginePoller
from pdserve_runtime.transport.client import EngineClient

# Largest exposition read from an engine (vLLM's is tens of kilobytes).
_EXPOSITION_LIMIT = 4 * 1024 * 1024
_KV_USAGE = re.compile(rb"^vllm:kv_cache_usage_perc(?:\{[^}]*\})?\s+([0-9.eE+-]+|NaN)\s*$", re.MULTILINE)


def parse_kv_usage(exposition: bytes) -> float | None:
    """The engine's KV-cache usage in [0, 1] (the highest of its series, e.g. across DP ranks), or None."""
    values = []
    for match in _KV_USAGE.finditer(exposition):
        with contextlib.suppress(ValueError):
            value = float(match.group(1))
            if not math.isnan(value):
                values.append(min(1.0, max(0.0, value)))
    return max(values) if values else None


class EngineMetricsScraper(EnginePoller):
    """Background task keeping `EndpointState.kv_cache_usage` of decode engines fresh."""

    name = "pdserve-router-engine-metrics"

    def __init__(self, table: EndpointTable, interval: float, timeout: float = 1.0) -> None:
        super().__init__(interval)
        self._table = table
        self._timeout = timeout

    def due(self) -> list[EndpointState]:
        return self._table.usable("decode")

    async def poll(self, client: EngineClient, state: EndpointState) -> None:
        await self.scrape(client, state)

    async def scrape(self, client: EngineClient, state: EndpointState) -> None:
        """Read one engine's KV-cache usage into its state (errors keep the old value)."""
        body = await self.get(client, state, "/metrics", _EXPOSITION_LIMIT, self._timeout)
        usage = parse_kv_usage(body) if body is not None else None
        if usage is not None:
            state.kv_cache_usage = usage
            state.kv_cache_usage_at = monotonic()
