"""A de-duplicating asyncio work queue of PDService keys, like client-go's workqueue.

Guarantees: a key is processed by at most one worker at a time (so two reconciles of one PDService never race);
a key added while queued is queued once (a burst of pod events costs one reconcile); a key added while being
processed is processed again right after (no lost update). Failed keys come back after an exponential backoff.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class WorkQueue(Generic[K]):
    def __init__(self, base_delay: float = 0.5, max_delay: float = 60.0) -> None:
        self._queue: asyncio.Queue[K] = asyncio.Queue()
        self._queued: set[K] = set()
        self._active: set[K] = set()
        self._dirty: set[K] = set()
        self._failures: dict[K, int] = {}
        self._timers: dict[K, asyncio.TimerHandle] = {}
        self._base, self._max = base_delay, max_delay

    def __len__(self) -> int:
        return len(self._queued)

    def add(self, key: K) -> None:
        if key in self._active:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    def add_after(self, key: K, delay: float) -> None:
        """Add `key` in `delay` seconds. One timer per key: an earlier request replaces a later one, a later
        request leaves an earlier one alone (that pass re-runs the key, which can ask again)."""
        loop = asyncio.get_running_loop()
        timer = self._timers.get(key)
        if timer is not None:
            if timer.when() <= loop.time() + delay:
                return
            timer.cancel()

        def fire() -> None:
            self._timers.pop(key, None)
            self.add(key)

        self._timers[key] = loop.call_later(delay, fire)

    def retry(self, key: K) -> float:
        """Re-queue a failed key after base * 2^failures seconds (capped); returns the delay."""
        failures = self._failures.get(key, 0)
        self._failures[key] = failures + 1
        delay: float = min(self._max, self._base * 2.0**failures)
        self.add_after(key, delay)
        return delay

    def forget(self, key: K) -> None:
        """Reset the backoff of a key that succeeded."""
        self._failures.pop(key, None)

    async def get(self) -> K:
        key = await self._queue.get()
        self._queued.discard(key)
        self._active.add(key)
        return key

    def done(self, key: K) -> None:
        self._active.discard(key)
        if key in self._dirty:
            self._dirty.discard(key)
            self.add(key)
