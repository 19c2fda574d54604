"""Request-body memory: what every body held costs, in total and per client address, and who gives way when full.

Why this shape: a router holds each request body while it arrives and while it is proxied (retries resend it), and
an anonymous client decides how many bodies arrive, how big and how fast. The budget therefore:

- **charges bytes as they are held, never as announced.** A `Hold` is one body; the connection charges it each
  time its buffer grows (`BodyBudget.grow`) and releases the whole hold when the answer is complete or the
  connection is gone. Headers announcing `Content-Length: 8388608` with no body cost nothing.
- **bounds the total and each client address** (`total`, `per_client`): past either, bytes are refused (503 for
  the total, 429 for an address), as before.
- **does not let one connection lock out others.** Before a growth is refused, bodies still arriving in the same
  scope (the address for its bound, everyone for the total) may be made to give way:

  1. by time: a body whose recent arrival rate (an exponentially decayed average, time constant `_RATE_WINDOW`)
     is below `min_rate` bytes per second, and which has been arriving for longer than that window, trickles:
     it loses its hold first (the connection gets 408), the largest first;
  2. by share: if the growing body (for an address's bound; a connection receives one body at a time) or its
     address (for the total) holds less than its fair share (the bound divided by the bodies or addresses holding
     bytes in that scope), the largest body still arriving among those above their share gives way (429 or 503),
     until the growth fits.

  Bodies that arrived whole (requests being served) never give way: they are load, not an attack, and the
  client is waiting for their answers. So behind one address (an ingress, SNAT) eight stalled 8 MiB uploads
  cannot refuse everyone else: a new request takes its fair share from them.

Everything runs on the event loop thread. Evicting is a callback into the connection, which answers and closes
synchronously (releasing the hold), so the freed bytes are there when `grow` continues.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

# Time constant of the arrival-rate average, and the least age before a body can count as trickling.
_RATE_WINDOW = 1.0

# What a refused or evicted hold is answered with (HTTP status).
TRICKLING, ADDRESS_FULL, TOTAL_FULL = 408, 429, 503


class Hold:
    """The bytes one request body holds, and how fast they have been arriving."""

    __slots__ = ("_evict", "client", "held", "rate", "receiving", "stamp", "started")

    def __init__(self, client: str, now: float, evict: Callable[[int], None] | None) -> None:
        self.client = client
        self.held = 0
        self.receiving = True  # still arriving: only such bodies ever give way
        self.rate = 0.0  # bytes per second, decayed average
        self.stamp = now
        self.started = now
        self._evict = evict

    def recent_rate(self, now: float) -> float:
        return self.rate * math.exp(-(now - self.stamp) / _RATE_WINDOW)

    def arrived(self, size: int, now: float) -> None:
        """`size` body bytes came in at `now` (whether or not they grew the buffer)."""
        self.rate = self.recent_rate(now) + size / _RATE_WINDOW
        self.stamp = now

    def evict(self, status: int) -> None:
        evict, self._evict = self._evict, None
        if evict is not None:
            evict(status)

    def forget(self) -> None:
        """Drop the eviction callback: a released hold no longer keeps its connection alive."""
        self._evict = None


class BodyBudget:
    """Bytes of request bodies held, in total and per client address (see the module docstring)."""

    def __init__(
        self, total: int, per_client: int, min_rate: float, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.total_limit = total
        self.per_client_limit = per_client
        self.min_rate = min_rate
        self.clock = clock
        self.total = 0
        self.by_client: dict[str, int] = {}
        self._holds: dict[str, set[Hold]] = {}  # holds with bytes, by address

    def hold(self, client: str, evict: Callable[[int], None] | None = None) -> Hold:
        """A new, empty hold for one body; `evict(status)` is called if it has to give way."""
        return Hold(client, self.clock(), evict)

    def grow(self, hold: Hold, size: int) -> int | None:
        """Charge `size` more bytes to `hold`; None when granted, else the HTTP status to refuse with."""
        if size <= 0:
            return None
        client = hold.client
        if self.by_client.get(client, 0) + size > self.per_client_limit and not self._make_room(hold, size, True):
            return ADDRESS_FULL
        if self.total + size > self.total_limit and not self._make_room(hold, size, False):
            return TOTAL_FULL
        self.by_client[client] = self.by_client.get(client, 0) + size
        self.total += size
        if not hold.held:
            self._holds.setdefault(client, set()).add(hold)
        hold.held += size
        return None

    def shrink(self, hold: Hold, size: int) -> None:
        """Give back `size` of the bytes `hold` has (a buffer replaced by a larger one)."""
        size = min(size, hold.held)
        if size <= 0:
            return
        hold.held -= size
        client = hold.client
        left = self.by_client.get(client, 0) - size
        if left > 0:
            self.by_client[client] = left
        else:
            self.by_client.pop(client, None)
        self.total -= size
        if not hold.held:
            holds = self._holds.get(client)
            if holds is not None:
                holds.discard(hold)
                if not holds:
                    del self._holds[client]

    def release(self, hold: Hold) -> None:
        """Everything `hold` has goes back (its answer is complete, or its connection is gone)."""
        hold.receiving = False
        hold.forget()
        self.shrink(hold, hold.held)

    # -- giving way ------------------------------------------------------------------------------------

    def _make_room(self, hold: Hold, size: int, per_client: bool) -> bool:
        """Evict bodies still arriving in the scope until `size` more fits for `hold`; False if it cannot."""
        now = self.clock()
        for slow in self._trickling(hold, per_client, now):
            self._evict(slow, TRICKLING)
            if self._fits(hold, size, per_client):
                return True
        while not self._fits(hold, size, per_client):
            victim = self._over_share(hold, size, per_client)
            if victim is None:
                return False
            self._evict(victim, ADDRESS_FULL if per_client else TOTAL_FULL)
        return True

    def _evict(self, victim: Hold, status: int) -> None:
        victim.evict(status)  # the connection answers and closes, which releases the hold
        self.release(victim)  # (and if it could not, the bytes are not counted twice: releasing is idempotent)

    def _fits(self, hold: Hold, size: int, per_client: bool) -> bool:
        if per_client:
            return self.by_client.get(hold.client, 0) + size <= self.per_client_limit
        return self.total + size <= self.total_limit

    def _scope(self, hold: Hold, per_client: bool) -> list[Hold]:
        if per_client:
            return list(self._holds.get(hold.client, ()))
        return [other for holds in self._holds.values() for other in holds]

    def _trickling(self, hold: Hold, per_client: bool, now: float) -> list[Hold]:
        """Bodies in the scope arriving slower than `min_rate` (and old enough to tell), largest first."""
        slow = [
            other
            for other in self._scope(hold, per_client)
            if other is not hold
            and other.receiving
            and now - other.started >= _RATE_WINDOW
            and other.recent_rate(now) < self.min_rate
        ]
        return sorted(slow, key=lambda other: other.held, reverse=True)

    def _over_share(self, hold: Hold, size: int, per_client: bool) -> Hold | None:
        """The largest arriving body above its fair share, if `hold` is within its own; else None.

        Shares are per connection within an address's bound and per address within the total (the share of an
        address is what all of its connections hold)."""
        scope = self._scope(hold, per_client)
        if per_client:
            holders = {id(other) for other in scope} | {id(hold)}
            share = self.per_client_limit // len(holders)
            if hold.held + size > share:
                return None
            candidates = [other for other in scope if other is not hold and other.receiving and other.held > share]
        else:
            addresses = set(self.by_client) | {hold.client}
            share = self.total_limit // len(addresses)
            if self.by_client.get(hold.client, 0) + size > share:
                return None
            candidates = [
                other
                for other in scope
                if other.client != hold.client and other.receiving and self.by_client.get(other.client, 0) > share
            ]
        return max(candidates, key=lambda other: other.held, default=None)
