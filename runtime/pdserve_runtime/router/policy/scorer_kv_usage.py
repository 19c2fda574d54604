"""Scorer: prefer decode engines with KV-cache headroom, as the engines report it (`vllm:kv_cache_usage_perc`).

Score = 1 - usage, from the engine metrics scraper. An engine without a fresh reading (not scraped yet, scrape
failing, older than `stale_after` seconds) gets the mean score of the engines that have one, so missing data
neither rewards nor punishes it; when no engine has a reading, everyone scores 1 and load decides.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from time import monotonic

from pdserve_runtime.router.endpoints import EndpointState
from pdserve_runtime.router.policy.base import PickContext


class KvCacheHeadroomScorer:
    def __init__(self, stale_after: float, clock: Callable[[], float] = monotonic) -> None:
        self._stale_after = stale_after
        self._clock = clock

    def score(self, ctx: PickContext, candidates: Sequence[EndpointState]) -> list[float]:
        horizon = self._clock() - self._stale_after
        known = [
            None if state.kv_cache_usage is None or state.kv_cache_usage_at < horizon else 1.0 - state.kv_cache_usage
            for state in candidates
        ]
        fresh = [value for value in known if value is not None]
        neutral = sum(fresh) / len(fresh) if fresh else 1.0
        return [neutral if value is None else value for value in known]
