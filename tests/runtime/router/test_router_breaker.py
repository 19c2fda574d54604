"""The circuit breaker: ejection after consecutive failures, probing back in."""

from __future__ import annotations

import pytest

from pdserve_runtime.router.breaker import CircuitBreaker


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
