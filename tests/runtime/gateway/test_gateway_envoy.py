"""The gateway path on loopback: a real Envoy configured as a GIE gateway, pdserve's picker, PD sidecars, simulators.

Each decode engine and its sidecar share one loopback address (127.0.0.x), as an engine and its sidecar share a pod
IP; the picker's target port is the sidecars' port, as the InferencePool's targetPorts say.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from pdserve.api.router_config import PickerConfig, RouterConfig
from pdserve_dev.testing.envoy import EnvoyProcess, FailureMode, gateway_bootstrap, run_envoy
from pdserve_dev.testing.metrics import metric_value, scrape
from pdserve_dev.testing.net import free_port, free_ports
from pdserve_dev.testing.sim import SimHandle, requests_seen, sim_in_process
from pdserve_runtime.gateway.server import PickerApp, sidecar_app
from pdserve_runtime.router.app import RouterApp

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


@contextlib.asynccontextmanager
async def gateway(
    tmp_path: Path, *, failure_mode: FailureMode = "FailClose", picker: bool = True, **picker_settings: Any
) -> AsyncIterator[Gateway]:
    sidecar_port = free_port()
    async with contextlib.AsyncExitStack() as stack:
        prefill = await stack.enter_async_context(sim_in_process(role="prefill", host=PREFILL_HOST, side_channel_host=PREFILL_HOST))
        decodes = [await stack.enter_async_context(sim_in_process(role="decode", host=h)) for h in DECODE_HOSTS]
        sidecars = []
        for decode in decodes:
            config = RouterConfig(
                served_model_name="sim-model", discovery="static", static_decode=[decode.url],
                engine_metrics_interval_seconds=0.0,
            )  # fmt: skip
            app = sidecar_app(config)
            await app.start(decode.host, sidecar_port)
            stack.push_async_callback(app.stop)
            sidecars.append(app)
        grpc_port, http_port, listen, admin = free_ports(4)
        app_picker = None
        if picker:
            config = RouterConfig(
                served_model_name="sim-model",
                discovery="static",
                static_prefill=[prefill.url],
                static_decode=[d.url for d in decodes],
                engine_metrics_interval_seconds=0.0,
                picker=PickerConfig(grpc_port=grpc_port, target_port=sidecar_port, **picker_settings),
            )
            app_picker = PickerApp(config)
            await app_picker.start("127.0.0.1", grpc_port, http_port)
            stack.push_async_callback(app_picker.stop)
        bootstrap = gateway_bootstrap(
            listen=("127.0.0.1", listen),
            admin=("127.0.0.1", admin),
            picker=("127.0.0.1", grpc_port),
            pool=[(h, sidecar_port) for h in DECODE_HOSTS],
            failure_mode=failure_mode,
        )
        envoy = await stack.enter_async_context(run_envoy(bootstrap, tmp_path / "envoy"))
        yield Gateway(envoy, app_picker, prefill, decodes, sidecars)


async def test_long_prompts_take_pd_through_the_sidecar_and_short_ones_go_decode_only(tmp_path: Path) -> None:
    async with gateway(tmp_path) as gw, aiohttp.ClientSession() as session:
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
