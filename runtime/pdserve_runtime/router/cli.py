"""`pdserve router`: run the PD router from a config file (Kubernetes mode) or from flags (static mode).

    pdserve router --port 8080 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
    pdserve router --config /etc/pdserve/router.yaml

Flags given together with --config override the file. The env variable PDSERVE_BIND_HOST, when set, is the
listen address whatever else says (the local test cluster runs each pod as a process on its own loopback IP).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
from pathlib import Path
from typing import Any

import click
import yaml
from pydantic import ValidationError

from pdserve.api.router_config import RouterConfig


def load_config(
    config_path: str | None,
    *,
    host: str | None = None,
    port: int | None = None,
    prefill: tuple[str, ...] = (),
    decode: tuple[str, ...] = (),
    served_model_name: str | None = None,
    threshold: int | None = None,
    fallback: bool | None = None,
    engine_metrics_interval: float | None = None,
    kv_events: tuple[str, ...] = (),
) -> RouterConfig:
    """The effective configuration: file, then flags, then PDSERVE_BIND_HOST. Raises click errors."""
    data: dict[str, Any] = {}
    if config_path is not None:
        try:
            loaded = yaml.safe_load(Path(config_path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise click.ClickException(f"cannot read router config {config_path}: {exc}") from None
        if not isinstance(loaded, dict):
            raise click.ClickException(f"router config {config_path} must be a YAML mapping")
        data = loaded
    elif not decode:
        raise click.UsageError("give --config FILE, or at least one --decode URL (static mode)")
    if prefill or decode:
        data["discovery"] = "static"
        data["staticPrefill"] = list(prefill)
        data["staticDecode"] = list(decode)
    data.setdefault("servedModelName", served_model_name or "")
    if served_model_name is not None:
        data["servedModelName"] = served_model_name
    if host is not None:
        data["host"] = host
    if port is not None:
        data["port"] = port
    policy = dict(data.get("policy") or {})
    if threshold is not None:
        policy["disaggregationThresholdTokens"] = threshold
    if fallback is not None:
        policy["fallbackToDecode"] = fallback
    data["policy"] = policy
    if engine_metrics_interval is not None:
        data["engineMetricsIntervalSeconds"] = engine_metrics_interval
    if kv_events:
        data["staticKvEvents"] = _kv_event_flags(kv_events)
    bind = os.environ.get("PDSERVE_BIND_HOST")
    if bind:
        data["host"] = bind
    try:
        return RouterConfig.model_validate(data)
    except ValidationError as exc:
        raise click.ClickException(f"invalid router config:\n{exc}") from None


def _kv_event_flags(values: tuple[str, ...]) -> dict[str, list[dict[str, str]]]:
    """`--kv-events URL=PUB[,REPLAY]` flags as staticKvEvents (a URL repeated: one publisher per DP rank)."""
    out: dict[str, list[dict[str, str]]] = {}
    for value in values:
        url, sep, endpoints = value.partition("=")
        if not sep or not url or not endpoints:
            raise click.BadParameter(f"{value!r} is not URL=tcp://HOST:PORT[,tcp://HOST:REPLAY_PORT]",
                                     param_hint="--kv-events")  # fmt: skip
        publisher, _, replay = endpoints.partition(",")
        entry = {"endpoint": publisher}
        if replay:
            entry["replayEndpoint"] = replay
        out.setdefault(url.rstrip("/"), []).append(entry)
    return out


@click.command("router")
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="RouterConfig YAML (Kubernetes mode).")
@click.option("--host", default=None, help="Listen address (default 0.0.0.0; PDSERVE_BIND_HOST wins).")
@click.option("--port", type=int, default=None, help="Listen port (default 8080).")
@click.option("--prefill", multiple=True, help="Prefill engine base URL (static mode, repeatable).")
@click.option("--decode", multiple=True, help="Decode engine base URL (static mode, repeatable).")
@click.option("--served-model-name", default=None, help="Model name for /v1/models (default: ask a decode engine).")
@click.option(
    "--disaggregation-threshold",
    "threshold",
    type=int,
    default=None,
    help="Uncached prompt tokens at or above which a request goes through prefill (0: always).",
)
@click.option("--fallback/--no-fallback", default=None, help="Let decode prefill locally when prefill fails.")
@click.option(
    "--engine-metrics-interval",
    type=float,
    default=None,
    help="Seconds between scrapes of decode engines' /metrics for KV-cache usage (0: off) [default: 2].",
)
@click.option(
    "--kv-events",
    multiple=True,
    metavar="URL=PUB[,REPLAY]",
    help="Static mode: an engine's KV event publisher and replay socket (vLLM --kv-events-config), e.g. "
    "http://10.0.0.5:8000=tcp://10.0.0.5:5557,tcp://10.0.0.5:5657 (repeatable; one per DP rank).",
)
@click.option("--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--access-log/--no-access-log", default=False, help="Log every request line (costs CPU).")
def router(  # noqa: PLR0917 (click passes every option as an argument)
    config_path: str | None,
    host: str | None,
    port: int | None,
    prefill: tuple[str, ...],
    decode: tuple[str, ...],
    served_model_name: str | None,
    threshold: int | None,
    fallback: bool | None,
    engine_metrics_interval: float | None,
    kv_events: tuple[str, ...],
    log_level: str,
    access_log: bool,
) -> None:
    """Run the PD router (OpenAI-compatible endpoint)."""
    if engine_metrics_interval is not None and engine_metrics_interval < 0:
        raise click.BadParameter("must be >= 0", param_hint="--engine-metrics-interval")
    config = load_config(
        config_path,
        host=host,
        port=port,
        prefill=prefill,
        decode=decode,
        served_model_name=served_model_name,
        threshold=threshold,
        fallback=fallback,
        engine_metrics_interval=engine_metrics_interval,
        kv_events=kv_events,
    )
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    serve(config, access_log=access_log)


def serve(config: RouterConfig, *, access_log: bool = False) -> None:
    """Run the router until SIGINT/SIGTERM, on uvloop."""
    import uvloop

    uvloop.run(_serve(config, access_log))


async def _serve(config: RouterConfig, access_log: bool) -> None:
    from pdserve_runtime.router.app import RouterApp

    log = logging.getLogger("pdserve.router")
    router = RouterApp(config, access_log=access_log)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    port = await router.start()
    # Everything built so far lives as long as the process: move it out of the collector's way so that full
    # collections on the request path only walk request-scoped objects (shorter GC pauses, lower p99).
    gc.collect()
    gc.freeze()
    log.info("Started router host=%s port=%d discovery=%s threshold=%d", config.host, port, config.discovery,
             config.policy.disaggregation_threshold_tokens)  # fmt: skip
    await stop.wait()
    log.info("Stopping router grace=%.0fs", config.shutdown_grace_seconds)
    await router.stop(config.shutdown_grace_seconds)
