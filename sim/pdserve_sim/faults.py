"""Fault injection: the run-time fault state behind the ``--fault-*`` flags and ``/sim/faults``.

Faults (all off by default):
- ``fail_next`` / ``fail_status``: the next N generation requests get ``fail_status`` with a vLLM error body.
- ``latency_s``: extra delay before each generation request is processed.
- ``stall_after_tokens``: streams stop after K tokens and hang (until the fault is cleared or the client
  goes away); non-streaming requests hang the same way.
- ``disconnect_after_tokens``: streams are cut (the connection is aborted, no [DONE]) after K tokens; with K = 0
  once the first token is computed but before it is sent (a PD decode has pulled its KV by then).
- ``drop_side_channel``: the side channel closes every connection without answering (decode pulls time out).
- ``unready``: ``/health`` answers 503 (the process keeps serving).
- ``crash_after_requests``: the process exits (status 70, no cleanup) when the Nth generation request
  arrives; ``{"crash": true}`` on the admin endpoint exits right after answering.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pdserve_sim.config import FaultConfig

_FIELDS = {
    "fail_next": int,
    "fail_status": int,
    "latency_s": float,
    "stall_after_tokens": int,
    "disconnect_after_tokens": int,
    "drop_side_channel": bool,
    "unready": bool,
    "crash_after_requests": int,
}


class Faults:
    """Mutable fault state shared by the HTTP handlers and the side channel."""

    def __init__(self, initial: FaultConfig) -> None:
        self.fail_next = initial.fail_next
        self.fail_status = initial.fail_status
        self.latency_s = initial.latency_s
        self.stall_after_tokens = initial.stall_after_tokens
        self.disconnect_after_tokens = initial.disconnect_after_tokens
        self.drop_side_channel = initial.drop_side_channel
        self.unready = initial.unready
        self.crash_after_requests = initial.crash_after_requests
        self.requests_seen = 0
        #: /health calls answered: lets a test wait for N health probes (a counted event) instead of sleeping.
        self.health_checks_seen = 0
        #: Set whenever no stall is configured; stalled streams wait on it.
        self.unstalled = asyncio.Event()
        if self.stall_after_tokens is None:
            self.unstalled.set()

    def update(self, changes: dict[str, Any]) -> None:
        """Apply a partial update (``null`` clears optional faults); raises ValueError on bad input."""
        for key, value in changes.items():
            kind = _FIELDS.get(key)
            if kind is None:
                raise ValueError(f"unknown fault {key!r}; known: {', '.join(sorted(_FIELDS))}, crash")
            if value is None and key in ("stall_after_tokens", "disconnect_after_tokens", "crash_after_requests"):
                setattr(self, key, None)
                continue
            if kind is bool:
                if not isinstance(value, bool):
                    raise ValueError(f"{key} must be a boolean")
            elif kind is int:
                if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                    raise ValueError(f"{key} must be a non-negative integer")
            elif isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise ValueError(f"{key} must be a non-negative number")
            if key == "fail_status" and not 400 <= value <= 599:
                raise ValueError("fail_status must be an HTTP error status (400-599)")
            setattr(self, key, kind(value))
        if self.stall_after_tokens is None:
            self.unstalled.set()
        else:
            self.unstalled.clear()

    def clear(self) -> None:
        """Turn every fault off."""
        self.update(
            {
                "fail_next": 0,
                "latency_s": 0.0,
                "stall_after_tokens": None,
                "disconnect_after_tokens": None,
                "drop_side_channel": False,
                "unready": False,
                "crash_after_requests": None,
            }
        )

    def to_dict(self) -> dict[str, Any]:
        """The current fault state."""
        out = {key: getattr(self, key) for key in _FIELDS}
        out["requests_seen"] = self.requests_seen
        out["health_checks_seen"] = self.health_checks_seen
        return out
