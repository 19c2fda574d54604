"""The max-score picker and the profile that runs filters, weighted scorers and the picker."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable

import pytest

from pdserve_runtime.router.endpoints import EndpointState
from pdserve_runtime.router.policy.base import PickContext, Profile, WeightedScorer
from pdserve_runtime.router.policy.filter_available import AvailableFilter
from pdserve_runtime.router.policy.picker_max import MaxScorePicker
from pdserve_runtime.router.policy.scorer_load import LeastLoadScorer, in_flight_requests
from pdserve_runtime.router.policy.scorer_prefix import PrefixAffinityScorer
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
