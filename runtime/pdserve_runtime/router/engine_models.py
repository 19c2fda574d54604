"""The context length each decode engine serves, read from its `/v1/models` (vLLM's `max_model_len`).

Why the router needs it: in the PD flow the prefill engine computes a prompt (and keeps its KV for the decode
engine to pull) before the decode engine checks whether prompt plus `max_tokens` fits its context; a request
that does not fit gets its 400 from decode only after prefill worked, and the prefill engine holds the KV until
its lease expires. Knowing the length, the proxy refuses such requests first (`context`).

`model_context_length` is pure: the `max_model_len` of the served model's entry (the base model; adapters carry
none). `ContextLengthLearner` reads it once per decode engine, in the background, and again every few seconds
for engines that have not answered yet; an engine whose length is unknown is checked as before (by the engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import orjson

from pdserve_runtime.router.endpoints import EndpointTable
from pdserve_runtime.transport.client import EngineClient, UpstreamError

log = logging.getLogger("pdserve.router")

_MODELS_LIMIT = 1024 * 1024
# Seconds between passes over the decode engines whose length is not known yet.
_INTERVAL = 2.0


def model_context_length(answer: bytes, served_model_name: str) -> int | None:
    """`max_model_len` of `served_model_name` in a `/v1/models` answer (or of the first model that has one when
    no name is configured); None when the answer does not say."""
    try:
        parsed: Any = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    data = parsed.get("data") if isinstance(parsed, dict) else None
    if not isinstance(data, list):
        return None
    for card in data:
        if not isinstance(card, dict) or (served_model_name and card.get("id") != served_model_name):
            continue
        length = card.get("max_model_len")
        if isinstance(length, int) and not isinstance(length, bool) and length > 0:
            return length
    return None


class ContextLengthLearner:
    """Background task filling `EndpointState.max_model_len` of decode engines."""

    def __init__(self, table: EndpointTable, served_model_name: str, connect_timeout: float) -> None:
        self._table = table
        self._name = served_model_name
        self._within = connect_timeout + 2.0
        self._task: asyncio.Task[None] | None = None

    def start(self, client: EngineClient) -> None:
        self._task = asyncio.create_task(self._run(client), name="pdserve-router-context-length")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self, client: EngineClient) -> None:
        while True:
            unknown = [state for state in self._table.states("decode") if state.max_model_len is None]
            if unknown:
                await asyncio.gather(*(self.read(client, state.url) for state in unknown))
            await asyncio.sleep(_INTERVAL)

    async def read(self, client: EngineClient, url: str) -> None:
        """Read one engine's context length into its state (a failure leaves it unknown, tried again later)."""
        try:
            status, body, _ = await client.get(url, "/v1/models", limit=_MODELS_LIMIT, within=self._within)
        except (UpstreamError, TimeoutError) as exc:
            log.debug("Failed reading models endpoint=%s error=%s", url, exc)
            return
        length = model_context_length(body, self._name) if status == 200 else None
        for state in self._table.states("decode"):
            if state.url == url and length is not None:
                state.max_model_len = length
                log.info("Read context length endpoint=%s max_model_len=%d", state.endpoint.label, length)
