"""Fixed-bucket histograms, and quantiles computed exactly as Prometheus' `histogram_quantile` does.

The replay's signals must be the ones the autoscaler would read from Prometheus, so latencies are recorded into
the same bucket boundaries the router and the engines export, windows are differences of cumulative counts
(what `rate(x_bucket[w])` sums to), and quantiles interpolate linearly inside the bucket holding the rank, with
the +Inf bucket answering the largest finite bound (promql/quantile.go, bucketQuantile).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence


class Histogram:
    """Cumulative per-bucket counts (bucket i counts values <= bounds[i]; the last slot is +Inf)."""

    __slots__ = ("bounds", "counts")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float, times: int = 1) -> None:
        """Record `value` `times` times."""
        self.counts[bisect_left(self.bounds, value)] += times

    def snapshot(self) -> tuple[int, ...]:
        """The counts now, to subtract from a later snapshot (a window)."""
        return tuple(self.counts)


def window(now: Sequence[int], before: Sequence[int] | None) -> list[int]:
    """Per-bucket counts observed between two snapshots (`before` None: since the start)."""
    if before is None:
        return list(now)
    return [a - b for a, b in zip(now, before, strict=True)]


def merge(windows: Iterable[Sequence[int]], size: int) -> list[int]:
    """Sum per-bucket counts of several pods (`sum by (le)`)."""
    total = [0] * size
    for counts in windows:
        for index, value in enumerate(counts):
            total[index] += value
    return total


def quantile(q: float, bounds: Sequence[float], counts: Sequence[int]) -> float | None:
    """Prometheus' histogram_quantile over non-cumulative per-bucket `counts`; None when there is no data."""
    observations = sum(counts)
    if observations == 0:
        return None
    rank = q * observations
    cumulative = 0
    for index, count in enumerate(counts):
        if cumulative + count >= rank and count > 0:
            if index == len(bounds):
                return bounds[-1]
            start = 0.0 if index == 0 else bounds[index - 1]
            end = bounds[index]
            return start + (end - start) * ((rank - cumulative) / count)
        cumulative += count
    return bounds[-1]
