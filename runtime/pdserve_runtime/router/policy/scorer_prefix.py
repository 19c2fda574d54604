"""Scorer: prefer the endpoint believed to hold the longest prefix of the prompt.

Score = matched prompt blocks / all full prompt blocks, from the router's prefix tracker (`PickContext.
prefix_blocks`). A prompt with no full block gives everyone 0: there is nothing to be affine to.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve_runtime.router.endpoints import EndpointState
from pdserve_runtime.router.policy.base import PickContext


class PrefixAffinityScorer:
    def score(self, ctx: PickContext, candidates: Sequence[EndpointState]) -> list[float]:
        total = len(ctx.prompt.block_hashes)
        if total == 0:
            return [0.0] * len(candidates)
        held = ctx.prefix_blocks
        return [held.get(state.url, 0) / total for state in candidates]
