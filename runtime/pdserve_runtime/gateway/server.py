"""Wiring of the gateway path's two processes: the endpoint picker and the PD sidecar.

`PickerApp`: the router's core (`RouterApp` without its generation routes: the same endpoint table, discovery,
prefix tracker, scheduler, prober and metrics) plus a gRPC server with Envoy's ext_proc service and gRPC health,
and, with `link_port`, the loopback link of the Go relay that serves ext_proc in front of it (`link.py`).
Its HTTP port serves `/health` and `/ready`, its metrics port (the router's) `/metrics`. Health, as the extension's
protocol names the services: `liveness` is SERVING while the process runs; `readiness` and
`envoy.service.ext_proc.v3.ExternalProcessor` are SERVING while at least one decode engine is usable (re-read every
`_HEALTH_INTERVAL` seconds), so a gateway or a kubelet sends requests to a picker only when it can pick.

`sidecar_app`: a `RouterApp` whose proxy is `SidecarProxy`, with static discovery of the one local decode engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from pdserve.api.router_config import PickerConfig, RouterConfig
from pdserve.api.settings import BIND_HOST_ENV
from pdserve_runtime.gateway.link import LinkServer
from pdserve_runtime.gateway.picker import SERVICE_NAME, EndpointPicker
from pdserve_runtime.gateway.proto import ext_proc_pb2 as pb
from pdserve_runtime.gateway.sidecar import SidecarProxy, sidecar_config
from pdserve_runtime.router.app import RouterApp
from pdserve_runtime.router.discovery import Discovery

_HEALTH_INTERVAL = 0.5


def pod_local_host() -> str:
    """Where the relay's link listens: loopback, or $PDSERVE_BIND_HOST where pods share one network namespace and
    each listens on its own address (the process node); the relay dials the same (`podLocal` in its main.go)."""
    return os.environ.get(BIND_HOST_ENV) or "127.0.0.1"


LIVENESS = "liveness"
READINESS = "readiness"
# Headroom above the body limit for the gRPC message that carries a whole request body back to the gateway.
_MESSAGE_MARGIN = 64 * 1024


class PickerApp:
    """One endpoint picker: the router's scheduling core behind ext_proc."""

    def __init__(
        self, config: RouterConfig, settings: PickerConfig | None = None, discovery: Discovery | None = None
    ) -> None:
        self.config = config
        self.settings = settings or PickerConfig()
        self.core = RouterApp(config, discovery, access_log=False, serve_generation=False)
        self.picker = EndpointPicker(config, self.settings, self.core.scheduler, self.core.tracker, self.core.metrics)
        self.health = health_aio.HealthServicer()
        limit = config.max_request_body_bytes + _MESSAGE_MARGIN
        self.grpc = grpc.aio.server(
            options=[("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
        )
        handler = grpc.stream_stream_rpc_method_handler(
            self.picker.process,
            request_deserializer=pb.ProcessingRequest.FromString,
            response_serializer=pb.ProcessingResponse.SerializeToString,
        )
        self.grpc.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, {"Process": handler}),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        self.link = LinkServer(self.picker, limit)
        self._health_task: asyncio.Task[None] | None = None
        self.grpc_port = 0
        self.http_port = 0

    async def start(
        self,
        host: str | None = None,
        grpc_port: int | None = None,
        http_port: int | None = None,
        *,
        metrics_port: int | None = None,
    ) -> int:
        """Discover engines and listen (gRPC, HTTP health, metrics); returns the gRPC port."""
        self.http_port = await self.core.start(host, http_port, metrics_port=metrics_port)
        bind = host if host is not None else self.config.host
        port = grpc_port if grpc_port is not None else self.settings.grpc_port
        shown = f"[{bind}]" if ":" in bind else bind
        self.grpc_port = self.grpc.add_insecure_port(f"{shown}:{port}")
        await self.grpc.start()
        if self.settings.link_port:
            await self.link.start(self.settings.link_port, pod_local_host())
        await self.health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        await self._update_readiness()
        self._health_task = asyncio.create_task(self._readiness_loop(), name="pdserve-picker-readiness")
        return self.grpc_port

    async def stop(self, grace: float = 0.0) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._health_task
        await self.health.enter_graceful_shutdown()
        await self.link.stop()
        await self.grpc.stop(grace)
        await self.core.stop(grace)

    def ready(self) -> bool:
        return bool(self.core.table.usable("decode"))

    async def _update_readiness(self) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if self.ready() else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in (READINESS, SERVICE_NAME, ""):
            await self.health.set(service, status)

    async def _readiness_loop(self) -> None:
        while True:
            await asyncio.sleep(_HEALTH_INTERVAL)
            await self._update_readiness()


def sidecar_app(config: RouterConfig, *, access_log: bool) -> RouterApp:
    """The PD sidecar: the router with `SidecarProxy` (the plan comes from the picker's header)."""
    return RouterApp(sidecar_config(config), proxy_class=SidecarProxy, access_log=access_log)
