"""The one table of process settings: every flag of `pdserve operator` and `pdserve router`, written once.

Each setting is one line of a frozen dataclass below (like the spec's defaults in `defaults.py`): its type, its
default, its flag, its help text and, where the Helm chart sets it, its chart value. Everything else is
generated from or checked against these lines:

- the click options of both commands (`optioning.click_options`): `pdserve operator --help` and
  `pdserve router --help` print exactly this;
- the settings reference page, `docs/settings.md` (`python -m pdserve.api.settings_doc > docs/settings.md`; a test
  fails when the page is stale);
- the chart: a test renders the operator Deployment with a non-default value for every setting that has a chart
  value and checks the flag carries it, and that `values.yaml` and `values.schema.json` agree with the table
  (the default, the type, the choices, and never a value the command would refuse).

Below the composition root (the CLIs, the operator's runner) nothing has a default of its own for any of these:
the operator's controller, reconcile, autoscaler loop and collector, and the router, are handed the values.
Code that runs a piece on its own (a test, a benchmark) reads the default from here:
`OperatorSettings.autoscaler_interval_seconds` is 15.0.

A router flag that overrides a field of the router's configuration file (`router_config.RouterConfig`) has no
default of its own: absent, the file's value (or the field's default) stands, and that field is where its default
is written (`config=`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pdserve.api.optioning import Setting, setting
from pdserve.api.policy import HOST_PATH_FLAG
from pdserve.api.router_config import RouterConfig

LogLevel = Literal["debug", "info", "warning", "error"]
LOG_LEVELS: tuple[LogLevel, ...] = ("debug", "info", "warning", "error")
LogFormat = Literal["json", "text"]
BIND_HOST_ENV = "PDSERVE_BIND_HOST"
"""When set, the listen address of the operator's servers and of the router, whatever the flags say (the local test
cluster runs each pod as a process on its own loopback address)."""


@dataclass(frozen=True)
class OperatorSettings:
    """The PDService operator: it reconciles every PDService into its children, and with a Prometheus it runs the
    SLO autoscaler of the pools scaled by pdserve."""

    # ---------------------------------------------------------------------------------------- API server, scope
    kubeconfig: str | None = setting(
        None,
        "--kubeconfig",
        file="existing",
        help="Kubeconfig; default $KUBECONFIG, then the in-cluster service account, then ~/.kube/config.",
    )
    namespaces: tuple[str, ...] = setting(
        (), "--namespace", "-n", help="Watch only this namespace (repeatable).", chart="watch.namespaces"
    )
    all_namespaces: bool = setting(False, "--all-namespaces", "-A", help="Watch every namespace (cluster-wide mode).")

    # ------------------------------------------------------------------------------------------------ servers
    metrics_port: int = setting(
        8080, "--metrics-port", help="Prometheus /metrics port; 0=off.", chart="operator.metricsPort"
    )
    health_port: int = setting(
        8081, "--health-port", help="Liveness /healthz port; 0=off.", chart="operator.healthPort"
    )
    bind: str = setting(
        "0.0.0.0",
        "--bind",
        env=BIND_HOST_ENV,
        help="Address of the metrics and health servers.",
    )

    # ------------------------------------------------------------------------------------------ leader election
    leader_elect: bool = setting(
        True,
        "--leader-elect/--no-leader-elect",
        help="Lease leader election.",
        chart="operator.leaderElection.enabled",
    )
    lease_name: str = setting(
        "pdserve-operator",
        "--lease-name",
        help="Name of the leader Lease.",
        chart="operator.leaderElection.leaseName",
        chart_default="",  # the chart's empty default means the release's full name
    )
    lease_namespace: str | None = setting(
        None, "--lease-namespace", help="Namespace of the Lease; default $POD_NAMESPACE, the watched one, or default."
    )
    lease_seconds: float = setting(
        15.0, "--lease-seconds", help="Lease duration.", chart="operator.leaderElection.leaseSeconds"
    )
    renew_deadline: float = setting(
        10.0, "--renew-deadline", help="Stop acting after this.", chart="operator.leaderElection.renewDeadlineSeconds"
    )
    retry_period: float = setting(
        2.0, "--retry-period", help="Lease acquire/renew period.", chart="operator.leaderElection.retryPeriodSeconds"
    )
    identity: str | None = setting(None, "--identity", help="Leader identity; default hostname + random suffix.")

    # ----------------------------------------------------------------------------------------------- reconcile
    workers: int = setting(4, "--workers", help="Concurrent reconciles (distinct objects).", chart="operator.workers")
    resync_seconds: float = setting(
        60.0, "--resync-seconds", help="Periodic full resync.", chart="operator.resyncSeconds"
    )
    relist_seconds: float = setting(600.0, "--relist-seconds", help="Full relist of children.")
    watch_timeout: int = setting(270, "--watch-timeout", help="Server-side watch timeout (s).")
    model_host_paths: tuple[str, ...] = setting(
        (),
        HOST_PATH_FLAG,
        metavar="PREFIX",
        help="A node folder spec.model.uri may name (repeatable). Default: none, node paths are refused. "
        "Never /, a system folder, or a folder holding one (/var, /opt; docs/security.md lists them).",
        chart="operator.allowModelHostPaths",
    )
    # Long enough that a restarted engine that fails again right after becoming ready (a bad request, memory growth
    # under its first load) is one episode, short enough that a single crash holds kstatus' Ready back for a minute.
    crash_recovery_seconds: float = setting(
        60.0,
        "--crash-recovery-seconds",
        minimum=0,
        help="A crashed container counts (Degraded EngineCrashed/CrashLooping) until running and ready this long.",
    )

    # --------------------------------------------------------------------------------------- the SLO autoscaler
    prometheus_url: str | None = setting(
        None,
        "--prometheus-url",
        metavar="URL",
        help="Prometheus base URL of the SLO autoscaler (e.g. http://prometheus-operated.monitoring.svc:9090). "
        "Without it, pools scaled by pdserve hold their replicas (ScalingActive=False, PrometheusNotConfigured).",
        chart="operator.prometheusUrl",
        chart_default="",  # the chart passes the flag only when the value is not empty
    )
    prometheus_timeout: float = setting(
        5.0,
        "--prometheus-timeout",
        minimum=0.1,
        help="Seconds the autoscaler's Prometheus queries of one tick may take together (one deadline for all of "
        "them; the query in flight when it passes is cancelled and the tick holds).",
    )
    autoscaler_interval_seconds: float = setting(
        15.0,
        "--autoscaler-interval-seconds",
        minimum=0.5,
        help="Seconds between two decisions of the SLO autoscaler (per PDService).",
    )
    autoscaler_window_seconds: float | None = setting(
        None,
        "--autoscaler-window-seconds",
        minimum=1.0,
        help="Rate and quantile window of the autoscaler's queries; default: the interval. Needs a scrape interval "
        "of at most a third of it.",
    )

    # ---------------------------------------------------------------------------------------------------- logs
    log_format: LogFormat = setting("json", "--log-format", help="Log format.", chart="operator.logFormat")
    log_level: LogLevel = setting("info", "--log-level", help="Log level.", chart="operator.logLevel")


@dataclass(frozen=True)
class RouterSettings:
    """The PD router: the OpenAI-compatible endpoint of one PDService. In a cluster the operator runs it with
    `--config`, the file it renders from the PDService (`router_config.RouterConfig`, Kubernetes discovery); given
    engine URLs instead it runs on its own (static mode). Flags given together with `--config` override the file."""

    config_path: str | None = setting(None, "--config", file="any", help="RouterConfig YAML (Kubernetes mode).")
    host: str | None = setting(None, "--host", env=BIND_HOST_ENV, config="host", help="Listen address.")
    port: int | None = setting(None, "--port", config="port", help="Listen port.")
    prefill: tuple[str, ...] = setting((), "--prefill", help="Prefill engine base URL (static mode, repeatable).")
    decode: tuple[str, ...] = setting((), "--decode", help="Decode engine base URL (static mode, repeatable).")
    served_model_name: str | None = setting(
        None, "--served-model-name", help="Model name for /v1/models (default: ask a decode engine)."
    )
    threshold: int | None = setting(
        None,
        "--disaggregation-threshold",
        config="policy.disaggregation_threshold_tokens",
        help="Uncached prompt tokens at or above which a request goes through prefill (0: always).",
    )
    fallback: bool | None = setting(
        None,
        "--fallback/--no-fallback",
        config="policy.fallback_to_decode",
        help="Let decode prefill locally when prefill fails.",
    )
    engine_metrics_interval: float | None = setting(
        None,
        "--engine-metrics-interval",
        minimum=0,
        config="engine_metrics_interval_seconds",
        help="Seconds between scrapes of decode engines' /metrics for KV-cache usage (0: off).",
    )
    kv_events: tuple[str, ...] = setting(
        (),
        "--kv-events",
        metavar="URL=PUB[,REPLAY]",
        help="Static mode: an engine's KV event publisher and replay socket (vLLM --kv-events-config), e.g. "
        "http://10.0.0.5:8000=tcp://10.0.0.5:5557,tcp://10.0.0.5:5657 (repeatable; one per DP rank).",
    )
    metrics_port: int | None = setting(
        None,
        "--metrics-port",
        minimum=0,
        config="metrics_port",
        help="Port of GET /metrics, apart from the client port: the metrics name every engine (0: any free port, "
        "logged).",
    )
    min_body_rate: float | None = setting(
        None,
        "--min-body-rate",
        minimum=0,
        config="min_body_bytes_per_second",
        help="Bytes per second under which a request body still arriving gives way to others when body memory is "
        "short (408).",
    )
    max_chunk_metadata_bytes: int | None = setting(
        None,
        "--max-chunk-metadata-bytes",
        minimum=0,
        config="max_chunk_metadata_bytes",
        help="Chunk extensions and trailers allowed in one chunked request body; more gets 400.",
    )
    client_write_timeout: float | None = setting(
        None,
        "--client-write-timeout",
        minimum=0,
        config="client_write_timeout_seconds",
        help="Seconds a client may leave an answer unread before its connection is closed (its engine request "
        "aborted, the engine not charged).",
    )
    prefill_budget_tokens: int | None = setting(
        None,
        "--prefill-budget-tokens",
        minimum=0,
        config="admission.prefill_budget_tokens",
        help="Uncached prompt tokens one prefill engine may hold across the router replicas; requests wait in the "
        "router until an engine has room (0: unbounded).",
    )
    decode_budget_sequences: int | None = setting(
        None,
        "--decode-budget-sequences",
        minimum=0,
        config="admission.decode_budget_sequences",
        help="Sequences one decode engine may run across the router replicas (its max_num_seqs; 0: unbounded).",
    )
    max_queued_requests: int | None = setting(
        None,
        "--max-queued-requests",
        minimum=1,
        config="admission.max_queued_requests",
        help="Requests waiting in the router at once; beyond, fair shares decide who is refused (429).",
    )
    max_queue_seconds: float | None = setting(
        None,
        "--max-queue-seconds",
        minimum=0,
        config="admission.max_queue_seconds",
        help="Longest wait for an engine with room before 503 with Retry-After.",
    )
    ttft_target_seconds: float | None = setting(
        None,
        "--ttft-target-seconds",
        minimum=0,
        config="admission.ttft_target_seconds",
        help="TTFT target: waiting requests that can still meet it go first.",
    )
    router_replicas: int | None = setting(
        None,
        "--router-replicas",
        minimum=1,
        config="admission.router_replicas",
        help="Router replicas sharing the engines' budgets (each takes its part).",
    )
    client_header: str | None = setting(
        None,
        "--client-header",
        config="admission.client_header",
        help="Header naming the client for fair queueing, set by a trusted proxy (default: Authorization, hashed, "
        "else the peer address).",
    )
    log_level: LogLevel = setting("info", "--log-level", help="Log level.")
    access_log: bool = setting(False, "--access-log/--no-access-log", help="Log every request line (costs CPU).")


COMMANDS: tuple[tuple[str, type[Any]], ...] = (("operator", OperatorSettings), ("router", RouterSettings))
"""Each command's settings table, in the order the reference page lists them."""


def shown_default(row: Setting) -> str | None:
    """What `--help` and the reference page give as the default of an option that has none of its own (a router
    flag overriding a configuration file field: that field's default), else None."""
    if row.config is None:
        return None
    value: Any = RouterConfig.model_construct(served_model_name="")
    for part in row.config.split("."):
        value = getattr(value, part)
    return str(value).lower() if isinstance(value, bool) else str(value)
