"""The endpoint table: which engines exist (from discovery) and their live state (from the proxy).

Discovery produces immutable `Endpoint` values and replaces a whole pool at once; the table keeps one mutable
`EndpointState` per URL so that in-flight counters and breaker history survive a rediscovery of the same engine.
An in-flight request holds a reference to its `EndpointState`, so an engine removed mid-request is released
correctly. Everything here runs on the event loop thread; discovery threads hand over via the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from pdserve_runtime.router.breaker import CircuitBreaker

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One engine as discovery sees it."""

    url: str
    role: Role
    kv_compat: str | None = None
    topology: Mapping[str, str] = field(default_factory=dict)
    ready: bool = True
    name: str = ""

    @property
    def label(self) -> str:
        """A short, stable name for logs and metric labels."""
        return self.name or self.url


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

    @property
    def url(self) -> str:
        return self.endpoint.url

    @property
    def usable(self) -> bool:
        """Ready in discovery and not ejected by the breaker."""
        return self.endpoint.ready and self.breaker.allows_traffic()


class EndpointTable:
    """Pools of endpoint states keyed by role and URL."""

    def __init__(
        self,
        *,
        failure_threshold: int = 3,
        open_seconds: float = 5.0,
        success_threshold: int = 1,
        on_removed: Callable[[str], None] | None = None,
    ) -> None:
        self._on_removed = on_removed
        self._failure_threshold = failure_threshold
        self._open_seconds = open_seconds
        self._success_threshold = success_threshold
        self._pools: dict[Role, dict[str, EndpointState]] = {role: {} for role in ROLES}
        # Snapshots are rebuilt on change so that the per-request path only reads a tuple.
        self._snapshots: dict[Role, tuple[EndpointState, ...]] = {role: () for role in ROLES}
        self.version = 0

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
        self.version += 1

    def states(self, role: Role) -> tuple[EndpointState, ...]:
        """Every known endpoint of a pool, usable or not."""
        return self._snapshots[role]

    def usable(self, role: Role) -> list[EndpointState]:
        """The endpoints of a pool that may take traffic now."""
        return [state for state in self._snapshots[role] if state.usable]

    def _new_breaker(self) -> CircuitBreaker:
        return CircuitBreaker(
            failure_threshold=self._failure_threshold,
            open_seconds=self._open_seconds,
            success_threshold=self._success_threshold,
        )
