"""Wiring: the endpoint table, discovery, scheduler, proxy, metrics and HTTP server as one router.

`RouterApp` owns every long-lived object of a router (no module-level state), so tests can run several routers
in one process. Besides the generation endpoints it serves `/health` (the process is alive), `/ready` (at least
one decode engine can take traffic: Kubernetes should only send traffic to a router that can serve it) and
`/v1/models`; `/metrics` is served on a port of its own (`metricsPort`), because it names every engine and its
load, which the clients of the router must not read. It runs the prober that brings ejected engines back, and
learns each decode engine's context length from its `/v1/models` (`engine_models`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from time import monotonic

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdserve.api.router_config import RouterConfig
from pdserve_runtime.router.control import Controls, ControlsCollector, ControlWatch
from pdserve_runtime.router.discovery import Discovery
from pdserve_runtime.router.discovery.peers import PeerWatch
from pdserve_runtime.router.discovery.static import StaticDiscovery
from pdserve_runtime.router.endpoints import ROLES, EndpointState, EndpointTable, KvEventSource
from pdserve_runtime.router.engine_metrics import EngineMetricsScraper
from pdserve_runtime.router.engine_models import ContextLengthLearner
from pdserve_runtime.router.errors import error_body
from pdserve_runtime.router.gate import Gate
from pdserve_runtime.router.kvhub import KvEventsCollector, KvEventsHub
from pdserve_runtime.router.metrics import RouterMetrics
from pdserve_runtime.router.policy.scheduler import Scheduler
from pdserve_runtime.router.prefix import PrefixTracker
from pdserve_runtime.router.proxy import Proxy
from pdserve_runtime.transport.client import EngineClient, UpstreamError
from pdserve_runtime.transport.server import HttpServer, Request, Responder, ServerLimits

log = logging.getLogger("pdserve.router")

# Largest /v1/models answer relayed from an engine.
_MODELS_LIMIT = 1024 * 1024


def default_discovery(config: RouterConfig, table: EndpointTable, client: EngineClient | None = None) -> Discovery:
    """Static URLs (with the engines' health path as their readiness, read through `client`) or the Kubernetes
    watch, as the config says."""
    if config.discovery == "static":
        breaker = config.circuit_breaker

        async def health(url: str) -> int | None:
            assert client is not None
            try:
                status, _, _ = await client.get(
                    url, breaker.health_path, limit=64 * 1024, within=config.connect_timeout_seconds + 1.0
                )
            except (UpstreamError, TimeoutError):
                return None
            return status

        kv_events = {
            url: [KvEventSource(source.endpoint, source.replay_endpoint) for source in sources]
            for url, sources in config.static_kv_events.items()
        }
        return StaticDiscovery(
            table,
            config.static_prefill,
            config.static_decode,
            kv_events=kv_events if config.policy.kv_events else None,
            health=health if client is not None and config.static_health_interval_seconds > 0 else None,
            interval=config.static_health_interval_seconds,
        )
    from pdserve_runtime.router.discovery.kubernetes import KubernetesDiscovery

    return KubernetesDiscovery(config, table)


def server_limits(config: RouterConfig) -> ServerLimits:
    return ServerLimits(
        max_connections=config.max_connections,
        max_header_bytes=config.max_request_header_bytes,
        max_body_bytes=config.max_request_body_bytes,
        header_timeout=config.header_timeout_seconds,
        body_timeout=config.body_timeout_seconds,
        keep_alive_timeout=config.keep_alive_timeout_seconds,
        max_buffered_bytes=config.max_buffered_body_bytes,
        max_buffered_bytes_per_client=config.max_buffered_body_bytes_per_client,
        min_body_rate=config.min_body_bytes_per_second,
        max_chunk_metadata_bytes=config.max_chunk_metadata_bytes,
        write_timeout=config.client_write_timeout_seconds,
    )


class RouterApp:
    """One router: its state, its background tasks and its HTTP routes."""

    def __init__(
        self,
        config: RouterConfig,
        discovery: Discovery | None = None,
        *,
        access_log: bool,
        proxy_class: type[Proxy] = Proxy,
        serve_generation: bool = True,
    ) -> None:
        """`proxy_class`: the PD flow (the sidecar's plans from the gateway's header: `gateway.sidecar`);
        `serve_generation` False for the endpoint picker, whose HTTP port serves only health (and, on the metrics
        port, metrics)."""
        self.config = config
        policy = config.policy
        self.tracker = PrefixTracker(
            max_blocks=policy.prefix_tracker_max_blocks,
            ttl_seconds=policy.prefix_cache_ttl_seconds,
            block_size=policy.block_size_tokens,
        )
        breaker = config.circuit_breaker
        self.table = EndpointTable(
            failure_threshold=breaker.failure_threshold,
            open_seconds=breaker.open_seconds,
            success_threshold=breaker.success_threshold,
            max_ejected_percent=breaker.max_ejected_percent,
            on_removed=self._forget,
        )
        # KV events: an index per engine that publishes them, following the table (kvhub).
        self.kv_events = KvEventsHub(self.table, max_blocks=policy.prefix_tracker_max_blocks)
        self.table.on_changed = self.kv_events.sync
        self.scheduler = Scheduler(
            self.table, self.tracker, policy, config.topology_labels, kv=self.kv_events if policy.kv_events else None
        )
        self.metrics = RouterMetrics(self.table)
        KvEventsCollector(self.kv_events).register(self.metrics.registry)
        self.gate = Gate(
            config.admission,
            self.table,
            self.scheduler,
            self.metrics.registry,
            fallback_to_decode=policy.fallback_to_decode,
            retry_after_s=config.retry_after_seconds,
        )
        control = config.router_control
        self.controls = Controls(self.scheduler, control.owner_uid if control is not None else None, gate=self.gate)
        self.metrics.registry.register(ControlsCollector(self.scheduler, self.gate))
        self.client = EngineClient(connect_timeout=config.connect_timeout_seconds)
        self.proxy = proxy_class(config, self.scheduler, self.tracker, self.metrics, self.client, gate=self.gate)
        self.discovery = discovery or default_discovery(config, self.table, self.client)
        self._watches: list[PeerWatch | ControlWatch] = []
        limits = server_limits(config)
        self.server = HttpServer(limits, error_body=error_body, access_log=access_log)
        if serve_generation:
            self.server.route("POST", "/v1/completions", self.proxy.completions)
            self.server.route("POST", "/v1/chat/completions", self.proxy.chat_completions)
            self.server.route("GET", "/v1/models", self.models)
        self.server.route("GET", "/health", self.health)
        self.server.route("GET", "/ready", self.ready)
        self.metrics_server = HttpServer(limits, error_body=error_body, access_log=False)
        self.metrics_server.route("GET", "/metrics", self.prometheus)
        self._tasks: list[asyncio.Task[None]] = []
        interval = config.engine_metrics_interval_seconds
        self._scraper = (
            EngineMetricsScraper(
                self.table,
                interval,
                prefill=config.admission.prefill_budget_tokens > 0,
                on_scraped=self.gate.dispatch,
            )
            if interval
            else None
        )
        self.context_lengths = ContextLengthLearner(
            self.table, config.served_model_name, config.connect_timeout_seconds
        )
        self._created = int(time.time())
        self.host = ""
        self.port = 0
        self.metrics_port = 0

    def _forget(self, url: str) -> None:
        """An engine left discovery: a replacement at the same address starts cold and with new connections."""
        self.tracker.forget(url)
        self.client.forget(url)

    async def start(
        self,
        host: str | None = None,
        port: int | None = None,
        *,
        metrics_port: int | None = None,
        reuse_port: bool = False,
    ) -> int:
        """Discover engines, start the background tasks and listen (clients on `port`, Prometheus on
        `metrics_port`; 0: any free port, then `self.port` / `self.metrics_port` say which); returns the client
        port."""
        if self.config.policy.kv_events:
            self.kv_events.start()
        await self.discovery.start()
        self._start_watches()
        self._tasks.append(asyncio.create_task(self._probe_loop(), name="pdserve-router-prober"))
        if self._scraper is not None:
            self._scraper.start(self.client)
        self.context_lengths.start(self.client)
        host = self.host = host if host is not None else self.config.host
        self.metrics_port = await self.metrics_server.start(
            host, metrics_port if metrics_port is not None else self.config.metrics_port
        )
        self.port = await self.server.start(host, port if port is not None else self.config.port, reuse_port=reuse_port)
        return self.port

    @property
    def metrics_url(self) -> str:
        """Where Prometheus reads this router (base URL; the path is /metrics)."""
        host = "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host
        return f"http://{host}:{self.metrics_port}"

    def _start_watches(self) -> None:
        """Kubernetes mode: the other router replicas (budget shares) and the router control ConfigMap."""
        config = self.config
        peers, control = config.admission.peers, config.router_control
        if config.discovery != "kubernetes" or (peers is None and control is None):
            return
        from pdserve.api.kubeclient import new_api_client  # lazy: static mode never loads the kubernetes client

        api = new_api_client()
        if peers is not None:
            self._watches.append(PeerWatch(peers, self._set_replicas, api))
        if control is not None:
            self._watches.append(ControlWatch(control, self.controls, api))
        for watch in self._watches:
            watch.start()

    def _set_replicas(self, count: int) -> None:
        self.gate.replicas = count

    async def stop(self, grace: float = 0.0) -> None:
        """Stop listening, tell every waiting request to retry elsewhere (503), let answers under way finish for up
        to `grace` seconds, stop everything."""
        self.gate.close()
        await self.server.stop(grace)
        await self.metrics_server.stop(0.0)
        await self.context_lengths.stop()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._scraper is not None:
            await self._scraper.stop()
        await self.discovery.stop()
        for watch in self._watches:
            watch.stop()
        await self.kv_events.stop()
        await self.client.close()

    # -- small endpoints -------------------------------------------------------------------------------------

    async def health(self, _request: Request, responder: Responder) -> None:
        responder.send(200, b'{"status":"ok"}')

    async def ready(self, _request: Request, responder: Responder) -> None:
        usable = {role: len(self.table.usable(role)) for role in ROLES}
        status = 200 if usable["decode"] else 503
        responder.send(status, orjson.dumps({"ready": status == 200, "usable": usable}))

    async def models(self, _request: Request, responder: Responder) -> None:
        name = self.config.served_model_name
        if name:
            model = {"id": name, "object": "model", "created": self._created, "owned_by": "pdserve", "root": name}
            responder.send(200, orjson.dumps({"object": "list", "data": [model]}))
            return
        # No configured name (static mode without --served-model-name): ask a decode engine, which knows.
        timeout = self.config.connect_timeout_seconds + 5.0
        for state in self.table.usable("decode"):
            try:
                status, body, _ = await self.client.get(state.url, "/v1/models", limit=_MODELS_LIMIT, within=timeout)
            except (UpstreamError, TimeoutError):
                continue
            if status == 200:
                responder.send(200, body)
                return
        responder.error(503, "no decode engine is available", self._retry_after())

    async def prometheus(self, _request: Request, responder: Responder) -> None:
        responder.send(200, generate_latest(self.metrics.registry), [("Content-Type", CONTENT_TYPE_LATEST)])

    def _retry_after(self) -> list[tuple[str, str]]:
        return [("Retry-After", str(self.config.retry_after_seconds))]

    # -- probing ejected engines ----------------------------------------------------------------------------

    async def _probe_loop(self) -> None:
        interval = self.config.circuit_breaker.probe_interval_seconds
        while True:
            await asyncio.sleep(interval)
            now = monotonic()
            due = [state for role in ROLES for state in self.table.states(role) if state.breaker.probe_due(now)]
            if due:
                await asyncio.gather(*(self._probe(state) for state in due))

    async def _probe(self, state: EndpointState) -> None:
        breaker = self.config.circuit_breaker
        try:
            status, _, _ = await self.client.get(
                state.url, breaker.health_path, limit=64 * 1024, within=self.config.connect_timeout_seconds + 1.0
            )
            ok = status == 200
        except (UpstreamError, TimeoutError):
            ok = False
        if state.breaker.record_probe(ok):
            log.info("Restored %s endpoint=%s after a good health probe", state.endpoint.role, state.endpoint.label)
            self.gate.dispatch()
