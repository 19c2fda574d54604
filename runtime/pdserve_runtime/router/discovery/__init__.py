"""Discovery fills the endpoint table: `static` from URLs, `kubernetes` from EndpointSlice (and ConfigMap) watches.

Both implement `Discovery` (start/stop) and only ever call `EndpointTable.replace` on the event loop thread.
"""

from __future__ import annotations

from typing import Protocol


class Discovery(Protocol):
    async def start(self) -> None:
        """Fill the table for the first time (or begin doing so) and keep it current until stop()."""

    async def stop(self) -> None:
        """Stop watching; the table keeps its last contents."""
