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

import logging
from typing import Any

import orjson

from pdserve_runtime.router.endpoints import EndpointState, EndpointTable
from pdserve_runtime.router.engine_poller import EnginePoller
from pdserve_runtime.transport.client import EngineClient

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


class ContextLengthLearner(EnginePoller):
    """Background task filling `EndpointState.max_model_len` of decode engines."""

    name = "pdserve-router-context-length"

    def __init__(self, table: EndpointTable, served_model_name: str, connect_timeout: float) -> None:
        super().__init__(_INTERVAL)
        self._table = table
        self._name = served_model_name
        self._within = connect_timeout + 2.0

    def due(self) -> list[EndpointState]:
        return [state for state in self._table.states("decode") if state.max_model_len is None]

    async def poll(self, client: EngineClient, state: EndpointState) -> None:
        """Read one engine's context length into its state (a failure leaves it unknown, tried again later)."""
        body = await self.get(client, state, "/v1/models", _MODELS_LIMIT, self._within)
        length = model_context_length(body, self._name) if body is not None else None
        if length is not None:
            state.max_model_len = length
            log.info("Read context length endpoint=%s max_model_len=%d", state.endpoint.label, length)
