"""`pdserve operator`: run the PDService operator from a kubeconfig (development) or in-cluster (ServiceAccount)."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import urllib.parse
import uuid

import click

from pdserve.api.policy import HOST_PATH_FLAG, Policy, PolicyError

log = logging.getLogger("pdserve.operator")


@click.command("operator")
@click.option(
    "--kubeconfig",
    type=click.Path(exists=True, dir_okay=False),
    help="Kubeconfig; default $KUBECONFIG, then the in-cluster service account, then ~/.kube/config.",
)
@click.option("--namespace", "-n", "namespaces", multiple=True, help="Watch only this namespace (repeatable).")
@click.option("--all-namespaces", "-A", is_flag=True, help="Watch every namespace (cluster-wide mode).")
@click.option("--metrics-port", type=int, default=8080, show_default=True, help="Prometheus /metrics port; 0=off.")
@click.option("--health-port", type=int, default=8081, show_default=True, help="Liveness /healthz port; 0=off.")
@click.option(
    "--bind",
    default="0.0.0.0",
    show_default=True,
    help="Address of the metrics and health servers (PDSERVE_BIND_HOST wins, as for the router and the simulator).",
)
@click.option("--leader-elect/--no-leader-elect", default=True, show_default=True, help="Lease leader election.")
@click.option("--lease-name", default="pdserve-operator", show_default=True, help="Name of the leader Lease.")
@click.option("--lease-namespace", help="Namespace of the Lease; default $POD_NAMESPACE, the watched one, or default.")
@click.option("--lease-seconds", type=float, default=15.0, show_default=True, help="Lease duration.")
@click.option("--renew-deadline", type=float, default=10.0, show_default=True, help="Stop acting after this.")
@click.option("--retry-period", type=float, default=2.0, show_default=True, help="Lease acquire/renew period.")
@click.option("--identity", help="Leader identity; default hostname + random suffix.")
@click.option("--workers", type=int, default=4, show_default=True, help="Concurrent reconciles (distinct objects).")
@click.option("--resync-seconds", type=float, default=60.0, show_default=True, help="Periodic full resync.")
@click.option("--relist-seconds", type=float, default=600.0, show_default=True, help="Full relist of children.")
@click.option("--watch-timeout", type=int, default=270, show_default=True, help="Server-side watch timeout (s).")
@click.option(
    HOST_PATH_FLAG,
    "model_host_paths",
    multiple=True,
    metavar="PREFIX",
    help="A node folder spec.model.uri may name (repeatable). Default: none, node paths are refused. "
    "Never /, a system folder, or a folder holding one (/var, /opt; docs/security.md lists them).",
)
@click.option(
    "--crash-recovery-seconds",
    type=click.FloatRange(min=0),
    default=60.0,  # status.CRASH_RECOVERY_SECONDS (not imported here: the CLI loads the operator lazily)
    show_default=True,
    help="A crashed container counts (Degraded EngineCrashed/CrashLooping) until running and ready this long.",
)
@click.option(
    "--prometheus-url",
    metavar="URL",
    help="Prometheus base URL of the SLO autoscaler (e.g. http://prometheus-operated.monitoring.svc:9090). "
    "Without it, pools scaled by pdserve hold their replicas (ScalingActive=False, PrometheusNotConfigured).",
)
@click.option(
    "--prometheus-timeout",
    type=click.FloatRange(min=0.1),
    default=5.0,
    show_default=True,
    help="Seconds one Prometheus query may take.",
)
@click.option(
    "--autoscaler-interval-seconds",
    type=click.FloatRange(min=0.5),
    default=15.0,
    show_default=True,
    help="Seconds between two decisions of the SLO autoscaler (per PDService).",
)
@click.option(
    "--autoscaler-window-seconds",
    type=click.FloatRange(min=1.0),
    help="Rate and quantile window of the autoscaler's queries; default: the interval. Needs a scrape interval "
    "of at most a third of it.",
)
@click.option("--log-format", type=click.Choice(["json", "text"]), default="json", show_default=True)
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info")
def operator(  # noqa: PLR0917 - click passes every option as an argument
    kubeconfig: str | None,
    namespaces: tuple[str, ...],
    all_namespaces: bool,
    metrics_port: int,
    health_port: int,
    bind: str,
    leader_elect: bool,
    lease_name: str,
    lease_namespace: str | None,
    lease_seconds: float,
    renew_deadline: float,
    retry_period: float,
    identity: str | None,
    workers: int,
    resync_seconds: float,
    relist_seconds: float,
    watch_timeout: int,
    model_host_paths: tuple[str, ...],
    crash_recovery_seconds: float,
    prometheus_url: str | None,
    prometheus_timeout: float,
    autoscaler_interval_seconds: float,
    autoscaler_window_seconds: float | None,
    log_format: str,
    log_level: str,
) -> None:
    """Run the PDService operator."""
    if bool(namespaces) == all_namespaces:
        raise click.UsageError("give either --namespace NS (repeatable) or --all-namespaces")
    if renew_deadline >= lease_seconds:
        raise click.UsageError("--renew-deadline must be shorter than --lease-seconds")
    try:
        policy = Policy.allowing(model_host_paths=model_host_paths)
    except PolicyError as exc:
        raise click.BadParameter(str(exc), param_hint=HOST_PATH_FLAG) from None
    if prometheus_url is not None:
        parsed = urllib.parse.urlsplit(prometheus_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise click.BadParameter(f"not an http(s) URL: {prometheus_url!r}", param_hint="--prometheus-url")
    from pdserve_operator import logs
    from pdserve_operator.runner import Options, run

    logs.setup(log_format, log_level)
    options = Options(
        kubeconfig=kubeconfig,
        namespaces=list(namespaces),
        metrics_port=metrics_port,
        health_port=health_port,
        # Pods on the local cluster's process node share one network namespace: the node names each pod's own
        # address, so two operator replicas do not both bind 0.0.0.0:8080.
        bind=os.environ.get("PDSERVE_BIND_HOST") or bind,
        leader_elect=leader_elect,
        lease_name=lease_name,
        lease_namespace=lease_namespace
        or os.environ.get("POD_NAMESPACE")
        or (namespaces[0] if namespaces else "default"),
        lease_seconds=lease_seconds,
        renew_deadline=renew_deadline,
        retry_period=retry_period,
        identity=identity or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}",
        workers=workers,
        resync_seconds=resync_seconds,
        relist_seconds=relist_seconds,
        watch_timeout=watch_timeout,
        policy=policy,
        crash_recovery_seconds=crash_recovery_seconds,
        prometheus_url=prometheus_url or None,
        prometheus_timeout=prometheus_timeout,
        autoscaler_interval=autoscaler_interval_seconds,
        autoscaler_window=autoscaler_window_seconds,
    )
    try:
        import uvloop

        uvloop.run(run(options))
    except ImportError:  # pragma: no cover - uvloop is a dependency; plain asyncio still works
        asyncio.run(run(options))
