"""The prompt model: approximate tokens consistent with the simulator, chained block hashes."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.api.prompt import text_tokens
from pdserve_runtime.router.tokens import block_hashes, describe_prompt, prompt_tokens


@pytest.mark.parametrize(
    ("text", "count"),
    [("", 0), ("Hello, world!", 4), ("internationalization", 4), ("a b c", 3), ("x" * 13, 3), ("  \n\t ", 0)],
)
def test_text_token_counts(text: str, count: int) -> None:
    assert len(text_tokens(text)) == count


@pytest.mark.parametrize(
    ("payload", "chat", "count"),
    [
        ({"prompt": "one two three"}, False, 3),
        ({"prompt": [5, 6, 7, 8]}, False, 4),
        ({"prompt": ["one two", "three"]}, False, 3),
        ({"prompt": [[1, 2], [3]]}, False, 3),
        ({"prompt": 12}, False, 0),
        ({}, False, 0),
        ({"messages": "nope"}, True, 0),
        ({"messages": [{"role": "user", "content": "hi"}]}, True, 12),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url"}]}]},
            True,
            12,
        ),
    ],
)
def test_prompt_token_counts(payload: dict[str, Any], chat: bool, count: int) -> None:
    assert len(prompt_tokens(payload, chat)) == count


def test_counts_agree_with_the_engine_simulator() -> None:
    sim_tokenizer = pytest.importorskip("pdserve_sim.tokenizer")
    texts = ["The quick brown fox, jumps over 1234567890 lazy dogs!", "naïve café — déjà vu", "a" * 100]
    for text in texts:
        assert len(text_tokens(text)) == len(sim_tokenizer.tokenize(text))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Explain KV caches."}]
    flattened = sim_tokenizer.flatten_chat([(m["role"], m["content"]) for m in messages])
    assert len(prompt_tokens({"messages": messages}, True)) == len(sim_tokenizer.tokenize(flattened))


def test_only_full_blocks_are_hashed_and_hashes_chain() -> None:
    tokens = list(range(10))
    assert len(block_hashes(tokens, 4)) == 2
    assert block_hashes(tokens, 11) == ()
    same_second_block = [99, 1, 2, 3, 4, 5, 6, 7]
    # Equal second blocks after different first blocks hash differently: a hash stands for the whole prefix.
    assert block_hashes(tokens[:8], 4)[1] != block_hashes(same_second_block, 4)[1]
    assert block_hashes(tokens, 4) == block_hashes(list(tokens), 4)


def test_a_shared_prefix_shares_leading_block_hashes() -> None:
    system = "You are a careful assistant. " * 20
    first = describe_prompt({"prompt": system + "What is a cache? " * 8}, False, 16)
    second = describe_prompt({"prompt": system + "Why is the sky blue? " * 8}, False, 16)
    common = 0
    for left, right in zip(first.block_hashes, second.block_hashes, strict=False):
        if left != right:
            break
        common += 1
    assert common >= 6
    assert first.block_hashes != second.block_hashes
