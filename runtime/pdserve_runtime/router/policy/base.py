"""The plugin interfaces and the profile that runs them.

A profile pick is: apply the filters in order (each may only remove candidates); if one candidate is left, take
it; otherwise sum each scorer's [0, 1] scores times its weight, and let the picker choose by total. Scorers see
the whole candidate list at once because the useful ones are relative (least loaded *among these*).

The [0, 1] contract is what makes weights comparable, so the profile checks it on every pick: a score outside it
(or a wrong number of scores) is a plugin bug, logged once per scorer and clamped, so one broken plugin cannot
outweigh the others by orders of magnitude.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdserve_runtime.router.endpoints import EndpointState
from pdserve_runtime.router.tokens import Held, PromptInfo


@dataclass(frozen=True, slots=True)
class PickContext:
    """Everything a plugin may look at besides the candidates."""

    prompt: PromptInfo
    # What each engine URL is believed to hold of the prompt (prefix tracker); absent = nothing.
    held: Mapping[str, Held] = field(default_factory=dict)
    # The endpoint already chosen on the other side (the decode engine when picking prefill, or the prefill
    # engine holding the KV when re-picking decode): pairing filters and topology scorers use it.
    peer: EndpointState | None = None
    # URLs already tried for this request; retries go elsewhere.
    excluded: Collection[str] = ()


class Filter(Protocol):
    """Removes candidates that must not be chosen."""

    def filter(self, ctx: PickContext, candidates: Sequence[EndpointState]) -> list[EndpointState]: ...


class Scorer(Protocol):
    """Rates every candidate in [0, 1]; higher is better. Returns one score per candidate, in order."""

    def score(self, ctx: PickContext, candidates: Sequence[EndpointState]) -> list[float]: ...


class Picker(Protocol):
    """Chooses one candidate given total scores (same order)."""

    def pick(self, candidates: Sequence[EndpointState], totals: Sequence[float]) -> EndpointState: ...


log = logging.getLogger("pdserve.router.policy")
_reported: set[str] = set()


def checked_scores(scorer: Scorer, scores: Sequence[float], count: int) -> list[float]:
    """`scores` held to the Scorer contract: `count` values in [0, 1] (NaN and missing values count as 0)."""
    fixed = [min(1.0, max(0.0, value)) if not math.isnan(value) else 0.0 for value in scores[:count]]
    fixed += [0.0] * (count - len(fixed))
    if len(scores) != count or fixed != list(scores):
        name = type(scorer).__name__
        if name not in _reported:
            _reported.add(name)
            log.error("Broke the scorer contract scorer=%s scores=%s candidates=%d (clamped to [0, 1])", name,
                      list(scores)[:8], count)  # fmt: skip
    return fixed


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    scorer: Scorer
    weight: float


@dataclass(frozen=True, slots=True)
class Profile:
    """Filters, weighted scorers and a picker: one way of choosing an endpoint of one pool."""

    filters: Sequence[Filter]
    scorers: Sequence[WeightedScorer]
    picker: Picker

    def pick(self, ctx: PickContext, candidates: Sequence[EndpointState]) -> EndpointState | None:
        remaining = list(candidates)
        for plugin in self.filters:
            remaining = plugin.filter(ctx, remaining)
            if not remaining:
                return None
        if len(remaining) == 1:
            return remaining[0]
        totals = [0.0] * len(remaining)
        for weighted in self.scorers:
            if weighted.weight == 0:
                continue
            scores = weighted.scorer.score(ctx, remaining)
            for index, value in enumerate(checked_scores(weighted.scorer, scores, len(remaining))):
                totals[index] += weighted.weight * value
        return self.picker.pick(remaining, totals)
