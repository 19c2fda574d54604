"""The router's per-engine prefix index, built from the engine's KV events (`pdserve.api.kvevents`).

Which blocks an engine's cache holds is what its events say, so every router replica that reads them knows it,
whoever routed the requests that filled the cache. The index must answer one question per request on the hot path:
how many leading blocks of this prompt does the engine hold, and in which tiers.

Block identity. Engines name blocks by their own chained hashes, whose function (sha256 over pickle or CBOR,
xxhash) and seed (PYTHONHASHSEED, else a fixed or random one) are engine settings the router cannot see. Events
also carry each block's token ids and its parent's hash, so the index renames every block with a *router hash*
computed from content alone: r(block) = H(r(parent), the block's token ids), r(parent of the first block) = 0,
with H keyed by this process (`chain_hash`: Python's SipHash over the ids packed as int64, so a client cannot craft
prompts whose hashes collide with cached ones). A prompt's blocks get the same names from its own token ids
(`prompt_blocks`), so matching is a walk over the prompt's router hashes. (Dynamo's KV router does the same:
its indexer keys blocks by hashes of their token ids, not by the engine's hashes.)

Per engine the index keeps `engine hash -> router hash` (to resolve parents and removals) and
`router hash -> medium mask` (a bit per tier: GPU, CPU, ...), and reports the leading run of a prompt's blocks held
in any tier, plus the leading run held in each tier (`Match.by_medium`), so a scorer can weigh a prefix in a CPU or
store tier below one in the GPU cache.

Not indexed, because a prompt's token ids alone do not name them: blocks of a LoRA adapter (`lora_id` /
`lora_name`), blocks whose hash covers extra keys (multimodal inputs, a cache salt), and KV-cache groups other than
the first of a hybrid model. A block whose parent the index does not know (its BlockStored was missed, or the
parent was removed before the child arrived) cannot be named either and is skipped: the index may under-report
what an engine holds, never over-report it.

Memory is bounded by `max_blocks` per engine: past it the oldest-stored half is dropped (an engine that keeps
stored blocks without ever removing any is not following the protocol; a normal engine's index never exceeds its
own cache size).
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from pdserve.api.kvevents import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
)

#: Bits of the medium mask: the known tiers first, others assigned as they appear (up to 16 names per process).
_MEDIUM_BITS: dict[str, int] = {MEDIUM_GPU: 1, MEDIUM_CPU: 2, MEDIUM_STORAGE: 4}
_MAX_MEDIUMS = 16
_ID_BYTES = 8


def medium_bit(medium: str | None) -> int:
    """The mask bit of a tier name (None is the GPU pool, as in vLLM before the field existed)."""
    name = medium or MEDIUM_GPU
    bit = _MEDIUM_BITS.get(name)
    if bit is None:
        if len(_MEDIUM_BITS) >= _MAX_MEDIUMS:
            return 1 << (_MAX_MEDIUMS - 1)  # every further unknown tier shares the last bit
        bit = 1 << len(_MEDIUM_BITS)
        _MEDIUM_BITS[name] = bit
    return bit


def medium_names(mask: int) -> list[str]:
    """The tier names of a mask."""
    return [name for name, bit in _MEDIUM_BITS.items() if mask & bit]


def chain_hash(parent: int, block_ids: bytes) -> int:
    """The router hash of a block: its parent's router hash and its token ids packed as native int64.

    `hash()` of bytes is SipHash keyed per process (unless PYTHONHASHSEED fixes the key), so the names are
    unpredictable to clients; the tuple folds in the parent."""
    return hash((parent, block_ids))


def pack_ids(ids: Sequence[int]) -> bytes:
    """Token ids as the packed int64 bytes `chain_hash` reads (native order, as `array('q')` writes)."""
    return array("q", ids).tobytes()


@dataclass(frozen=True, slots=True)
class Match:
    """What an engine holds of a prompt: its leading `blocks` in any tier, and the leading run in each tier."""

    blocks: int
    by_medium: Mapping[str, int]


class EngineIndex:
    """The blocks one engine's events say it holds (one publisher: an engine, or one data-parallel rank of it)."""

    def __init__(self, *, max_blocks: int = 1_000_000) -> None:
        self._max_blocks = max_blocks
        self._router_of: dict[BlockHash, int] = {}
        self._mask: dict[int, int] = {}
        self.block_size: int | None = None
        #: Set by the router once a prompt's block was found here (`kvhub`); a new incarnation resets it.
        self.confirmed = False
        #: Events this index applied, and events it had to skip (unnamed blocks, other groups, adapters).
        self.applied = 0
        self.skipped = 0

    def __len__(self) -> int:
        """Blocks held, across tiers."""
        return len(self._mask)

    def __contains__(self, router_hash: int) -> bool:
        return router_hash in self._mask

    def mask(self, router_hash: int) -> int:
        """The tiers holding a block (0: none)."""
        return self._mask.get(router_hash, 0)

    def clear(self) -> None:
        """Forget everything (AllBlocksCleared, or a new engine incarnation)."""
        self._router_of.clear()
        self._mask.clear()
        self.confirmed = False

    def apply(self, batch: EventBatch) -> None:
        """Apply one batch's events in order."""
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                self._removed(event)
            elif isinstance(event, AllBlocksCleared):
                self.clear()
                self.applied += 1

    def _stored(self, event: BlockStored) -> None:
        if (
            event.lora_id is not None
            or event.lora_name is not None
            or event.has_extra_keys
            or event.group_idx not in (None, 0)
        ):
            self.skipped += 1
            return
        if event.parent_block_hash is None:
            parent = 0
        else:
            known = self._router_of.get(event.parent_block_hash)
            if known is None:
                self.skipped += 1
                return
            parent = known
        size = event.block_size
        self.block_size = size
        bit = medium_bit(event.medium)
        packed = pack_ids(event.token_ids)
        step = size * _ID_BYTES
        router_of, masks = self._router_of, self._mask
        for index, engine_hash in enumerate(event.block_hashes):
            parent = chain_hash(parent, packed[index * step : (index + 1) * step])
            router_of[engine_hash] = parent
            masks[parent] = masks.get(parent, 0) | bit
        self.applied += 1
        if len(masks) > self._max_blocks:
            self._shrink()

    def _removed(self, event: BlockRemoved) -> None:
        bit = medium_bit(event.medium)
        router_of, masks = self._router_of, self._mask
        for engine_hash in event.block_hashes:
            router = router_of.get(engine_hash)
            if router is None:
                continue
            left = masks.get(router, 0) & ~bit
            if left:
                masks[router] = left
            else:
                masks.pop(router, None)
                del router_of[engine_hash]
        self.applied += 1

    def _shrink(self) -> None:
        """Drop the oldest-stored half (dicts keep insertion order)."""
        drop = len(self._mask) // 2
        for key in list(self._mask)[:drop]:
            del self._mask[key]
        for engine_hash in [key for key, router in self._router_of.items() if router not in self._mask]:
            del self._router_of[engine_hash]


class BlockChain(Protocol):
    """A prompt's router hashes, computed on demand (`prompt_blocks.PromptBlocks`)."""

    def block(self, index: int) -> int | None:
        """The router hash of the prompt's block `index`, or None past its last full block."""
        ...


def match_engines(engines: Mapping[str, Sequence[EngineIndex]], chain: BlockChain) -> dict[str, Match]:
    """The leading blocks of the prompt each engine holds (engines holding none are absent).

    One walk over the prompt's blocks for all engines together, stopping at the first block no engine holds, so a
    prompt nobody holds costs one block's hash. An engine with several publishers (data-parallel ranks) holds a
    block held by any of them: its front end may place the request on any rank.
    """
    # Per engine still matching: the lookups of its publishers' masks, the tiers holding every block so far, and
    # where each tier's run ended.
    alive = {url: [index._mask.get for index in indices] for url, indices in engines.items() if indices}
    live: dict[str, int] = {}
    ended: dict[str, dict[int, int]] = {}
    found: dict[str, int] = {}
    position = 0
    while alive:
        router_hash = chain.block(position)
        if router_hash is None:
            break
        for url, lookups in list(alive.items()):
            mask = 0
            for lookup in lookups:
                mask |= lookup(router_hash, 0)
            if not mask:
                del alive[url]
                continue
            if position == 0:
                live[url] = mask
            else:
                previous = live[url]
                if previous & ~mask:
                    # Some tiers' runs end before this block: their leading run is `position` blocks.
                    for bit in _bits(previous & ~mask):
                        ended.setdefault(url, {})[bit] = position
                    live[url] = previous & mask
            found[url] = position + 1
        position += 1
    result: dict[str, Match] = {}
    for url, blocks in found.items():
        runs = {bit: blocks for bit in _bits(live[url])}
        runs.update(ended.get(url, {}))
        result[url] = Match(blocks, {name: runs[bit] for name, bit in _MEDIUM_BITS.items() if bit in runs})
    return result


def _bits(mask: int) -> list[int]:
    return [1 << shift for shift in range(mask.bit_length()) if mask >> shift & 1]
