"""Scorers: least load, prefix affinity, same topology; each returns [0, 1] per candidate. Table-driven."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pdserve_runtime.router.endpoints import EndpointState
from pdserve_runtime.router.policy.base import PickContext
from pdserve_runtime.router.policy.scorer_load import LeastLoadScorer, in_flight_requests, in_flight_tokens
from pdserve_runtime.router.policy.scorer_prefix import PrefixAffinityScorer
from pdserve_runtime.router.policy.scorer_topology import SameTopologyScorer
from pdserve_runtime.router.tiers import STORE, Medium, TierWeights
from pdserve_runtime.router.tokens import Held, PromptInfo

StateFactory = Callable[..., EndpointState]

ZONE = "topology.kubernetes.io/zone"
RACK = "example.com/rack"


def prompt(size: int) -> PromptInfo:
    """A prompt whose key is `size` bytes long (the tag included)."""
    return PromptInfo(key=b"t" + b"x" * (size - 1), block_size=16)


@pytest.mark.parametrize(
    ("loads", "expected"),
    [
        ([0, 0, 0], [1.0, 1.0, 1.0]),  # equal load says nothing
        ([0, 10], [1.0, 0.0]),
        ([2, 4, 6], [1.0, 0.5, 0.0]),
        ([5], [1.0]),
        ([100, 101], [1.0, 0.0]),  # relative: one more request is the whole range
    ],
)
def test_least_in_flight_requests(make_state: StateFactory, loads: list[int], expected: list[float]) -> None:
    states = [make_state(f"d{i}", in_flight=load) for i, load in enumerate(loads)]
    scores = LeastLoadScorer(in_flight_requests).score(PickContext(prompt=prompt(16)), states)
    assert scores == pytest.approx(expected)


def test_least_in_flight_tokens_measures_prefill_work(make_state: StateFactory) -> None:
    states = [
        make_state("p0", "prefill", in_flight=9, tokens=100),
        make_state("p1", "prefill", in_flight=1, tokens=4000),
    ]
    assert LeastLoadScorer(in_flight_tokens).score(PickContext(prompt=prompt(16)), states) == [1.0, 0.0]


@pytest.mark.parametrize(
    ("size", "held", "expected"),
    [
        (400, {}, [0.0, 0.0]),
        (400, {"e0": 400}, [1.0, 0.0]),
        (400, {"e0": 100, "e1": 300}, [0.25, 0.75]),
        (1, {"e0": 1}, [0.0, 0.0]),  # an empty prompt: nothing to be affine to
        (400, {"e0": 60, "e1": 70}, [0.0, 0.175]),  # less than a block (16 tokens at 4 bytes) is worth nothing
    ],
)
def test_prefix_affinity(make_state: StateFactory, size: int, held: dict[str, int], expected: list[float]) -> None:
    states = [make_state("e0"), make_state("e1")]
    ctx = PickContext(prompt=prompt(size), held={url: Held(common, None) for url, common in held.items()})
    assert PrefixAffinityScorer().score(ctx, states) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("labels", "peer", "candidates", "expected"),
    [
        ([ZONE], None, [{ZONE: "a"}], [0.0]),
        ([ZONE], {ZONE: "a"}, [{ZONE: "a"}, {ZONE: "b"}, {}], [1.0, 0.0, 0.0]),
        ([ZONE, RACK], {ZONE: "a", RACK: "r1"}, [{ZONE: "a", RACK: "r1"}, {ZONE: "a", RACK: "r2"}], [1.0, 0.5]),
        ([ZONE], {}, [{ZONE: "a"}], [0.0]),  # the peer has no domain: no preference
        ([], {ZONE: "a"}, [{ZONE: "a"}], [0.0]),
    ],
)
def test_same_topology(
    make_state: StateFactory,
    labels: list[str],
    peer: dict[str, str] | None,
    candidates: list[dict[str, str]],
    expected: list[float],
) -> None:
    peer_state = None if peer is None else make_state("d", topology=peer)
    states = [make_state(f"p{i}", "prefill", topology=topology) for i, topology in enumerate(candidates)]
    ctx = PickContext(prompt=prompt(16), peer=peer_state)
    assert SameTopologyScorer(labels).score(ctx, states) == pytest.approx(expected)


class _CpuTier:
    """A tier source that says e1's prefix sits in its CPU tier (what a KV-event index reports)."""

    def medium(self, url: str, held: Held) -> Medium:
        return Medium.STORE if url == STORE else Medium.CPU if url == "e1" else Medium.GPU


@pytest.mark.parametrize(
    ("held", "expected"),
    [
        # The store's prefix counts for every engine at the store's weight; an engine's own GPU prefix at 1.
        ({STORE: 400}, [0.25, 0.25]),
        ({STORE: 400, "e0": 400}, [1.0, 0.25]),
        ({STORE: 400, "e0": 40}, [0.25, 0.25]),  # own prefix below a block: the store's is what counts
        # A CPU-tier prefix is worth the CPU weight: more than the store's, less than GPU memory.
        ({"e0": 200, "e1": 400}, [0.5, 0.5]),
        ({STORE: 400, "e1": 400}, [0.25, 0.5]),
    ],
)
def test_prefix_affinity_weighs_the_tier(make_state: StateFactory, held: dict[str, int], expected: list[float]) -> None:
    states = [make_state("e0"), make_state("e1")]
    ctx = PickContext(prompt=prompt(400), held={url: Held(common, None) for url, common in held.items()})
    scorer = PrefixAffinityScorer(TierWeights(cpu=0.5, store=0.25), _CpuTier())
    assert scorer.score(ctx, states) == pytest.approx(expected)
