r"""The router's model of a prompt: its bytes as a prefix-comparable key, and how many of its tokens an engine would
have to compute given what the engine is believed to hold.

The router has no tokenizer (it must not load model files, and a real tokenizer would cost more CPU than the rest
of the request path). It needs two things, and the shared byte-level model of `pdserve.api.prompt` serves both
without any Python work per token:

- a key per prompt whose common prefix with another prompt's key is their common prefix: the prompt's UTF-8
  bytes (chat requests flattened with the shared template) or, for token-id prompts, the ids as 8-byte integers,
  behind a one-byte tag so the two never match each other;
- for the engine the scheduler chose, whether the tokens it would have to compute reach the disaggregation
  threshold, decided exactly under the model the engine simulator implements.

Exact decision without counting the whole prompt (`uncached_tokens`). An engine caches whole blocks of
`block_size` tokens and always computes the last prompt token, so with n prompt tokens of which the first c are
common with a prompt the engine holds, it computes u = n - block * min(floor(c / block), floor((n - 1) / block)).
Cut the key at p, just after the last space or newline before the end of the common part (tokens never span a
space byte, so counts add up across p): c = A + G and n = A + B, where A counts the tokens before p, G the common
tokens between p and the end of the common part (a few bytes: the tail of one word), and B the tokens from p to
the end. Then B - G <= u < max(B - G, 1) + block, so:

- B - G >= threshold: u reaches it. B is counted in growing slices from p and the count stops as soon as it reaches
  threshold + G, so a long uncached tail costs a few kilobytes of counting, whatever the prompt's length;
- max(B - G, 1) + block <= threshold: u stays below it;
- otherwise (u within one block of the threshold) A is counted too and u is exact.

The common part itself is found by the prefix tracker with memcmp over stored keys (`prefix.py`), so the cost of
a routing decision depends on the threshold, not on the prompt's length.

One place where this is not the simulator's answer, on purpose: two prompts whose first different byte is a space
byte (" a" against "a", "a  b" against "a b"). The model's tokens ignore spaces, so the simulator may hold more
tokens than the byte comparison shows; the router counts from the first different byte, as a real tokenizer's
tokens (which encode whitespace) would differ there. It then counts too many uncached tokens, never too few: the
error only ever sends a prompt through prefill. Comparing whitespace-insensitively would cost a pass over every
prompt and be wrong for real engines.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pdserve.api.prompt import CHUNK_BYTES, chat_prompt, count_tokens, is_word_byte, trailing_word_run, utf8

TEXT_TAG = b"t"
IDS_TAG = b"i"
_ID_BYTES = 8
# Token density assumed for the part of a prompt that was not counted (load estimates only, never decisions).
_BYTES_PER_TOKEN = 4.5
# First slice counted from the cut; each next slice doubles (a slice ends at the next space byte).
_FIRST_SLICE = 2048


@dataclass(frozen=True, slots=True)
class PromptInfo:
    """What the routing policies know about one request's prompt."""

    key: bytes
    block_size: int

    @property
    def size(self) -> int:
        """Length of the key in bytes (prefix affinity is measured in bytes of the key)."""
        return len(self.key)


@dataclass(frozen=True, slots=True)
class Held:
    """What an engine holds of a prompt: the longest common prefix with a prompt it processed (the tracker's
    guess), or, from the engine's KV events (`kvhub`), its leading blocks of the prompt."""

    common: int  # bytes of the key in common (the tag included); estimated from `blocks` for indexed engines
    stored_next: int | None  # the byte after the common part in the stored prompt; None where it ended
    blocks: int | None = None
    """Leading blocks of the prompt the engine's KV events say it holds, in any tier (None: a tracker guess)."""
    by_medium: Mapping[str, int] | None = None
    """For each tier (`GPU`, `CPU`, ...), the leading blocks of the prompt held in that tier."""
    counted: tuple[int, int] = (0, 0)
    """(tokens, key offset): the prompt's tokens before that offset were counted when `blocks` was found."""
    block_size: int | None = None
    """The engine's block size, when its events said it (`blocks` are of this size)."""


@dataclass(frozen=True, slots=True)
class Uncached:
    """Prompt tokens an engine would compute, and whether they reach the threshold (always exact)."""

    tokens: int  # exact when `exact`, else an estimate on the same side of the threshold as the truth
    exact: bool
    wants_prefill: bool


def _content_text(content: object) -> str:
    """The text of a chat message's content: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [part.get("text", "") for part in content if isinstance(part, dict) and part.get("type") == "text"]
        return " ".join(part for part in parts if isinstance(part, str))
    return ""


def _ids_key(ids: list[Any]) -> bytes | None:
    try:
        return IDS_TAG + array("q", ids).tobytes()
    except (TypeError, OverflowError):
        return None  # not all int64: engines will refuse it; route it as having no prefix


def prompt_key(payload: dict[str, object], chat: bool) -> bytes:
    """The prefix-comparable key of a completions or chat request body (already parsed as a dict)."""
    if chat:
        messages = payload.get("messages")
        if not isinstance(messages, list):
            return TEXT_TAG
        pairs = [
            (str(message.get("role", "")), _content_text(message.get("content")))
            for message in messages
            if isinstance(message, dict)
        ]
        return TEXT_TAG + utf8(chat_prompt(pairs))
    prompt = payload.get("prompt")
    if isinstance(prompt, str):
        return TEXT_TAG + utf8(prompt)
    if isinstance(prompt, list) and prompt:
        if all(type(item) is int for item in prompt):
            return _ids_key(prompt) or TEXT_TAG
        # A batch of prompts: engines see each one, but for routing their concatenation is a fair estimate.
        texts = [item for item in prompt if isinstance(item, str)]
        if texts:
            return TEXT_TAG + utf8(" ".join(texts))
        ids = [token for item in prompt if isinstance(item, list) for token in item if type(token) is int]
        return _ids_key(ids) or TEXT_TAG
    return TEXT_TAG


def describe_prompt(payload: dict[str, object], chat: bool, block_size: int) -> PromptInfo:
    """The routing view of a request body."""
    return PromptInfo(key=prompt_key(payload, chat), block_size=block_size)


def prompt_tokens(prompt: PromptInfo) -> int:
    """Every token of the prompt (a full count: tests and tools, not the request path)."""
    key = prompt.key
    if key[:1] == IDS_TAG:
        return (len(key) - 1) // _ID_BYTES
    return count_tokens(key[1:])


def _cached(common_tokens: int, total_tokens: int, block: int) -> int:
    """Tokens an engine reuses: whole common blocks, never the last prompt token."""
    if total_tokens <= 0:
        return 0
    return block * min(common_tokens // block, (total_tokens - 1) // block)


def _count_from(key: bytes, start: int, limit: int) -> tuple[int, int]:
    """Tokens of key[start:], counted in slices cut after space bytes, stopping once `limit` is reached.

    Returns (tokens counted, where counting stopped); stopping before len(key) means the count reached `limit`.
    """
    total = 0
    pos = start
    step = _FIRST_SLICE
    end_of_key = len(key)
    while pos < end_of_key:
        if total >= limit:
            break
        end = pos + step
        if end >= end_of_key:
            end = end_of_key
        else:
            cut = key.find(b" ", end)
            end = end_of_key if cut < 0 else cut + 1
        total += count_tokens(key[pos:end])
        pos = end
        step *= 2
    return total, pos


def _gap_common_tokens(key: bytes, start: int, common: int, stored_next: int | None) -> int:
    """Tokens of key[start:common] that are whole and equal in both prompts (no space byte in that range).

    Every token of the range is shared except possibly the last one, when it is a slice of a word run that
    continues past the common part in either prompt (the two runs then slice differently from there).
    """
    gap = key[start:common]
    tokens = count_tokens(gap)
    if not gap or not is_word_byte(gap[-1]):
        return tokens
    if trailing_word_run(gap) % CHUNK_BYTES == 0:
        return tokens  # the run's last slice is full: it ends here whatever follows
    query_next = key[common] if common < len(key) else None
    ends_here = (query_next is None or not is_word_byte(query_next)) and (
        stored_next is None or not is_word_byte(stored_next)
    )
    return tokens if ends_here else tokens - 1


def uncached_tokens(prompt: PromptInfo, held: Held | None, threshold: int) -> Uncached:
    """Tokens the engine would compute for `prompt` given what it holds; see the module docstring."""
    key, block = prompt.key, prompt.block_size
    if held is not None and held.blocks is not None:
        return _indexed_uncached(key, held.block_size or block, held.blocks, held.counted, threshold)
    common = held.common if held is not None else 0
    if key[:1] == IDS_TAG:
        total = (len(key) - 1) // _ID_BYTES
        shared = max(0, common - 1) // _ID_BYTES
        tokens = total - _cached(shared, total, block)
        return Uncached(tokens, True, tokens >= threshold)
    if common <= 1:
        # Nothing in common: every token is computed, so counting stops at the threshold.
        counted, stopped = _count_from(key, 1, threshold)
        if stopped < len(key):
            return Uncached(_estimate(key, 1, counted, stopped), False, True)
        return Uncached(counted, True, counted >= threshold)
    # Cut just after the last space or newline of the common part (memrchr: only the last word is scanned).
    cut = max(key.rfind(b" ", 1, common), key.rfind(b"\n", 1, common)) + 1 or 1
    gap = _gap_common_tokens(key, cut, common, held.stored_next if held is not None else None)
    tail, stopped = _count_from(key, cut, threshold + gap)
    if stopped < len(key):
        return Uncached(_estimate(key, cut, tail, stopped) - gap, False, True)
    if tail - gap >= threshold:
        return Uncached(tail - gap, False, True)
    if max(tail - gap, 1) + block <= threshold:
        return Uncached(max(tail - gap, 0), False, False)
    before = count_tokens(key[1:cut])
    tokens = before + tail - _cached(before + gap, before + tail, block)
    return Uncached(tokens, True, tokens >= threshold)


def _indexed_uncached(key: bytes, block: int, blocks: int, counted: tuple[int, int], threshold: int) -> Uncached:
    """Tokens to compute when the engine's events say it holds the prompt's first `blocks` blocks.

    The tokens before `counted[1]` are known (`counted[0]`, from producing the blocks); the rest are counted from
    there until the count settles the decision, as in `uncached_tokens`."""
    seen, at = counted
    if key[:1] == IDS_TAG:
        total = (len(key) - 1) // _ID_BYTES
        tokens = total - _cached(blocks * block, total, block)
        return Uncached(tokens, True, tokens >= threshold)
    held_tokens = blocks * block
    # u = n - cached >= n - held_tokens: once the rest reaches `limit`, u >= threshold for sure.
    limit = max(0, threshold + held_tokens - seen)
    rest, stopped = _count_from(key, at, limit)
    if stopped < len(key):
        return Uncached(_estimate(key, at, rest, stopped) + seen - held_tokens, False, True)
    total = seen + rest
    tokens = total - _cached(held_tokens, total, block)
    return Uncached(tokens, True, tokens >= threshold)


def _estimate(key: bytes, start: int, counted: int, stopped: int) -> int:
    """Counted tokens plus the rest of the key at the density seen so far (load estimates only)."""
    seen = stopped - start
    density = counted / seen if seen and counted else 1 / _BYTES_PER_TOKEN
    return counted + round((len(key) - stopped) * density)
