"""CrashLoopBackOff: how long a container that exited waits before it is started again.

The kubelet restarts a container immediately after its first exit, then waits 10 s, 20 s, 40 s, ... up to
5 minutes. A container that ran for 10 minutes (twice the cap) before exiting starts the sequence over.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CrashBackoff:
    """Exponential restart delay for one container (pure: the caller supplies durations)."""

    initial: float = 10.0
    cap: float = 300.0
    _current: float | None = None

    def next_delay(self, ran_for: float) -> float:
        """The delay before restarting a container that just exited after running ``ran_for`` seconds."""
        if ran_for >= 2 * self.cap:
            self._current = None
        if self._current is None:
            self._current = self.initial
            return 0.0
        delay = self._current
        self._current = min(self._current * 2, self.cap)
        return delay
