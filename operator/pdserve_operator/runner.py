"""Composition root of the operator process: API client, cache, controller, leader election, kopf, servers.

Everything a process has one of is created here and passed down: the API client (by `pdserve.api.kubeclient`'s
order: --kubeconfig, $KUBECONFIG, in-cluster), the metrics and their registry (served on --metrics-port), the
thread pool that applies a wave's objects concurrently, the validated view of every PDService shared by the
reconcile and the autoscaler (`view.SpecViews`), and, with --prometheus-url, the SLO autoscaler's loops
(`autoscaler.loop.Autoscalers`) with their own thread pool for /scale writes (both pools are shut down on exit).
Importing the operator's modules creates none of them.

The settings come from one table (`pdserve.api.settings.OperatorSettings`); this is where they are read, resolved
against the environment (`resolved`) and handed down as plain values: nothing below has a default of its own.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import kopf
import prometheus_client
from kubernetes import client as k8s

from pdserve.api.kubeclient import new_api_client
from pdserve.api.policy import Policy
from pdserve.api.settings import BIND_HOST_ENV, OperatorSettings
from pdserve_operator import handlers
from pdserve_operator.autoscaler.loop import CHECK_S, MAX_BACKOFF, Autoscalers, LoopSettings
from pdserve_operator.autoscaler.metrics import AutoscalerMetrics
from pdserve_operator.autoscaler.report import ScalingBoard
from pdserve_operator.controller import Controller
from pdserve_operator.kinds import PDSERVICE
from pdserve_operator.kube import ApiError, KubeApi
from pdserve_operator.leader import LeaseElector
from pdserve_operator.metrics import OperatorMetrics
from pdserve_operator.service_metrics import PDServiceCollector
from pdserve_operator.view import SpecViews

log = logging.getLogger("pdserve.operator")


# Concurrent applies across all reconciles; the API server, not this pool, is the bottleneck.
APPLY_THREADS = 8
# The threads the autoscaler's loops share for /scale writes and their Events (the Kubernetes client is synchronous;
# Prometheus queries are awaited on the event loop, each loop with its own connection: `autoscaler.prometheus`).
AUTOSCALER_THREADS = 4


def resolved(settings: OperatorSettings) -> OperatorSettings:
    """The settings with what the environment decides filled in: the listen address ($PDSERVE_BIND_HOST wins: pods
    on the local cluster's process node share one network namespace, and the node names each pod's own address, so
    two operator replicas do not both bind 0.0.0.0:8080), the Lease's namespace and the leader identity."""
    return dataclasses.replace(
        settings,
        bind=os.environ.get(BIND_HOST_ENV) or settings.bind,
        lease_namespace=lease_namespace(settings),
        identity=identity(settings),
        prometheus_url=settings.prometheus_url or None,
    )


def lease_namespace(settings: OperatorSettings) -> str:
    """--lease-namespace, else $POD_NAMESPACE (in a cluster: the operator's own), else the first watched one, else
    default."""
    return (
        settings.lease_namespace
        or os.environ.get("POD_NAMESPACE")
        or (settings.namespaces[0] if settings.namespaces else "default")
    )


def identity(settings: OperatorSettings) -> str:
    """--identity, else the hostname and a random suffix (two processes on one host never share an identity)."""
    return settings.identity or f"{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


def connection_pool_size(settings: OperatorSettings) -> int:
    """urllib3 connections the operator's one ApiClient may keep open: one per thread that can be in a request at
    the same time (every reconcile worker, every apply thread, the Lease elector, a relist, the CRD wait) plus
    headroom. The library's default (5 per CPU: 10 on two cores) is smaller than that, and a full pool does not
    block: it opens a fresh TLS connection for the extra request and throws it away afterwards (urllib3 logs
    "Connection pool is full, discarding connection"), a handshake per request exactly when the API is busiest.
    The autoscaler's threads count too: they write /scale and post Events."""
    return settings.workers + APPLY_THREADS + AUTOSCALER_THREADS + 4


def api_client(settings: OperatorSettings) -> k8s.ApiClient:
    """The process's one ApiClient (shared by the reconcilers, the apply pool and the Lease elector)."""
    return new_api_client(settings.kubeconfig, pool_size=connection_pool_size(settings))


async def run(settings: OperatorSettings, policy: Policy) -> None:
    """Run the operator until kopf stops. `policy`: what the administrator allows beyond the API (built from the
    settings by the CLI, which refuses a policy that would undo a guarantee)."""
    options = resolved(settings)
    namespaces, me = list(options.namespaces), identity(options)
    client = api_client(options)
    metrics = OperatorMetrics(process_metrics=True)
    applier = ThreadPoolExecutor(max_workers=APPLY_THREADS, thread_name_prefix="pdserve-apply")
    scaling = ScalingBoard(configured=bool(options.prometheus_url))
    views = SpecViews(policy)
    elector: LeaseElector | None = None
    api = KubeApi(client, is_leader=lambda: elector.is_leader() if elector else True, metrics=metrics)
    controller = Controller(
        api,
        views=views,
        workers=options.workers,
        resync_seconds=options.resync_seconds,
        relist_seconds=options.relist_seconds,
        crash_window=options.crash_recovery_seconds,
        namespaces=namespaces,
        is_leader=api_is_leader(lambda: elector),
        metrics=metrics,
        applier=applier,
        scaling=scaling,
    )
    autoscalers, scaler_pool = autoscaler_loops(options, controller, api, scaling, AutoscalerMetrics(metrics.registry))
    if options.leader_elect:
        # A separate KubeApi so lease traffic is not counted as reconcile traffic (`requests`, `writes`).
        elector = LeaseElector(
            KubeApi(client, metrics=metrics),
            namespace=lease_namespace(options),
            name=options.lease_name,
            identity=me,
            lease_seconds=options.lease_seconds,
            renew_deadline=options.renew_deadline,
            retry_period=options.retry_period,
            on_started_leading=controller.enqueue_all,
        )
    # Each PDService's conditions and SLO targets, read from the controller's cache at scrape time by the leader.
    metrics.registry.register(PDServiceCollector(controller.store, api_is_leader(lambda: elector)))
    if options.metrics_port:
        prometheus_client.start_http_server(options.metrics_port, addr=options.bind, registry=metrics.registry)

    registry = kopf.OperatorRegistry()
    handlers.register(controller, registry, kubeconfig=options.kubeconfig)
    kopf_settings = kopf.OperatorSettings()
    handlers.configure(kopf_settings, server_timeout=options.watch_timeout, client_timeout=options.watch_timeout + 30)
    stop = asyncio.Event()
    liveness = f"http://{options.bind}:{options.health_port}/healthz" if options.health_port else None
    log.info(
        "Starting operator identity=%s namespaces=%s leader_elect=%s prometheus=%s",
        me,
        ",".join(namespaces) or "*",
        options.leader_elect,
        options.prometheus_url or "-",
    )
    await wait_for_crd(KubeApi(client, metrics=metrics))
    tasks = [asyncio.create_task(controller.run(stop))]
    if elector is not None:
        tasks.append(asyncio.create_task(elector.run(stop)))
    if autoscalers is not None:
        tasks.append(asyncio.create_task(autoscalers.run(stop)))
    try:
        await kopf.operator(
            registry=registry,
            settings=kopf_settings,
            standalone=True,  # no kopf peering: leader election is the Lease above
            # Our identity, or kopf derives one from getpass.getuser(), which raises for a uid without a passwd
            # entry: the image's user 65532 (found by running the chart's pod as that user on the process node).
            # kopf types it as a NewType of str that it does not export.
            identity=cast(Any, me),
            clusterwide=not namespaces,
            namespaces=namespaces,
            liveness_endpoint=liveness,
        )
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        applier.shutdown(wait=False, cancel_futures=True)
        if scaler_pool is not None:
            scaler_pool.shutdown(wait=False, cancel_futures=True)
        log.info("Stopped operator identity=%s", me)


def autoscaler_loops(
    options: OperatorSettings, controller: Controller, api: KubeApi, board: ScalingBoard, metrics: AutoscalerMetrics
) -> tuple[Autoscalers | None, ThreadPoolExecutor | None]:
    """The SLO autoscaler's loops and their thread pool, when the operator has a Prometheus (else None, None:
    status then says PrometheusNotConfigured for every pool scaled by pdserve)."""
    url = options.prometheus_url
    if not url:
        return None, None
    from pdserve_operator.autoscaler.collector import Collector, connect  # the Prometheus client: only when used

    pool = ThreadPoolExecutor(max_workers=AUTOSCALER_THREADS, thread_name_prefix="pdserve-autoscaler")
    settings = LoopSettings(
        interval_s=options.autoscaler_interval_seconds,
        window_s=options.autoscaler_window_seconds,
        check_s=CHECK_S,
        max_backoff=MAX_BACKOFF,
    )
    loops = Autoscalers(
        controller.store,
        api,
        board,
        lambda: Collector(connect(url), deadline_s=options.prometheus_timeout),
        views=controller.views,
        metrics=metrics,
        settings=settings,
        executor=pool,
        is_leader=controller.is_leader,
        enqueue=controller.enqueue,
    )
    return loops, pool


async def wait_for_crd(api: KubeApi, max_delay: float = 30.0) -> None:
    """Block until the API server serves PDServices. kopf resolves its resources when it starts and may not pick
    up a CRD created later, so starting before the CRD would leave the operator deaf until restarted."""
    delay = 1.0
    path = PDSERVICE.collection_path(None) + "?limit=1"
    while True:
        try:
            await asyncio.to_thread(api.get, path, PDSERVICE.kind)
            return
        except ApiError as exc:
            if exc.code not in (0, 404, 503):
                return  # e.g. 403 in namespaced RBAC: the resource exists, kopf will list per namespace
            log.warning("Waiting for the PDService CRD to be served error=%s retry_in=%.0fs", exc, delay)
        await asyncio.sleep(delay)
        delay = min(max_delay, delay * 2)


def api_is_leader(elector_ref: Callable[[], LeaseElector | None]) -> Callable[[], bool]:
    """A leader check that reads the elector lazily (it is built after the controller it notifies)."""

    def check() -> bool:
        elector = elector_ref()
        return elector.is_leader() if elector is not None else True

    return check
