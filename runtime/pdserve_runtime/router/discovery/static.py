"""Static discovery: fixed engine URLs from flags or the config file (local runs, benchmarks, tests)."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve_runtime.router.endpoints import Endpoint, EndpointTable


class StaticDiscovery:
    """Puts the configured URLs in the table once; health is then the circuit breaker's business."""

    def __init__(self, table: EndpointTable, prefill: Sequence[str], decode: Sequence[str]) -> None:
        self._table = table
        self._prefill = [url.rstrip("/") for url in prefill]
        self._decode = [url.rstrip("/") for url in decode]

    async def start(self) -> None:
        self._table.replace("prefill", [Endpoint(url=url, role="prefill") for url in self._prefill])
        self._table.replace("decode", [Endpoint(url=url, role="decode") for url in self._decode])

    async def stop(self) -> None:
        return None
