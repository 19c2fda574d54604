r"""The prompt model the PD router and the engine simulator share: how a prompt becomes approximate tokens, and how
a chat request becomes one prompt.

The router must estimate how many tokens of a prompt an engine would have to compute (to compare with the
disaggregation threshold) without loading a tokenizer, and the engine simulator must count the same tokens, so
that a threshold means the same thing to both. This module is that shared definition; the router owns its use,
the simulator imports it, and neither copies it.

Tokens are defined on the prompt's UTF-8 bytes, so that the router can count them with a few C-level passes over a
byte string (`count_tokens`: no Python work per token) and cut a prompt anywhere a space byte separates two
tokens. Each byte is in one of three classes:

- word bytes: ASCII letters, digits, `_`, and every byte of a non-ASCII character;
- space bytes: `\t \n \v \f \r`, the ASCII separators `\x1c`-`\x1f`, and the space;
- other bytes: everything else (ASCII punctuation and control characters).

A token is a slice of at most 6 bytes of a maximal run of word bytes (cut from the run's start), or one other byte;
space bytes are not tokens. So "Hello, world!" is 4 tokens, "internationalization" is 4, "naïve" (6 bytes) is 1.
For ASCII text this is the same as `\w{1,6}|[^\w\s]` over the characters; against a real BPE tokenizer it is
within a few tens of percent for English, well inside the slack of a threshold.

Token ids: a token's id is `VOCAB_OFFSET + crc32(token bytes) % VOCAB_SIZE` (`token_ids`): stable across processes
and machines, so the simulator's prefix cache, the block contents its KV events carry and the router's prefix index
(`pdserve_runtime.router.kvindex`) agree on every engine and every router replica.

Chat template: each message is a `<|role|>` header line, its content and a newline; the prompt ends with
`<|assistant|>` and a newline. The system prompt and earlier turns therefore form a shared prefix.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable
from itertools import chain

#: Bytes per token slice of a long run of word bytes.
CHUNK_BYTES = 6
#: Kept for the simulator's word list: a word of at most this many ASCII letters is one token.
CHUNK_CHARS = CHUNK_BYTES

_WORD = frozenset(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_") | frozenset(range(0x80, 0x100))
SPACE_BYTES = frozenset(b"\t\n\x0b\x0c\r\x1c\x1d\x1e\x1f ")
"""The space class: bytes that separate tokens and are not tokens themselves."""

# Greedy `[word]{1,6}` cuts a run of n word bytes into exactly its ceil(n / 6) slices, in C.
_TOKEN_SLICES = re.compile(rb"[A-Za-z0-9_\x80-\xff]{1,6}|[^A-Za-z0-9_\x80-\xff\t\n\x0b\x0c\r\x1c-\x1f ]")

# Each byte mapped to its class letter: w(ord), s(pace) as b" ", o(ther) as b"p".
_CLASSES = bytes((0x77 if b in _WORD else 0x20 if b in SPACE_BYTES else 0x70) for b in range(256))
_SIX_WORD = b"w" * CHUNK_BYTES


def utf8(text: str) -> bytes:
    """The bytes the model counts (lone surrogates, which JSON can carry, are kept rather than refused)."""
    return text.encode("utf-8", "surrogatepass")


def text_tokens(text: str) -> list[bytes]:
    """The approximate tokens of `text`, as byte strings (see the module docstring)."""
    return _TOKEN_SLICES.findall(utf8(text))


#: Size of the id space of ordinary tokens, and the first such id (ids below it are "special": EOS and friends).
VOCAB_SIZE = 32000
VOCAB_OFFSET = 100


def _slice_ids(data: bytes) -> tuple[int, ...]:
    """The ids of the tokens of `data`, by the definition: one regex pass, one crc32 per token."""
    crc32 = zlib.crc32
    return tuple(VOCAB_OFFSET + crc32(token) % VOCAB_SIZE for token in _TOKEN_SLICES.findall(data))


class _Chunks(dict[bytes, tuple[int, ...]]):
    """Whitespace-separated chunk -> the ids of its tokens, filled on first sight.

    Tokens never span a space byte, and `bytes.split()` cuts only at ASCII whitespace (a subset of the space
    class), so the tokens of a text are the tokens of its chunks in order. Text reuses a small set of chunks
    (words with their punctuation), so after warming up a prompt costs one C-level split and one dict lookup per
    chunk instead of a regex pass and a crc32 per token. Bounded: chunks longer than `_MAX_CHUNK` bytes are not
    kept, and the whole map is cleared when it reaches `_MAX_CHUNKS` entries (a few tens of MB at most)."""

    def __missing__(self, chunk: bytes) -> tuple[int, ...]:
        ids = _slice_ids(chunk)
        if len(chunk) <= _MAX_CHUNK:
            if len(self) >= _MAX_CHUNKS:
                self.clear()
            self[chunk] = ids
        return ids


_MAX_CHUNK = 32
_MAX_CHUNKS = 1 << 18
_CHUNKS = _Chunks()


def token_ids(data: bytes) -> list[int]:
    """The token ids of `data` (UTF-8) under the model (equal to `_slice_ids(data)`, computed chunk by chunk)."""
    return list(chain.from_iterable(map(_CHUNKS.__getitem__, data.split())))


def count_tokens(data: bytes) -> int:
    """How many tokens `data` (UTF-8) holds, equal to `len(_TOKEN_SLICES.findall(data))` but without building them.

    Algorithm: translate every byte to its class letter, then
    tokens = other bytes + word runs + sum over runs of floor((run length - 1) / 6)
    (a run of n word bytes is ceil(n / 6) = 1 + floor((n - 1) / 6) slices). Run starts are a word byte after a
    space or other byte (or at the start); dropping each run's first byte leaves runs of n - 1 bytes, in which the
    non-overlapping count of six word bytes is floor((n - 1) / 6). Every step is one C pass over the bytes.
    """
    if not data:
        return 0
    classes = data.translate(_CLASSES)
    others = classes.count(b"p")
    starts = classes.count(b" w") + classes.count(b"pw")
    tails = classes.replace(b" w", b"  ").replace(b"pw", b"p ")
    if classes[0] == 0x77:  # a run at the very start
        starts += 1
        tails = tails[1:]
    return others + starts + tails.count(_SIX_WORD)


def trailing_word_run(data: bytes) -> int:
    """Length of the run of word bytes at the end of `data`."""
    classes = data.translate(_CLASSES)
    return len(data) - 1 - max(classes.rfind(b" "), classes.rfind(b"p"))


def is_word_byte(value: int) -> bool:
    """Whether a byte belongs to a word run (the class that tokens slice in sixes)."""
    return value in _WORD


def chat_prompt(messages: Iterable[tuple[str, str]]) -> str:
    """The one prompt a list of (role, text content) pairs becomes under the shared chat template."""
    parts = [f"<|{role}|>\n{content}\n" for role, content in messages]
    parts.append("<|assistant|>\n")
    return "".join(parts)
