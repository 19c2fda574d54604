"""The circuit breaker: ejection after consecutive failures, probing back in; the pool's ejection budget; the
one in-flight accounting helper."""

from __future__ import annotations

import asyncio

import pytest

from pdserve_runtime.router.breaker import CircuitBreaker
from pdserve_runtime.router.endpoints import Endpoint, EndpointTable


@pytest.mark.parametrize(
    ("events", "threshold", "expect_open"),
    [
        (["fail", "fail"], 3, False),
        (["fail", "fail", "fail"], 3, True),
        (["fail", "fail", "ok", "fail", "fail"], 3, False),  # a success breaks the run
        (["fail"], 1, True),
        (["ok", "ok"], 1, False),
    ],
)
def test_consecutive_failures_open_the_breaker(events: list[str], threshold: int, expect_open: bool) -> None:
    breaker = CircuitBreaker(failure_threshold=threshold)
    for event in events:
        if event == "fail":
            breaker.record_failure(now=10.0)
        else:
            breaker.record_success()
    assert breaker.is_open is expect_open
    assert breaker.allows_traffic() is not expect_open


def test_record_failure_reports_the_ejecting_failure_once() -> None:
    breaker = CircuitBreaker(failure_threshold=2)
    assert [breaker.record_failure(now=1.0) for _ in range(4)] == [False, True, False, False]


@pytest.mark.parametrize(
    ("opened_at", "now", "open_seconds", "due"),
    [(None, 100.0, 5.0, False), (10.0, 12.0, 5.0, False), (10.0, 15.0, 5.0, True), (10.0, 99.0, 5.0, True)],
)
def test_probe_is_due_only_after_the_open_period(
    opened_at: float | None, now: float, open_seconds: float, due: bool
) -> None:
    breaker = CircuitBreaker(open_seconds=open_seconds, opened_at=opened_at)
    assert breaker.probe_due(now) is due


@pytest.mark.parametrize(
    ("probes", "success_threshold", "closed_after"),
    [
        ([True], 1, 1),
        ([False, True], 1, 2),
        ([True, True], 2, 2),
        ([True, False, True, True], 2, 4),  # a bad probe restarts the count
        ([False, False], 1, None),
    ],
)
def test_good_probes_close_the_breaker(probes: list[bool], success_threshold: int, closed_after: int | None) -> None:
    breaker = CircuitBreaker(failure_threshold=1, success_threshold=success_threshold)
    breaker.record_failure(now=0.0)
    closed_at = None
    for index, ok in enumerate(probes, start=1):
        if breaker.record_probe(ok):
            closed_at = index
    assert closed_at == closed_after
    assert breaker.allows_traffic() is (closed_after is not None)
    if closed_after is not None:
        assert breaker.consecutive_failures == 0  # a fresh start, not one failure from ejection


def _pool(size: int, percent: int = 50) -> EndpointTable:
    table = EndpointTable(failure_threshold=1, max_ejected_percent=percent)
    table.replace("decode", [Endpoint(url=f"http://d{index}", role="decode") for index in range(size)])
    return table


@pytest.mark.parametrize(
    ("size", "percent", "ejected"),
    [
        (1, 50, 0),  # the only engine is never ejected for errors
        (2, 50, 1),
        (3, 50, 1),
        (4, 50, 2),
        (4, 100, 3),  # even at 100 %, the last usable engine stays
        (4, 0, 0),  # ejection off
        (10, 10, 1),
    ],
)
def test_ejection_stays_within_the_pool_budget(size: int, percent: int, ejected: int) -> None:
    table = _pool(size, percent)
    for _ in range(3):
        for state in table.states("decode"):
            table.record_failure(state, now=0.0)
    assert sum(1 for state in table.states("decode") if not state.usable) == ejected


@pytest.mark.parametrize(
    ("pool", "eject", "after", "usable", "still_ejected"),
    [
        # Issue 23's order: d1 ejected beside a usable d0, then d0's pod starts terminating (its slice says not
        # ready). The budget allowed d1's ejection only because d0 was usable; the pool must not be left empty.
        ((2, 50), [1], [(0, False), (1, True)], [1], []),
        # A scale-down removes the healthy engines: one ejection of the two left fits the new budget, the other is
        # undone (the longest ejected, closest to its probe, comes back first).
        ((4, 50), [0, 1], [(0, True), (1, True)], [0], [1]),
        ((4, 100), [0, 1, 2], [(0, True), (1, True), (2, True)], [0], [1, 2]),
        # The pool of one left is never ejected for errors.
        ((2, 50), [1], [(1, True)], [1], []),
        # Still within budget after the change: nothing is undone.
        ((3, 50), [2], [(1, True), (2, True)], [1], [2]),
        ((2, 50), [1], [(0, True), (1, False)], [0], [1]),
        # Restoring a not-ready engine would serve nothing: it stays ejected, the pool waits for discovery.
        ((2, 50), [1], [(0, False), (1, False)], [], [1]),
        # A new engine joining does not undo anything.
        ((2, 50), [1], [(0, True), (1, True), (2, False)], [0], [1]),
    ],
)
def test_the_ejection_budget_holds_as_the_pool_changes(
    pool: tuple[int, int],
    eject: list[int],
    after: list[tuple[int, bool]],
    usable: list[int],
    still_ejected: list[int],
) -> None:
    table = _pool(*pool)  # size, max ejected percent
    states = {state.url: state for state in table.states("decode")}
    for order, index in enumerate(eject):
        assert table.record_failure(states[f"http://d{index}"], now=float(order)), f"d{index} ejected"
    table.replace("decode", [Endpoint(url=f"http://d{index}", role="decode", ready=ready) for index, ready in after])
    assert [state.url for state in table.usable("decode")] == [f"http://d{index}" for index in usable]
    ejected = [state.url for state in table.states("decode") if not state.breaker.allows_traffic()]
    assert ejected == [f"http://d{index}" for index in still_ejected]


def test_the_lease_releases_the_counts_whatever_ends_the_block() -> None:
    state = _pool(1).states("decode")[0]
    with state.lease(tokens=300):
        assert (state.in_flight, state.in_flight_tokens) == (1, 300)
    with pytest.raises(RuntimeError), state.lease(tokens=5):
        raise RuntimeError("an engine failure, a bug")

    async def cancelled() -> None:
        with state.lease(tokens=7):
            await asyncio.sleep(3600)

    async def main() -> None:
        task = asyncio.create_task(cancelled())
        await asyncio.sleep(0)
        assert state.in_flight == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert (state.in_flight, state.in_flight_tokens) == (0, 0)
