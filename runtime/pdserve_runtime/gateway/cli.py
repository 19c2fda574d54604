"""`pdserve picker` and `pdserve sidecar`: the two processes of router mode gateway.

    pdserve picker --config /etc/pdserve/router.yaml                  # Kubernetes mode (the rendered RouterConfig)
    pdserve picker --grpc-port 9002 --target-port 8100 --prefill http://10.0.0.5:8000 --decode http://10.0.0.7:8000
    pdserve sidecar --port 8100 --decode http://127.0.0.1:8000 --kv-side-channel-port 5600

The picker takes the router's config and flags (`pdserve router --help`), plus its own; PDSERVE_BIND_HOST wins for
the listen address of both, as for the router.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from typing import Any

import click

from pdserve.api.optioning import click_options
from pdserve.api.router_config import PickerConfig, RouterConfig
from pdserve.api.settings import RouterSettings, shown_default
from pdserve_runtime.router.cli import ROWS, load_config


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")


@click.command("picker")
@click.option("--grpc-port", type=int, default=None, help="ext_proc and gRPC health port (default 9002).")
@click.option(
    "--link-port", type=int, default=None, help="Loopback port for pdserve-picker-relay (default 0: no link)."
)
@click.option("--target-port", type=int, default=None, help="Decode pods' sidecar port (default: the engine's).")
@click.option("--fallback-endpoints", type=int, default=None, help="Further decode endpoints listed after the pick.")
@click.option(
    "--max-in-flight-per-decode",
    "max_in_flight",
    type=int,
    default=None,
    help="Shed (429) when every usable decode engine has this many requests in flight (default 0: never).",
)
@click_options(ROWS, shown=shown_default)
def picker(
    grpc_port: int | None,
    link_port: int | None,
    target_port: int | None,
    fallback_endpoints: int | None,
    max_in_flight: int | None,
    **values: Any,
) -> None:
    """Run pdserve's endpoint picker for a Gateway API Inference Extension gateway (Envoy ext_proc).

    Every `pdserve router` option applies (the same config file, discovery and routing policy); its port serves
    /health and /ready, its metrics port /metrics."""
    router_settings = RouterSettings(**values)
    config = load_config(router_settings)
    picks = {
        name: value
        for name, value in (
            ("grpc_port", grpc_port),
            ("link_port", link_port),
            ("target_port", target_port),
            ("fallback_endpoints", fallback_endpoints),
            ("max_in_flight_per_decode", max_in_flight),
        )
        if value is not None
    }
    try:
        settings = PickerConfig(**picks)
    except ValueError as exc:
        raise click.ClickException(f"invalid picker settings:\n{exc}") from None
    _logging(router_settings.log_level)
    import uvloop

    uvloop.run(_serve_picker(config, settings))


async def _serve_picker(config: RouterConfig, settings: PickerConfig) -> None:
    from pdserve_runtime.gateway.server import PickerApp

    log = logging.getLogger("pdserve.picker")
    app = PickerApp(config, settings)
    stop = _stop_event()
    grpc_port = await app.start()
    gc.collect()
    gc.freeze()
    log.info("Started picker host=%s grpc_port=%d link_port=%d http_port=%d metrics_port=%d discovery=%s "
             "target_port=%s", config.host, grpc_port, app.link.port, app.http_port, app.core.metrics_port,
             config.discovery, settings.target_port)  # fmt: skip
    await stop.wait()
    await app.stop(config.shutdown_grace_seconds)


@click.command("sidecar")
@click.option("--host", default=None, help="Listen address (default 0.0.0.0; PDSERVE_BIND_HOST wins).")
@click.option("--port", type=int, required=True, help="Listen port (the InferencePool's target port).")
@click.option("--decode", required=True, help="The local decode engine's base URL, e.g. http://127.0.0.1:8000.")
@click.option("--served-model-name", default="", help="Model name for logs (the engine answers /v1/models).")
@click.option(
    "--kv-side-channel-port",
    "kv_ports",
    type=int,
    multiple=True,
    help="Ports a prefill answer may name as remote_port (repeatable; default: any).",
)
@click.option("--metrics-port", type=int, default=None, help="Port of GET /metrics (default: the router's, 9090).")
@click.option("--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"]))
def sidecar(  # noqa: PLR0917 (click passes every option as an argument)
    host: str | None,
    port: int,
    decode: str,
    served_model_name: str,
    kv_ports: tuple[int, ...],
    metrics_port: int | None,
    log_level: str,
) -> None:
    """Run the PD sidecar of a decode pod (router mode gateway)."""
    settings = RouterSettings(
        host=host, port=port, decode=(decode,), served_model_name=served_model_name, metrics_port=metrics_port
    )
    config = load_config(settings)
    if kv_ports:
        config = config.model_copy(update={"kv_side_channel_ports": list(kv_ports)})
    _logging(log_level)
    import uvloop

    uvloop.run(_serve_sidecar(config))


async def _serve_sidecar(config: RouterConfig) -> None:
    from pdserve_runtime.gateway.server import sidecar_app

    log = logging.getLogger("pdserve.sidecar")
    app = sidecar_app(config, access_log=False)
    stop = _stop_event()
    port = await app.start()
    gc.collect()
    gc.freeze()
    log.info("Started sidecar host=%s port=%d decode=%s", config.host, port, config.static_decode[0])
    await stop.wait()
    await app.stop(config.shutdown_grace_seconds)


def _stop_event() -> asyncio.Event:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    return stop
