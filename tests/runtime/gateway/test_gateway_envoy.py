"""The gateway path on loopback: a real Envoy configured as a GIE gateway, pdserve's picker, PD sidecars, simulators.

Each decode engine and its sidecar share one loopback address (127.0.0.x), as an engine and its sidecar share a pod
IP; the picker's target port is the sidecars' port, as the InferencePool's targetPorts say.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pdserve.api.router_config import PickerConfig, RouterConfig
from pdserve_dev.testing import rawhttp
from pdserve_dev.testing.envoy import BodyMode, EnvoyProcess, FailureMode, gateway_bootstrap, run_envoy, run_relay
from pdserve_dev.testing.metrics import metric_value, scrape
from pdserve_dev.testing.net import free_port, free_ports
from pdserve_dev.testing.sim import SimHandle, requests_seen, set_faults, sim_in_process, sim_server_in_process
from pdserve_dev.testing.wait import wait_for_async
from pdserve_runtime.gateway.server import PickerApp, sidecar_app
from pdserve_runtime.router.app import RouterApp
from pdserve_runtime.router.endpoints import EndpointTable

pytestmark = pytest.mark.timeout(90)

LONG = "The history of the river valley settlements began with small farms. " * 30  # ~ 360 tokens
SHORT = "Say hi."
DECODE_HOSTS = ("127.0.0.21", "127.0.0.22")
PREFILL_HOST = "127.0.0.20"


async def by_source(url: str, source: str) -> float:
    return metric_value(await scrape(url), "vllm:prompt_tokens_by_source_total", source=source)


@dataclass
class Gateway:
    envoy: EnvoyProcess
    picker: PickerApp | None
    prefill: SimHandle
    decodes: list[SimHandle]
    sidecars: list[RouterApp]
    servers: list[Any]  # the decode engines' SimServers (to kill one)


@contextlib.asynccontextmanager
async def gateway(
    tmp_path: Path,
    *,
    failure_mode: FailureMode = "FailClose",
    picker: bool = True,
    body_mode: BodyMode = "full-duplex",
    relay: bool = True,
    http1_trailers: bool = False,
    **picker_settings: Any,
) -> AsyncIterator[Gateway]:
    """The gateway path; `relay`: Envoy talks to pdserve-picker-relay, which talks to the picker's link (what the
    operator deploys), else to the picker's own gRPC ext_proc service."""
    sidecar_port = free_port()
    async with contextlib.AsyncExitStack() as stack:
        prefill = await stack.enter_async_context(
            sim_in_process(role="prefill", host=PREFILL_HOST, side_channel_host=PREFILL_HOST)
        )
        servers = [await stack.enter_async_context(sim_server_in_process(role="decode", host=h)) for h in DECODE_HOSTS]
        decodes = [SimHandle(h, server.http_port, 0) for h, server in zip(DECODE_HOSTS, servers, strict=True)]
        sidecars = []
        for decode in decodes:
            config = RouterConfig(
                served_model_name="sim-model", discovery="static", static_decode=[decode.url],
                engine_metrics_interval_seconds=0.0,
            )  # fmt: skip
            app = sidecar_app(config, access_log=False)
            await app.start(decode.host, sidecar_port, metrics_port=0)
            stack.push_async_callback(app.stop)
            sidecars.append(app)
        grpc_port, http_port, listen, admin, link_port, relay_port = free_ports(6)
        app_picker = None
        if picker:
            config = RouterConfig(
                served_model_name="sim-model",
                discovery="static",
                static_prefill=[prefill.url],
                static_decode=[d.url for d in decodes],
                engine_metrics_interval_seconds=0.0,
            )
            settings = PickerConfig(
                grpc_port=grpc_port, link_port=link_port if relay else 0, target_port=sidecar_port, **picker_settings
            )
            app_picker = PickerApp(config, settings)
            await app_picker.start("127.0.0.1", grpc_port, http_port, metrics_port=0)
            stack.push_async_callback(app_picker.stop)
        if relay:
            await stack.enter_async_context(
                run_relay(("127.0.0.1", relay_port), ("127.0.0.1", link_port), ("127.0.0.1", grpc_port), tmp_path)
            )
        bootstrap = gateway_bootstrap(
            listen=("127.0.0.1", listen),
            admin=("127.0.0.1", admin),
            picker=("127.0.0.1", relay_port if relay else grpc_port),
            pool=[(h, sidecar_port) for h in DECODE_HOSTS],
            failure_mode=failure_mode,
            body_mode=body_mode,
            http1_trailers=http1_trailers,
        )
        envoy = await stack.enter_async_context(run_envoy(bootstrap, tmp_path / "envoy"))
        yield Gateway(envoy, app_picker, prefill, decodes, sidecars, servers)


@pytest.mark.parametrize("relay", [True, False], ids=["relay", "picker-grpc"])
@pytest.mark.parametrize("body_mode", ["full-duplex", "buffered"])
async def test_long_prompts_take_pd_through_the_sidecar_and_short_ones_go_decode_only(
    tmp_path: Path, body_mode: BodyMode, relay: bool
) -> None:
    async with gateway(tmp_path, body_mode=body_mode, relay=relay) as gw, aiohttp.ClientSession() as session:
        body = {"model": "sim-model", "prompt": LONG, "max_tokens": 8, "stream": True}
        async with session.post(gw.envoy.url + "/v1/completions", json=body) as response:
            text = await response.text()
            assert response.status == 200, text
            assert response.headers["X-Pdserve-Route"] == "pd"
        assert text.count("data: {") == 8
        assert text.endswith("data: [DONE]\n\n")
        assert await requests_seen(gw.prefill.url) == 1
        pulled = [await by_source(d.url, "external_kv_transfer") for d in gw.decodes]
        assert sorted(pulled)[0] == 0 and sorted(pulled)[1] > 300
        body = {"model": "sim-model", "prompt": SHORT, "max_tokens": 4}
        async with session.post(gw.envoy.url + "/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            assert response.headers["X-Pdserve-Route"] == "decode-only"
        assert await requests_seen(gw.prefill.url) == 1


@pytest.mark.parametrize("relay", [True, False], ids=["relay", "picker-grpc"])
async def test_a_request_whose_body_ends_with_trailers_is_picked_and_served(tmp_path: Path, relay: bool) -> None:
    """In full duplex (GIE's mode) a body that ends with trailers never carries end_of_stream: the trailers end it,
    and the pick follows them (before, the relay and the picker answered the trailers alone, and Envoy sent the
    request on unpicked with an empty body: a 400). The buffered modes cannot do this (docs/gateway.md): Envoy
    holds the trailers until the body chunk is answered."""
    async with gateway(tmp_path, relay=relay, http1_trailers=True) as gw:
        body = json.dumps({"model": "sim-model", "prompt": LONG, "max_tokens": 4}).encode()
        status, headers, answer = await rawhttp.send(gw.envoy.url, _chunked_with_trailers(body), within=8.0)
        assert status == 200, answer
        assert headers["x-pdserve-route"] == "pd"
        assert json.loads(answer)["usage"]["completion_tokens"] == 4
        assert await requests_seen(gw.prefill.url) == 1


def _chunked_with_trailers(body: bytes) -> bytes:
    """POST /v1/completions as HTTP/1.1 chunked, in two chunks, ended by a trailer field (aiohttp's client cannot
    send trailers)."""
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\nTrailer: x-body-digest\r\nConnection: close\r\n\r\n"
    )
    half = len(body) // 2
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:half], body[half:]))
    return head + chunks + b"0\r\nx-body-digest: 0123\r\n\r\n"


async def test_client_supplied_prefill_header_and_kv_params_are_never_trusted(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw, aiohttp.ClientSession() as session:
        # A short prompt naming a prefill host of its own, and KV params pointing at the real prefill engine: the
        # picker removes the header, the sidecar strips the params, and decode computes the prompt itself.
        forged = {"do_remote_prefill": True, "remote_host": PREFILL_HOST, "remote_port": 1, "remote_block_ids": [[1]]}
        body = {"model": "sim-model", "prompt": SHORT, "max_tokens": 2, "kv_transfer_params": forged}
        headers = {"x-prefiller-host-port": f"{PREFILL_HOST}:{gw.prefill.http_port}"}
        async with session.post(gw.envoy.url + "/v1/completions", json=body, headers=headers) as response:
            assert response.status == 200, await response.text()
            assert response.headers["X-Pdserve-Route"] == "decode-only"
        assert await requests_seen(gw.prefill.url) == 0
        assert sum([await by_source(d.url, "external_kv_transfer") for d in gw.decodes]) == 0
        assert sum([await by_source(d.url, "local_compute") for d in gw.decodes]) > 0


@pytest.mark.parametrize(("mode", "get_status"), [("FailOpen", 200), ("FailClose", 503)])
async def test_picker_down_gives_the_pools_failure_mode(tmp_path: Path, mode: FailureMode, get_status: int) -> None:
    async with gateway(tmp_path, failure_mode=mode, picker=False) as gw, aiohttp.ClientSession() as session:
        # FailOpen: Envoy still serves what it can send without the picker (to a pool endpoint of its own choice).
        async with session.get(gw.envoy.url + "/v1/models") as response:
            assert response.status == get_status, await response.text()
        # A POST: Envoy 1.40 fails open only if it learns the picker is down before it has streamed the body into
        # the ext_proc stream (the body is gone otherwise), so under FailOpen a completion may get either answer;
        # under FailClose never anything but the status_on_error. Either way nothing reaches an engine unplanned
        # but a whole request served decode-only.
        body = {"model": "sim-model", "prompt": LONG, "max_tokens": 2, "stream": True}
        async with session.post(gw.envoy.url + "/v1/completions", json=body) as response:
            text = await response.text()
            assert response.status in ((200, 503) if mode == "FailOpen" else (503,)), text
            if response.status == 200:
                assert response.headers["X-Pdserve-Route"] == "decode-only"
                assert text.endswith("data: [DONE]\n\n")
        assert await requests_seen(gw.prefill.url) == 0
        assert sum([await requests_seen(d.url) for d in gw.decodes]) == (response.status == 200)


async def test_no_ready_decode_engine_is_503_with_retry_after(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw, aiohttp.ClientSession() as session:
        assert gw.picker is not None
        for decode in gw.decodes:
            await set_faults(decode.url, unready=True)
        picker = gw.picker
        await wait_for_async(lambda: _none_usable(picker), message="the picker saw both engines unready")
        body = {"model": "sim-model", "prompt": SHORT, "max_tokens": 2}
        async with session.post(gw.envoy.url + "/v1/completions", json=body) as response:
            answer = await response.json()
            assert response.status == 503
            assert response.headers["Retry-After"] == "2"
        assert answer["error"]["code"] == 503
        assert sum([await requests_seen(d.url) for d in gw.decodes]) == 0


async def _none_usable(picker: PickerApp) -> bool:
    return not picker.core.table.usable("decode")


async def test_every_engine_at_its_limit_is_429(tmp_path: Path) -> None:
    async with gateway(tmp_path, max_in_flight_per_decode=1) as gw, aiohttp.ClientSession() as session:
        assert gw.picker is not None
        for decode in gw.decodes:
            await set_faults(decode.url, latency_s=30.0)
        body = {"model": "sim-model", "prompt": SHORT, "max_tokens": 2}
        held = [asyncio.create_task(session.post(gw.envoy.url + "/v1/completions", json=body)) for _ in gw.decodes]
        try:
            table = gw.picker.core.table
            await wait_for_async(
                lambda: _all_busy(table.states("decode")), message="one request in flight on each decode engine"
            )
            async with session.post(gw.envoy.url + "/v1/completions", json=body) as response:
                answer = await response.json()
                assert response.status == 429
            assert "in-flight limit" in answer["error"]["message"]
        finally:
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)


async def _all_busy(states: Any) -> bool:
    return all(state.in_flight == 1 for state in states)


async def test_streams_relay_every_chunk_and_the_picker_counts_them_until_they_end(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw, aiohttp.ClientSession() as session:
        assert gw.picker is not None
        table = gw.picker.core.table
        for decode in gw.decodes:
            await set_faults(decode.url, latency_s=1.0)  # every stream waits in its engine before its first token
        bodies = [{"model": "sim-model", "prompt": f"{i} {LONG}", "max_tokens": 16, "stream": True} for i in range(6)]

        async def one(body: dict[str, Any]) -> str:
            async with session.post(gw.envoy.url + "/v1/completions", json=body) as response:
                assert response.status == 200
                return await response.text()

        streams = asyncio.gather(*(one(body) for body in bodies))
        # Counted while they run (the load the scheduler scores), as the router counts its own.
        await wait_for_async(
            lambda: _in_flight(table, 6), message="the picker counted six streams in flight on decode engines"
        )
        texts = await streams
        assert all(text.count("data: {") == 16 and text.endswith("data: [DONE]\n\n") for text in texts)
        await wait_for_async(
            lambda: _released(table), message="the picker released every engine once the streams ended"
        )
        exposition = await scrape(f"http://127.0.0.1:{gw.picker.core.metrics_port}")
        assert metric_value(exposition, "pdserve_picker_picks_total", route="pd") == 6
        # The served endpoint is read back (Envoy's upstream.address attribute): every stream went to its pick.
        assert metric_value(exposition, "pdserve_picker_served_total", endpoint="pick") == 6


async def _in_flight(table: EndpointTable, count: int) -> bool:
    return sum(state.in_flight for state in table.states("decode")) == count


async def _released(table: Any) -> bool:
    return all(s.in_flight == 0 and s.in_flight_tokens == 0 for r in ("prefill", "decode") for s in table.states(r))


async def test_a_killed_decode_engine_is_ejected_and_never_picked_again(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw, aiohttp.ClientSession() as session:
        assert gw.picker is not None
        dead = gw.picker.core.table.states("decode")[0]
        await gw.servers[0].stop()  # the engine is gone; its sidecar still answers (it is another process in a pod)
        threshold = gw.picker.config.circuit_breaker.failure_threshold
        failures = 0
        # Unique prompts, so only load and chance choose between the two engines: send until the picker ejects the
        # dead one (bounded: each pick has even odds), then it must not be picked again.
        for index in range(60):
            if not dead.breaker.allows_traffic():
                break
            body = {"model": "sim-model", "prompt": f"{index} {SHORT}", "max_tokens": 2}
            async with session.post(gw.envoy.url + "/v1/completions", json=body) as response:
                failures += response.status != 200
        assert not dead.breaker.allows_traffic(), "the dead engine was never ejected"
        assert failures == threshold  # only the failures that feed the breaker reach clients
        served_before = await requests_seen(gw.decodes[1].url)
        for index in range(10):
            body = {"model": "sim-model", "prompt": f"after {index} {SHORT}", "max_tokens": 2}
            async with session.post(gw.envoy.url + "/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
        assert await requests_seen(gw.decodes[1].url) == served_before + 10


async def test_a_failing_prefill_engine_is_prefilled_locally_and_a_4xx_is_relayed(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw, aiohttp.ClientSession() as session:
        body = {"model": "sim-model", "prompt": LONG, "max_tokens": 4}
        await set_faults(gw.prefill.url, fail_next=1, fail_status=503)
        async with session.post(gw.envoy.url + "/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
            assert response.headers["X-Pdserve-Route"] == "fallback"
        await set_faults(gw.prefill.url, fail_next=1, fail_status=400)
        async with session.post(gw.envoy.url + "/v1/completions", json={**body, "prompt": "x " + LONG}) as response:
            assert response.status == 400, await response.text()
        assert await requests_seen(gw.prefill.url) == 2
        assert sum([await by_source(d.url, "external_kv_transfer") for d in gw.decodes]) == 0
