"""Prometheus metrics with vLLM's names, labels (``engine``, ``model_name``) and bucket boundaries.

Every simulator owns its own ``CollectorRegistry`` so several simulators can run in one process (tests).
Bucket lists are the defaults of vLLM's Prometheus stat logger (vllm/v1/metrics/buckets.py) and of the
NIXL connector's metrics; dashboards and PromQL written for vLLM work unchanged.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
    960.0, 1920.0, 7680.0,
)  # fmt: skip
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
NIXL_POST_TIME_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
NIXL_XFER_TIME_BUCKETS = NIXL_POST_TIME_BUCKETS[1:]
NIXL_BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))  # 2 KiB .. 8 GiB
NIXL_DESCRIPTORS_BUCKETS = (10, 20, 30, 50, 75, 100, 200, 400, 1000, 2000, 4000, 10000, 20000, 50000)

# vLLM 0.32's FINISH_REASON_STRINGS (vllm/v1/engine/__init__.py); "repetition" (a repetitive token pattern was
# detected) is never reached by the simulator, but vLLM pre-creates every reason's series, and so does it (the
# real-engine tier's metrics diff, tests/realvllm, found it missing).
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


def build_1_2_5_buckets(max_value: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count histogram buckets)."""
    out: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_value:
                return tuple(out)
            out.append(float(value))
        scale *= 10


class FastHistogram:
    """A lock-free histogram with fixed labels for the single-threaded hot path.

    prometheus_client's Histogram takes a lock and updates two values per observation; the simulator
    observes inter-token latency once per streamed token, so it keeps plain per-bucket counts instead
    (bucket ``i`` counts values ``<= bounds[i]``, the last slot is +Inf) and renders them cumulatively.
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = list(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        """Record one value."""
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    @property
    def count(self) -> int:
        """Number of observations."""
        return sum(self.counts)


class _HistogramCollector:
    """Exposes one FastHistogram as a Prometheus histogram family."""

    def __init__(self, name: str, doc: str, labels: dict[str, str], hist: FastHistogram) -> None:
        self.name, self.doc, self.labels, self.hist = name, doc, labels, hist
        self._les = [floatToGoString(b) for b in hist.bounds] + ["+Inf"]  # type: ignore[no-untyped-call]

    def collect(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(self.name, self.doc, labels=list(self.labels))
        cumulative = 0
        buckets: list[tuple[str, float]] = []
        for le, n in zip(self._les, self.hist.counts, strict=True):
            cumulative += n
            buckets.append((le, float(cumulative)))
        family.add_metric(list(self.labels.values()), buckets, self.hist.sum)
        yield family


class SimMetrics:
    """All metrics of one simulated engine, pre-bound to its label values for cheap updates."""

    def __init__(
        self, model_name: str, max_model_len: int, engine: str = "0", cache_info: dict[str, str] | None = None
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        labels = ["model_name", "engine"]
        values = (model_name, engine)
        reg = self.registry

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> FastHistogram:
            histogram = FastHistogram(buckets)
            reg.register(_HistogramCollector(name, doc, dict(zip(labels, values, strict=True)), histogram))
            return histogram

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=reg).labels(*values)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=reg).labels(*values)

        token_buckets = build_1_2_5_buckets(max_model_len)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Time per output token of each request in seconds.",
            ITL_BUCKETS,
        )
        self.e2e = hist(
            "vllm:e2e_request_latency_seconds", "End-to-end request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.queue = hist("vllm:request_queue_time_seconds", "Time spent in WAITING phase.", REQUEST_LATENCY_BUCKETS)
        self.inference = hist(
            "vllm:request_inference_time_seconds", "Time spent in RUNNING phase.", REQUEST_LATENCY_BUCKETS
        )
        self.prefill_time = hist(
            "vllm:request_prefill_time_seconds", "Time spent in PREFILL phase.", REQUEST_LATENCY_BUCKETS
        )
        self.decode_time = hist(
            "vllm:request_decode_time_seconds", "Time spent in DECODE phase.", REQUEST_LATENCY_BUCKETS
        )
        self.prompt_tokens_hist = hist("vllm:request_prompt_tokens", "Prompt tokens per request.", token_buckets)
        self.generation_tokens_hist = hist(
            "vllm:request_generation_tokens", "Generated tokens per request.", token_buckets
        )
        self.max_tokens_param = hist(
            "vllm:request_params_max_tokens", "The max_tokens request parameter.", token_buckets
        )
        self.iteration_tokens = hist("vllm:iteration_tokens_total", "Tokens per engine step.", ITERATION_TOKENS_BUCKETS)

        self.running = gauge("vllm:num_requests_running", "Requests in RUNNING state.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests in WAITING state.")
        waiting_by_reason = Gauge(
            "vllm:num_requests_waiting_by_reason",
            "Waiting requests by the reason they wait.",
            [*labels, "reason"],
            registry=reg,
        )
        # vLLM's reasons: "capacity" (no KV blocks / sequence slots) and "deferred" (held back, e.g. while
        # its KV arrives from a remote prefill engine).
        self.waiting_capacity = waiting_by_reason.labels(*values, "capacity")
        self.waiting_remote_kv = waiting_by_reason.labels(*values, "deferred")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")

        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.")
        self.prefix_queries = counter("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.")
        self.external_hits = counter(
            "vllm:external_prefix_cache_hits", "External (KV connector) prefix cache hits, in tokens."
        )
        self.external_queries = counter(
            "vllm:external_prefix_cache_queries", "External (KV connector) prefix cache queries, in tokens."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prefill tokens processed.")
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Prompt tokens whose KV was not computed here (cache hits, KV transfers)."
        )
        self.generation_tokens = counter("vllm:generation_tokens", "Generation tokens processed.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemptions.")
        by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Prompt tokens by where their KV came from.",
            [*labels, "source"],
            registry=reg,
        )
        self.tokens_by_source = {s: by_source.labels(*values, s) for s in TOKEN_SOURCES}
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*labels, "finished_reason"],
            registry=reg,
        )
        self.success = {r: success.labels(*values, r) for r in FINISH_REASONS}

        self.nixl_xfer_time = hist(
            "vllm:nixl_xfer_time_seconds", "Transfer duration of NIXL KV cache transfers.", NIXL_XFER_TIME_BUCKETS
        )
        self.nixl_post_time = hist(
            "vllm:nixl_post_time_seconds", "Post time of NIXL KV cache transfers.", NIXL_POST_TIME_BUCKETS
        )
        self.nixl_bytes = hist(
            "vllm:nixl_bytes_transferred", "Bytes transferred per NIXL KV cache transfer.", NIXL_BYTES_BUCKETS
        )
        self.nixl_descriptors = hist(
            "vllm:nixl_num_descriptors", "Descriptors per NIXL KV cache transfer.", NIXL_DESCRIPTORS_BUCKETS
        )
        self.nixl_failed_transfers = counter(
            "vllm:nixl_num_failed_transfers", "Number of failed NIXL KV cache transfers."
        )
        self.nixl_failed_notifications = counter(
            "vllm:nixl_num_failed_notifications", "Number of failed NIXL KV cache notifications."
        )
        self.nixl_expired = counter(
            "vllm:nixl_num_kv_expired_reqs", "Requests whose held KV expired before decode pulled it."
        )

        # The simulator's own health: when the process cannot keep up with the modelled step times (CPU
        # bound), steps end late and every latency it reports is inflated; benchmarks should check these.
        self.step_lag = Gauge(
            "pdserve:sim_step_lag_seconds", "How late the last engine step ended versus its modelled time.",
            registry=reg,
        )  # fmt: skip
        self.late_steps = Counter(
            "pdserve:sim_late_steps", "Engine steps that ended more than 5 ms after their modelled time.",
            registry=reg,
        )  # fmt: skip
        # vLLM logs a lease extension only at debug level; counted here so tests wait for one instead of sleeping.
        self.lease_extensions = Counter(
            "pdserve:sim_kv_lease_extensions",
            "Held KV whose lease a decode engine's heartbeat extended (its request still queued at decode).",
            registry=reg,
        )
        self.prompt_mismatch = Counter(
            "pdserve:sim_kv_prompt_mismatch", "KV pulls whose prefill prompt length differs from the decode's.",
            registry=reg,
        )  # fmt: skip
        # What real vLLM reports only as a failed NIXL handshake ("compatibility check failed") in its log: a
        # prefill and a decode engine of different kv-compat ids were paired. Counted by both engines of the pair
        # (the prefill refusing the pull, the decode whose pull was refused), so a scrape of either side sees it.
        self.kv_compat_mismatch = Counter(
            "pdserve:sim_kv_compat_mismatch",
            "KV pulls between a prefill and a decode engine whose kv-compat ids differ (refused, like a failed NIXL "
            "compatibility check); counted by both engines.",
            registry=reg,
        )
        # The KV store path (`kvstore`), which vLLM reports through its connector's own stats.
        self.store_blocks = Counter(
            "pdserve:sim_kv_store_blocks", "KV blocks put into (op=put) or loaded from (op=get) the KV store.",
            ["op"], registry=reg,
        )  # fmt: skip
        self.store_errors = Counter(
            "pdserve:sim_kv_store_errors", "KV store calls that failed (op=put, get).", ["op"], registry=reg
        )
        for op in ("put", "get"):
            self.store_blocks.labels(op)
            self.store_errors.labels(op)
        if cache_info:
            # vLLM's info-style gauge describing the KV cache configuration (always 1).
            info = Gauge(
                "vllm:cache_config_info", "Information of the LLMEngine CacheConfig", [*cache_info, "engine"],
                registry=reg,
            )  # fmt: skip
            info.labels(*cache_info.values(), engine).set(1)

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
