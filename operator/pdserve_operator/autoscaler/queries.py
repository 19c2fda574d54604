"""Every PromQL query the autoscaler runs, in one table.

Series labels: the scrape configuration gives every engine and router series the pod's `namespace`, `pod`, its
pool (`pdserve.io/role`: prefill, decode, router) and the PDService it belongs to (`SeriesLabels` names those
labels; the defaults match pdserve's local cluster Prometheus). Each query is a template over:

- `{sel}`: the pool's selector, `namespace="ns",<service>="name",<pool>="prefill",pod=~"a|b|c"`. The pod regex
  lists the pods that exist now (the operator's cache): a deleted pod's series, which Prometheus keeps answering
  for up to five minutes, never count.
- `{w}`: the window of rates and quantiles (`AutoscalerConfig.window_s`), `{q}`: the SLO quantile (0.9 for p90).

Engine metrics are vLLM's (the simulator exports the same names); counters carry `_total`, histograms
`_bucket`. Router metrics are `pdserve_runtime.router.metrics`'. Queries `by (pod)` feed the per-pod samples the
capacity model learns from and the pool sums; `by (le)` quantiles merge the live pods' buckets, as a dashboard
would.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Scope(enum.Enum):
    """Whose series a query reads."""

    ENGINE = "engine"
    ROUTER = "router"


@dataclass(frozen=True, slots=True)
class Query:
    """One PromQL template and why the autoscaler reads it."""

    name: str
    scope: Scope
    promql: str
    #: The result has one series per pod (`by (pod)`), else one series for the whole selection.
    by_pod: bool
    feeds: str
    #: Every engine creates these series at start (at 0): a pod Prometheus scrapes has one whenever the metric
    #: exists, so an answer without it means the metric is missing (renamed, not exported), never zero.
    per_scraped_pod: bool = False

    @property
    def spans_window(self) -> bool:
        """Whether the query reads a range of the window (a rate): a pod has a series only once Prometheus holds
        two of its samples in the window."""
        return "[{w}]" in self.promql


def _rate_by_pod(metric: str, extra: str = "") -> str:
    return f"sum by (pod) (rate({metric}{{{{{{sel}}{extra}}}}}[{{w}}]))"


def _quantile(metric: str, by: str = "le", extra: str = "") -> str:
    return f"histogram_quantile({{q}}, sum by ({by}) (rate({metric}_bucket{{{{{{sel}}{extra}}}}}[{{w}}])))"


QUERIES: tuple[Query, ...] = (
    # ------------------------------------------------------------------------------------------- engine load
    Query(
        "uncached_tokens",
        Scope.ENGINE,
        _rate_by_pod("vllm:prompt_tokens_by_source_total", ',source="local_compute"'),
        True,
        "prompt tokens computed here per second: prefill's load (prefix hits and pulled KV excluded)",
        per_scraped_pod=True,
    ),
    Query(
        "prompt_tokens",
        Scope.ENGINE,
        _rate_by_pod("vllm:prompt_tokens_total"),
        True,
        "prompt tokens of finished requests per second (uncached share, decode's mean context)",
        per_scraped_pod=True,
    ),
    Query(
        "generated_tokens",
        Scope.ENGINE,
        _rate_by_pod("vllm:generation_tokens_total"),
        True,
        "tokens generated per second: decode's load",
        per_scraped_pod=True,
    ),
    Query(
        "requests",
        Scope.ENGINE,
        _rate_by_pod("vllm:request_success_total"),
        True,
        "finished requests per second (tokens per request)",
        per_scraped_pod=True,
    ),
    # --------------------------------------------------------------------------------------- engine gauges
    Query(
        "running",
        Scope.ENGINE,
        "sum by (pod) (vllm:num_requests_running{{{sel}}})",
        True,
        "requests running",
        per_scraped_pod=True,
    ),
    Query(
        "waiting",
        Scope.ENGINE,
        "sum by (pod) (vllm:num_requests_waiting{{{sel}}})",
        True,
        "requests queued (prefill: the backlog whose growth is unserved demand)",
        per_scraped_pod=True,
    ),
    Query(
        "waiting_by_reason",
        Scope.ENGINE,
        "sum by (reason) (vllm:num_requests_waiting_by_reason{{{sel}}})",
        False,
        'why requests wait: "capacity" (no slot or KV blocks: decode demand) or "deferred" (KV still arriving)',
    ),
    Query(
        "kv_usage",
        Scope.ENGINE,
        "avg by (pod) (vllm:kv_cache_usage_perc{{{sel}}})",
        True,
        "KV-cache usage, reported (never a scaling signal: handoffs fill it without load)",
        per_scraped_pod=True,
    ),
    Query(
        "last_scrape",
        Scope.ENGINE,
        "max by (pod) (timestamp(up{{{sel}}} == 1))",
        True,
        "when each pod was last scraped successfully: freshness and completeness",
    ),
    # ----------------------------------------------------------------------------------- engine latencies
    Query(
        "engine_ttft",
        Scope.ENGINE,
        _quantile("vllm:time_to_first_token_seconds"),
        False,
        "prefill: engine time to first token (queue + prefill), prefill's own share of TTFT; decode: slot wait, "
        "KV pull and first step",
    ),
    Query(
        "engine_ttft_by_pod",
        Scope.ENGINE,
        _quantile("vllm:time_to_first_token_seconds", "le, pod"),
        True,
        "prefill's per-pod latency, paired with its load for the capacity model",
    ),
    Query("engine_itl", Scope.ENGINE, _quantile("vllm:inter_token_latency_seconds"), False, "decode step time"),
    Query(
        "engine_itl_by_pod",
        Scope.ENGINE,
        _quantile("vllm:inter_token_latency_seconds", "le, pod"),
        True,
        "decode's per-pod latency, paired with its load for the capacity model",
    ),
    Query(
        "queue_time",
        Scope.ENGINE,
        _quantile("vllm:request_queue_time_seconds"),
        False,
        "decode: waiting for a sequence slot (a TTFT breach caused by decode)",
    ),
    Query(
        "kv_transfer",
        Scope.ENGINE,
        _quantile("vllm:nixl_xfer_time_seconds"),
        False,
        "decode: NIXL pull time of a prompt's KV (a TTFT breach caused by the network)",
    ),
    Query(
        "prompt_length",
        Scope.ENGINE,
        _quantile("vllm:request_prompt_tokens"),
        False,
        "prompt length at the SLO quantile: the prefill time an idle replica needs",
    ),
    # ------------------------------------------------------------------------------------------------ router
    Query(
        "router_ttft",
        Scope.ROUTER,
        _quantile("pdserve_router_time_to_first_token_seconds"),
        False,
        "client-visible TTFT (every hop: router, prefill, KV transfer, decode's first step)",
    ),
    Query(
        "router_ttft_pd",
        Scope.ROUTER,
        _quantile("pdserve_router_time_to_first_token_seconds", extra=',route="pd"'),
        False,
        "client-visible TTFT of disaggregated requests: the ones prefill capacity affects",
    ),
    Query(
        "router_itl",
        Scope.ROUTER,
        _quantile("pdserve_router_inter_token_latency_seconds"),
        False,
        "client-visible inter-token latency",
    ),
    Query(
        "router_requests",
        Scope.ROUTER,
        "sum(rate(pdserve_router_requests_total{{{sel}}}[{w}]))",
        False,
        "finished requests per second, all routes",
    ),
    Query(
        "router_queue",
        Scope.ROUTER,
        "sum by (pool) (pdserve_router_queue_requests{{{sel}}})",
        False,
        "requests waiting in the routers for an engine with room (late binding), per pool: the backlog the engines' "
        "gauges no longer show",
    ),
    Query(
        "router_queue_tokens",
        Scope.ROUTER,
        "sum by (pool) (pdserve_router_queue_prompt_tokens{{{sel}}})",
        False,
        "their uncached prompt tokens: the prefill work waiting in the routers",
    ),
    Query(
        "router_last_scrape",
        Scope.ROUTER,
        "max by (pod) (timestamp(up{{{sel}}} == 1))",
        True,
        "when each router pod was last scraped successfully",
    ),
)

BY_NAME: dict[str, Query] = {query.name: query for query in QUERIES}


def render(query: Query, *, selector: str, window_s: float, quantile: float) -> str:
    """The PromQL text of `query` for one selector."""
    return query.promql.format(sel=selector, w=f"{max(1, round(window_s))}s", q=f"{quantile:g}")
