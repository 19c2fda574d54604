"""Per-PDService series for dashboards and alerts: what each PDService's status says and what its SLO asks.

Prometheus cannot read a custom resource, so the operator, which holds every PDService in its informer cache,
exports the two things the chart's alerts and dashboard need from them:

- `pdserve_pdservice_condition{namespace,pdservice,type,status}`: for each condition in the PDService's status,
  one series per status value (True, False, Unknown), 1 for the current one and 0 for the others, the shape of
  kube-state-metrics' condition gauges and Flux's `gotk_reconcile_condition`. An alert selects
  `{type="Stalled",status="True"} == 1`, and a flip changes a value instead of relying on a series going stale.
- `pdserve_pdservice_slo_target_seconds{namespace,pdservice,kind,le}`: `spec.slo`'s targets in seconds, kind
  `ttft` (time to first token) and `itl` (inter-token latency), the same kind values as the autoscaler's
  `pdserve_autoscaler_observed_latency_seconds{kind}`. `le` is the router histogram bucket the SLO's error
  ratio reads as "within target" (`pdserve.api.latency_buckets.slo_bucket`): the burn-rate rules keep the
  router's `_bucket` series `and on (namespace, pdservice, le)` this one, which is how a per-PDService target
  reaches PromQL without a rule per PDService.
- `pdserve_pdservice_slo_objective_ratio{namespace,pdservice}`: `spec.slo.percentile` as a ratio (0.9 for the
  default p90): the share of requests that must meet the targets. One minus it is the error budget the
  burn rates are measured against.

The collector reads the cache at scrape time, so nothing is kept in sync and a deleted PDService's series vanish
with it. Only the leader exports: it is the replica that writes the status these series repeat, and a single
exporter keeps one series per PDService, so the rules' joins stay one-to-one while two replicas run.
A PDService whose `spec.slo` does not parse exports its conditions (InvalidSpec among them) and no targets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import ValidationError

from pdserve.api.defaulting import resolve
from pdserve.api.defaults import EffectiveSlo
from pdserve.api.latency_buckets import ROUTER_ITL_BUCKETS, ROUTER_TTFT_BUCKETS, le_label, slo_bucket
from pdserve.api.v1alpha1 import SloSpec
from pdserve_operator.store import Store

CONDITION_STATUSES = ("True", "False", "Unknown")

CONDITION = "pdserve_pdservice_condition"
SLO_TARGET = "pdserve_pdservice_slo_target_seconds"
SLO_OBJECTIVE = "pdserve_pdservice_slo_objective_ratio"


def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
    return (
        GaugeMetricFamily(
            CONDITION,
            "1 for the current status of each condition of a PDService, 0 for the other statuses.",
            labels=["namespace", "pdservice", "type", "status"],
        ),
        GaugeMetricFamily(
            SLO_TARGET,
            "spec.slo latency target (kind ttft or itl); le is the router histogram bucket that counts as within it.",
            labels=["namespace", "pdservice", "kind", "le"],
        ),
        GaugeMetricFamily(
            SLO_OBJECTIVE,
            "spec.slo.percentile as a ratio: the share of requests that must meet the targets.",
            labels=["namespace", "pdservice"],
        ),
    )


def slo_series(slo: Mapping[str, Any] | None) -> tuple[list[tuple[str, str, float]], float | None]:
    """The target series of one `spec.slo` as (kind, le, seconds), and its objective ratio (None without targets).

    Raises pydantic's ValidationError for a `spec.slo` the API would reject."""
    view = resolve(EffectiveSlo, SloSpec.model_validate(slo or {}))
    targets = []
    for kind, milliseconds, bounds in (
        ("ttft", view.ttft_milliseconds, ROUTER_TTFT_BUCKETS),
        ("itl", view.itl_milliseconds, ROUTER_ITL_BUCKETS),
    ):
        if milliseconds is not None:
            seconds = milliseconds / 1000.0
            targets.append((kind, le_label(slo_bucket(seconds, bounds)), seconds))
    return targets, (view.percentile / 100.0 if targets else None)


class PDServiceCollector(Collector):
    """Exports the series above from the operator's informer cache, on the leader only."""

    def __init__(self, store: Store, is_leader: Callable[[], bool]) -> None:
        self._store = store
        self._is_leader = is_leader

    def describe(self) -> Iterator[Metric]:
        # Names only: without it the registry would call collect() while registering, before the cache is filled.
        yield from _families()

    def collect(self) -> Iterator[Metric]:
        condition, target, objective = _families()
        if self._is_leader():
            for (namespace, name), body in self._store.owners():
                for item in (body.get("status") or {}).get("conditions") or []:
                    kind, current = item.get("type"), item.get("status")
                    if not kind:
                        continue
                    for status in CONDITION_STATUSES:
                        condition.add_metric([namespace, name, kind, status], 1.0 if current == status else 0.0)
                try:
                    targets, ratio = slo_series((body.get("spec") or {}).get("slo"))
                except ValidationError:
                    continue  # the status says InvalidSpec; there is no target to export
                for kind, le, seconds in targets:
                    target.add_metric([namespace, name, kind, le], seconds)
                if ratio is not None:
                    objective.add_metric([namespace, name], ratio)
        yield condition
        yield target
        yield objective
