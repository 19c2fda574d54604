"""Request traces for replay: the Azure LLM inference traces (Splitwise, CC-BY 4.0) and a synthetic shape.

A trace is a list of `Request(arrival, prompt, output)` sorted by arrival, in seconds from its start. Replays
are shaped by three factors, always reported with the results:

- a slice `[start_s, start_s + duration_s)` of the original trace;
- time compression `c`: arrival times are divided by `c` (an hour at c = 2 replays in 30 minutes and every
  change of load happens twice as fast, while pods still take as long to start);
- rate scaling `k`: every request becomes floor(k) copies plus one more with probability frac(k), each copy
  shifted by a uniform jitter of up to `jitter_s` (after compression) so copies do not arrive as one burst.
  A copy takes the prompt and output lengths of a request drawn from within `mix_s` (trace time) of the
  original: k times the traffic is k times the users, whose requests are independent. Plain copies would keep
  the small trace's relative noise (one 14k-token prompt becoming k of them in the same second); mixing keeps
  the arrival shape and the local length distribution while the noise shrinks as it does for a bigger
  population.

The total rate multiplier is c x k.
"""

from __future__ import annotations

import bisect
import csv
import gzip
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Request:
    """One request: when it arrives (s), its prompt length and its output length (tokens)."""

    arrival: float
    prompt: int
    output: int


def load_azure(path: str | Path) -> list[Request]:
    """Read an Azure LLM inference trace (TIMESTAMP, ContextTokens, GeneratedTokens), times from its start.

    A path ending in `.gz` is read through gzip (the repository ships the traces compressed, `bench/traces`)."""
    rows: list[tuple[float, int, int]] = []
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", newline="") as handle:
        for row in csv.DictReader(handle):
            stamp = datetime.strptime(row["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f").timestamp()
            rows.append((stamp, max(1, int(row["ContextTokens"])), max(1, int(row["GeneratedTokens"]))))
    rows.sort()
    start = rows[0][0] if rows else 0.0
    return [Request(t - start, prompt, output) for t, prompt, output in rows]


def shape(
    requests: Sequence[Request],
    *,
    start_s: float = 0.0,
    duration_s: float | None = None,
    compression: float = 1.0,
    rate_scale: float = 1.0,
    jitter_s: float = 1.0,
    mix_s: float = 60.0,
    seed: int = 0,
) -> list[Request]:
    """Slice, compress and rate-scale a trace (module docstring)."""
    end = math.inf if duration_s is None else start_s + duration_s
    rng = random.Random(seed)
    whole, frac = int(rate_scale), rate_scale - int(rate_scale)
    times = [r.arrival for r in requests]
    out: list[Request] = []
    for index, request in enumerate(requests):
        if not start_s <= request.arrival < end:
            continue
        base = (request.arrival - start_s) / compression
        copies = whole + (1 if rng.random() < frac else 0)
        low = bisect.bisect_left(times, request.arrival - mix_s)
        high = max(bisect.bisect_right(times, request.arrival + mix_s), index + 1)
        for copy in range(copies):
            if copy == 0:
                out.append(Request(base, request.prompt, request.output))
                continue
            donor = requests[rng.randrange(low, high)]
            out.append(Request(base + rng.random() * jitter_s, donor.prompt, donor.output))
    out.sort(key=lambda r: r.arrival)
    return out


def synthetic(
    *,
    duration_s: float,
    base_rate: float,
    lengths: Sequence[Request],
    seed: int = 0,
) -> list[Request]:
    """A step, a ramp, a sine and a burst in one trace (Poisson arrivals, lengths drawn from `lengths`).

    Shape over the duration D (rate as a multiple of `base_rate`): 0-15% at 1; 15-30% a step to 2; 30-45% a
    ramp back down to 1; 45-80% a sine 1 + 0.5 sin (two periods); 80-85% a burst at 2.5; 85-100% at 1.
    """
    rng = random.Random(seed)

    def rate(t: float) -> float:
        x = t / duration_s
        if x < 0.15:
            return 1.0
        if x < 0.30:
            return 2.0
        if x < 0.45:
            return 2.0 - (x - 0.30) / 0.15
        if x < 0.80:
            return 1.0 + 0.5 * math.sin(2 * math.pi * 2 * (x - 0.45) / 0.35)
        if x < 0.85:
            return 2.5
        return 1.0

    peak = 2.5 * base_rate
    out: list[Request] = []
    t = 0.0
    while True:
        # Thinning (Lewis-Shedler): candidates at the peak rate, kept with probability rate(t) / peak.
        t += rng.expovariate(peak)
        if t >= duration_s:
            break
        if rng.random() * peak <= rate(t) * base_rate:
            sample = lengths[rng.randrange(len(lengths))]
            out.append(Request(t, sample.prompt, sample.output))
    return out


@dataclass(frozen=True, slots=True)
class WindowDemand:
    """Demand of a trace in one window: what sizing for that window has to carry."""

    start_s: float
    requests_per_s: float
    prompt_tokens_per_s: float
    output_tokens_per_s: float
    prompt_tokens_quantile: float


def windows(requests: Sequence[Request], window_s: float, percentile: float = 90) -> list[WindowDemand]:
    """Demand per consecutive window of the (already shaped) trace."""
    if not requests:
        return []
    count = int(requests[-1].arrival // window_s) + 1
    buckets: list[list[Request]] = [[] for _ in range(count)]
    for request in requests:
        buckets[int(request.arrival // window_s)].append(request)
    out: list[WindowDemand] = []
    for index, bucket in enumerate(buckets):
        prompts = sorted(r.prompt for r in bucket)
        quantile = float(prompts[min(len(prompts) - 1, int(len(prompts) * percentile / 100))]) if prompts else 0.0
        out.append(
            WindowDemand(
                index * window_s,
                len(bucket) / window_s,
                sum(r.prompt for r in bucket) / window_s,
                sum(r.output for r in bucket) / window_s,
                quantile,
            )
        )
    return out
