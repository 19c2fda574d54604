"""Prometheus metrics of the operator itself (not of the workloads it manages).

No module-level metrics: the runner creates one `OperatorMetrics` (with its own registry, which its /metrics server
exposes) and hands it to the IO layer, the controller and the leader elector, like the router's `RouterApp` owns its
`RouterMetrics`. Two operators in one process, or a test next to a running operator, never share counters, and
importing the package registers nothing anywhere.
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)


class OperatorMetrics:
    """Every operator metric in one registry. `process_metrics` adds the standard process_*/python_* collectors
    (what the default registry would have exposed), for the real process; tests leave them out."""

    def __init__(self, registry: CollectorRegistry | None = None, *, process_metrics: bool = False) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.reconciles = Counter(
            "pdserve_operator_reconciles_total",
            "Reconcile passes by outcome (ok, noop, invalid, error).",
            ["result"],
            registry=registry,
        )
        self.reconcile_errors = Counter(
            "pdserve_operator_reconcile_errors_total",
            "Reconcile passes that raised and were retried.",
            registry=registry,
        )
        self.reconcile_seconds = Histogram(
            "pdserve_operator_reconcile_duration_seconds",
            "Wall time of one reconcile pass.",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=registry,
        )
        self.api_requests = Counter(
            "pdserve_operator_api_requests_total",
            "Requests the reconciler sent to the Kubernetes API (kopf's watches are not counted).",
            ["verb", "kind", "code"],
            registry=registry,
        )
        self.writes = Counter(
            "pdserve_operator_writes_total",
            "Reconciler writes to the API: apply, delete, status, event.",
            ["verb", "kind"],
            registry=registry,
        )
        self.lease_writes = Counter(
            "pdserve_operator_lease_writes_total", "Leader Lease creates and renewals.", registry=registry
        )
        self.leader = Gauge(
            "pdserve_operator_leader", "1 while this replica holds the leader Lease and acts.", registry=registry
        )
        self.queue_depth = Gauge(
            "pdserve_operator_queue_depth", "PDServices waiting for a reconcile.", registry=registry
        )
        self.cached_objects = Gauge(
            "pdserve_operator_cached_objects", "Objects in the informer cache.", registry=registry
        )
        if process_metrics:
            ProcessCollector(registry=registry)
            PlatformCollector(registry=registry)
            GCCollector(registry=registry)
