"""The router's latency histogram buckets, shared by the router and the operator.

The router observes client-visible TTFT and inter-token latency into these buckets
(`pdserve_router_time_to_first_token_seconds`, `pdserve_router_inter_token_latency_seconds`). The SLO burn-rate
alerts count a request as "within target" by reading one of those buckets, the one a PDService's `spec.slo` target
falls in, and the operator names it for them (`pdserve_pdservice_slo_target_seconds{le}`). Both sides must therefore
agree on the bounds, and on how a bound is spelled in the `le` label: hence this module in the shared API.

The bounds follow vLLM's own (`vllm:time_to_first_token_seconds`, `vllm:inter_token_latency_seconds`), with two
finer ones below 10 ms for ITL, so router and engine panels overlay.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

ROUTER_TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0,
)  # fmt: skip
ROUTER_ITL_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip


def slo_bucket(target_seconds: float, bounds: Sequence[float]) -> float:
    """The bucket bound an SLI reads for `target_seconds`: the largest bound not above the target.

    A request counts as within target when it falls in that bucket, so a target between two bounds is judged
    strictly: requests in (bound, target] count as slow, never a slow request as fast. A target below the first
    bound uses the first bound (nothing finer is measured). Targets on a bound are exact.
    """
    index = bisect_right(bounds, target_seconds)
    return bounds[max(index - 1, 0)]


def le_label(bound: float) -> str:
    """A bound as the router's `le` label spells it (`1.0`, `0.25`, `2560.0`: the Python client's formatting, which
    is also how Prometheus 3 normalises classic-histogram `le` values on ingestion). Exact for the bounds above;
    a bound needing an exponent would be spelled differently, and `test_latency_buckets` rejects one."""
    return repr(float(bound))
