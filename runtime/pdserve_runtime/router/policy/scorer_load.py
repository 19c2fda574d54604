"""Scorer: prefer the least loaded endpoint, by a load measure the router itself keeps.

Min-max normalised over the candidates: the least loaded scores 1, the most loaded 0, and when all are equal
everyone scores 1 (load says nothing, let other scorers decide). Relative scoring keeps the weight meaningful
whether engines run 2 or 200 requests. The measure is router-side in-flight work, updated synchronously at pick
time, so a burst of concurrent picks spreads out instead of herding onto the engine that looked idle.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pdserve_runtime.router.endpoints import EndpointState
from pdserve_runtime.router.policy.base import PickContext


def in_flight_requests(state: EndpointState) -> float:
    """Requests the router has sent to the endpoint (or bound to it, about to be sent) and not finished (decode
    load)."""
    return float(state.in_flight + state.reserved)


def in_flight_tokens(state: EndpointState) -> float:
    """Uncached prompt tokens being prefilled on the endpoint, or bound to it (prefill load)."""
    return float(state.in_flight_tokens + state.reserved_tokens)


class LeastLoadScorer:
    def __init__(self, measure: Callable[[EndpointState], float]) -> None:
        self._measure = measure

    def score(self, ctx: PickContext, candidates: Sequence[EndpointState]) -> list[float]:
        loads = [self._measure(state) for state in candidates]
        low, high = min(loads), max(loads)
        if high == low:
            return [1.0] * len(loads)
        span = high - low
        return [(high - load) / span for load in loads]
