"""Prometheus metrics of the SLO autoscaler, on the operator's registry (served on its --metrics-port).

Names are a contract (dashboards and alerts read them); every per-service series carries `namespace` and
`pdservice`:

- `pdserve_autoscaler_desired_replicas`, `_current_replicas`, `_ready_replicas` {namespace, pdservice, pool}:
  what the last decision asked for, what the pool's StatefulSet asked for before it, how many pods were ready.
- `pdserve_autoscaler_capacity_per_replica` {.., pool}: the load one replica carries within the SLO (prefill:
  uncached prompt tokens/s, decode: generated tokens/s), prior or learned.
- `pdserve_autoscaler_demand` {.., pool}: the load expected over the next interval (same units).
- `pdserve_autoscaler_observed_latency_seconds` {.., kind}: quantiles at the SLO percentile over the window;
  kind `ttft` and `itl` are the routers' client-visible ones, `prefill_ttft` the prefill engines' TTFT and
  `decode_itl` the decode engines' ITL.
- `pdserve_autoscaler_decisions_total` {.., pool, reason}: one per pool per tick, by the decision's reason.
- `pdserve_autoscaler_disaggregation_threshold_tokens` {namespace, pdservice}: the threshold the autoscaler
  publishes to the routers (only while spec.autoscaling.disaggregationThreshold lets it choose one).
- `pdserve_autoscaler_threshold_decisions_total` {.., reason}: one per tick while it chooses, by reason.
- `pdserve_autoscaler_last_tick_timestamp_seconds` {namespace, pdservice}: Unix time the last tick read its
  signals at (an alert on its age finds a stalled loop; its steps show the ticks' cadence).
- `pdserve_autoscaler_query_errors_total` {.., query}: PromQL queries that failed (`queries.py` names).
- `pdserve_autoscaler_errors_total` {.., stage}: ticks that failed (`collect`, `decide`) and /scale writes the API
  server refused (`scale`); each is retried with backoff.

A value that is unknown this tick (no traffic for a quantile, no metrics) has no sample rather than a stale or a
zero one; a service's series are removed when its loop stops (PDService deleted, autoscaling turned off,
leadership lost), so only the leader exports them. The error counters start at 0 for every stage and query when
a loop starts (`begin`): Prometheus' rate() needs a sample before the first error to see it, so an alert or a
panel on them sees the first failure, not only the second.
"""

from __future__ import annotations

import contextlib
from typing import Literal, get_args

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve_operator.autoscaler.decision import Decision
from pdserve_operator.autoscaler.queries import BY_NAME
from pdserve_operator.autoscaler.signals import ROLES, ServiceSignals
from pdserve_operator.autoscaler.threshold import ThresholdReason

SERVICE_LABELS = ("namespace", "pdservice")
LATENCY_KINDS = ("ttft", "itl", "prefill_ttft", "decode_itl")
ErrorStage = Literal["collect", "decide", "scale"]
"""Where a loop step failed: the `stage` label of `pdserve_autoscaler_errors_total` (type-checked at each call)."""
ERROR_STAGES: tuple[ErrorStage, ...] = get_args(ErrorStage)


class AutoscalerMetrics:
    """The autoscaler's metrics, registered on `registry` (the operator's)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        pool = [*SERVICE_LABELS, "pool"]
        self.desired = Gauge(
            "pdserve_autoscaler_desired_replicas", "Replicas the last decision asked for.", pool, registry=registry
        )
        self.current = Gauge(
            "pdserve_autoscaler_current_replicas",
            "Replicas the pool's StatefulSet asked for when the autoscaler decided.",
            pool,
            registry=registry,
        )
        self.ready = Gauge(
            "pdserve_autoscaler_ready_replicas",
            "Ready pods of the pool when the autoscaler decided.",
            pool,
            registry=registry,
        )
        self.capacity = Gauge(
            "pdserve_autoscaler_capacity_per_replica",
            "Load one replica carries within the SLO (prefill: uncached prompt tokens/s, decode: generated tokens/s).",
            pool,
            registry=registry,
        )
        self.demand = Gauge(
            "pdserve_autoscaler_demand",
            "Load expected over the next interval (prefill: uncached prompt tokens/s, decode: generated tokens/s).",
            pool,
            registry=registry,
        )
        self.latency = Gauge(
            "pdserve_autoscaler_observed_latency_seconds",
            "Latency quantiles at the SLO percentile over the window: ttft and itl (client-visible, routers), "
            "prefill_ttft and decode_itl (the pools' engines).",
            [*SERVICE_LABELS, "kind"],
            registry=registry,
        )
        self.decisions = Counter(
            "pdserve_autoscaler_decisions_total",
            "Decisions per pool and tick, by reason.",
            [*SERVICE_LABELS, "pool", "reason"],
            registry=registry,
        )
        self.threshold = Gauge(
            "pdserve_autoscaler_disaggregation_threshold_tokens",
            "Disaggregation threshold the autoscaler publishes to the routers (uncached prompt tokens).",
            list(SERVICE_LABELS),
            registry=registry,
        )
        self.threshold_decisions = Counter(
            "pdserve_autoscaler_threshold_decisions_total",
            "Disaggregation threshold decisions per tick, by reason.",
            [*SERVICE_LABELS, "reason"],
            registry=registry,
        )
        self.last_tick = Gauge(
            "pdserve_autoscaler_last_tick_timestamp_seconds",
            "Unix time the last tick read its signals at.",
            list(SERVICE_LABELS),
            registry=registry,
        )
        self.query_errors = Counter(
            "pdserve_autoscaler_query_errors_total",
            "PromQL queries of the collector that failed.",
            [*SERVICE_LABELS, "query"],
            registry=registry,
        )
        self.errors = Counter(
            "pdserve_autoscaler_errors_total",
            "Failed ticks (collect, decide) and refused /scale writes (scale); each is retried with backoff.",
            [*SERVICE_LABELS, "stage"],
            registry=registry,
        )

    def record(self, namespace: str, name: str, decision: Decision, signals: ServiceSignals) -> None:
        """The gauges and counters of one tick."""
        for pool in decision.pools:
            labels = (namespace, name, pool.role)
            self.desired.labels(*labels).set(pool.desired)
            self.current.labels(*labels).set(pool.current)
            self.ready.labels(*labels).set(signals.pool(pool.role).ready)
            estimate = pool.estimate
            _set(self.capacity, labels, None if estimate is None else estimate.capacity_per_replica)
            _set(self.demand, labels, None if estimate is None else estimate.demand)
            self.decisions.labels(*labels, str(pool.reason)).inc()
        router = signals.router
        ttft = router.ttft_pd_s if router.ttft_pd_s is not None else router.ttft_s
        for kind, value in (
            ("ttft", ttft),
            ("itl", router.itl_s),
            ("prefill_ttft", signals.prefill.engine_ttft_s),
            ("decode_itl", signals.decode.engine_itl_s),
        ):
            _set(self.latency, (namespace, name, kind), value)
        for query in signals.failed_queries:
            self.query_errors.labels(namespace, name, query).inc()
        self.last_tick.labels(namespace, name).set(signals.at)
        if decision.threshold is None:
            _remove(self.threshold, (namespace, name))
        else:
            self.threshold.labels(namespace, name).set(decision.threshold.desired)
            self.threshold_decisions.labels(namespace, name, str(decision.threshold.reason)).inc()

    def begin(self, namespace: str, name: str) -> None:
        """A service's loop started: its error counters exist at 0 (see the module docstring)."""
        for stage in ERROR_STAGES:
            self.errors.labels(namespace, name, stage)
        for query in BY_NAME:
            self.query_errors.labels(namespace, name, query)

    def error(self, namespace: str, name: str, stage: ErrorStage) -> None:
        self.errors.labels(namespace, name, stage).inc()

    def forget(self, namespace: str, name: str) -> None:
        """Remove a service's gauges and error counters (its loop stopped): only a running loop's numbers are
        exported."""
        for gauge in (self.desired, self.current, self.ready, self.capacity, self.demand):
            for role in ROLES:
                _remove(gauge, (namespace, name, role))
        for kind in LATENCY_KINDS:
            _remove(self.latency, (namespace, name, kind))
        _remove(self.threshold, (namespace, name))
        _remove(self.last_tick, (namespace, name))
        for reason in ThresholdReason:
            _remove(self.threshold_decisions, (namespace, name, str(reason)))
        for stage in ERROR_STAGES:
            _remove(self.errors, (namespace, name, stage))
        for query in BY_NAME:
            _remove(self.query_errors, (namespace, name, query))


def _set(gauge: Gauge, labels: tuple[str, ...], value: float | None) -> None:
    if value is None:
        _remove(gauge, labels)
    else:
        gauge.labels(*labels).set(value)


def _remove(family: Gauge | Counter, labels: tuple[str, ...]) -> None:
    with contextlib.suppress(KeyError):  # never set
        family.remove(*labels)
