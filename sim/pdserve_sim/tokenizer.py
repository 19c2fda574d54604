"""A cheap, deterministic stand-in for a real tokenizer, and the simulator's deterministic "model output".

Tokenization: the pieces are the approximate tokens of ``pdserve.api.prompt`` (the definition the PD router
uses too, so a router threshold means the same tokens here), UTF-8 byte slices; each token's id is
``VOCAB_OFFSET + crc32(token) % VOCAB_SIZE`` (``pdserve.api.prompt.token_ids``, which the router's prefix index
uses too): stable across processes and runs (unlike ``hash()``), so prefix
caching sees identical ids for identical text on every engine. Chat messages are flattened with the shared chat
template (:func:`flatten_chat`) before tokenizing.

Generation: the output is a deterministic function of the prompt: token ``i`` of a request is the word
``WORDS[(seed + i * 7919) % len(WORDS)]`` with a leading space, where ``seed`` derives from the prompt's token
ids. Every generated word is one token under the rules above, so re-tokenizing the output gives the count.
With ``--eos-mean-tokens N`` a request that does not set ``ignore_eos`` ends early ("stop") after
:func:`natural_length` tokens (never before ``min_tokens``); by default the model never emits EOS.
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Sequence

from pdserve.api.prompt import CHUNK_CHARS, VOCAB_OFFSET, VOCAB_SIZE, chat_prompt, token_ids, utf8

__all__ = ["VOCAB_OFFSET", "VOCAB_SIZE", "tokenize"]

#: Ids below VOCAB_OFFSET are "special"; the simulated end-of-sequence token.
EOS_TOKEN_ID = 2

# Short common words (<= 6 letters, so each is exactly one token). Generated text cycles through them.
_WORD_TEXT = """the of and to in is was for on that with as by at from his her they this are be it an had not or have
    which one you were all their has been more when can there would who will so about into than its them
    some could only other new time first two may then these like over any such after most also what made
    well where many before must through back years much being way under world should long just both each
    those while great state three since never under water city light river house small place again point
    north south east west early house field green stone paper music story market garden window summer
    winter spring autumn forest island bridge harbor valley signal engine memory cache batch token prompt
    decode router stream packet server"""
WORDS: tuple[str, ...] = tuple(dict.fromkeys(w for w in _WORD_TEXT.split() if len(w) <= CHUNK_CHARS))
#: The JSON-escaped form of each generated piece (" word"), precomputed for the streaming hot path.
WORD_PIECES: tuple[str, ...] = tuple(" " + w for w in WORDS)
WORD_IDS: tuple[int, ...] = tuple(VOCAB_OFFSET + zlib.crc32(w.encode()) % VOCAB_SIZE for w in WORDS)
_STRIDE = 7919


def tokenize(text: str) -> list[int]:
    """Token ids of ``text`` under the approximation described in the module docstring."""
    return token_ids(utf8(text))


def flatten_chat(messages: Sequence[tuple[str, str]]) -> str:
    """Render (role, content) pairs with the shared chat template."""
    return chat_prompt(messages)


def generation_seed(prompt_ids: Sequence[int]) -> int:
    """A stable seed for the output of a prompt (same prompt -> same text on every engine)."""
    # Hash the first and last 64 ids and the length: cheap for long prompts, still prompt-specific.
    head = ",".join(map(str, prompt_ids[:64]))
    tail = ",".join(map(str, prompt_ids[-64:]))
    return zlib.crc32(f"{len(prompt_ids)}|{head}|{tail}".encode())


def word_index(seed: int, position: int) -> int:
    """Index into WORDS of the generated token at ``position`` (0-based) for ``seed``."""
    return (seed + position * _STRIDE) % len(WORDS)


def natural_length(seed: int, mean_tokens: float) -> int:
    """How many tokens the simulated model generates before its end-of-sequence token, for a prompt seed.

    Geometric-like with the given mean (``1 + floor(-mean * ln(u))`` for a uniform ``u`` derived from the
    seed), so output lengths vary across prompts but the same prompt always stops at the same place.
    """
    u = ((seed * 2654435761) % (1 << 32) + 0.5) / (1 << 32)
    return 1 + int(-mean_tokens * math.log(u))


def json_string_body(text: str) -> str:
    """``text`` JSON-escaped without the surrounding quotes (for hand-built JSON in the hot path)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]
