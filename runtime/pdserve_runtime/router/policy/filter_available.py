"""Filter: only endpoints that are ready, not ejected by their circuit breaker, and not yet tried."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve_runtime.router.endpoints import EndpointState
from pdserve_runtime.router.policy.base import PickContext


class AvailableFilter:
    def filter(self, ctx: PickContext, candidates: Sequence[EndpointState]) -> list[EndpointState]:
        excluded = ctx.excluded
        return [state for state in candidates if state.usable and state.url not in excluded]
