"""Selective disaggregation and the scheduler's plans over a real endpoint table."""

from __future__ import annotations

import random
import time

import pytest

from pdserve.api.router_config import RoutingPolicyConfig
from pdserve_runtime.router.endpoints import Endpoint, EndpointTable
from pdserve_runtime.router.policy.decision import Route
from pdserve_runtime.router.policy.scheduler import Scheduler
from pdserve_runtime.router.prefix import PrefixTracker
from pdserve_runtime.router.tiers import STORE
from pdserve_runtime.router.tokens import TEXT_TAG, PromptInfo

ZONE = "topology.kubernetes.io/zone"


def prompt(blocks: int, extra: int = 0) -> PromptInfo:
    """A text prompt of exactly blocks * 16 + extra tokens (each word is one token)."""
    words = " ".join(f"w{index}" for index in range(blocks * 16 + extra))
    return PromptInfo(key=TEXT_TAG + words.encode(), block_size=16)


def scheduler(
    prefill: list[Endpoint], decode: list[Endpoint], *, threshold: int = 256, **policy: object
) -> tuple[Scheduler, EndpointTable, PrefixTracker]:
    table = EndpointTable()
    table.replace("prefill", prefill)
    table.replace("decode", decode)
    tracker = PrefixTracker()
    config = RoutingPolicyConfig(disaggregation_threshold_tokens=threshold, **policy)
    return Scheduler(table, tracker, config, [ZONE], random.Random(3)), table, tracker


def p(name: str, kv: str | None = None, zone: str | None = None) -> Endpoint:
    return Endpoint(url=f"http://{name}", role="prefill", kv_compat=kv, topology={ZONE: zone} if zone else {})


def d(name: str, kv: str | None = None, zone: str | None = None) -> Endpoint:
    return Endpoint(url=f"http://{name}", role="decode", kv_compat=kv, topology={ZONE: zone} if zone else {})


def test_no_decode_engine_gives_an_empty_plan() -> None:
    sched, _, _ = scheduler([p("p1")], [])
    plan = sched.plan(prompt(40), now=0.0)
    assert plan.decode is None


@pytest.mark.parametrize(
    ("blocks", "route"),
    [(2, Route.DECODE_ONLY), (40, Route.PD)],
)
def test_route_follows_the_prompt_length(blocks: int, route: Route) -> None:
    sched, _, _ = scheduler([p("p1")], [d("d1")])
    plan = sched.plan(prompt(blocks), now=0.0)
    assert plan.route is route
    assert (plan.prefill is not None) is (route is Route.PD)


def test_a_prompt_cached_on_the_decode_engine_skips_prefill() -> None:
    sched, _, tracker = scheduler([p("p1")], [d("d1")])
    tracker.record("http://d1", prompt(40).key, now=0.0)
    plan = sched.plan(prompt(40, extra=5), now=1.0)
    assert plan.route is Route.DECODE_ONLY
    assert plan.uncached_tokens == 5


@pytest.mark.parametrize(("kv_store", "route"), [(True, Route.DECODE_ONLY), (False, Route.PD)])
def test_a_prompt_in_the_store_is_loaded_by_decode_instead_of_prefilled(kv_store: bool, route: Route) -> None:
    sched, _, tracker = scheduler([p("p1")], [d("d1")], kv_store=kv_store)
    tracker.record(STORE, prompt(40).key, now=0.0)  # what a prefill engine wrote to the store
    plan = sched.plan(prompt(40, extra=5), now=1.0)
    assert plan.route is route


@pytest.mark.parametrize(
    ("warm_load", "load_weight", "winner"),
    [
        (0, 1.0, "http://d2"),  # warm and idle: obviously d2
        (3, 1.0, "http://d2"),  # warm but busiest (1 + 0) ties cold but idle (0 + 1): either may win
        (10, 2.0, "http://d1"),  # load weighted double: the idle cold engine wins
    ],
)
def test_decode_choice_balances_prefix_against_load(warm_load: int, load_weight: float, winner: str) -> None:
    sched, table, tracker = scheduler([p("p1")], [d("d1"), d("d2")], decode_load_weight=load_weight)
    tracker.record("http://d2", prompt(40).key, now=0.0)
    {state.url: state for state in table.states("decode")}["http://d2"].in_flight = warm_load
    picks = {sched.plan(prompt(40), now=1.0).decode.url for _ in range(10)}  # type: ignore[union-attr]
    assert winner in picks
    if warm_load != 3:
        assert picks == {winner}


def test_prefill_choice_pairs_kv_compat_and_prefers_the_decode_zone() -> None:
    sched, _, _ = scheduler(
        [p("p-old", kv="v1", zone="a"), p("p-far", kv="v2", zone="b"), p("p-near", kv="v2", zone="a")],
        [d("d1", kv="v2", zone="a")],
    )
    plan = sched.plan(prompt(40), now=0.0)
    assert plan.route is Route.PD
    assert plan.prefill is not None and plan.prefill.url == "http://p-near"


def test_prefill_choice_follows_the_prefix_unless_the_engine_is_loaded() -> None:
    sched, _, tracker = scheduler([p("p1"), p("p2")], [d("d1")])
    tracker.record("http://p2", prompt(40).key, now=0.0)
    plan = sched.plan(prompt(40), now=1.0)
    assert plan.prefill is not None and plan.prefill.url == "http://p2"


def test_mid_rollout_the_decode_pick_moves_to_an_engine_with_a_partner() -> None:
    # d-old has no compatible prefill engine any more; PD traffic must go to d-new.
    sched, _, _ = scheduler([p("p-new", kv="v2")], [d("d-old", kv="v1"), d("d-new", kv="v2")])
    for _ in range(20):
        plan = sched.plan(prompt(40), now=0.0)
        assert plan.route is Route.PD
        assert plan.decode is not None and plan.decode.url == "http://d-new"


def test_no_prefill_engine_means_fallback() -> None:
    sched, table, _ = scheduler([p("p1")], [d("d1")])
    table.states("prefill")[0].breaker.opened_at = 0.0
    plan = sched.plan(prompt(40), now=0.0)
    assert plan.route is Route.FALLBACK
    assert plan.decode is not None and plan.prefill is None


def test_prefix_awareness_can_be_turned_off() -> None:
    sched, _, tracker = scheduler([p("p1")], [d("d1")], prefix_aware=False)
    tracker.record("http://d1", prompt(40).key, now=0.0)
    assert sched.plan(prompt(40), now=1.0).route is Route.PD


def test_engine_reported_kv_usage_steers_decode_choice() -> None:
    sched, table, _ = scheduler([p("p1")], [d("d1"), d("d2")])
    full, empty = table.states("decode")
    full.kv_cache_usage, full.kv_cache_usage_at = 0.95, time.monotonic()
    empty.kv_cache_usage, empty.kv_cache_usage_at = 0.05, time.monotonic()
    assert {sched.plan(prompt(2), now=0.0).decode.url for _ in range(10)} == {"http://d2"}  # type: ignore[union-attr]


@pytest.mark.parametrize(("weight", "steered"), [(0.5, True), (0.0, False)])
def test_the_kv_headroom_weight_is_a_policy_setting(weight: float, steered: bool) -> None:
    sched, table, _ = scheduler([p("p1")], [d("d1"), d("d2")], kv_headroom_weight=weight)
    full, empty = table.states("decode")
    full.kv_cache_usage, full.kv_cache_usage_at = 0.95, time.monotonic()
    empty.kv_cache_usage, empty.kv_cache_usage_at = 0.05, time.monotonic()
    picks = {sched.plan(prompt(2), now=0.0).decode.url for _ in range(40)}  # type: ignore[union-attr]
    assert (picks == {"http://d2"}) is steered


@pytest.mark.parametrize(
    ("holder_in_flight", "other_in_flight", "route", "chosen"),
    [
        (1, 0, Route.DECODE_ONLY, "http://d1"),  # one request more is not worth a full prefill elsewhere
        (5, 1, Route.DECODE_ONLY, "http://d1"),  # within 2x the pick's load, or 4 more
        (6, 1, Route.PD, "http://d2"),  # beyond both: the prefix is not worth piling up on one engine
    ],
)
def test_a_decode_engine_holding_the_prompt_is_kept_unless_much_busier(
    holder_in_flight: int, other_in_flight: int, route: Route, chosen: str
) -> None:
    sched, table, tracker = scheduler([p("p1")], [d("d1"), d("d2")], decode_prefix_weight=0.5)
    long = prompt(40)
    tracker.record("http://d1", long.key, now=0.0)
    holder, other = table.states("decode")
    holder.in_flight, other.in_flight = holder_in_flight, other_in_flight
    # The scored pick alone (load outweighs half-weight affinity) would take d2 and need a prefill.
    assert sched.pick_decode(long, sched.held_by(long, 0.0)) is other
    plan = sched.plan(prompt(40, extra=3), now=0.0)
    assert plan.route is route
    assert plan.decode is not None and plan.decode.url == chosen
