"""The endpoint table: which engines exist (from discovery) and their live state (from the proxy).

Discovery produces immutable `Endpoint` values and replaces a whole pool at once; the table keeps one mutable
`EndpointState` per URL so that in-flight counters and breaker history survive a rediscovery of the same engine.
An in-flight request holds a reference to its `EndpointState`, so an engine removed mid-request is released
correctly. Everything here runs on the event loop thread; discovery threads hand over via the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlsplit

from pdserve_runtime.router.breaker import CircuitBreaker

log = logging.getLogger("pdserve.router")

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class KvEventSource:
    """Where one engine publisher (an engine, or one data-parallel rank of it) sends and replays its KV events."""

    endpoint: str
    replay_endpoint: str | None = None


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One engine as discovery sees it."""

    url: str
    role: Role
    kv_compat: str | None = None
    topology: Mapping[str, str] = field(default_factory=dict)
    ready: bool = True
    name: str = ""
    # Addresses the engine may advertise as its KV side-channel host (`remote_host`); the URL's host always is.
    addresses: frozenset[str] = frozenset()
    # The engine's KV event publishers (one per data-parallel rank); empty when it publishes none.
    kv_events: tuple[KvEventSource, ...] = ()

    @property
    def label(self) -> str:
        """A short, stable name for logs and metric labels."""
        return self.name or self.url

    @property
    def kv_hosts(self) -> frozenset[str]:
        """Where a decode engine may be told to pull this engine's KV from."""
        host = urlsplit(self.url).hostname or ""
        return self.addresses | {host}


@dataclass(slots=True)
class EndpointState:
    """One engine plus what the router knows about its load and health right now."""

    endpoint: Endpoint
    breaker: CircuitBreaker
    in_flight: int = 0
    in_flight_tokens: int = 0
    errors: int = 0
    # From the engine's own /metrics (decode engines; see engine_metrics): usage in [0, 1] and when it was read.
    kv_cache_usage: float | None = None
    kv_cache_usage_at: float = 0.0
    # The engine's context length (its /v1/models `max_model_len`; see engine_models), None until read.
    max_model_len: int | None = None
    # Requests (and their uncached prompt tokens) the admission gate bound to this engine that have not started
    # yet (`gate.Binding`): counted against the engine's room like requests in flight.
    reserved: int = 0
    reserved_tokens: int = 0
    # Requests the engine itself reports (running + waiting, from its /metrics; see engine_metrics), when it was
    # read, and how many of this router's were in flight then: the difference is someone else's load.
    reported_requests: int | None = None
    reported_at: float = 0.0
    own_at_report: int = 0

    @property
    def url(self) -> str:
        return self.endpoint.url

    @property
    def usable(self) -> bool:
        """Ready in discovery and not ejected by the breaker."""
        return self.endpoint.ready and self.breaker.allows_traffic()

    @contextmanager
    def lease(self, tokens: int = 0) -> Iterator[None]:
        """Count one request (and its uncached prompt tokens) in flight to this engine for the `with` block.

        The one place in-flight counts change: whatever ends the block (an answer, an engine failure, the client
        going away, a bug) releases them.
        """
        self.in_flight += 1
        self.in_flight_tokens += tokens
        try:
            yield
        finally:
            self.in_flight -= 1
            self.in_flight_tokens -= tokens


class EndpointTable:
    """Pools of endpoint states keyed by role and URL."""

    def __init__(
        self,
        *,
        failure_threshold: int = 3,
        open_seconds: float = 5.0,
        success_threshold: int = 1,
        max_ejected_percent: int = 50,
        on_removed: Callable[[str], None] | None = None,
        on_changed: Callable[[], None] | None = None,
    ) -> None:
        self._on_removed = on_removed
        self.on_changed = on_changed
        self._max_ejected_percent = max_ejected_percent
        self._failure_threshold = failure_threshold
        self._open_seconds = open_seconds
        self._success_threshold = success_threshold
        self._pools: dict[Role, dict[str, EndpointState]] = {role: {} for role in ROLES}
        # Snapshots are rebuilt on change so that the per-request path only reads a tuple.
        self._snapshots: dict[Role, tuple[EndpointState, ...]] = {role: () for role in ROLES}
        self.version = 0
        # Called after every change of a pool (the admission gate: a new engine takes waiting requests at once).
        self.listeners: list[Callable[[], None]] = []

    def replace(self, role: Role, endpoints: Iterable[Endpoint]) -> None:
        """Make `endpoints` the whole `role` pool, keeping the live state of URLs already known."""
        old = self._pools[role]
        new: dict[str, EndpointState] = {}
        for endpoint in endpoints:
            state = old.get(endpoint.url)
            if state is None:
                state = EndpointState(endpoint=endpoint, breaker=self._new_breaker())
            else:
                state.endpoint = endpoint
            new[endpoint.url] = state
        self._pools[role] = new
        if self._on_removed is not None:
            for url in old.keys() - new.keys():
                self._on_removed(url)
        self._snapshots[role] = tuple(new.values())
        self._keep_budget(role)
        self.version += 1
        if self.on_changed is not None:
            self.on_changed()  # the KV-event indexes follow the table first: a dispatch pass may route on them
        for listener in self.listeners:
            listener()

    def _keep_budget(self, role: Role) -> None:
        """Undo the ejections the pool's new shape no longer allows (see `record_failure` for the budget).

        The budget is checked when an engine is ejected, but discovery changes the pool afterwards: the one usable
        engine left beside an ejected one starts terminating (its slice says not ready), or a scale-down removes the
        healthy engines and keeps the ejected ones. Left as they were, the ejections would then hold a pool of
        Ready engines out of traffic until their open periods end, every request refused with 503 meanwhile
        (issue 23: decode pods replaced under load). Ready engines come back without a probe, the longest ejected
        first (the closest to its probe), until the pool has a usable engine and no more ejections than its
        budget. Not-ready ones stay ejected: bringing them back would serve nothing.
        """
        pool = self._snapshots[role]
        ejected = sorted(
            (state for state in pool if state.endpoint.ready and not state.breaker.allows_traffic()),
            key=lambda state: state.breaker.opened_at or 0.0,
        )
        for state in ejected:
            if self._within_budget(pool):
                return
            state.breaker.restore()
            log.info("Restored %s endpoint=%s: the pool can no longer spare it (pool=%d usable_now=%d)", role,
                     state.endpoint.label, len(pool), sum(1 for other in pool if other.usable))  # fmt: skip

    def states(self, role: Role) -> tuple[EndpointState, ...]:
        """Every known endpoint of a pool, usable or not."""
        return self._snapshots[role]

    def usable(self, role: Role) -> list[EndpointState]:
        """The endpoints of a pool that may take traffic now."""
        return [state for state in self._snapshots[role] if state.usable]

    def record_failure(self, state: EndpointState, now: float) -> bool:
        """Feed an engine failure to its breaker; True when it ejected the engine.

        An engine is ejected only within the pool's ejection budget (Envoy's max ejection percent): at most
        `max_ejected_percent` of the pool (rounded down, at least one in a pool of two or more) at once, and never
        the last usable engine of the pool. Errors alone must not leave a pool empty: when every engine fails,
        requests keep being tried (and the client gets an error) rather than refused by the router's own memory.
        `replace` keeps the budget when discovery changes the pool afterwards (`_keep_budget`).
        """
        return state.breaker.record_failure(now, may_open=self._may_eject(state))

    def _may_eject(self, state: EndpointState) -> bool:
        pool = self._snapshots[state.endpoint.role]
        ejected = sum(1 for other in pool if not other.breaker.allows_traffic())
        usable_others = sum(1 for other in pool if other is not state and other.usable)
        return ejected < self._budget(len(pool)) and usable_others > 0

    def _budget(self, size: int) -> int:
        """How many engines of a pool of `size` may be ejected at once."""
        if size < 2 or not self._max_ejected_percent:
            return 0
        return max(1, size * self._max_ejected_percent // 100)

    def _within_budget(self, pool: tuple[EndpointState, ...]) -> bool:
        """No more ejections than the budget, and a usable engine whenever some engine is ready."""
        ejected = sum(1 for state in pool if not state.breaker.allows_traffic())
        serving = any(state.usable for state in pool) or not any(state.endpoint.ready for state in pool)
        return ejected <= self._budget(len(pool)) and serving

    def _new_breaker(self) -> CircuitBreaker:
        return CircuitBreaker(
            failure_threshold=self._failure_threshold,
            open_seconds=self._open_seconds,
            success_threshold=self._success_threshold,
        )
