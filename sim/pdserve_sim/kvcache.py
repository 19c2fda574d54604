"""KV cache bookkeeping: a fixed pool of blocks with reference counts and a prefix cache of block hashes.

Algorithm (the shape of vLLM's v1 KV cache manager, without the memory):
- The cache holds ``num_blocks`` blocks of ``block_size`` tokens. A running request owns one reference on
  each block that holds its tokens.
- A *full* block of prompt tokens has a hash chained from its parent block's hash and its token ids, so a
  hash identifies the whole prefix up to that block. Once a full block is computed its hash is registered.
- When a block's last reference goes, it joins the free list (least recently freed first) but keeps its
  hash: a later request with the same prefix can revive it ("prefix cache hit") until the allocator hands
  the block out again, at which point its hash is forgotten (eviction).
- A lookup walks the request's block hashes from the first and stops at the first miss: only a prefix can
  be reused, because a block's KV depends on every token before it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` (a partial last block has no hash)."""
    hashes: list[int] = []
    parent = 0
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start : start + block_size])))
        hashes.append(parent)
    return hashes


class BlockPool:
    """Reference-counted KV blocks with an evictable prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, on_evict: Callable[[int], None] | None = None) -> None:
        self.num_blocks = num_blocks
        #: Told the hash of every cached block the allocator takes back (the KV events' BlockRemoved).
        self.on_evict = on_evict
        self.block_size = block_size
        self._refs = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        # Blocks [_fresh, num_blocks) were never used; they are handed out first so cached blocks live
        # longer (and so a huge pool costs nothing up front).
        self._fresh = 0
        # Freed blocks in eviction order (oldest first). Values unused; OrderedDict gives O(1) removal.
        self._free: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (free, possibly still holding a cached hash)."""
        return self.num_blocks - self._fresh + len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks holding a registered prefix (referenced or free)."""
        return len(self._by_hash)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request (vLLM's kv_cache_usage_perc, 1.0 = full)."""
        return 1.0 - self.num_free / self.num_blocks if self.num_blocks else 0.0

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """Blocks holding the longest cached prefix of ``hashes`` (not yet referenced by the caller)."""
        hit: list[int] = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def num_unreferenced(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` sit in the free list (acquiring them shrinks :attr:`num_free`)."""
        refs = self._refs
        return sum(1 for b in blocks if refs[b] == 0)

    def acquire(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks found by :meth:`lookup`."""
        for block in blocks:
            if self._refs[block] == 0:
                del self._free[block]
            self._refs[block] += 1

    def allocate(self, count: int) -> list[int] | None:
        """``count`` fresh blocks, evicting cached ones oldest first; None if not enough are free."""
        if count > self.num_free:
            return None
        fresh = min(count, self.num_blocks - self._fresh)
        out = list(range(self._fresh, self._fresh + fresh))
        self._fresh += fresh
        for block in out:
            self._refs[block] = 1
        for _ in range(count - fresh):
            block, _unused = self._free.popitem(last=False)
            old = self._hash_of[block]
            if old is not None:
                # Evict: the block's content is about to be overwritten.
                self._hash_of[block] = None
                if self._by_hash.get(old) == block:
                    del self._by_hash[old]
                    if self.on_evict is not None:
                        self.on_evict(old)
            self._refs[block] = 1
            out.append(block)
        return out

    def register(self, block: int, block_hash: int) -> bool:
        """Record that ``block`` now holds the full prefix identified by ``block_hash``; False when the prefix was
        cached already (in another block) or the block holds one, so nothing new entered the cache."""
        if self._hash_of[block] is None and block_hash not in self._by_hash:
            self._hash_of[block] = block_hash
            self._by_hash[block_hash] = block
            return True
        return False

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block; unreferenced blocks become free (and stay cached)."""
        # Free in reverse so a request's tail blocks are evicted before its (more shareable) head blocks.
        for block in reversed(blocks):
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._free[block] = None
