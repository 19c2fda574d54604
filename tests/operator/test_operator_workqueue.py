"""The work queue: dedup, one worker per key, no lost update, backoff."""

from __future__ import annotations

import asyncio

from pdserve_operator.workqueue import WorkQueue


async def test_dedup_and_requeue_while_active() -> None:
    queue: WorkQueue[str] = WorkQueue(base_delay=0.01)
    queue.add("a")
    queue.add("a")
    queue.add("b")
    assert len(queue) == 2
    key = await queue.get()
    assert key == "a"
    queue.add("a")  # changed while being processed: must run again, but not concurrently
    assert len(queue) == 1
    queue.done("a")
    assert len(queue) == 2
    assert await queue.get() == "b"
    assert await queue.get() == "a"


async def test_retry_backs_off_exponentially() -> None:
    queue: WorkQueue[str] = WorkQueue(base_delay=0.01, max_delay=0.04)
    delays = [queue.retry("k") for _ in range(4)]
    assert delays == [0.01, 0.02, 0.04, 0.04]
    assert await asyncio.wait_for(queue.get(), 1) == "k"
    queue.forget("k")
    assert queue.retry("k") == 0.01


async def test_add_after_keeps_the_earliest_timer_of_a_key() -> None:
    """A requeue at a recovery window's end (seconds) must not wait behind a long backoff timer, and a later request
    must not push an earlier one back."""
    queue: WorkQueue[str] = WorkQueue()
    queue.add_after("late-then-early", 30)
    queue.add_after("late-then-early", 0.01)
    queue.add_after("early-then-late", 0.02)
    queue.add_after("early-then-late", 30)
    got = {await asyncio.wait_for(queue.get(), 1), await asyncio.wait_for(queue.get(), 1)}
    assert got == {"late-then-early", "early-then-late"}
    assert len(queue) == 0
