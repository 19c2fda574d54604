"""Router-side prefix tracking: which engine most likely still holds a prompt's leading blocks.

Every routed prompt's block hashes are recorded against the engines it was sent to (the prefill engine that
computed it and the decode engine that received its KV or computed it locally). Because block hashes chain,
an engine that holds block i held the whole prefix up to i when it was recorded, so the match length of a new
prompt on an engine is the number of leading blocks whose owner sets (restricted to fresh entries) still
contain that engine.

Engines evict cached blocks under memory pressure without telling the router, so the tracker forgets in two
ways: entries older than `ttl_seconds` are ignored, and the total number of remembered blocks is bounded by
`max_blocks` with least-recently-used eviction (an OrderedDict, touched on every record). Both are guesses
about the engine's cache; a wrong guess costs only a less-than-ideal routing choice, never correctness.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixTracker:
    """Remembers recently routed prompt blocks per engine URL."""

    def __init__(self, *, max_blocks: int = 200_000, ttl_seconds: float = 600.0) -> None:
        self._max_blocks = max_blocks
        self._ttl = ttl_seconds
        self._blocks: OrderedDict[int, dict[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def record(self, url: str, hashes: Sequence[int], now: float) -> None:
        """Note that the engine at `url` now holds these blocks."""
        blocks = self._blocks
        for block in hashes:
            owners = blocks.get(block)
            if owners is None:
                blocks[block] = {url: now}
            else:
                owners[url] = now
                blocks.move_to_end(block)
        while len(blocks) > self._max_blocks:
            blocks.popitem(last=False)

    def match(self, hashes: Sequence[int], now: float) -> dict[str, int]:
        """Number of leading blocks of the prompt each engine holds (engines with none are absent)."""
        matched: dict[str, int] = {}
        alive: set[str] | None = None
        horizon = now - self._ttl
        for index, block in enumerate(hashes):
            owners = self._blocks.get(block)
            if not owners:
                break
            fresh = {url for url, seen in owners.items() if seen >= horizon}
            alive = fresh if alive is None else alive & fresh
            if not alive:
                break
            for url in alive:
                matched[url] = index + 1
        return matched

    def forget(self, url: str) -> None:
        """Drop an engine that left the table (a replacement pod at the same address starts cold)."""
        for owners in self._blocks.values():
            owners.pop(url, None)
