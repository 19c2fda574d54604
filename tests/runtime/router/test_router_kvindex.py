"""The per-engine prefix index: blocks named from their token ids (not the engine's hashes), tiers, eviction, what
cannot be named; the prompt side names the same blocks, resumed from a recent prompt exactly; the uncached
decision from an indexed engine."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.api.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from pdserve.api.prompt import chat_prompt, token_ids, utf8
from pdserve_runtime.router.kvindex import EngineIndex, Match, match_engines
from pdserve_runtime.router.prompt_blocks import ChainCache, PromptBlocks
from pdserve_runtime.router.tokens import IDS_TAG, TEXT_TAG, Held, PromptInfo, prompt_tokens, uncached_tokens
from pdserve_sim.kvcache import block_hashes
from pdserve_sim.kvevents import KvEventRecorder

BLOCK = 4
WORDS = [
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "zeta",
    "eta",
    "theta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "omicron",
    "pi",
    "rho",
    "sigma",
    "tau",
]


def _text(words: int, seed: int = 0) -> str:
    return " ".join(WORDS[(seed + i * 7) % len(WORDS)] + str(i % 13) for i in range(words))


def _events(text: str, *, medium: str = "GPU", block: int = BLOCK) -> EventBatch:
    """What a simulator engine publishes after computing `text` (its own hashes, one BlockStored)."""
    ids = token_ids(utf8(text))
    hashes = block_hashes(ids, block)
    recorder = KvEventRecorder(block)
    for index, value in enumerate(hashes):
        recorder.stored(value, hashes[index - 1] if index else None, ids[index * block : (index + 1) * block])
    events = tuple(
        BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, medium=medium)
        for e in recorder.take()
        if isinstance(e, BlockStored)
    )
    return EventBatch(time.time(), events, 0)


def _match(index: EngineIndex, text: str) -> Match | None:
    return match_engines({"e": [index]}, PromptBlocks(TEXT_TAG + utf8(text), BLOCK)).get("e")


def test_a_prompt_matches_the_blocks_an_engine_stored_for_it() -> None:
    text = _text(40)
    index = EngineIndex()
    index.apply(_events(text))
    blocks = len(token_ids(utf8(text))) // BLOCK
    assert _match(index, text) == Match(blocks, {"GPU": blocks})
    # A prompt that shares the first 20 words: only whole blocks of the shared tokens.
    other = _text(20) + " something else entirely different"
    shared = len(token_ids(utf8(_text(20)))) // BLOCK
    match = _match(index, other)
    assert match is not None and shared <= match.blocks <= shared + 1
    assert _match(index, "completely unrelated words here and there and more") is None


def test_the_same_blocks_from_another_engine_with_other_hashes_match_too() -> None:
    # Engines hash with their own function and seed: the index names blocks by content.
    batch = _events(_text(30))
    renamed = tuple(
        BlockStored(
            tuple(h ^ 0x5A5A for h in e.block_hashes),  # type: ignore[operator]
            None if e.parent_block_hash is None else e.parent_block_hash ^ 0x5A5A,  # type: ignore[operator]
            e.token_ids,
            e.block_size,
        )
        for e in batch.events
        if isinstance(e, BlockStored)
    )
    index = EngineIndex()
    index.apply(EventBatch(1.0, renamed, 0))
    assert _match(index, _text(30)) is not None


def test_removal_and_clearing() -> None:
    text = _text(40)
    batch = _events(text)
    stored = batch.events[0]
    assert isinstance(stored, BlockStored)
    index = EngineIndex()
    index.apply(batch)
    # Evict the third block: the prompt is held up to it.
    index.apply(EventBatch(2.0, (BlockRemoved((stored.block_hashes[2],), "GPU"),), 0))
    assert _match(index, text) == Match(2, {"GPU": 2})
    index.apply(EventBatch(3.0, (AllBlocksCleared(),), 0))
    assert len(index) == 0 and _match(index, text) is None


def test_tiers_are_kept_per_block() -> None:
    text = _text(40)
    gpu = _events(text)
    stored = gpu.events[0]
    assert isinstance(stored, BlockStored)
    index = EngineIndex()
    index.apply(gpu)
    index.apply(_events(text, medium="CPU"))
    total = len(stored.block_hashes)
    assert _match(index, text) == Match(total, {"GPU": total, "CPU": total})
    # The GPU tier evicts block 3 (offloaded blocks stay in the CPU tier): GPU holds 3 leading blocks, CPU all.
    index.apply(EventBatch(2.0, (BlockRemoved((stored.block_hashes[3],), "GPU"),), 0))
    assert _match(index, text) == Match(total, {"GPU": 3, "CPU": total})
    # A tier name vLLM may add later gets a bit of its own.
    index.apply(_events(text, medium="STORE-X"))
    match = _match(index, text)
    assert match is not None and match.by_medium["STORE-X"] == total


def test_blocks_it_cannot_name_are_skipped() -> None:
    text = _text(20)
    stored = _events(text).events[0]
    assert isinstance(stored, BlockStored)
    index = EngineIndex()
    # A child whose parent was never seen, an adapter's blocks, a salted block, a second KV-cache group.
    orphan = BlockStored(stored.block_hashes[1:], stored.block_hashes[0], stored.token_ids[BLOCK:], BLOCK)
    lora = BlockStored(stored.block_hashes, None, stored.token_ids, BLOCK, lora_id=3)
    salted = BlockStored(stored.block_hashes, None, stored.token_ids, BLOCK, has_extra_keys=True)
    group = BlockStored(stored.block_hashes, None, stored.token_ids, BLOCK, group_idx=1)
    index.apply(EventBatch(1.0, (orphan, lora, salted, group), 0))
    assert len(index) == 0 and index.skipped == 4


def test_the_bound_drops_the_oldest_half() -> None:
    index = EngineIndex(max_blocks=10)
    index.apply(_events(_text(60)))
    assert 0 < len(index) <= 10


def test_data_parallel_ranks_are_merged() -> None:
    text = _text(40)
    rank0, rank1 = EngineIndex(), EngineIndex()
    rank1.apply(_events(text))
    found = match_engines({"e": [rank0, rank1], "f": [EngineIndex()]}, PromptBlocks(TEXT_TAG + utf8(text), BLOCK))
    assert set(found) == {"e"}


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 400), st.integers(0, 400), st.integers(1, 8), st.text(max_size=40))
def test_resumed_blocks_equal_fresh_ones(seen_words: int, words: int, seed: int, tail: str) -> None:
    """Resuming from a cached prompt's checkpoint gives exactly the blocks of tokenizing from the start."""
    previous = TEXT_TAG + utf8(_text(seen_words, seed))
    key = TEXT_TAG + utf8(_text(words, seed) + tail)
    cache = ChainCache()
    old = PromptBlocks(previous, BLOCK)
    old.block(10**6)  # compute everything, as routing it would when an engine held it all
    cache.keep(old)
    resumed = cache.start(key, BLOCK)
    fresh = PromptBlocks(key, BLOCK)
    index = 0
    while True:
        expected = fresh.block(index)
        assert resumed.block(index) == expected
        if expected is None:
            break
        index += 1
    assert resumed.tokens_seen == fresh.tokens_seen == len(token_ids(key[1:]))


def test_token_id_prompts_are_blocks_of_their_ids() -> None:
    from array import array

    ids = list(range(100, 140))
    index = EngineIndex()
    index.apply(EventBatch(1.0, (BlockStored(tuple(range(10)), None, tuple(ids), BLOCK),), 0))
    key = IDS_TAG + array("q", ids).tobytes()
    found = match_engines({"e": [index]}, PromptBlocks(key, BLOCK))
    assert found["e"].blocks == 10


def test_uncached_tokens_from_an_indexed_engine() -> None:
    system = chat_prompt([("system", _text(300)), ("user", "first question")])
    prompt = PromptInfo(TEXT_TAG + utf8(system), 16)
    total = prompt_tokens(prompt)
    blocks = PromptBlocks(prompt.key, 16)
    blocks.block(3)  # as the hub leaves it after matching 4 blocks
    held = Held(blocks.byte_end(4), None, blocks=4, counted=(blocks.tokens_seen, blocks.bytes_seen))
    decided = uncached_tokens(prompt, held, threshold=256)
    assert decided.wants_prefill and decided.tokens >= total - 64
    everything = PromptBlocks(prompt.key, 16)
    everything.block(10**6)
    whole = (total - 1) // 16
    held = Held(prompt.size, None, blocks=whole + 1, counted=(everything.tokens_seen, everything.bytes_seen))
    decided = uncached_tokens(prompt, held, threshold=256)
    # The last prompt token is always computed: the engine reuses at most (n - 1) // block blocks.
    assert decided.exact and decided.tokens == total - 16 * whole and not decided.wants_prefill


def test_a_prompt_differing_right_at_a_checkpoint_is_not_resumed_past_it() -> None:
    """The byte before a checkpoint is a space; a prompt that has a word byte there tokenizes differently from that
    point on, so the checkpoint must not be used (only those ending within the common bytes)."""
    old = PromptBlocks(TEXT_TAG + utf8(_text(600)), BLOCK)
    old.block(10**6)
    end = old._checkpoints[1][0]
    assert old.key[end - 1 : end] == b" "
    key = old.key[: end - 1] + b"Z" + old.key[end:]  # two words join into one run of word bytes
    cache = ChainCache()
    cache.keep(old)
    resumed, fresh = cache.start(key, BLOCK), PromptBlocks(key, BLOCK)
    assert [resumed.block(i) for i in range(200)] == [fresh.block(i) for i in range(200)]
