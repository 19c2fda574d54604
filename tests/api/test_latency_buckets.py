"""The router's latency buckets and their `le` spelling, shared by the router and the operator's SLO metrics."""

from __future__ import annotations

from prometheus_client.utils import floatToGoString

from pdserve.api.latency_buckets import ROUTER_ITL_BUCKETS, ROUTER_TTFT_BUCKETS, le_label, slo_bucket


def test_le_label_is_how_the_router_spells_each_bound() -> None:
    for bound in ROUTER_TTFT_BUCKETS + ROUTER_ITL_BUCKETS:
        assert le_label(bound) == floatToGoString(bound)  # type: ignore[no-untyped-call]


def test_bounds_are_sorted_and_distinct() -> None:
    for bounds in (ROUTER_TTFT_BUCKETS, ROUTER_ITL_BUCKETS):
        assert list(bounds) == sorted(set(bounds))


def test_slo_bucket_is_the_largest_bound_not_above_the_target() -> None:
    bounds = (0.1, 0.25, 0.5, 1.0)
    assert [slo_bucket(t, bounds) for t in (0.05, 0.1, 0.2, 0.25, 0.8, 1.0, 7.0)] == [
        0.1,
        0.1,
        0.1,
        0.25,
        0.5,
        1.0,
        1.0,
    ]
