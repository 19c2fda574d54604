"""A per-endpoint circuit breaker: eject an engine after consecutive failures, probe it back in.

States:

- closed: the engine takes traffic; `failure_threshold` consecutive failures open the breaker.
- open: no traffic. Once `open_seconds` have passed since it opened, the router's prober calls the engine's
  health path every `probe_interval_seconds`; `success_threshold` consecutive good probes close it again, a bad
  probe restarts the count (the breaker stays open).

Any success on real traffic resets the failure count, so only an unbroken run of failures ejects an engine:
one flaky answer among many good ones does not. Time is passed in, never read, so tests drive it directly.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class CircuitBreaker:
    """The health memory of one endpoint (mutated only on the event loop thread)."""

    failure_threshold: int = 3
    open_seconds: float = 5.0
    success_threshold: int = 1
    consecutive_failures: int = 0
    consecutive_probe_successes: int = 0
    opened_at: float | None = None

    @property
    def is_open(self) -> bool:
        return self.opened_at is not None

    def allows_traffic(self) -> bool:
        """Whether requests may be routed to this endpoint."""
        return self.opened_at is None

    def record_success(self) -> None:
        """A request to the endpoint succeeded."""
        self.consecutive_failures = 0

    def record_failure(self, now: float, may_open: bool = True) -> bool:
        """A request failed (connect error, 5xx, timeout). Returns True when this failure ejected the endpoint.

        `may_open`: whether the pool can spare the endpoint (`EndpointTable.record_failure` decides); when not,
        failures keep counting and the next one past the threshold may eject it once the pool can.
        """
        self.consecutive_failures += 1
        if self.opened_at is None and may_open and self.consecutive_failures >= self.failure_threshold:
            self.opened_at = now
            self.consecutive_probe_successes = 0
            return True
        return False

    def restore(self) -> None:
        """Close the breaker without a probe: the pool can no longer spare this endpoint (`EndpointTable`)."""
        self.opened_at = None
        self.consecutive_failures = 0
        self.consecutive_probe_successes = 0

    def probe_due(self, now: float) -> bool:
        """Whether the prober should check this endpoint now."""
        return self.opened_at is not None and now - self.opened_at >= self.open_seconds

    def record_probe(self, ok: bool) -> bool:
        """Record a health probe of an open endpoint. Returns True when it closed the breaker."""
        if self.opened_at is None:
            return False
        if not ok:
            self.consecutive_probe_successes = 0
            return False
        self.consecutive_probe_successes += 1
        if self.consecutive_probe_successes >= self.success_threshold:
            self.opened_at = None
            self.consecutive_failures = 0
            self.consecutive_probe_successes = 0
            return True
        return False
