"""The router's Prometheus metrics (all `pdserve_router_*`).

- `pdserve_router_requests_total{route,outcome}`: every generation request once, when it ends. route is
  pd / decode-only / fallback / none (refused before routing); outcome is success, client_error (4xx from the
  router or an engine), upstream_error (engines failed), unavailable (no engine could take it), cancelled
  (client went away), timeout, or shed (answered 429/503 by the admission gate: `pdserve_router_shed_total` says
  why).
- `pdserve_router_time_to_first_token_seconds{route}`, `pdserve_router_inter_token_latency_seconds{route}`,
  `pdserve_router_e2e_request_latency_seconds{route}`: measured at the router, so they include prefill, the
  KV handoff and the router itself: what a client sees. Buckets follow vLLM's so dashboards can overlay them;
  the TTFT and ITL bounds live in `pdserve.api.latency_buckets`, where the operator reads them to name the bucket
  of each PDService's SLO target for the burn-rate alerts.
  ITL is observed per chunk read from the engine; when several SSE events arrive in one read their gap is
  observed once (the client saw them together too).
- `pdserve_router_routing_decision_seconds`: prompt analysis + scheduling, per request.
- `pdserve_router_added_latency_seconds`: TTFT minus the time spent waiting on engines before the first byte:
  the router's own share of TTFT (parsing, scheduling, serialising, event-loop queueing in the router).
- `pdserve_router_retries_total{stage}`, `pdserve_router_fallbacks_total{reason}`.
- `pdserve_router_endpoint_errors_total{role,endpoint,kind}`, `pdserve_router_endpoint_ejections_total`.
- `pdserve_router_endpoint_in_flight_requests{role,endpoint}`, `pdserve_router_endpoint_in_flight_tokens`,
  `pdserve_router_endpoint_up{role,endpoint}` (1 usable, 0 not), `pdserve_router_endpoint_kv_cache_usage`
  (engine-reported, decode only): read from the endpoint table at scrape time
  by a custom collector, so the request path pays nothing for them.

Each router owns its registry (no global state): several routers can run in one test process.

The histograms are `FastHistogram`s exported by a collector at scrape time: the inter-token histogram is observed
once per relayed chunk, and prometheus_client's Histogram takes a lock and walks every bucket per observation,
several times the cost of the bisect and two additions here (everything runs on the event loop thread).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from pdserve.api.latency_buckets import ROUTER_ITL_BUCKETS as ITL_BUCKETS
from pdserve.api.latency_buckets import ROUTER_TTFT_BUCKETS as TTFT_BUCKETS
from pdserve_runtime.router.endpoints import ROLES, EndpointTable
from pdserve_runtime.router.policy.decision import Route

E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
DECISION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.025, 0.05,
                    0.1, 0.25, 0.5, 1.0)  # fmt: skip
OUTCOMES = ("success", "client_error", "upstream_error", "unavailable", "shed", "cancelled", "timeout")

ROUTE_LABELS = (*(route.value for route in Route), "none")


class FastHistogram:
    """One histogram series: per-bucket counts and a sum (event loop thread only, no lock)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value


class HistogramFamily(Collector):
    """A labelled family of `FastHistogram`s, exported like prometheus_client's Histogram."""

    def __init__(self, name: str, documentation: str, labels: Sequence[str], buckets: Sequence[float]) -> None:
        self.name = name
        self.documentation = documentation
        self.label_names = list(labels)
        self.buckets = tuple(buckets)
        self.children: dict[tuple[str, ...], FastHistogram] = {}
        if not self.label_names:
            self.labels()

    def labels(self, *values: str) -> FastHistogram:
        child = self.children.get(values)
        if child is None:
            child = self.children[values] = FastHistogram(self.buckets)
        return child

    def observe(self, value: float) -> None:
        """For an unlabelled family."""
        self.children[()].observe(value)

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.label_names)
        for values, child in self.children.items():
            cumulative, buckets = 0, []
            for bound, count in zip((*child.bounds, float("inf")), child.counts, strict=True):
                cumulative += count
                buckets.append((floatToGoString(bound), float(cumulative)))  # type: ignore[no-untyped-call]
            family.add_metric(list(values), buckets, child.total)
        yield family


class _TableCollector(Collector):
    """Exports per-endpoint gauges straight from the endpoint table at scrape time."""

    def __init__(self, table: EndpointTable) -> None:
        self._table = table

    def collect(self) -> Iterator[Metric]:
        in_flight = GaugeMetricFamily(
            "pdserve_router_endpoint_in_flight_requests",
            "Requests the router has in flight to each engine.",
            labels=["role", "endpoint"],
        )
        tokens = GaugeMetricFamily(
            "pdserve_router_endpoint_in_flight_tokens",
            "Uncached prompt tokens the router has in flight to each prefill engine.",
            labels=["role", "endpoint"],
        )
        up = GaugeMetricFamily(
            "pdserve_router_endpoint_up",
            "1 when the engine is ready and not ejected by the circuit breaker, else 0.",
            labels=["role", "endpoint"],
        )
        kv_usage = GaugeMetricFamily(
            "pdserve_router_endpoint_kv_cache_usage",
            "KV-cache usage in [0, 1] last scraped from each decode engine's /metrics.",
            labels=["role", "endpoint"],
        )
        for role in ROLES:
            for state in self._table.states(role):
                labels = [role, state.endpoint.label]
                in_flight.add_metric(labels, state.in_flight)
                tokens.add_metric(labels, state.in_flight_tokens)
                up.add_metric(labels, 1.0 if state.usable else 0.0)
                if state.kv_cache_usage is not None:
                    kv_usage.add_metric(labels, state.kv_cache_usage)
        yield in_flight
        yield tokens
        yield up
        yield kv_usage


class RouterMetrics:
    """All router metrics in one registry, with label children bound ahead of the hot path."""

    def __init__(self, table: EndpointTable) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.requests = Counter(
            "pdserve_router_requests",
            "Generation requests by route and outcome.",
            ["route", "outcome"],
            registry=registry,
        )
        self.ttft = HistogramFamily(
            "pdserve_router_time_to_first_token_seconds",
            "Time from request arrival at the router to the first response byte sent to the client.",
            ["route"],
            TTFT_BUCKETS,
        )
        self.itl = HistogramFamily(
            "pdserve_router_inter_token_latency_seconds",
            "Gap between consecutive stream chunks relayed to the client.",
            ["route"],
            ITL_BUCKETS,
        )
        self.e2e = HistogramFamily(
            "pdserve_router_e2e_request_latency_seconds",
            "Time from request arrival to the last byte sent to the client.",
            ["route"],
            E2E_BUCKETS,
        )
        self.decision = HistogramFamily(
            "pdserve_router_routing_decision_seconds",
            "Time to analyse the prompt and choose engines for one request.",
            [],
            DECISION_BUCKETS,
        )
        self.overhead = HistogramFamily(
            "pdserve_router_added_latency_seconds",
            "The router's own share of time to first token: TTFT minus time spent waiting on engines.",
            [],
            OVERHEAD_BUCKETS,
        )
        for family in (self.ttft, self.itl, self.e2e, self.decision, self.overhead):
            registry.register(family)
        self.retries = Counter(
            "pdserve_router_retries", "Retries of a request stage on another engine.", ["stage"], registry=registry
        )
        self.fallbacks = Counter(
            "pdserve_router_fallbacks",
            "Requests that wanted prefill but were prefilled on the decode engine instead.",
            ["reason"],
            registry=registry,
        )
        self.endpoint_errors = Counter(
            "pdserve_router_endpoint_errors",
            "Failed requests to an engine, by kind (connect, timeout, status, protocol, stream).",
            ["role", "endpoint", "kind"],
            registry=registry,
        )
        self.ejections = Counter(
            "pdserve_router_endpoint_ejections",
            "Times the circuit breaker ejected an engine.",
            ["role", "endpoint"],
            registry=registry,
        )
        registry.register(_TableCollector(table))
        # Bound children: labels() costs a dict lookup and a lock per call, so do it once.
        self.ttft_by_route = {route: self.ttft.labels(route) for route in ROUTE_LABELS}
        self.itl_by_route = {route: self.itl.labels(route) for route in ROUTE_LABELS}
        self.e2e_by_route = {route: self.e2e.labels(route) for route in ROUTE_LABELS}
        self._requests_by = {
            (route, outcome): self.requests.labels(route, outcome) for route in ROUTE_LABELS for outcome in OUTCOMES
        }

    def count_request(self, route: str, outcome: str) -> None:
        """One finished generation request."""
        child = self._requests_by.get((route, outcome))
        if child is None:
            child = self._requests_by[(route, outcome)] = self.requests.labels(route, outcome)
        child.inc()
