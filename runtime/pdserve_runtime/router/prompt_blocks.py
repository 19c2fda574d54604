"""A prompt's blocks as router hashes (`kvindex.chain_hash`), computed only as far as a match needs them, and
reused from a recent prompt that shares the bytes.

The router names a prompt's blocks from its token ids the way the engines' events name theirs (`kvindex`), so it
needs the token ids the engine computes. Decided: the router computes them itself with the shared prompt model
(`pdserve.api.prompt.token_ids`), which is the simulator's tokenizer; a prompt given as token ids is used as is.
Weighed: the engine's own `/tokenize` (exact for any model, but a round trip to an engine before every routing
decision, and the prompt's JSON twice over the wire); the model's tokenizer and chat template in the router
(exact, but the router would load model files, and a real tokenizer costs more CPU per token than the prompt
model). With engines whose tokenizer is not the prompt model (a real vLLM), the hashes never match the index: the
router sees that (no prompt ever matches, so `kvhub` never confirms the engine's index) and keeps using its own
tracking for those engines, so the index is never worse than no index.

Cost on the hot path is bounded by what is held, and by what this router saw recently, not by the prompt's length:

- blocks are produced one slice at a time (about `SLICE_BYTES` of text, cut just after a space byte: tokens never
  span one), and `kvindex.match_engines` asks for the next block only while some engine holds every block so far,
  so a prompt nobody holds costs one slice's tokenization and one block hash;
- after each slice the state (blocks so far, the ids of the unfinished block, tokens counted) is a checkpoint, and
  `ChainCache` keeps recent prompts' checkpoints: a new prompt sharing bytes with one of them (the next turn of a
  chat, a shared system prompt) starts from the last checkpoint inside the shared bytes. A checkpoint sits just
  after a space byte, where the prompt model's tokens end whatever follows, so the state there depends only on the
  bytes before it: reusing it is exact.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict

from pdserve.api.prompt import token_ids
from pdserve_runtime.router.kvindex import chain_hash, pack_ids
from pdserve_runtime.router.prefix import common_prefix_length
from pdserve_runtime.router.tokens import IDS_TAG

_ID_BYTES = 8
#: Text tokenized per step (the step ends at the next space byte after this many bytes).
SLICE_BYTES = 1024


class PromptBlocks:
    """The router hashes of one prompt's full blocks, produced lazily (`kvindex.BlockChain`)."""

    __slots__ = ("_checkpoints", "_hashes", "_parent", "_pending", "_pos", "_slices", "_tokens", "block_size", "key")

    def __init__(self, key: bytes, block_size: int) -> None:
        self.key = key
        self.block_size = block_size
        self._hashes: list[int] = []
        # Each tokenized slice of a text key: (start byte, end byte, tokens before it, its tokens).
        self._slices: list[tuple[int, int, int, int]] = []
        # After each slice: (end byte, tokens before it, blocks hashed, parent hash, ids of the unfinished block).
        self._checkpoints: list[tuple[int, int, int, int, tuple[int, ...]]] = []
        self._pending: list[int] = []
        self._pos = 1  # after the key's tag byte
        self._tokens = 0  # tokens produced from key[1:self._pos]
        self._parent = 0

    @classmethod
    def resumed(cls, key: bytes, block_size: int, source: PromptBlocks, common: int) -> PromptBlocks:
        """A prompt's blocks starting from `source`'s last checkpoint within their `common` leading bytes."""
        blocks = cls(key, block_size)
        if key[:1] == IDS_TAG or source.block_size != block_size:
            return blocks
        checkpoints = source._checkpoints
        index = bisect_left(checkpoints, (common + 1,)) - 1  # the last checkpoint ending at or before `common`
        if index < 0:
            return blocks
        end, tokens, hashed, parent, pending = checkpoints[index]
        blocks._hashes = source._hashes[:hashed]
        blocks._slices = source._slices[: index + 1]
        blocks._checkpoints = checkpoints[: index + 1]
        blocks._pending = list(pending)
        blocks._pos, blocks._tokens, blocks._parent = end, tokens, parent
        return blocks

    @property
    def tokens_seen(self) -> int:
        """Tokens of the prompt produced so far (before `bytes_seen`)."""
        return self._tokens

    @property
    def bytes_seen(self) -> int:
        """Where in the key tokenization stopped (a cut after a space byte, or the end)."""
        return self._pos

    def byte_end(self, blocks: int) -> int:
        """About where in the key the first `blocks` blocks end (the tag byte counted): exact for token-id keys,
        interpolated within the slice that holds the block's last token for text (prefix scores are ratios)."""
        if blocks <= 0:
            return 1
        tokens = blocks * self.block_size
        if self.key[:1] == IDS_TAG:
            return 1 + tokens * _ID_BYTES
        for start, end, before, count in self._slices:
            if before < tokens <= before + count:
                return start + (end - start) * (tokens - before) // count
        return self._pos

    def block(self, index: int) -> int | None:
        """The router hash of block `index`, or None past the prompt's last full block."""
        hashes = self._hashes
        while index >= len(hashes):
            if not self._more():
                return None
        return hashes[index]

    def _more(self) -> bool:
        """Produce at least one more block hash; False when the prompt has no further full block."""
        key, size = self.key, self.block_size
        end_of_key = len(key)
        if key[:1] == IDS_TAG:
            # Ids are already packed int64 in the key: hash one block's bytes.
            start = 1 + len(self._hashes) * size * _ID_BYTES
            end = start + size * _ID_BYTES
            if end > end_of_key:
                return False
            self._parent = chain_hash(self._parent, key[start:end])
            self._hashes.append(self._parent)
            self._pos, self._tokens = end, (end - 1) // _ID_BYTES
            return True
        pending = self._pending
        hashed = len(self._hashes)
        while len(self._hashes) == hashed:
            if self._pos >= end_of_key:
                return False
            end = self._pos + SLICE_BYTES
            if end >= end_of_key:
                end = end_of_key
            else:
                cut = key.find(b" ", end)
                end = end_of_key if cut < 0 else cut + 1
            ids = token_ids(key[self._pos : end])
            if ids:
                self._slices.append((self._pos, end, self._tokens, len(ids)))
            self._pos = end
            self._tokens += len(ids)
            pending.extend(ids)
            full = len(pending) // size
            if full:
                packed = pack_ids(pending[: full * size])
                step = size * _ID_BYTES
                parent = self._parent
                for block in range(full):
                    parent = chain_hash(parent, packed[block * step : (block + 1) * step])
                    self._hashes.append(parent)
                self._parent = parent
                del pending[: full * size]
            if end < end_of_key:
                self._checkpoints.append((end, self._tokens, len(self._hashes), self._parent, tuple(pending)))
        return True


class ChainCache:
    """Recent prompts' `PromptBlocks`, found by the longest common byte prefix with a new prompt (sorted keys, two
    neighbours compared with memcmp, as `prefix.PrefixTracker` does), bounded by their keys' bytes (LRU)."""

    def __init__(self, max_bytes: int = 16 * 1024 * 1024) -> None:
        self._max_bytes = max_bytes
        self._keys: list[bytes] = []
        self._entries: OrderedDict[bytes, PromptBlocks] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def start(self, key: bytes, block_size: int) -> PromptBlocks:
        """The blocks of `key`, resumed from the cached prompt sharing most of its bytes (if it was cut at the same
        block size)."""
        keys = self._keys
        index = bisect_left(keys, key)
        best, source = 0, None
        for neighbour in (index - 1, index):
            if 0 <= neighbour < len(keys):
                common = common_prefix_length(key, keys[neighbour])
                if common > best:
                    best, source = common, self._entries[keys[neighbour]]
        if source is None or best <= 1:
            return PromptBlocks(key, block_size)
        return PromptBlocks.resumed(key, block_size, source, best)

    def keep(self, blocks: PromptBlocks) -> None:
        """Remember a prompt's blocks as far as they were computed (a prompt that is a prefix of it is dropped)."""
        key = blocks.key
        if len(key) > self._max_bytes // 4:
            return
        entries, keys = self._entries, self._keys
        if key in entries:
            entries[key] = blocks
            entries.move_to_end(key)
            return
        index = bisect_left(keys, key)
        while index and key.startswith(keys[index - 1]):
            index -= 1
            self._forget(keys.pop(index))
        keys.insert(index, key)
        entries[key] = blocks
        self._bytes += len(key)
        while self._bytes > self._max_bytes:
            oldest, _ = entries.popitem(last=False)
            self._bytes -= len(oldest)
            position = bisect_left(keys, oldest)
            if position < len(keys) and keys[position] == oldest:
                del keys[position]

    def _forget(self, key: bytes) -> None:
        if self._entries.pop(key, None) is not None:
            self._bytes -= len(key)
