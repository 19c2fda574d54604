"""Router-side prefix tracking: which engine most likely still holds how much of a prompt.

Every prompt an engine served successfully is recorded against that engine (the prefill engine that computed it,
the decode engine that received its KV or computed it locally) as its prompt key (`tokens.prompt_key`: the
prompt's bytes behind a one-byte tag). What an engine holds of a new prompt is the longest common prefix of its
key with any key recorded for the engine, which is exactly what a prefix cache of chained block hashes can reuse
(up to whole blocks: `tokens.uncached_tokens` does that arithmetic).

Per engine the keys are kept sorted, so the longest common prefix of a new key with all of them is the longer of
its common prefixes with its two neighbours in that order: two binary searches (bisect on bytes, then on the
common length with memcmp over memoryview slices), no work per token or per block, whatever the prompt's length.
A new key makes a recorded key that is a prefix of it redundant (an earlier turn of the same chat), so that one is
dropped. A key longer than a sixteenth of the memory bound is kept cut at that length and marked with a 0xff byte
(never part of UTF-8 text; a partial 8-byte id for token-id keys): a huge prompt must not flush every other
prompt out of the tracker, and a match never reaches past the cut (what follows it is unknown, so the boundary
is treated as inside a word).

Engines evict cached blocks under memory pressure without telling the router, so the tracker forgets in two
ways: entries older than `ttl_seconds` are dropped, and the total is bounded by `max_blocks` (estimated from the
keys' bytes at `BYTES_PER_BLOCK_TOKEN` bytes per token) with least-recently-used eviction. Both are guesses about
the engine's cache; a wrong guess costs only a less-than-ideal routing choice, never correctness. The keys hold
prompt text in memory for at most `ttl_seconds`, bounded as above.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict

from pdserve_runtime.router.tokens import Held

#: Bytes of prompt per token assumed when the memory bound (in blocks of `block_size` tokens) is applied.
BYTES_PER_BLOCK_TOKEN = 4
_CUT = b"\xff"


def common_prefix_length(a: bytes, b: bytes) -> int:
    """Length of the longest common prefix of two byte strings (memcmp in a binary search, no copies)."""
    limit = min(len(a), len(b))
    view = memoryview(b)
    if a.startswith(view[:limit]):
        return limit
    low, high = 0, limit - 1  # a[:low] == b[:low] is known; the answer is at most high
    while low < high:
        middle = (low + high + 1) // 2
        if a.startswith(view[low:middle], low):
            low = middle
        else:
            high = middle - 1
    return low


class PrefixTracker:
    """Remembers recently served prompt keys per engine URL."""

    def __init__(self, *, max_blocks: int = 200_000, ttl_seconds: float = 600.0, block_size: int = 16) -> None:
        self._max_bytes = max_blocks * block_size * BYTES_PER_BLOCK_TOKEN
        # A multiple of 8 bytes after the tag: a cut token-id key ends on a whole id.
        self._max_key = 1 + max(64, self._max_bytes // 16) // 8 * 8
        self._ttl = ttl_seconds
        self._sorted: dict[str, list[bytes]] = {}
        # (url, key) -> when it was last recorded, oldest first; doubles as the LRU order.
        self._seen: OrderedDict[tuple[str, bytes], float] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        """Number of (engine, prompt) entries remembered."""
        return len(self._seen)

    @property
    def remembered_bytes(self) -> int:
        """Bytes of prompt keys held, across engines."""
        return self._bytes

    def record(self, url: str, key: bytes, now: float) -> None:
        """Note that the engine at `url` now holds the prompt `key`."""
        self._expire(now)
        if len(key) > self._max_key:
            key = key[: self._max_key] + _CUT
        entry = (url, key)
        if entry in self._seen:
            self._seen[entry] = now
            self._seen.move_to_end(entry)
            return
        keys = self._sorted.setdefault(url, [])
        index = bisect_left(keys, key)
        # Keys that are prefixes of the new one sort right before it: they are redundant now.
        while index and key.startswith(keys[index - 1]):
            index -= 1
            self._drop(url, keys.pop(index))
        keys.insert(index, key)
        self._seen[entry] = now
        self._bytes += len(key)
        while self._bytes > self._max_bytes and self._seen:
            (old_url, old_key), _ = self._seen.popitem(last=False)
            self._remove_sorted(old_url, old_key)
            self._bytes -= len(old_key)

    def match(self, key: bytes, now: float) -> dict[str, Held]:
        """What each engine holds of `key` (engines with no key in common beyond the tag are absent)."""
        self._expire(now)
        held: dict[str, Held] = {}
        for url, keys in self._sorted.items():
            if not keys:
                continue
            index = bisect_left(keys, key)
            best, best_key = 0, b""
            for neighbour in (index - 1, index):
                if 0 <= neighbour < len(keys):
                    stored = keys[neighbour]
                    common = common_prefix_length(key, stored)
                    if common > best:
                        best, best_key = common, stored
            if best > 1:
                held[url] = Held(best, best_key[best] if best < len(best_key) else None)
        return held

    def forget(self, url: str) -> None:
        """Drop an engine that left the table (a replacement pod at the same address starts cold)."""
        for key in self._sorted.pop(url, []):
            if self._seen.pop((url, key), None) is not None:
                self._bytes -= len(key)

    def _expire(self, now: float) -> None:
        horizon = now - self._ttl
        seen = self._seen
        while seen:
            entry, when = next(iter(seen.items()))
            if when >= horizon:
                return
            seen.popitem(last=False)
            self._remove_sorted(*entry)
            self._bytes -= len(entry[1])

    def _drop(self, url: str, key: bytes) -> None:
        """Forget one entry already taken out of the sorted list."""
        if self._seen.pop((url, key), None) is not None:
            self._bytes -= len(key)

    def _remove_sorted(self, url: str, key: bytes) -> None:
        keys = self._sorted.get(url)
        if keys:
            index = bisect_left(keys, key)
            if index < len(keys) and keys[index] == key:
                del keys[index]
