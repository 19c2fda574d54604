"""Filters: availability (ready, breaker, already tried) and kv-compat pairing. Table-driven."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pdserve_runtime.router.endpoints import EndpointState
from pdserve_runtime.router.policy.base import PickContext
from pdserve_runtime.router.policy.filter_available import AvailableFilter
from pdserve_runtime.router.policy.filter_kv_compat import KvCompatFilter
from pdserve_runtime.router.tokens import PromptInfo

StateFactory = Callable[..., EndpointState]

PROMPT = PromptInfo(key=b"tsome prompt", block_size=16)


@pytest.mark.parametrize(
    ("candidates", "excluded", "kept"),
    [
        ([("a", {}), ("b", {})], (), ["a", "b"]),
        ([("a", {"ready": False}), ("b", {})], (), ["b"]),
        ([("a", {"ejected": True}), ("b", {})], (), ["b"]),
        ([("a", {}), ("b", {})], ("a",), ["b"]),
        ([("a", {"ejected": True}), ("b", {"ready": False})], (), []),
        ([], (), []),
    ],
)
def test_available_filter(
    make_state: StateFactory, candidates: list[tuple[str, dict[str, Any]]], excluded: tuple[str, ...], kept: list[str]
) -> None:
    states = [make_state(url, **options) for url, options in candidates]
    ctx = PickContext(prompt=PROMPT, excluded=excluded)
    assert [state.url for state in AvailableFilter().filter(ctx, states)] == kept


@pytest.mark.parametrize(
    ("peer_kv", "candidates", "kept"),
    [
        ("NO_PEER", [("a", "x"), ("b", "y")], ["a", "b"]),  # first pick: no pairing constraint yet
        ("x", [("a", "x"), ("b", "y")], ["a"]),
        ("y", [("a", "x"), ("b", "y"), ("c", "y")], ["b", "c"]),
        ("z", [("a", "x")], []),  # mid-rollout: nothing compatible
        (None, [("a", None), ("b", "x")], ["a"]),  # static mode: unlabelled pairs with unlabelled
    ],
)
def test_kv_compat_filter(
    make_state: StateFactory, peer_kv: str | None, candidates: list[tuple[str, str | None]], kept: list[str]
) -> None:
    peer = None if peer_kv == "NO_PEER" else make_state("peer", kv=peer_kv)
    states = [make_state(url, "prefill", kv=kv) for url, kv in candidates]
    ctx = PickContext(prompt=PROMPT, peer=peer)
    assert [state.url for state in KvCompatFilter().filter(ctx, states)] == kept
