"""Prometheus metrics of the operator itself (not of the workloads it manages)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter(
    "pdserve_operator_reconciles_total", "Reconcile passes by outcome (ok, noop, invalid, error).", ["result"]
)
RECONCILE_ERRORS = Counter("pdserve_operator_reconcile_errors_total", "Reconcile passes that raised and were retried.")
RECONCILE_SECONDS = Histogram(
    "pdserve_operator_reconcile_duration_seconds",
    "Wall time of one reconcile pass.",
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
API_REQUESTS = Counter(
    "pdserve_operator_api_requests_total",
    "Requests the reconciler sent to the Kubernetes API (kopf's watches are not counted).",
    ["verb", "kind", "code"],
)
WRITES = Counter(
    "pdserve_operator_writes_total", "Reconciler writes to the API: apply, delete, status, event.", ["verb", "kind"]
)
LEASE_WRITES = Counter("pdserve_operator_lease_writes_total", "Leader Lease creates and renewals.")
LEADER = Gauge("pdserve_operator_leader", "1 while this replica holds the leader Lease and acts.")
QUEUE_DEPTH = Gauge("pdserve_operator_queue_depth", "PDServices waiting for a reconcile.")
CACHED_OBJECTS = Gauge("pdserve_operator_cached_objects", "Objects in the informer cache.")
