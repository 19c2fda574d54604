"""The Grafana dashboard for PD serving, generated: `python -m pdserve_dev.dashboard` writes the chart's copy.

The chart ships `charts/pdserve/files/monitoring/dashboard.json` (a ConfigMap for Grafana's dashboard sidecar); this
module is where it is written, the way kubernetes-mixin writes its dashboards in jsonnet: every panel's PromQL in one
readable table, the selectors and the grid computed instead of copied 30 times. A test fails when the checked-in
JSON differs from `dashboard()`, and the monitoring cluster test runs every expression in it against the local
cluster's Prometheus while load runs.

Series and labels (the same under the local cluster's Prometheus and the chart's PodMonitor/ServiceMonitor):
engine and router series carry `namespace`, `pod`, `pool` (prefill, decode, router) and `pdservice`; the
operator's `pdserve_pdservice_*` and `pdserve_autoscaler_*` series carry the PDService's `namespace` and
`pdservice` themselves. Template variables: `datasource`, `namespace`, `pdservice` (both multi-valued, default
all) and `pool` (the engine pools the engine panels show). Panels aggregate `by (namespace, pdservice, ...)` so
several PDServices never blend.

SLO targets reach PromQL through the operator (`pdserve_pdservice_slo_target_seconds{kind,le}` and
`pdserve_pdservice_slo_objective_ratio`, `pdserve_operator.service_metrics`): quantile panels draw the target beside
the quantiles, and the "within target" panel counts requests in the target's router bucket against the objective,
the SLI the chart's burn-rate alerts use.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHART_COPY = Path(__file__).resolve().parents[2] / "charts" / "pdserve" / "files" / "monitoring" / "dashboard.json"

UID = "pdserve-pd-serving"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

SVC = 'namespace=~"$namespace", pdservice=~"$pdservice"'
"""Selector of the chosen PDServices."""
ENGINES = SVC + ', pool=~"$pool"'
"""Selector of the chosen engine pools of the chosen PDServices."""
RATE = "$__rate_interval"
BY = "namespace, pdservice"


@dataclass(frozen=True)
class Target:
    expr: str
    legend: str
    instant: bool = False


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    targets: tuple[Target, ...]
    unit: str = "short"
    kind: str = "timeseries"
    width: int = 8
    stack: bool = False
    #: Series whose display name matches are drawn dashed: targets and objectives beside what is measured.
    dashed: str | None = None


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...] = field(default_factory=tuple)


def quantiles(metric: str, selector: str, by: str, legend: str) -> tuple[Target, ...]:
    """p50, p90 and p99 of a histogram `metric` (without `_bucket`), merged over pods and routes."""
    return tuple(
        Target(
            f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{{{selector}}}[{RATE}])))",
            f"{legend} p{round(q * 100)}",
        )
        for q in (0.5, 0.9, 0.99)
    )


def within_target(metric: str, kind: str, window: str = RATE) -> str:
    """Share of observations of router histogram `metric` in the bucket of the PDService's `kind` target."""
    return (
        f"sum by ({BY}) (rate({metric}_bucket{{{SVC}}}[{window}]) "
        f'and on (namespace, pdservice, le) pdserve_pdservice_slo_target_seconds{{kind="{kind}"}}) '
        f"/ sum by ({BY}) (rate({metric}_count{{{SVC}}}[{window}]))"
    )


def burn_rate(metric: str, kind: str) -> str:
    """The 1h burn rate: the share over target divided by the error budget (the alerts' recording rule, inline so
    the dashboard works without the PrometheusRule)."""
    budget = f"(1 - max by ({BY}) (pdserve_pdservice_slo_objective_ratio{{{SVC}}}))"
    return f"(1 - ({within_target(metric, kind, '1h')})) / on (namespace, pdservice) {budget}"


TTFT = "pdserve_router_time_to_first_token_seconds"
ITL = "pdserve_router_inter_token_latency_seconds"

ROWS: tuple[Row, ...] = (
    Row(
        "Service level: what clients see at the router, against spec.slo",
        (
            Panel(
                "Time to first token vs target",
                "Client-visible TTFT (router: prefill, KV transfer, decode's first step and the router itself), "
                "p50/p90/p99 over every route, and spec.slo.ttftMilliseconds (dashed).",
                (
                    *quantiles(TTFT, SVC, BY, "{{pdservice}}"),
                    Target(
                        f'max by ({BY}) (pdserve_pdservice_slo_target_seconds{{{SVC}, kind="ttft"}})',
                        "{{pdservice}} target",
                    ),
                ),
                unit="s",
                dashed=".* target",
            ),
            Panel(
                "Inter-token latency vs target",
                "Gaps between the chunks the router relays, p50/p90/p99, and spec.slo.itlMilliseconds (dashed).",
                (
                    *quantiles(ITL, SVC, BY, "{{pdservice}}"),
                    Target(
                        f'max by ({BY}) (pdserve_pdservice_slo_target_seconds{{{SVC}, kind="itl"}})',
                        "{{pdservice}} target",
                    ),
                ),
                unit="s",
                dashed=".* target",
            ),
            Panel(
                "Requests within target vs objective",
                "The SLI: share of requests (ITL: of gaps) in the router histogram bucket of the target, against the "
                "objective (spec.slo.percentile, dashed). Targets between two buckets are judged at the lower one.",
                (
                    Target(within_target(TTFT, "ttft"), "{{pdservice}} TTFT"),
                    Target(within_target(ITL, "itl"), "{{pdservice}} ITL"),
                    Target(
                        f"max by ({BY}) (pdserve_pdservice_slo_objective_ratio{{{SVC}}})", "{{pdservice}} objective"
                    ),
                ),
                unit="percentunit",
                dashed=".* objective",
            ),
            Panel(
                "Error budget burn rate (1h)",
                "How many times faster than the SLO allows the error budget burns over the last hour (1 = on "
                "budget). The alerts page at 14.4x over 1h and 5m, or 6x over 6h and 30m (capped for large budgets).",
                (
                    Target(burn_rate(TTFT, "ttft"), "{{pdservice}} TTFT"),
                    Target(burn_rate(ITL, "itl"), "{{pdservice}} ITL"),
                ),
                unit="none",
                width=24,
            ),
        ),
    ),
    Row(
        "Traffic",
        (
            Panel(
                "Requests per second by route",
                "Finished requests: pd (prefill then decode), decode-only (short or cached prompts) and fallback "
                "(wanted prefill, prefilled on decode instead); none = refused before routing.",
                (
                    Target(
                        f"sum by ({BY}, route) (rate(pdserve_router_requests_total{{{SVC}}}[{RATE}]))",
                        "{{pdservice}} {{route}}",
                    ),
                ),
                unit="reqps",
                stack=True,
            ),
            Panel(
                "Route mix",
                "Share of requests per route.",
                (
                    Target(
                        f"sum by ({BY}, route) (rate(pdserve_router_requests_total{{{SVC}}}[{RATE}])) "
                        f"/ ignoring (route) group_left () "
                        f"sum by ({BY}) (rate(pdserve_router_requests_total{{{SVC}}}[{RATE}]))",
                        "{{pdservice}} {{route}}",
                    ),
                ),
                unit="percentunit",
                stack=True,
            ),
            Panel(
                "Outcomes and fallbacks",
                "Requests that did not succeed, by outcome, and fallbacks by reason (prefill failed or none "
                "available).",
                (
                    Target(
                        f"sum by ({BY}, outcome) "
                        f'(rate(pdserve_router_requests_total{{{SVC}, outcome!="success"}}[{RATE}]))',
                        "{{pdservice}} {{outcome}}",
                    ),
                    Target(
                        f"sum by ({BY}, reason) (rate(pdserve_router_fallbacks_total{{{SVC}}}[{RATE}]))",
                        "{{pdservice}} fallback: {{reason}}",
                    ),
                ),
                unit="reqps",
            ),
            Panel(
                "Tokens per second",
                "Prompt tokens processed and tokens generated, per engine pool.",
                (
                    Target(
                        f"sum by ({BY}, pool) (rate(vllm:prompt_tokens_total{{{ENGINES}}}[{RATE}]))",
                        "{{pdservice}} {{pool}} prompt",
                    ),
                    Target(
                        f"sum by ({BY}, pool) (rate(vllm:generation_tokens_total{{{ENGINES}}}[{RATE}]))",
                        "{{pdservice}} {{pool}} generated",
                    ),
                ),
                unit="short",
            ),
            Panel(
                "Prompt tokens by KV source",
                "Where each pool's prompt KV came from: computed here, a prefix-cache hit, or pulled from prefill "
                "(decode's external_kv_transfer should carry nearly every pd prompt token).",
                (
                    Target(
                        f"sum by ({BY}, pool, source) (rate(vllm:prompt_tokens_by_source_total{{{ENGINES}}}[{RATE}]))",
                        "{{pdservice}} {{pool}} {{source}}",
                    ),
                ),
                unit="short",
                stack=True,
            ),
            Panel(
                "Engine latency",
                "The engines' own view: prefill TTFT (queue + prefill) and decode ITL at p90, to tell which pool "
                "a client-visible breach comes from.",
                (
                    Target(
                        f"histogram_quantile(0.9, sum by ({BY}, pool, le) "
                        f"(rate(vllm:time_to_first_token_seconds_bucket{{{ENGINES}}}[{RATE}])))",
                        "{{pdservice}} {{pool}} TTFT p90",
                    ),
                    Target(
                        f"histogram_quantile(0.9, sum by ({BY}, pool, le) "
                        f"(rate(vllm:inter_token_latency_seconds_bucket{{{ENGINES}}}[{RATE}])))",
                        "{{pdservice}} {{pool}} ITL p90",
                    ),
                ),
                unit="s",
            ),
        ),
    ),
    Row(
        "Pools",
        (
            Panel(
                "Engines up",
                "Engine pods Prometheus scrapes successfully, per pool.",
                (
                    Target(
                        f'count by ({BY}, pool) (up{{{SVC}, pool=~"prefill|decode"}} == 1)', "{{pdservice}} {{pool}}"
                    ),
                ),
                unit="short",
            ),
            Panel(
                "P:D replica ratio",
                "Prefill engines up per decode engine up (spec.autoscaling.prefillToDecodeRatio bounds it).",
                (
                    Target(
                        f'count by ({BY}) (up{{{SVC}, pool="prefill"}} == 1) '
                        f'/ count by ({BY}) (up{{{SVC}, pool="decode"}} == 1)',
                        "{{pdservice}}",
                    ),
                ),
                unit="none",
            ),
            Panel(
                "Requests running and waiting",
                'Per pool; waiting by reason: "capacity" (no slot or KV blocks) or "deferred" (KV still arriving).',
                (
                    Target(
                        f"sum by ({BY}, pool) (vllm:num_requests_running{{{ENGINES}}})",
                        "{{pdservice}} {{pool}} running",
                    ),
                    Target(
                        f"sum by ({BY}, pool, reason) (vllm:num_requests_waiting_by_reason{{{ENGINES}}})",
                        "{{pdservice}} {{pool}} waiting ({{reason}})",
                    ),
                ),
                unit="short",
            ),
            Panel(
                "KV-cache usage",
                "Per engine pod. Decode near 1 means full batches and preemptions; prefill holds KV until decode "
                "pulls it.",
                (Target(f"max by ({BY}, pool, pod) (vllm:kv_cache_usage_perc{{{ENGINES}}})", "{{pod}}"),),
                unit="percentunit",
            ),
            Panel(
                "Prefix cache hit rate",
                "Prompt tokens found in the prefix cache over prompt tokens looked up, per pool.",
                (
                    Target(
                        f"sum by ({BY}, pool) (rate(vllm:prefix_cache_hits_total{{{ENGINES}}}[{RATE}])) "
                        f"/ sum by ({BY}, pool) (rate(vllm:prefix_cache_queries_total{{{ENGINES}}}[{RATE}]))",
                        "{{pdservice}} {{pool}}",
                    ),
                ),
                unit="percentunit",
            ),
        ),
    ),
    Row(
        "KV transfer (NIXL)",
        (
            Panel(
                "KV transfer time",
                "Time decode engines spend pulling a prompt's KV from prefill (vllm:nixl_xfer_time_seconds).",
                quantiles("vllm:nixl_xfer_time_seconds", SVC + ', pool="decode"', BY, "{{pdservice}}"),
                unit="s",
            ),
            Panel(
                "KV transfer failures",
                "Failed pulls and notifications on decode, and KV that prefill held until its lease expired "
                "(decode never pulled it). Any failure is a failed or recomputed request.",
                (
                    Target(
                        f"sum by ({BY}, pod) (rate(vllm:nixl_num_failed_transfers_total{{{SVC}}}[{RATE}]))",
                        "{{pod}} failed transfers",
                    ),
                    Target(
                        f"sum by ({BY}, pod) (rate(vllm:nixl_num_failed_notifications_total{{{SVC}}}[{RATE}]))",
                        "{{pod}} failed notifications",
                    ),
                    Target(
                        f"sum by ({BY}, pod) (rate(vllm:nixl_num_kv_expired_reqs_total{{{SVC}}}[{RATE}]))",
                        "{{pod}} expired",
                    ),
                ),
                unit="ops",
            ),
            Panel(
                "KV transferred",
                "Bytes pulled per second by decode engines.",
                (Target(f"sum by ({BY}) (rate(vllm:nixl_bytes_transferred_sum{{{SVC}}}[{RATE}]))", "{{pdservice}}"),),
                unit="Bps",
            ),
        ),
    ),
    Row(
        "Autoscaler",
        (
            Panel(
                "Replicas: desired, current, ready",
                "What pdserve's SLO autoscaler asks for each pool, what the StatefulSet has, and what is ready.",
                tuple(
                    Target(
                        f"max by ({BY}, pool) (pdserve_autoscaler_{what}_replicas{{{SVC}}})",
                        f"{{{{pdservice}}}} {{{{pool}}}} {what}",
                    )
                    for what in ("desired", "current", "ready")
                ),
                unit="short",
            ),
            Panel(
                "Decisions by reason",
                "The reason of each pool's decision every tick (ScaledUp, WithinTolerance, AtMaxReplicas, "
                "MetricsUnavailable, ...): the share of ticks per reason.",
                (
                    Target(
                        f"sum by ({BY}, pool, reason) (rate(pdserve_autoscaler_decisions_total{{{SVC}}}[{RATE}]))",
                        "{{pdservice}} {{pool}}: {{reason}}",
                    ),
                ),
                unit="ops",
                stack=True,
            ),
            Panel(
                "Demand vs capacity",
                "Each pool's demand (prefill: uncached prompt tokens/s, decode: generated tokens/s) against the "
                "learned capacity per replica times the ready replicas.",
                (
                    Target(
                        f"max by ({BY}, pool) (pdserve_autoscaler_demand{{{SVC}}})", "{{pdservice}} {{pool}} demand"
                    ),
                    Target(
                        f"max by ({BY}, pool) (pdserve_autoscaler_capacity_per_replica{{{SVC}}}) "
                        f"* on ({BY}, pool) max by ({BY}, pool) (pdserve_autoscaler_ready_replicas{{{SVC}}})",
                        "{{pdservice}} {{pool}} capacity",
                    ),
                ),
                unit="short",
                dashed=".* capacity",
            ),
            Panel(
                "Observed latency / target",
                "The latency the autoscaler acts on, over the spec.slo target of the same kind (1 = at target).",
                (
                    Target(
                        f"max by ({BY}, kind) (pdserve_autoscaler_observed_latency_seconds{{{SVC}}}) "
                        f"/ on ({BY}, kind) max by ({BY}, kind) (pdserve_pdservice_slo_target_seconds{{{SVC}}})",
                        "{{pdservice}} {{kind}}",
                    ),
                ),
                unit="none",
            ),
            Panel(
                "Autoscaler errors",
                "Failed Prometheus queries per query (the autoscaler holds a pool whose signals are missing), and "
                "failed ticks and refused /scale writes per stage (retried with backoff).",
                (
                    Target(
                        f"sum by ({BY}, query) (rate(pdserve_autoscaler_query_errors_total{{{SVC}}}[{RATE}]))",
                        "{{pdservice}} query {{query}}",
                    ),
                    Target(
                        f"sum by ({BY}, stage) (rate(pdserve_autoscaler_errors_total{{{SVC}}}[{RATE}]))",
                        "{{pdservice}} {{stage}}",
                    ),
                ),
                unit="ops",
            ),
        ),
    ),
    Row(
        "Router",
        (
            Panel(
                "Router overhead",
                "The router's own share of TTFT (parsing, scheduling, relaying) and its routing decision, p99.",
                (
                    Target(
                        f"histogram_quantile(0.99, sum by ({BY}, le) "
                        f"(rate(pdserve_router_added_latency_seconds_bucket{{{SVC}}}[{RATE}])))",
                        "{{pdservice}} added latency p99",
                    ),
                    Target(
                        f"histogram_quantile(0.99, sum by ({BY}, le) "
                        f"(rate(pdserve_router_routing_decision_seconds_bucket{{{SVC}}}[{RATE}])))",
                        "{{pdservice}} routing decision p99",
                    ),
                ),
                unit="s",
            ),
            Panel(
                "Engines usable by the router",
                "Engines in the router's table that are ready and not ejected by its circuit breaker, per role.",
                (
                    Target(
                        f"max by ({BY}, role) (sum by ({BY}, role, pod) (pdserve_router_endpoint_up{{{SVC}}}))",
                        "{{pdservice}} {{role}}",
                    ),
                ),
                unit="short",
            ),
            Panel(
                "Engine errors and retries",
                "Failed requests to engines seen by the router, by role and kind, and the retries they caused.",
                (
                    Target(
                        f"sum by ({BY}, role, kind) (rate(pdserve_router_endpoint_errors_total{{{SVC}}}[{RATE}]))",
                        "{{pdservice}} {{role}} {{kind}}",
                    ),
                    Target(
                        f"sum by ({BY}, stage) (rate(pdserve_router_retries_total{{{SVC}}}[{RATE}]))",
                        "{{pdservice}} retry {{stage}}",
                    ),
                ),
                unit="ops",
            ),
        ),
    ),
    Row(
        "Status",
        (
            Panel(
                "PDService conditions",
                "The conditions that are True now (the operator's pdserve_pdservice_condition).",
                (
                    Target(
                        f'max by ({BY}, type) (pdserve_pdservice_condition{{{SVC}, status="True"}}) == 1',
                        "{{pdservice}} {{type}}",
                        instant=True,
                    ),
                ),
                kind="table",
                width=12,
            ),
            Panel(
                "Operator reconciles by result",
                "Reconcile passes per second of the operator replica that leads.",
                (Target(f"sum by (result) (rate(pdserve_operator_reconciles_total[{RATE}]))", "{{result}}"),),
                unit="ops",
                width=12,
            ),
        ),
    ),
)


VARIABLES: tuple[tuple[str, str, str], ...] = (
    ("namespace", "Namespace", 'label_values(up{pool=~"prefill|decode|router"}, namespace)'),
    ("pdservice", "PDService", 'label_values(up{namespace=~"$namespace", pool=~"prefill|decode|router"}, pdservice)'),
    (
        "pool",
        "Engine pool",
        'label_values(up{namespace=~"$namespace", pdservice=~"$pdservice", pool=~"prefill|decode"}, pool)',
    ),
)
"""(name, label, Grafana query) of each query variable, all multi-valued with All selected."""


def _templating() -> dict[str, Any]:
    variables: list[dict[str, Any]] = [
        {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
            "refresh": 1,
        }
    ]
    for name, label, query in VARIABLES:
        variables.append(
            {
                "name": name,
                "label": label,
                "type": "query",
                "datasource": DATASOURCE,
                "definition": query,
                "query": {"qryType": 1, "query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
                "refresh": 2,  # on time range change: PDServices come and go
                "multi": True,
                "includeAll": True,
                "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
                "sort": 1,
                "hide": 0,
            }
        )
    return {"list": variables}


def _panel(panel: Panel, panel_id: int, x: int, y: int) -> dict[str, Any]:
    custom: dict[str, Any] = {"fillOpacity": 10 if panel.stack else 0, "showPoints": "never", "spanNulls": True}
    if panel.stack:
        custom["stacking"] = {"mode": "normal", "group": "A"}
    overrides: list[dict[str, Any]] = []
    if panel.dashed:
        overrides.append(
            {
                "matcher": {"id": "byRegexp", "options": panel.dashed},
                "properties": [
                    {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}},
                    {"id": "custom.stacking", "value": {"mode": "none"}},
                ],
            }
        )
    body: dict[str, Any] = {
        "id": panel_id,
        "type": panel.kind,
        "title": panel.title,
        "description": panel.description,
        "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": panel.width, "x": x, "y": y},
        "fieldConfig": {
            "defaults": {"unit": panel.unit, **({"custom": custom} if panel.kind == "timeseries" else {})},
            "overrides": overrides,
        },
        "options": (
            {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}, "tooltip": {"mode": "multi"}}
            if panel.kind == "timeseries"
            else {"showHeader": True}
        ),
        "targets": [
            {
                "refId": chr(ord("A") + index),
                "datasource": DATASOURCE,
                "expr": target.expr,
                "legendFormat": target.legend,
                "range": not target.instant,
                "instant": target.instant,
                **({"format": "table"} if target.instant else {}),
            }
            for index, target in enumerate(panel.targets)
        ],
    }
    return body


def dashboard() -> dict[str, Any]:
    """The dashboard JSON (Grafana schema 39), rows laid out top to bottom, panels left to right in a 24-wide grid."""
    panels: list[dict[str, Any]] = []
    next_id, y = 1, 0
    for row in ROWS:
        panels.append(
            {
                "id": next_id,
                "type": "row",
                "title": row.title,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        next_id, y, x = next_id + 1, y + 1, 0
        for panel in row.panels:
            if x + panel.width > 24:
                x, y = 0, y + 8
            panels.append(_panel(panel, next_id, x, y))
            next_id, x = next_id + 1, x + panel.width
        y += 8
    return {
        "title": "pdserve / PD serving",
        "uid": UID,
        "description": (
            "Prefill/decode disaggregated serving with pdserve, per PDService and pool: TTFT and ITL against "
            "spec.slo, traffic and route mix, pools and P:D ratio, KV transfer, the SLO autoscaler, the router."
        ),
        "tags": ["pdserve", "vllm", "llm"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": _templating(),
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    """The chart copy's exact text."""
    return json.dumps(dashboard(), indent=2) + "\n"


def expressions(board: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every query target in `board`, rows' nested panels included."""
    found: list[tuple[str, str]] = []
    for panel in board["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            found += [(inner["title"], t["expr"]) for t in inner.get("targets", [])]
    return found


def promql(
    expr: str, *, namespace: str = ".+", pdservice: str = ".+", pool: str = ".+", rate_interval: str = "1m"
) -> str:
    """`expr` as Grafana sends it to Prometheus with these variable values (regular expressions, as Grafana writes a
    multi-valued selection: `(a|b)`), for tests that run the dashboard's queries."""
    for name, value in (
        ("$__rate_interval", rate_interval),
        ("$namespace", namespace),
        ("$pdservice", pdservice),
        ("$pool", pool),
    ):
        expr = expr.replace(name, value)
    return expr


def variable_queries() -> list[tuple[str, str]]:
    """(variable, PromQL) of each query variable: Grafana's `label_values(selector, label)` is the values of `label`
    on the series of `selector`, i.e. `group by (label) (selector)`."""
    found = []
    for name, _, query in VARIABLES:
        match = re.fullmatch(r"label_values\((.*), (\w+)\)", query)
        assert match is not None, query
        found.append((name, f"group by ({match[2]}) ({match[1]})"))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve_dev.dashboard", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the chart's copy is not the generated one")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        same = CHART_COPY.exists() and CHART_COPY.read_text() == text
        print(f"{CHART_COPY}: {'up to date' if same else 'differs; run python -m pdserve_dev.dashboard'}")
        return 0 if same else 1
    CHART_COPY.write_text(text)
    print(f"Wrote {CHART_COPY}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
