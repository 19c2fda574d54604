"""The max-score picker, the profile that runs filters, weighted scorers and the picker, and the [0, 1] contract every
scorer keeps (checked by the profile and by a property test over the real scorers)."""

from __future__ import annotations

import logging
import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve_runtime.router.breaker import CircuitBreaker
from pdserve_runtime.router.endpoints import Endpoint, EndpointState
from pdserve_runtime.router.policy.base import PickContext, Profile, WeightedScorer
from pdserve_runtime.router.policy.filter_available import AvailableFilter
from pdserve_runtime.router.policy.picker_max import MaxScorePicker
from pdserve_runtime.router.policy.scorer_kv_usage import KvCacheHeadroomScorer
from pdserve_runtime.router.policy.scorer_load import LeastLoadScorer, in_flight_requests, in_flight_tokens
from pdserve_runtime.router.policy.scorer_prefix import PrefixAffinityScorer
from pdserve_runtime.router.policy.scorer_topology import SameTopologyScorer
from pdserve_runtime.router.tokens import Held, PromptInfo

StateFactory = Callable[..., EndpointState]


@pytest.mark.parametrize(
    ("totals", "winner"),
    [([0.1, 0.9, 0.5], "c1"), ([2.0, 1.0], "c0"), ([0.0, 0.0, 3.0], "c2")],
)
def test_picks_the_highest_total(make_state: StateFactory, totals: list[float], winner: str) -> None:
    states = [make_state(f"c{i}") for i in range(len(totals))]
    assert MaxScorePicker(random.Random(1)).pick(states, totals).url == winner


def test_ties_are_spread_at_random(make_state: StateFactory) -> None:
    states = [make_state(f"c{i}") for i in range(3)]
    picker = MaxScorePicker(random.Random(7))
    counts = Counter(picker.pick(states, [1.0, 1.0, 1.0]).url for _ in range(300))
    assert set(counts) == {"c0", "c1", "c2"}
    assert min(counts.values()) > 60


@pytest.mark.parametrize(
    ("load_weight", "prefix_weight", "winner"),
    [
        (1.0, 0.0, "idle"),  # only load counts
        (0.0, 1.0, "warm"),  # only the cache counts
        (1.0, 2.0, "warm"),  # the cache outweighs
        (2.0, 1.0, "idle"),  # load outweighs
    ],
)
def test_profile_combines_weighted_scores(
    make_state: StateFactory, load_weight: float, prefix_weight: float, winner: str
) -> None:
    profile = Profile(
        filters=(AvailableFilter(),),
        scorers=(
            WeightedScorer(LeastLoadScorer(in_flight_requests), load_weight),
            WeightedScorer(PrefixAffinityScorer(), prefix_weight),
        ),
        picker=MaxScorePicker(random.Random(0)),
    )
    states = [make_state("idle", in_flight=0), make_state("warm", in_flight=4), make_state("down", ejected=True)]
    ctx = PickContext(prompt=PromptInfo(key=b"t" + b"x" * 639, block_size=16), held={"warm": Held(640, None)})
    picked = profile.pick(ctx, states)
    assert picked is not None
    assert picked.url == winner


def test_profile_returns_none_when_filters_leave_nothing(make_state: StateFactory) -> None:
    profile = Profile(filters=(AvailableFilter(),), scorers=(), picker=MaxScorePicker())
    ctx = PickContext(prompt=PromptInfo(key=b"tx", block_size=16))
    assert profile.pick(ctx, [make_state("a", ready=False)]) is None


class _Broken:
    """A scorer that breaks the [0, 1] contract: huge for one engine, negative for the next, one score short."""

    def score(self, ctx: PickContext, candidates: Sequence[EndpointState]) -> list[float]:
        return [1000.0, -5.0][: len(candidates) - 1] if len(candidates) > 2 else [1000.0, -5.0]


def test_a_scorer_outside_zero_to_one_is_clamped_and_reported(
    make_state: StateFactory, caplog: pytest.LogCaptureFixture
) -> None:
    profile = Profile(
        filters=(),
        scorers=(
            WeightedScorer(_Broken(), 1.0),
            WeightedScorer(LeastLoadScorer(in_flight_requests), 1.5),
        ),
        picker=MaxScorePicker(random.Random(0)),
    )
    states = [make_state("broken-favourite", in_flight=5), make_state("idle", in_flight=0)]
    ctx = PickContext(prompt=PromptInfo(key=b"tx", block_size=16))
    with caplog.at_level(logging.ERROR, logger="pdserve.router.policy"):
        # Clamped to 1.0, the broken score no longer outweighs the load scorer's 1.5.
        assert profile.pick(ctx, states).url == "idle"  # type: ignore[union-attr]
        assert profile.pick(ctx, [*states, make_state("third", in_flight=9)]) is not None  # one score short
    assert [record.getMessage().split(" scores=")[0] for record in caplog.records] == [
        "Broke the scorer contract scorer=_Broken"
    ]


@settings(max_examples=200, deadline=None)
@given(
    loads=st.lists(st.integers(0, 10**6), min_size=1, max_size=6),
    usages=st.lists(st.none() | st.floats(0, 1), min_size=6, max_size=6),
    held=st.lists(st.integers(0, 5000), min_size=6, max_size=6),
    size=st.integers(1, 5000),
)
def test_every_scorer_keeps_the_contract(
    loads: list[int], usages: list[float | None], held: list[int], size: int
) -> None:
    states = [
        EndpointState(
            endpoint=Endpoint(url=f"e{i}", role="decode", topology={"z": "a" if i % 2 else "b"}),
            breaker=CircuitBreaker(),
            in_flight=load,
            in_flight_tokens=load * 7,
            kv_cache_usage=usages[i],
            kv_cache_usage_at=100.0,
        )
        for i, load in enumerate(loads)
    ]
    prompt = PromptInfo(key=b"t" + b"x" * (size - 1), block_size=16)
    holds = {f"e{i}": Held(min(size, held[i]), None) for i in range(len(loads))}
    ctx = PickContext(prompt=prompt, held=holds, peer=states[0])
    scorers: list[Any] = [
        LeastLoadScorer(in_flight_requests),
        LeastLoadScorer(in_flight_tokens),
        PrefixAffinityScorer(),
        SameTopologyScorer(["z"]),
        KvCacheHeadroomScorer(stale_after=30.0, clock=lambda: 101.0),
    ]
    for scorer in scorers:
        scores = scorer.score(ctx, states)
        assert len(scores) == len(states)
        assert all(0.0 <= value <= 1.0 for value in scores), (type(scorer).__name__, scores)
