"""``pdserve sim``: run one simulated engine, natively or as a drop-in for vLLM's ``serve`` command line.

Native:   ``pdserve sim --role decode --port 8001 --fast``
Drop-in:  ``pdserve sim [native options] serve MODEL --host H --port P --kv-transfer-config '{...}' ...``
          (also ``pdserve sim MODEL --port P ...`` or ``pdserve sim --model M ...``: the arguments of the
          vllm/vllm-openai image, whose entrypoint is ``vllm serve``).

In drop-in mode the role comes from ``kv_transfer_config.kv_role`` (kv_producer = prefill, kv_consumer =
decode, kv_both or absent = both), the engine id from its ``engine_id``, the lease from
``kv_connector_extra_config.kv_lease_duration``, the failure policy from ``kv_load_failure_policy``; the
side channel honours ``VLLM_NIXL_SIDE_CHANNEL_HOST``/``VLLM_NIXL_SIDE_CHANNEL_PORT`` (default 5600). The
kv-compat id is ``PDSERVE_KV_COMPAT`` if set, else derived from model, block size and max-model-len
(:func:`pdserve_sim.config.derive_kv_compat_id`). vLLM flags the simulator does not model are
accepted and logged once. ``PDSERVE_SIM_PRESET``, ``PDSERVE_SIM_FAST``, ``PDSERVE_SIM_SPEED`` and
``PDSERVE_SIM_STARTUP_DELAY`` pick the timing in either mode. ``PDSERVE_BIND_HOST``, when set, is where HTTP
and the side channel bind, whatever ``--host`` says.

On startup the process prints one line ``PDSERVE_SIM_READY {"http_port": ..., "side_channel_port": ...,
"pid": ...}`` to stdout once both listeners are bound (ports given as 0 are resolved there).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import uuid
from typing import Any, cast

import click
import prometheus_client

from pdserve_sim.config import FailurePolicy, FaultConfig, Role, SimConfig, preset
from pdserve_sim.kvevents import KvEventsConfig
from pdserve_sim.kvstore import CONFIG_ENV, StoreError, StoreSettings

log = logging.getLogger("pdserve.sim")

_SIDE_CHANNEL_PORT_DEFAULT = 5600


def _env_port() -> int:
    value = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT")
    return int(value) if value else _SIDE_CHANNEL_PORT_DEFAULT


_VLLM_HINTS = ("--model", "--kv-transfer-config", "--served-model-name", "--tensor-parallel-size", "-tp")


def route_vllm_args(args: list[str], native: set[str], flags: set[str]) -> list[str]:
    """Insert ``serve`` before a vLLM-style argument list that lacks it.

    vLLM's image runs ``vllm serve`` as its entrypoint, so pod args begin with the model (a positional word)
    or with vLLM-only flags. ``native`` are the group's own option names, ``flags`` those taking no value.
    """
    for i, arg in enumerate(args):
        if arg == "serve":
            return args
        name = arg.split("=", 1)[0]
        if name in _VLLM_HINTS and name not in native:
            return [*args[:i], "serve", *args[i:]]
        previous = args[i - 1] if i else ""
        takes_value = previous.startswith("-") and "=" not in previous and previous not in flags
        if not arg.startswith("-") and not takes_value:
            # A positional word that is not a subcommand: vLLM's MODEL argument.
            return [*args[:i], "serve", *args[i:]]
    return args


class _SimGroup(click.Group):
    """A group that routes vLLM-style argument lists (no ``serve`` word) to the ``serve`` subcommand."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        native = {opt for param in self.params for opt in getattr(param, "opts", [])}
        flags = {opt for p in self.params if isinstance(p, click.Option) and p.is_flag for opt in p.opts}
        return super().parse_args(ctx, route_vllm_args(args, native, flags))


@click.group(
    cls=_SimGroup,
    invoke_without_command=True,
    context_settings={"help_option_names": ["-h", "--help"], "show_default": True},
)
@click.option("--role", type=click.Choice(["prefill", "decode", "both"]), default="both", help="PD role.")
@click.option("--host", default="0.0.0.0", help="HTTP bind host (PDSERVE_BIND_HOST overrides).")
@click.option("--port", type=int, default=8000, help="HTTP port (0 = any free port).")
@click.option(
    "--side-channel-port",
    type=int,
    default=None,
    help="KV side-channel port [default: $VLLM_NIXL_SIDE_CHANNEL_PORT or 5600; 0 = any free port].",
)
@click.option(
    "--side-channel-host",
    default=None,
    help="Host advertised as remote_host [default: $VLLM_NIXL_SIDE_CHANNEL_HOST or the bind host].",
)
@click.option("--model", default="sim-model", help="Model name served.")
@click.option("--served-model-name", multiple=True, help="Extra names the model answers to (repeatable).")
@click.option(
    "--preset",
    default=lambda: os.environ.get("PDSERVE_SIM_PRESET", "cpu-tiny"),
    help="Timing preset: cpu-tiny, cpu-tiny-shared, h200-8b or fast [default: $PDSERVE_SIM_PRESET or cpu-tiny].",
)
@click.option(
    "--fast",
    is_flag=True,
    default=lambda: os.environ.get("PDSERVE_SIM_FAST", "") not in ("", "0", "false"),
    help="Near-zero latency (the fast preset, no modelled sleeps) [env PDSERVE_SIM_FAST].",
)
@click.option(
    "--speed",
    type=float,
    default=lambda: float(os.environ.get("PDSERVE_SIM_SPEED", "1.0")),
    help="Divide every modelled duration by this [env PDSERVE_SIM_SPEED].",
)
@click.option("--engine-id", default=None, help="NIXL engine id [default: random per process].")
@click.option("--kv-compat-id", default=None, help="KV compatibility id [default: derived from the model].")
@click.option("--kv-lease-seconds", type=float, default=30.0, help="How long prefill holds un-pulled KV.")
@click.option(
    "--kv-load-failure-policy", type=click.Choice(["fail", "recompute"]), default="fail", help="On a failed pull."
)
@click.option("--kv-transfer-timeout", type=float, default=5.0, help="Seconds decode retries a KV pull.")
@click.option(
    "--kv-handshake-seconds",
    type=float,
    default=0.0,
    help="Modelled one-time handshake per new prefill peer (real NIXL: ~5 s per P-D pair).",
)
@click.option("--block-size", type=int, default=None, help="KV block size in tokens [default: preset's].")
@click.option("--max-model-len", type=int, default=None, help="Context length [default: preset's].")
@click.option("--num-kv-blocks", type=int, default=None, help="KV capacity in blocks [default: preset's].")
@click.option("--max-num-seqs", type=int, default=None, help="Max running sequences [default: preset's].")
@click.option("--max-num-batched-tokens", type=int, default=None, help="Token budget per step.")
@click.option("--kv-bytes-per-token", type=int, default=None, help="Side-channel payload per prompt token.")
@click.option(
    "--tensor-parallel-size", type=int, default=1, help="Reported TP size (prefill TP > decode TP refuses pulls)."
)
@click.option(
    "--eos-mean-tokens",
    type=float,
    default=0.0,
    help="Mean natural output length for requests without ignore_eos (0 = never stop early).",
)
@click.option(
    "--shutdown-timeout",
    type=float,
    default=0.0,
    help="On SIGTERM, refuse new requests (503) and, for up to this many seconds, finish in-flight ones and serve "
    "pulls of the KV handed out until pulled or expired (0 = abort at once, vLLM's default).",
)
@click.option(
    "--kv-events-config",
    default=None,
    help="vLLM's KV events config (JSON: enable_kv_cache_events, publisher, endpoint, replay_endpoint, topic).",
)
@click.option("--enable-prompt-tokens-details", is_flag=True, help="Report cached prompt tokens in usage.")
@click.option("--enable-request-id-headers", is_flag=True, help="Send X-Request-Id response headers.")
@click.option("--fault-fail-next", type=int, default=0, help="Fail the next N generation requests.")
@click.option("--fault-fail-status", type=int, default=503, help="Status of injected failures.")
@click.option("--fault-latency", type=float, default=0.0, help="Extra seconds before each request.")
@click.option("--fault-stall-after", type=int, default=None, help="Stall streams after K tokens.")
@click.option("--fault-disconnect-after", type=int, default=None, help="Cut streams after K tokens.")
@click.option("--fault-drop-side-channel", is_flag=True, help="Close side-channel connections unanswered.")
@click.option("--fault-unready", is_flag=True, help="Answer /health with 503.")
@click.option("--fault-crash-after-requests", type=int, default=None, help="Exit on the Nth request.")
@click.option(
    "--startup-delay",
    type=float,
    default=lambda: float(os.environ.get("PDSERVE_SIM_STARTUP_DELAY", "0")),
    help="Seconds before the listeners open, like vLLM loading a model [env PDSERVE_SIM_STARTUP_DELAY].",
)
@click.option("--log-level", default="info", type=click.Choice(["debug", "info", "warning", "error"]))
@click.pass_context
def sim(ctx: click.Context, /, **options: Any) -> None:
    """Run the vLLM-compatible prefill/decode engine simulator."""
    ctx.obj = options
    _setup_logging(options["log_level"])
    if ctx.invoked_subcommand is None:
        config = build_config(options, {})
        run(config, options["log_level"], options["startup_delay"])


@sim.command(
    "serve",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
)
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def serve(ctx: click.Context, vllm_args: tuple[str, ...]) -> None:
    """Drop-in for ``vllm serve MODEL ...``: accepts vLLM's command line (see the module docstring)."""
    if "--help" in vllm_args or "-h" in vllm_args:
        click.echo(
            "Usage: pdserve sim [NATIVE OPTIONS] serve MODEL [vLLM serve flags]\n\n"
            "Drop-in for `vllm serve`. Modelled flags: --model, --host, --port, --kv-transfer-config,\n"
            "--kv-events-config, --tensor-parallel-size/-tp, --max-model-len, --block-size, --served-model-name,\n"
            "--max-num-seqs, --max-num-batched-tokens, --num-gpu-blocks-override, --enable-prompt-tokens-details,\n"
            "--enable-request-id-headers, --shutdown-timeout; other vLLM flags are accepted and ignored.\n"
            "Timing comes from the native options before `serve` or PDSERVE_SIM_PRESET/_FAST/_SPEED.\n"
            "See `pdserve sim --help` for the native options."
        )
        return
    options = dict(ctx.obj or {})
    vllm = parse_vllm_args(list(vllm_args))
    config = build_config(options, vllm)
    run(config, options.get("log_level", "info"), options.get("startup_delay") or 0.0)


def _kv_events(text: str) -> KvEventsConfig | None:
    """vLLM's --kv-events-config JSON as the simulator's config (None: events off)."""
    try:
        raw = json.loads(text)
    except ValueError as exc:
        raise click.BadParameter(f"--kv-events-config is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise click.BadParameter("--kv-events-config must be a JSON object")
    try:
        return KvEventsConfig.from_vllm(raw)
    except (TypeError, ValueError) as exc:
        raise click.BadParameter(f"--kv-events-config: {exc}") from None


def parse_vllm_args(args: list[str]) -> dict[str, Any]:
    """The vLLM flags the simulator models; everything else is collected under ``"ignored"``."""
    parser = argparse.ArgumentParser(prog="pdserve sim serve", add_help=False, allow_abbrev=False)
    parser.add_argument("model_tag", nargs="?")
    parser.add_argument("--model")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--kv-transfer-config")
    parser.add_argument("--kv-events-config")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int)
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--block-size", type=int)
    parser.add_argument("--served-model-name", nargs="+")
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--num-gpu-blocks-override", type=int)
    parser.add_argument("--enable-prompt-tokens-details", action="store_true", default=None)
    parser.add_argument("--shutdown-timeout", type=float)
    parser.add_argument("--enable-request-id-headers", action="store_true", default=None)
    ns, unknown = parser.parse_known_args(args)
    out: dict[str, Any] = {k: v for k, v in vars(ns).items() if v is not None}
    if "model_tag" in out:
        out.setdefault("model", out.pop("model_tag"))
    if "kv_transfer_config" in out:
        try:
            ktc = json.loads(out["kv_transfer_config"])
        except ValueError as exc:
            raise click.BadParameter(f"--kv-transfer-config is not JSON: {exc}") from None
        if not isinstance(ktc, dict):
            raise click.BadParameter("--kv-transfer-config must be a JSON object")
        out["kv_transfer_config"] = ktc
    if "kv_events_config" in out:
        out["kv_events_config"] = _kv_events(out["kv_events_config"])
    out["ignored"] = unknown
    return out


def _native_kv_events(options: dict[str, Any]) -> KvEventsConfig | None:
    text = options.get("kv_events_config")
    return _kv_events(text) if text else None


def build_config(options: dict[str, Any], vllm: dict[str, Any]) -> SimConfig:
    """Merge native options, vLLM drop-in flags and the environment into a SimConfig."""
    fast = bool(options.get("fast"))
    try:
        timing = preset("fast" if fast else options.get("preset") or "cpu-tiny")
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--preset") from None
    overrides: dict[str, int] = {}
    for key, field in (
        ("block_size", "block_size"),
        ("max_model_len", "max_model_len"),
        ("num_kv_blocks", "num_kv_blocks"),
        ("num_gpu_blocks_override", "num_kv_blocks"),
        ("max_num_seqs", "max_num_seqs"),
        ("max_num_batched_tokens", "max_num_batched_tokens"),
        ("kv_bytes_per_token", "kv_payload_bytes_per_token"),
    ):
        value = vllm.get(key, options.get(key))
        if value is not None:
            if value <= 0:
                raise click.BadParameter(f"{key} must be positive")
            overrides[field] = value
    if overrides:
        timing = timing.with_overrides(**overrides)

    role = options.get("role") or "both"
    engine_id = options.get("engine_id")
    lease = float(options.get("kv_lease_seconds", 30.0))
    policy = options.get("kv_load_failure_policy") or "fail"
    kv_compat = options.get("kv_compat_id")
    ktc = vllm.get("kv_transfer_config")
    dropin = bool(vllm)
    store: StoreSettings | None = None
    if dropin:
        role = "both"
        if ktc:
            ktc, store = _connectors(ktc)
            role = {"kv_producer": "prefill", "kv_consumer": "decode"}.get(str(ktc.get("kv_role")), "both")
            engine_id = ktc.get("engine_id") or engine_id
            extra = ktc.get("kv_connector_extra_config") or {}
            if isinstance(extra, dict) and extra.get("kv_lease_duration") is not None:
                lease = float(extra["kv_lease_duration"])
            if ktc.get("kv_load_failure_policy") in ("fail", "recompute"):
                policy = ktc["kv_load_failure_policy"]
        kv_compat = os.environ.get("PDSERVE_KV_COMPAT") or kv_compat
        ignored = vllm.get("ignored") or []
        if ignored:
            log.info("Ignored vLLM flags the simulator does not model: %s", " ".join(ignored))

    model = vllm.get("model") or options.get("model") or "sim-model"
    served = tuple(vllm.get("served_model_name") or options.get("served_model_name") or ())
    host = vllm.get("host") or options.get("host") or "0.0.0.0"
    port = vllm.get("port", options.get("port", 8000))
    bind = os.environ.get("PDSERVE_BIND_HOST") or host
    side_port = options.get("side_channel_port")
    if side_port is None:
        side_port = _env_port()
    advertised = (
        options.get("side_channel_host")
        or os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST")
        or (bind if bind not in ("0.0.0.0", "::", "") else "127.0.0.1")
    )
    tp = int(vllm.get("tensor_parallel_size") or options.get("tensor_parallel_size") or 1)
    faults = FaultConfig(
        fail_next=int(options.get("fault_fail_next") or 0),
        fail_status=int(options.get("fault_fail_status") or 503),
        latency_s=float(options.get("fault_latency") or 0.0),
        stall_after_tokens=options.get("fault_stall_after"),
        disconnect_after_tokens=options.get("fault_disconnect_after"),
        drop_side_channel=bool(options.get("fault_drop_side_channel")),
        unready=bool(options.get("fault_unready")),
        crash_after_requests=options.get("fault_crash_after_requests"),
    )
    return SimConfig(
        role=cast(Role, role),
        model=model,
        served_model_names=served,
        host=bind,
        port=int(port),
        side_channel_host=advertised,
        side_channel_bind_host=bind,
        side_channel_port=int(side_port),
        engine_id=engine_id or f"sim-{role}-{uuid.uuid4().hex[:12]}",
        kv_compat_id=kv_compat or "",
        kv_lease_seconds=lease,
        kv_load_failure_policy=cast(FailurePolicy, policy),
        kv_transfer_timeout_s=float(options.get("kv_transfer_timeout", 5.0)),
        kv_handshake_s=float(options.get("kv_handshake_seconds") or 0.0),
        timing=timing,
        fast=fast or options.get("preset") == "fast",
        speed=float(options.get("speed") or 1.0),
        tensor_parallel_size=tp,
        eos_mean_tokens=float(options.get("eos_mean_tokens") or 0.0),
        prompt_tokens_details=bool(
            vllm.get("enable_prompt_tokens_details") or options.get("enable_prompt_tokens_details")
        ),
        request_id_headers=bool(vllm.get("enable_request_id_headers") or options.get("enable_request_id_headers")),
        shutdown_timeout_s=float(vllm.get("shutdown_timeout", options.get("shutdown_timeout")) or 0.0),
        kv_events=vllm["kv_events_config"] if "kv_events_config" in vllm else _native_kv_events(options),
        faults=faults,
        kv_store=store,
    )


def _connectors(ktc: dict[str, Any]) -> tuple[dict[str, Any], StoreSettings | None]:
    """vLLM's MultiConnector config split into its NIXL entry (what the simulator models as its side channel, with
    the top level's role and engine id) and the Mooncake store's settings; a plain connector config as it is."""
    if ktc.get("kv_connector") != "MultiConnector":
        return ktc, None
    children = (ktc.get("kv_connector_extra_config") or {}).get("connectors") or []
    if not isinstance(children, list) or not all(isinstance(child, dict) for child in children):
        raise click.BadParameter("--kv-transfer-config: MultiConnector needs a list of connector objects")
    nixl: dict[str, Any] = next((child for child in children if child.get("kv_connector") == "NixlConnector"), {})
    merged = {**ktc, **nixl, "engine_id": nixl.get("engine_id") or ktc.get("engine_id")}
    mooncake = next((child for child in children if child.get("kv_connector") == "MooncakeStoreConnector"), None)
    modelled = {"NixlConnector", "MooncakeStoreConnector"}
    others = sorted({str(child.get("kv_connector")) for child in children} - modelled)
    if others:
        log.info("Accepted KV connectors the simulator does not model: %s", ", ".join(others))
    if mooncake is None:
        return merged, None
    try:
        return merged, StoreSettings.from_vllm(mooncake, os.environ.get(CONFIG_ENV))
    except StoreError as exc:
        raise click.ClickException(str(exc)) from None


def _setup_logging(log_level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )


def run(config: SimConfig, log_level: str = "info", startup_delay: float = 0.0) -> None:
    """Serve until SIGINT/SIGTERM (after ``startup_delay`` seconds of modelled model loading)."""
    _setup_logging(log_level)
    # vLLM's /metrics has no *_created series; keep the exposition the same (this process only).
    prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover - uvloop is a dependency, but stay runnable without it
        pass
    asyncio.run(_serve(config, startup_delay))


async def _serve(config: SimConfig, startup_delay: float = 0.0) -> None:
    from pdserve_sim.server import SimServer

    if startup_delay > 0:
        # vLLM opens its port only once the model is loaded; so does the simulator.
        log.info("Loading model=%s (modelled startup of %.1f s)", config.model, startup_delay)
        await asyncio.sleep(startup_delay)
    server = SimServer(config)
    try:
        await server.start()
    except OSError as exc:
        raise click.ClickException(f"cannot bind: {exc}") from None
    except StoreError as exc:
        raise click.ClickException(f"cannot use the KV store: {exc}") from None
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    ready = {"http_port": server.http_port, "side_channel_port": server.side_channel_port, "pid": os.getpid()}
    log.info(
        "Started simulator role=%s model=%s engine_id=%s http=%s:%d side_channel=%s:%d advertised=%s "
        "kv_compat_id=%s fast=%s speed=%s",
        config.role,
        config.public_model_name,
        config.engine_id,
        config.host,
        server.http_port,
        config.side_channel_bind_host,
        server.side_channel_port,
        config.side_channel_host,
        config.effective_kv_compat_id,
        config.fast,
        config.speed,
    )
    print("PDSERVE_SIM_READY " + json.dumps(ready), flush=True)
    try:
        await stop.wait()
        if config.shutdown_timeout_s > 0:
            await server.drain(config.shutdown_timeout_s)
    finally:
        log.info("Stopping simulator engine_id=%s", config.engine_id)
        await server.stop()
