"""The prefix tracker: leading-block matches per engine, TTL, LRU bound, forgetting engines."""

from __future__ import annotations

import pytest

from pdserve_runtime.router.prefix import PrefixTracker


@pytest.mark.parametrize(
    ("records", "query", "expected"),
    [
        ([], [1, 2, 3], {}),
        ([("a", [1, 2, 3])], [1, 2, 3], {"a": 3}),
        ([("a", [1, 2, 3])], [1, 2, 9], {"a": 2}),
        ([("a", [1, 2, 3])], [9, 2, 3], {}),  # a different first block: no prefix in common
        ([("a", [1, 2, 3]), ("b", [1, 2])], [1, 2, 3, 4], {"a": 3, "b": 2}),
        ([("a", [1]), ("b", [1, 2, 3])], [1, 2, 3], {"a": 1, "b": 3}),
        ([("a", [1, 2, 3])], [], {}),
    ],
)
def test_match_counts_leading_blocks_per_engine(
    records: list[tuple[str, list[int]]], query: list[int], expected: dict[str, int]
) -> None:
    tracker = PrefixTracker()
    for url, blocks in records:
        tracker.record(url, blocks, now=0.0)
    assert tracker.match(query, now=1.0) == expected


def test_entries_older_than_the_ttl_are_ignored() -> None:
    tracker = PrefixTracker(ttl_seconds=10.0)
    tracker.record("old", [1, 2], now=0.0)
    tracker.record("new", [1, 2], now=8.0)
    assert tracker.match([1, 2], now=9.0) == {"old": 2, "new": 2}
    assert tracker.match([1, 2], now=15.0) == {"new": 2}


def test_the_least_recently_used_blocks_are_evicted_beyond_the_bound() -> None:
    tracker = PrefixTracker(max_blocks=3)
    tracker.record("a", [1, 2], now=0.0)
    tracker.record("b", [7, 8], now=1.0)  # block 1 (oldest) goes
    assert len(tracker) == 3
    assert tracker.match([1, 2], now=2.0) == {}
    assert tracker.match([7, 8], now=2.0) == {"b": 2}


def test_forgetting_an_engine_drops_only_its_claims() -> None:
    tracker = PrefixTracker()
    tracker.record("a", [1, 2], now=0.0)
    tracker.record("b", [1], now=0.0)
    tracker.forget("a")
    assert tracker.match([1, 2], now=0.0) == {"b": 1}
