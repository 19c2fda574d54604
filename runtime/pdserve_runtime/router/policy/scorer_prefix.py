"""Scorer: prefer the endpoint believed to hold the longest prefix of the prompt.

Score = bytes of the prompt key the engine holds (prefix tracker, `PickContext.held`) / bytes of the key. Bytes
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


class PrefixAffinityScorer:
    def score(self, ctx: PickContext, candidates: Sequence[EndpointState]) -> list[float]:
        held = ctx.held
        size = ctx.prompt.size
        if not held or size <= 1:
            return [0.0] * len(candidates)
        least = ctx.prompt.block_size * BYTES_PER_BLOCK_TOKEN
        scores = []
        for state in candidates:
            entry = held.get(state.url)
            scores.append(entry.common / size if entry is not None and entry.common > least else 0.0)
        return scores
