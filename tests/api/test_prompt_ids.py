"""The prompt model's token ids: computed chunk by chunk (the fast path) they are the definition's, whatever the
bytes (space classes `bytes.split()` does not cut at, punctuation, long runs, non-ASCII)."""

from __future__ import annotations

import re
import zlib

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.api.prompt import VOCAB_OFFSET, VOCAB_SIZE, text_tokens, token_ids, utf8

ALPHABET = st.sampled_from([b"a", b"Z", b"9", b"_", b" ", b"\t", b"\n", b"\x1c", b"\x1f", b",", b"!", b"\xc3\xa9",
                            b"\xff", b"word", b"abcdefghij"])  # fmt: skip


# The model's token pattern, spelled out again (the module docstring of pdserve.api.prompt).
TOKEN = re.compile(rb"[A-Za-z0-9_\x80-\xff]{1,6}|[^A-Za-z0-9_\x80-\xff\t\n\x0b\x0c\r\x1c-\x1f ]")


def _definition(data: bytes) -> list[int]:
    return [VOCAB_OFFSET + zlib.crc32(token) % VOCAB_SIZE for token in text_tokens(data.decode("utf-8", "replace"))]


@settings(max_examples=500, deadline=None)
@given(st.lists(ALPHABET, max_size=60).map(b"".join))
def test_chunked_ids_are_the_definitions(data: bytes) -> None:
    expected = [VOCAB_OFFSET + zlib.crc32(token) % VOCAB_SIZE for token in TOKEN.findall(data)]
    assert token_ids(data) == expected
    assert token_ids(data) == token_ids(data)  # and again, from the warm chunk map


def test_text_prompts() -> None:
    text = "Hello, world! naïve internationalization\x1cx"
    assert token_ids(utf8(text)) == _definition(utf8(text))
