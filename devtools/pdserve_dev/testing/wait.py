"""Polling until something holds: one helper for every test, benchmark and the demo.

Tests wait for a counted event and then assert; these helpers are how they wait. A predicate's exceptions count
as "not yet" (an object that does not exist yet, a connection refused), except AssertionError, which is a
verdict and propagates at once: a retry loop must never swallow a failed assertion.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

T = TypeVar("T")


class WaitTimeoutError(AssertionError):
    """`wait_for` gave up; an AssertionError so pytest shows it as a test failure, not an error."""


def _timeout_message(
    what: str | Callable[[], str], predicate: object, timeout: float, last_error: BaseException | None
) -> str:
    text = what() if callable(what) else what
    detail = f" (last error: {last_error!r})" if last_error is not None else ""
    return f"Timed out after {timeout:.0f}s waiting for {text or predicate!r}{detail}"


def wait_for(
    predicate: Callable[[], T | None],
    timeout: float = 30.0,
    interval: float = 0.2,
    message: str | Callable[[], str] = "",
) -> T:
    """Call `predicate` until it returns something truthy and return that; raise WaitTimeoutError after `timeout`."""
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
        except AssertionError:
            raise
        except Exception as exc:
            last_error = exc
        if time.monotonic() >= deadline:
            raise WaitTimeoutError(_timeout_message(message, predicate, timeout, last_error))
        time.sleep(interval)


def wait_until_none_left(problems: Callable[[], Sequence[str]], timeout: float, interval: float, what: str) -> None:
    """Wait until `problems()` lists nothing (each entry says what still differs from the awaited state); on
    timeout the message says `what` was awaited and what the last call still listed."""
    left: list[str] = []

    def settled() -> bool:
        left[:] = problems()
        return not left

    wait_for(settled, timeout, interval, lambda: f"{what} (still: {'; '.join(left)})")


async def wait_for_async(
    predicate: Callable[[], Awaitable[T | None]],
    within: float = 30.0,
    interval: float = 0.05,
    message: str | Callable[[], str] = "",
) -> T:
    """`wait_for` for a coroutine function, sleeping on the event loop between tries (`within` seconds)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    last_error: BaseException | None = None
    while True:
        try:
            value = await predicate()
            if value:
                return value
        except AssertionError:
            raise
        except Exception as exc:
            last_error = exc
        if loop.time() >= deadline:
            raise WaitTimeoutError(_timeout_message(message, predicate, within, last_error))
        await asyncio.sleep(interval)
