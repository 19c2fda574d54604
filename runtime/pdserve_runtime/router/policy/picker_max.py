"""Picker: the highest total score; ties (within a small epsilon) are broken at random.

Random tie-breaking matters at low load, when every engine scores the same: always taking the first would send
every request of an idle period to one engine and leave the others' prefix caches cold.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from pdserve_runtime.router.endpoints import EndpointState

_EPSILON = 1e-9


class MaxScorePicker:
    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def pick(self, candidates: Sequence[EndpointState], totals: Sequence[float]) -> EndpointState:
        best = max(totals)
        top = [state for state, total in zip(candidates, totals, strict=True) if total >= best - _EPSILON]
        return top[0] if len(top) == 1 else self._rng.choice(top)
