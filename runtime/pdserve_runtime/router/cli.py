"""`pdserve router`: run the PD router from a config file (Kubernetes mode) or from flags (static mode).

    pdserve router --port 8080 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
    pdserve router --config /etc/pdserve/router.yaml

Every option is a row of `pdserve.api.settings.RouterSettings` (default, flag and help are written there). Flags
given together with --config override the file. The env variable PDSERVE_BIND_HOST, when set, is the listen address
whatever else says (the local test cluster runs each pod as a process on its own loopback IP).
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
from pydantic.alias_generators import to_camel

from pdserve.api.optioning import click_options, settings_of
from pdserve.api.router_config import RouterConfig
from pdserve.api.settings import BIND_HOST_ENV, RouterSettings, shown_default

ROWS = settings_of(RouterSettings)


def load_config(settings: RouterSettings) -> RouterConfig:
    """The effective configuration: the file (`--config`), then the flags that override one of its fields (a
    `RouterSettings` row with `config=`), then $PDSERVE_BIND_HOST. Raises click errors."""
    data: dict[str, Any] = {}
    if settings.config_path is not None:
        try:
            loaded = yaml.safe_load(Path(settings.config_path).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise click.ClickException(f"cannot read router config {settings.config_path}: {exc}") from None
        if not isinstance(loaded, dict):
            raise click.ClickException(f"router config {settings.config_path} must be a YAML mapping")
        data = loaded
    elif not settings.decode:
        raise click.UsageError("give --config FILE, or at least one --decode URL (static mode)")
    if settings.prefill or settings.decode:
        data["discovery"] = "static"
        data["staticPrefill"] = list(settings.prefill)
        data["staticDecode"] = list(settings.decode)
    data.setdefault("servedModelName", settings.served_model_name or "")
    if settings.served_model_name is not None:
        data["servedModelName"] = settings.served_model_name
    for row in ROWS:
        value = getattr(settings, row.name)
        if row.config is not None and value is not None:
            _put(data, row.config, value)
    if settings.kv_events:
        data["staticKvEvents"] = _kv_event_flags(settings.kv_events)
    bind = os.environ.get(BIND_HOST_ENV)
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


def _put(data: dict[str, Any], path: str, value: object) -> None:
    """Set the configuration file field at `path` (dotted, snake_case) to `value`, under the file's own spelling
    (camelCase), so that a flag replaces the file's value rather than standing beside it."""
    *parents, last = [to_camel(part) for part in path.split(".")]
    for part in parents:
        data[part] = dict(data.get(part) or {})
        data = data[part]
    data[last] = value


@click.command("router")
@click_options(ROWS, shown=shown_default)
def router(**values: Any) -> None:
    """Run the PD router (OpenAI-compatible endpoint)."""
    settings = RouterSettings(**values)
    config = load_config(settings)
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    serve(config, access_log=settings.access_log)


def serve(config: RouterConfig, *, access_log: bool) -> None:
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
    log.info("Started router host=%s port=%d metrics_port=%d discovery=%s threshold=%d", config.host, port,
             router.metrics_port, config.discovery, config.policy.disaggregation_threshold_tokens)  # fmt: skip
    await stop.wait()
    log.info("Stopping router grace=%.0fs", config.shutdown_grace_seconds)
    await router.stop(config.shutdown_grace_seconds)
