"""Prometheus' instant-query API (IO), asynchronously, so that a tick's queries can share one deadline.

The collector sends a tick's queries one after the other and gives all of them together one deadline
(`--prometheus-timeout`): `asyncio.timeout` cancels whatever read is in progress when it passes and the connection
is closed. A per-request timeout of a synchronous client cannot do that: it bounds each socket read, and a
Prometheus (or a proxy in front of it) that trickles its answer a byte at a time never trips it, which once made
one collect take minutes. Being asynchronous also keeps one PDService's queries from ever waiting on another's:
each loop awaits its own queries on the event loop, with no shared thread pool to queue in, and has a session
(connection pool) of its own.

Queries are POSTed (a pod regex of hundreds of pods outgrows a URL) to `/api/v1/query` with the evaluation time,
as Prometheus' HTTP API documents. Failures are two kinds, which the collector treats differently:
`PrometheusConnectionError` (no connection, reset, an answer that is not Prometheus') ends the tick's queries at once, a
`QueryRefusedError` (Prometheus answered with an error) fails that query alone.
"""

from __future__ import annotations

import json
from typing import Any

import aiohttp

__all__ = ["PrometheusClient", "PrometheusConnectionError", "QueryRefusedError"]

#: The most of a query's answer read (bytes): a tick's answers are a few series per pod.
MAX_ANSWER_BYTES = 16 * 1024 * 1024


class PrometheusConnectionError(ConnectionError):
    """Prometheus could not be reached or did not answer as Prometheus does."""


class QueryRefusedError(Exception):
    """Prometheus answered the query with an error (bad query, timeout on its side, overload)."""


class PrometheusClient:
    """One PDService's connection to Prometheus (its own session, created on first use inside the event loop)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self._session: aiohttp.ClientSession | None = None

    async def query(self, promql: str, at: float) -> list[dict[str, Any]]:
        """The result vector of `promql` evaluated at `at` (Unix seconds). No timeout of its own: the caller's
        deadline cancels it (module docstring)."""
        if self._session is None or self._session.closed:
            # No total timeout here: the tick's one deadline is the caller's. Cookies are never needed.
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None), cookie_jar=aiohttp.DummyCookieJar()
            )
        try:
            async with self._session.post(
                f"{self.url}/api/v1/query", data={"query": promql, "time": f"{at:.3f}"}
            ) as response:
                status = response.status
                body = bytearray()
                async for chunk in response.content.iter_chunked(65536):
                    body += chunk
                    if len(body) > MAX_ANSWER_BYTES:
                        raise QueryRefusedError(f"answer larger than {MAX_ANSWER_BYTES} bytes")
        except aiohttp.ClientError as exc:
            raise PrometheusConnectionError(f"{type(exc).__name__}: {exc}") from exc
        try:
            answer = json.loads(body)
        except ValueError:
            raise PrometheusConnectionError(f"HTTP {status}: not a Prometheus answer: {body[:120]!r}") from None
        if not isinstance(answer, dict):
            raise PrometheusConnectionError(f"HTTP {status}: not a Prometheus answer")
        if answer.get("status") != "success":
            raise QueryRefusedError(f"HTTP {status} {answer.get('errorType', '')}: {answer.get('error', answer)}")
        data = answer.get("data") or {}
        result = data.get("result")
        if data.get("resultType") != "vector" or not isinstance(result, list):
            raise QueryRefusedError(f"expected a vector, got {data.get('resultType')}")
        return [series for series in result if isinstance(series, dict)]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None
