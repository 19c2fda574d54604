"""The prefix tracker: longest common prefix per engine over sorted keys, TTL, the memory bound, forgetting."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve_runtime.router.prefix import PrefixTracker, common_prefix_length
from pdserve_runtime.router.tokens import Held


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=60), st.binary(max_size=60), st.binary(max_size=60))
def test_common_prefix_length(shared: bytes, left: bytes, right: bytes) -> None:
    a, b = shared + left, shared + right
    expected = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        expected += 1
    assert common_prefix_length(a, b) == expected == common_prefix_length(b, a)


@pytest.mark.parametrize(
    ("records", "query", "expected"),
    [
        ([], b"tabc", {}),
        ([("a", b"tabc")], b"tabc", {"a": Held(4, None)}),
        ([("a", b"tabc")], b"tabx", {"a": Held(3, ord("c"))}),
        ([("a", b"tabc")], b"txbc", {}),  # only the tag in common: nothing held
        ([("a", b"tabc"), ("b", b"tab")], b"tabcd", {"a": Held(4, None), "b": Held(3, None)}),
        ([("a", b"tazz"), ("a", b"tabc"), ("a", b"tb")], b"tabd", {"a": Held(3, ord("c"))}),  # best neighbour
        ([("a", b"tabc")], b"t", {}),
    ],
)
def test_match_finds_the_longest_common_prefix_per_engine(
    records: list[tuple[str, bytes]], query: bytes, expected: dict[str, Held]
) -> None:
    tracker = PrefixTracker()
    for url, key in records:
        tracker.record(url, key, now=0.0)
    assert tracker.match(query, now=1.0) == expected


@settings(max_examples=100, deadline=None)
@given(st.lists(st.binary(min_size=1, max_size=12), max_size=30), st.binary(max_size=12))
def test_match_equals_a_scan_of_every_key(keys: list[bytes], query: bytes) -> None:
    tracker = PrefixTracker()
    for key in keys:
        tracker.record("e", b"t" + key, now=0.0)
    best = max((common_prefix_length(b"t" + query, b"t" + key) for key in keys), default=0)
    held = tracker.match(b"t" + query, now=0.0)
    assert (held["e"].common if "e" in held else 0) == (best if best > 1 else 0)


def test_a_longer_turn_replaces_the_earlier_one() -> None:
    tracker = PrefixTracker()
    tracker.record("a", b"tturn one", now=0.0)
    tracker.record("a", b"tturn one, turn two", now=1.0)
    assert len(tracker) == 1
    assert tracker.match(b"tturn one, turn two, three", now=2.0) == {"a": Held(19, None)}


def test_entries_older_than_the_ttl_are_ignored() -> None:
    tracker = PrefixTracker(ttl_seconds=10.0)
    tracker.record("old", b"tabc", now=0.0)
    tracker.record("new", b"tabc", now=8.0)
    assert set(tracker.match(b"tabc", now=9.0)) == {"old", "new"}
    assert set(tracker.match(b"tabc", now=15.0)) == {"new"}
    assert len(tracker) == 1


def test_the_least_recently_used_prompts_are_evicted_beyond_the_bound() -> None:
    # One block of 16 tokens at 4 bytes per token: 64 bytes of prompt.
    tracker = PrefixTracker(max_blocks=1, block_size=16)
    tracker.record("a", b"t" + b"x" * 40, now=0.0)
    tracker.record("b", b"t" + b"y" * 40, now=1.0)  # together over 64 bytes: the oldest goes
    assert tracker.remembered_bytes == 41
    assert tracker.match(b"t" + b"x" * 40, now=2.0) == {}
    assert set(tracker.match(b"t" + b"y" * 40, now=2.0)) == {"b"}


def test_forgetting_an_engine_drops_only_its_claims() -> None:
    tracker = PrefixTracker()
    tracker.record("a", b"tabc", now=0.0)
    tracker.record("b", b"tab", now=0.0)
    tracker.forget("a")
    assert tracker.match(b"tabc", now=0.0) == {"b": Held(3, None)}
    assert tracker.remembered_bytes == 3


def test_matching_a_huge_prompt_compares_bytes_not_tokens() -> None:
    """Seven megabytes against a few thousand stored prompts: a couple of binary searches (no per-token work)."""
    tracker = PrefixTracker(max_blocks=10**7)
    system = os.urandom(1 << 20)
    for index in range(2000):
        tracker.record("a", b"t" + system + b"%d" % index, now=0.0)
    big = b"t" + system + b"1999" + os.urandom(6 << 20)
    held = tracker.match(big, now=0.0)
    assert held["a"].common == 1 + len(system) + 4


def test_a_huge_prompt_is_remembered_cut_and_never_flushes_the_others() -> None:
    tracker = PrefixTracker(max_blocks=1000, block_size=16)  # 64 kB of prompts
    tracker.record("a", b"t" + b"small prompt " * 10, now=0.0)
    huge = b"t" + b"word " * 200_000  # 1 MB
    tracker.record("a", huge, now=1.0)
    tracker.record("b", huge, now=1.0)
    assert tracker.remembered_bytes < 64_000
    assert set(tracker.match(b"t" + b"small prompt " * 10, now=2.0)) == {"a"}
    held = tracker.match(huge + b"more", now=2.0)
    cut = held["a"].common
    assert 1_000 < cut < 8_000 and held["a"].stored_next == 0xFF  # a word continues past the cut, as far as is known
