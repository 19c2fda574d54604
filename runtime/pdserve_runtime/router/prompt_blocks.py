"""A prompt's blocks as router hashes (`kvindex.chain_hash`), computed only as far as a match needs them.

The router names a prompt's blocks from its token ids the way the engines' events name theirs (`kvindex`), so it
needs the token ids the engine computes. Decided: the router computes them itself with the shared prompt model
(`pdserve.api.prompt.token_ids`), which is the simulator's tokenizer; a prompt given as token ids is used as is.
Weighed: the engine's own `/tokenize` (exact for any model, but a round trip to an engine before every routing
decision, and the prompt's JSON twice over the wire); the model's tokenizer and chat template in the router
(exact, but the router would load model files and a real tokenizer costs about as much CPU as the rest of the
request path). With engines whose tokenizer is not the prompt model (a real vLLM), the hashes never match the
index: the router sees that (no prompt ever matches, `KvEventsHub` calls the engine unconfirmed) and keeps using
its own tracking for those engines, so the index is never worse than no index.

Cost on the hot path is bounded by what is held, not by the prompt's length: blocks are produced one at a time,
and `kvindex.match_engines` asks for the next block only while some engine holds every block so far. Text is
tokenized in slices cut just after a space byte (tokens never span one), the first 2 KiB and doubling, so a prompt
nobody holds costs one slice's tokenization and one block hash.
"""

from __future__ import annotations

from pdserve.api.prompt import token_ids
from pdserve_runtime.router.kvindex import chain_hash, pack_ids
from pdserve_runtime.router.tokens import IDS_TAG

_ID_BYTES = 8
_FIRST_SLICE = 2048


class PromptBlocks:
    """The router hashes of one prompt's full blocks, produced lazily (`kvindex.BlockChain`)."""

    __slots__ = ("_block_size", "_hashes", "_key", "_parent", "_pending", "_pos", "_slices", "_step", "_tokens")

    def __init__(self, key: bytes, block_size: int) -> None:
        self._key = key
        self._block_size = block_size
        self._hashes: list[int] = []
        # Each tokenized slice of a text key: (start byte, end byte, tokens before it, its tokens).
        self._slices: list[tuple[int, int, int, int]] = []
        self._pending: list[int] = []
        self._pos = 1  # after the key's tag byte
        self._step = _FIRST_SLICE
        self._tokens = 0  # tokens produced from key[1:self._pos]
        self._parent = 0

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
        tokens = blocks * self._block_size
        if self._key[:1] == IDS_TAG:
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
        key, size = self._key, self._block_size
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
        while len(pending) < size:
            if self._pos >= end_of_key:
                return False
            end = self._pos + self._step
            if end >= end_of_key:
                end = end_of_key
            else:
                cut = key.find(b" ", end)
                end = end_of_key if cut < 0 else cut + 1
            ids = token_ids(key[self._pos : end])
            if ids:
                self._slices.append((self._pos, end, self._tokens, len(ids)))
            self._pos = end
            self._step *= 2
            self._tokens += len(ids)
            pending.extend(ids)
        # Hash every full block the slice completed.
        full = len(pending) // size
        packed = pack_ids(pending[: full * size])
        step = size * _ID_BYTES
        for block in range(full):
            self._parent = chain_hash(self._parent, packed[block * step : (block + 1) * step])
            self._hashes.append(self._parent)
        del pending[: full * size]
        return True
