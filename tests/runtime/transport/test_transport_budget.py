"""The body budget as a table of situations (an injected clock): who is charged, who is refused, who gives way."""

from __future__ import annotations

import pytest

from pdserve_runtime.transport.budget import ADDRESS_FULL, TOTAL_FULL, TRICKLING, BodyBudget, Hold

KIB = 1024


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Uploads:
    """Holds on one budget, each remembering the status it was evicted with."""

    def __init__(self, total: int, per_client: int, min_rate: float = 64 * KIB) -> None:
        self.clock = Clock()
        self.budget = BodyBudget(total, per_client, min_rate, clock=self.clock)
        self.evicted: dict[int, int] = {}

    def start(self, client: str) -> Hold:
        holder: list[Hold] = []
        hold = self.budget.hold(client, lambda status: self.evicted.__setitem__(id(holder[0]), status))
        holder.append(hold)
        return hold

    def send(self, hold: Hold, size: int) -> int | None:
        hold.arrived(size, self.clock.now)
        return self.budget.grow(hold, size)

    def status(self, hold: Hold) -> int | None:
        return self.evicted.get(id(hold))


def test_bytes_are_charged_as_they_arrive_and_released_whole() -> None:
    uploads = Uploads(total=1000 * KIB, per_client=100 * KIB)
    hold = uploads.start("10.0.0.1")
    assert uploads.budget.total == 0  # an announced length costs nothing
    assert uploads.send(hold, 40 * KIB) is None
    assert uploads.send(hold, 40 * KIB) is None
    assert (uploads.budget.total, uploads.budget.by_client) == (80 * KIB, {"10.0.0.1": 80 * KIB})
    uploads.budget.shrink(hold, 30 * KIB)
    assert hold.held == 50 * KIB
    uploads.budget.release(hold)
    assert (uploads.budget.total, uploads.budget.by_client) == (0, {})
    uploads.budget.release(hold)  # idempotent
    assert uploads.budget.total == 0


@pytest.mark.parametrize(
    ("per_client", "total", "expected"),
    [(100 * KIB, 1000 * KIB, ADDRESS_FULL), (1000 * KIB, 100 * KIB, TOTAL_FULL)],
    ids=["address", "total"],
)
def test_whole_requests_never_give_way(per_client: int, total: int, expected: int) -> None:
    """Bodies that arrived whole are load (their clients wait for answers): a newcomer is refused instead."""
    uploads = Uploads(total=total, per_client=per_client)
    served = uploads.start("10.0.0.1")
    assert uploads.send(served, 90 * KIB) is None
    served.receiving = False
    newcomer = uploads.start("10.0.0.1")
    assert uploads.send(newcomer, 20 * KIB) == expected
    assert uploads.status(served) is None and served.held == 90 * KIB


def test_stalled_uploads_give_way_to_a_new_request_from_the_same_address() -> None:
    """Eight uploads of 8 MiB that stopped sending do not lock everyone else behind that address out."""
    uploads = Uploads(total=512 * 1024 * KIB, per_client=64 * 1024 * KIB)
    stalled = [uploads.start("10.0.0.1") for _ in range(8)]
    for hold in stalled:
        assert uploads.send(hold, 8 * 1024 * KIB - 1) is None
    uploads.clock.now += 10.0  # they have been quiet for a while
    newcomer = uploads.start("10.0.0.1")
    assert uploads.send(newcomer, 16 * KIB) is None
    given_way = [hold for hold in stalled if uploads.status(hold) is not None]
    assert [uploads.status(hold) for hold in given_way] == [TRICKLING]  # one was enough
    assert given_way[0].held == 0


def test_uploads_above_their_share_give_way_even_while_they_keep_sending() -> None:
    """Fast uploads holding more than their fair share of an address lose it to a request within its share."""
    uploads = Uploads(total=512 * 1024 * KIB, per_client=64 * 1024 * KIB)
    busy = [uploads.start("10.0.0.1") for _ in range(8)]
    for hold in busy:
        assert uploads.send(hold, 8 * 1024 * KIB) is None  # right now: not trickling
    newcomer = uploads.start("10.0.0.1")
    assert uploads.send(newcomer, 16 * KIB) is None
    assert sorted(status for hold in busy if (status := uploads.status(hold)) is not None) == [ADDRESS_FULL]


def test_a_request_beyond_its_own_share_is_refused_rather_than_evicting() -> None:
    uploads = Uploads(total=512 * 1024 * KIB, per_client=64 * 1024 * KIB)
    first = uploads.start("10.0.0.1")
    assert uploads.send(first, 40 * 1024 * KIB) is None
    second = uploads.start("10.0.0.1")
    # 30 MiB more would exceed the address; its share (64 MiB over 2 bodies) is 32 MiB: within it, the first gives way.
    assert uploads.send(second, 30 * 1024 * KIB) is None
    assert uploads.status(first) == ADDRESS_FULL
    third = uploads.start("10.0.0.1")
    assert uploads.send(third, 40 * 1024 * KIB) == ADDRESS_FULL  # beyond its share of 32 MiB: refused
    assert uploads.status(second) is None


def test_the_total_is_shared_by_address() -> None:
    """Across addresses, the address holding more than its share of the total gives way."""
    uploads = Uploads(total=64 * 1024 * KIB, per_client=64 * 1024 * KIB)
    greedy = [uploads.start("10.0.0.1") for _ in range(4)]
    for hold in greedy:
        assert uploads.send(hold, 16 * 1024 * KIB) is None
    other = uploads.start("10.0.0.2")
    assert uploads.send(other, 1024 * KIB) is None
    assert [uploads.status(hold) for hold in greedy].count(TOTAL_FULL) == 1


def test_a_young_upload_is_not_trickling_yet() -> None:
    """The arrival rate needs a window to mean anything: an upload that just started is judged by share only."""
    uploads = Uploads(total=1000 * KIB, per_client=100 * KIB)
    young = uploads.start("10.0.0.1")
    assert uploads.send(young, 99 * KIB) is None
    other = uploads.start("10.0.0.1")
    # Its share is 50 KiB; 60 KiB is beyond it, and the young upload is not trickling: refused.
    assert uploads.send(other, 60 * KIB) == ADDRESS_FULL
    assert uploads.status(young) is None


@pytest.mark.parametrize("quiet", [0.0, 3.0], ids=["keeping-pace", "gone-quiet"])
def test_only_an_upload_that_slowed_down_counts_as_trickling(quiet: float) -> None:
    uploads = Uploads(total=10_000 * KIB, per_client=1000 * KIB, min_rate=64 * KIB)
    upload = uploads.start("10.0.0.1")
    for _ in range(10):
        uploads.clock.now += 0.5
        assert uploads.send(upload, 64 * KIB) is None  # 128 KiB/s
    uploads.clock.now += quiet
    other = uploads.start("10.0.0.1")
    # 600 KiB does not fit beside 640 KiB, and it is more than its share (500 KiB): only a trickler gives way.
    status = uploads.send(other, 600 * KIB)
    if quiet:
        assert (status, uploads.status(upload)) == (None, TRICKLING)
    else:
        assert (status, uploads.status(upload)) == (ADDRESS_FULL, None)
