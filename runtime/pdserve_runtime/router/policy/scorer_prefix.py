"""Scorer: prefer the endpoint believed to hold the longest prefix of the prompt, in the fastest tier.

Score = bytes of the prompt key the engine holds (prefix tracker, `PickContext.held`) / bytes of the key, times the
weight of the tier it holds them in (`tiers`: 1 for GPU memory, less for its CPU tier). With a shared KV store, what
the store holds counts for every engine at the store's weight, and an engine scores the better of the two. Bytes
stand in for tokens here: the ratio is what matters, and counting tokens would cost work per token. A common
prefix shorter than one block's worth of bytes (`block_size` tokens at `BYTES_PER_BLOCK_TOKEN` bytes) scores 0:
an engine reuses whole blocks only, so holding less than one is worth nothing. A prompt nobody holds gives
everyone 0.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve_runtime.router.endpoints import EndpointState
from pdserve_runtime.router.policy.base import PickContext
from pdserve_runtime.router.prefix import BYTES_PER_BLOCK_TOKEN
from pdserve_runtime.router.tiers import STORE, TierSource, TierWeights, TrackedTiers
from pdserve_runtime.router.tokens import Held

_GPU_ONLY = TierWeights(cpu=1.0, store=0.0)


class PrefixAffinityScorer:
    def __init__(self, weights: TierWeights = _GPU_ONLY, tiers: TierSource | None = None) -> None:
        self.weights = weights
        self.tiers = tiers or TrackedTiers()

    def score(self, ctx: PickContext, candidates: Sequence[EndpointState]) -> list[float]:
        held = ctx.held
        size = ctx.prompt.size
        if not held or size <= 1:
            return [0.0] * len(candidates)
        least = ctx.prompt.block_size * BYTES_PER_BLOCK_TOKEN
        stored = held.get(STORE)
        everyone = self._worth(STORE, stored, size, least) if stored is not None else 0.0
        scores = []
        for state in candidates:
            entry = held.get(state.url)
            own = self._worth(state.url, entry, size, least) if entry is not None else 0.0
            scores.append(max(own, everyone))
        return scores

    def _worth(self, url: str, entry: Held, size: int, least: int) -> float:
        if entry.common <= least:
            return 0.0
        return entry.common / size * self.weights.of(self.tiers.medium(url, entry))
