"""A background task that reads something from decode engines every few seconds: the shape the engine metrics
scraper and the context-length learner share (one task, the due engines read at once, errors left to the reader).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from pdserve_runtime.router.endpoints import EndpointState
from pdserve_runtime.transport.client import EngineClient, UpstreamError

log = logging.getLogger("pdserve.router")


class EnginePoller:
    """Every `interval` seconds, `poll` each engine `due` names, concurrently; subclasses say which and what."""

    name = "pdserve-router-engine-poller"

    def __init__(self, interval: float) -> None:
        self._interval = interval
        self._task: asyncio.Task[None] | None = None

    def start(self, client: EngineClient) -> None:
        self._task = asyncio.create_task(self._run(client), name=self.name)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def due(self) -> Sequence[EndpointState]:
        """The engines to read this time."""
        raise NotImplementedError

    async def poll(self, client: EngineClient, state: EndpointState) -> None:
        """Read one engine (a failure must leave its state as it was, for the next pass)."""
        raise NotImplementedError

    @staticmethod
    async def get(client: EngineClient, state: EndpointState, path: str, limit: int, within: float) -> bytes | None:
        """The body of the engine's answer to GET `path` when it is a 200, else None (never raises)."""
        try:
            status, body, _ = await client.get(state.url, path, limit=limit, within=within)
        except (UpstreamError, TimeoutError) as exc:
            log.debug("Failed reading engine endpoint=%s path=%s error=%s", state.endpoint.label, path, exc)
            return None
        return body if status == 200 else None

    async def _run(self, client: EngineClient) -> None:
        while True:
            states = self.due()
            if states:
                await asyncio.gather(*(self.poll(client, state) for state in states))
            await asyncio.sleep(self._interval)
