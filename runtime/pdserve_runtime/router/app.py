"""Wiring: the endpoint table, discovery, scheduler, proxy and metrics as one aiohttp application.

`RouterApp` owns every long-lived object of a router (no module-level state), so tests can run several routers
in one process. Besides the generation endpoints it serves `/health` (the process is alive), `/ready` (at least
one decode engine can take traffic: Kubernetes should only send traffic to a router that can serve it),
`/v1/models` and `/metrics`, and runs the prober that brings ejected engines back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from time import monotonic

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdserve.api.router_config import RouterConfig
from pdserve_runtime.router.discovery import Discovery
from pdserve_runtime.router.discovery.static import StaticDiscovery
from pdserve_runtime.router.endpoints import ROLES, EndpointState, EndpointTable
from pdserve_runtime.router.engine_metrics import EngineMetricsScraper
from pdserve_runtime.router.errors import error_response
from pdserve_runtime.router.metrics import RouterMetrics
from pdserve_runtime.router.policy.scheduler import Scheduler
from pdserve_runtime.router.prefix import PrefixTracker
from pdserve_runtime.router.proxy import Proxy

log = logging.getLogger("pdserve.router")


def default_discovery(config: RouterConfig, table: EndpointTable) -> Discovery:
    """Static URLs or the Kubernetes watch, as the config says."""
    if config.discovery == "static":
        return StaticDiscovery(table, config.static_prefill, config.static_decode)
    from pdserve_runtime.router.discovery.kubernetes import KubernetesDiscovery

    return KubernetesDiscovery(config, table)


class RouterApp:
    """One router: its state, its background tasks and its HTTP routes."""

    def __init__(
        self, config: RouterConfig, discovery: Discovery | None = None, engine_metrics_interval: float = 2.0
    ) -> None:
        """`engine_metrics_interval`: seconds between scrapes of decode engines' /metrics (0 turns it off)."""
        self.config = config
        policy = config.policy
        self.tracker = PrefixTracker(
            max_blocks=policy.prefix_tracker_max_blocks, ttl_seconds=policy.prefix_cache_ttl_seconds
        )
        breaker = config.circuit_breaker
        self.table = EndpointTable(
            failure_threshold=breaker.failure_threshold,
            open_seconds=breaker.open_seconds,
            success_threshold=breaker.success_threshold,
            on_removed=self.tracker.forget,
        )
        self.scheduler = Scheduler(self.table, self.tracker, policy, config.topology_labels)
        self.metrics = RouterMetrics(self.table)
        self.proxy = Proxy(config, self.scheduler, self.tracker, self.metrics)
        self.discovery = discovery or default_discovery(config, self.table)
        self._prober: asyncio.Task[None] | None = None
        self._scraper = EngineMetricsScraper(self.table, engine_metrics_interval) if engine_metrics_interval else None
        self._created = int(time.time())

    def web_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_request_body_bytes)
        app.router.add_post("/v1/completions", self.proxy.completions)
        app.router.add_post("/v1/chat/completions", self.proxy.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.prometheus)
        app.middlewares.append(_openai_errors)
        app.on_startup.append(self._startup)
        app.on_cleanup.append(self._cleanup)
        return app

    async def _startup(self, _app: web.Application) -> None:
        await self.proxy.start()
        await self.discovery.start()
        self._prober = asyncio.create_task(self._probe_loop(), name="pdserve-router-prober")
        if self._scraper is not None:
            self._scraper.start(self.proxy.session)

    async def _cleanup(self, _app: web.Application) -> None:
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober
        if self._scraper is not None:
            await self._scraper.stop()
        await self.discovery.stop()
        await self.proxy.close()

    # -- small endpoints -------------------------------------------------------------------------------------

    async def health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, _request: web.Request) -> web.Response:
        usable = {role: len(self.table.usable(role)) for role in ROLES}
        status = 200 if usable["decode"] else 503
        return web.json_response({"ready": status == 200, "usable": usable}, status=status)

    async def models(self, request: web.Request) -> web.StreamResponse:
        name = self.config.served_model_name
        if name:
            model = {"id": name, "object": "model", "created": self._created, "owned_by": "pdserve", "root": name}
            return web.json_response({"object": "list", "data": [model]})
        # No configured name (static mode without --served-model-name): ask a decode engine, which knows.
        for state in self.table.usable("decode"):
            try:
                async with self.proxy.session.get(state.url + "/v1/models") as upstream:
                    if upstream.status == 200:
                        return web.Response(body=await upstream.read(), content_type="application/json")
            except (aiohttp.ClientError, TimeoutError):
                continue
        return error_response(503, "no decode engine is available", headers=self._retry_after())

    async def prometheus(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def _retry_after(self) -> dict[str, str]:
        return {"Retry-After": str(self.config.retry_after_seconds)}

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
        timeout = aiohttp.ClientTimeout(total=self.config.connect_timeout_seconds + 1.0)
        try:
            async with self.proxy.session.get(state.url + breaker.health_path, timeout=timeout) as response:
                ok = response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        if state.breaker.record_probe(ok):
            log.info("Restored %s endpoint=%s after a good health probe", state.endpoint.role, state.endpoint.label)


@web.middleware
async def _openai_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """aiohttp's own HTTP errors (404 path, 405 method) in OpenAI shape instead of text/plain."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(
            exc.status, exc.reason, headers={"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        )
