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

import click

from pdserve.api.router_config import PickerConfig, RouterConfig
from pdserve_runtime.router.cli import load_config


def _logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")


@click.command("picker")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="RouterConfig YAML (Kubernetes mode).")
@click.option("--host", default=None, help="Listen address (default 0.0.0.0; PDSERVE_BIND_HOST wins).")
@click.option("--port", type=int, default=None, help="HTTP port for /health, /ready and /metrics (default 8080).")
@click.option("--grpc-port", type=int, default=None, help="ext_proc and gRPC health port (default 9002).")
@click.option("--target-port", type=int, default=None, help="Decode pods' sidecar port (default: the engine's).")
@click.option("--fallback-endpoints", type=int, default=None, help="Further decode endpoints listed after the pick.")
@click.option(
    "--max-in-flight-per-decode",
    "max_in_flight",
    type=int,
    default=None,
    help="Shed (429) when every usable decode engine has this many requests in flight (default 0: never).",
)
@click.option("--prefill", multiple=True, help="Prefill engine base URL (static mode, repeatable).")
@click.option("--decode", multiple=True, help="Decode engine base URL (static mode, repeatable).")
@click.option("--served-model-name", default=None, help="Model name (default: none).")
@click.option("--disaggregation-threshold", "threshold", type=int, default=None, help="As for `pdserve router`.")
@click.option("--fallback/--no-fallback", default=None, help="Send to decode when no prefill engine can serve.")
@click.option("--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"]))
def picker(  # noqa: PLR0917 (click passes every option as an argument)
    config_path: str | None,
    host: str | None,
    port: int | None,
    grpc_port: int | None,
    target_port: int | None,
    fallback_endpoints: int | None,
    max_in_flight: int | None,
    prefill: tuple[str, ...],
    decode: tuple[str, ...],
    served_model_name: str | None,
    threshold: int | None,
    fallback: bool | None,
    log_level: str,
) -> None:
    """Run pdserve's endpoint picker for a Gateway API Inference Extension gateway (Envoy ext_proc)."""
    config = load_config(
        config_path,
        host=host,
        port=port,
        prefill=prefill,
        decode=decode,
        served_model_name=served_model_name,
        threshold=threshold,
        fallback=fallback,
    )
    values = {
        name: value
        for name, value in (
            ("grpc_port", grpc_port),
            ("target_port", target_port),
            ("fallback_endpoints", fallback_endpoints),
            ("max_in_flight_per_decode", max_in_flight),
        )
        if value is not None
    }
    try:
        settings = PickerConfig(**values)
    except ValueError as exc:
        raise click.ClickException(f"invalid picker settings:\n{exc}") from None
    _logging(log_level)
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
    log.info("Started picker host=%s grpc_port=%d http_port=%d discovery=%s target_port=%s", config.host, grpc_port,
             app.http_port, config.discovery, settings.target_port)  # fmt: skip
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
@click.option("--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"]))
def sidecar(  # noqa: PLR0917 (click passes every option as an argument)
    host: str | None, port: int, decode: str, served_model_name: str, kv_ports: tuple[int, ...], log_level: str
) -> None:
    """Run the PD sidecar of a decode pod (router mode gateway)."""
    config = load_config(None, host=host, port=port, decode=(decode,), served_model_name=served_model_name)
    if kv_ports:
        config = config.model_copy(update={"kv_side_channel_ports": list(kv_ports)})
    _logging(log_level)
    import uvloop

    uvloop.run(_serve_sidecar(config))


async def _serve_sidecar(config: RouterConfig) -> None:
    from pdserve_runtime.gateway.server import sidecar_app

    log = logging.getLogger("pdserve.sidecar")
    app = sidecar_app(config)
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
