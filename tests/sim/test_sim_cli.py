"""``pdserve sim`` as a subprocess: native flags, the ``serve MODEL`` drop-in form, vLLM's env variables."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from pdserve_dev.testing.net import free_port
from pdserve_dev.testing.sim import READY_PREFIX, set_faults, sim_process, wait_healthy
from pdserve_dev.testing.wait import wait_for_async

pytestmark = pytest.mark.timeout(60)

PDSERVE = str(Path(sys.executable).parent / "pdserve")


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


@contextlib.asynccontextmanager
async def pdserve(*args: str, env: dict[str, str] | None = None) -> AsyncIterator[tuple[dict[str, int], list[str]]]:
    """Run the real `pdserve` console script; yields its READY ports and (live) stderr lines."""
    import os

    proc = await asyncio.create_subprocess_exec(
        PDSERVE, *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    stderr: list[str] = []

    async def pump() -> None:
        assert proc.stderr is not None
        while line := await proc.stderr.readline():
            stderr.append(line.decode())

    pumper = asyncio.create_task(pump())
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(20):
            while True:
                line = (await proc.stdout.readline()).decode()
                assert line, f"pdserve sim exited: {''.join(stderr)}"
                if line.startswith(READY_PREFIX):
                    ready = json.loads(line[len(READY_PREFIX) :])
                    break
        yield ready, stderr
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        pumper.cancel()


async def state(http: aiohttp.ClientSession, url: str) -> dict[str, object]:
    async with http.get(url + "/sim/state") as resp:
        result: dict[str, object] = await resp.json()
        return result


async def test_native_flags(http: aiohttp.ClientSession) -> None:
    async with pdserve("sim", "--role", "decode", "--host", "127.0.0.1", "--port", "0", "--fast",
                       "--side-channel-port", "0", "--model", "m1", "--kv-compat-id", "abc") as (ready, _):  # fmt: skip
        url = f"http://127.0.0.1:{ready['http_port']}"
        await wait_healthy(url)
        st = await state(http, url)
        assert st["role"] == "decode" and st["model"] == "m1" and st["kv_compat_id"] == "abc"
        async with http.post(url + "/v1/completions", json={"model": "m1", "prompt": "hi", "max_tokens": 2}) as resp:
            assert resp.status == 200


async def test_vllm_serve_drop_in(http: aiohttp.ClientSession) -> None:
    side_port = free_port()
    ktc = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_producer", "engine_id": "prefill-abc",
                      "kv_buffer_device": "cuda", "kv_connector_extra_config": {"kv_lease_duration": 12}})  # fmt: skip
    env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_port), "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.1.2.3",
           "PDSERVE_KV_COMPAT": "compat-1", "PDSERVE_SIM_FAST": "1"}  # fmt: skip
    args = ["sim", "serve", "org/Model-8B", "--host", "127.0.0.1", "--port", "0", "--kv-transfer-config", ktc,
            "--tensor-parallel-size", "2", "--max-model-len", "4096", "--block-size", "16",
            "--served-model-name", "model-a", "--enforce-eager", "--gpu-memory-utilization", "0.9",
            "--disable-log-requests"]  # fmt: skip
    async with pdserve(*args, env=env) as (ready, stderr):
        assert ready["side_channel_port"] == side_port
        url = f"http://127.0.0.1:{ready['http_port']}"
        await wait_healthy(url)
        st = await state(http, url)
        assert st["role"] == "prefill" and st["engine_id"] == "prefill-abc" and st["kv_compat_id"] == "compat-1"
        async with http.get(url + "/v1/models") as resp:
            model = (await resp.json())["data"][0]
        assert model["id"] == "model-a" and model["root"] == "org/Model-8B" and model["max_model_len"] == 4096
        body = {"model": "model-a", "prompt": "hello " * 40, "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}  # fmt: skip
        async with http.post(url + "/v1/completions", json=body) as resp:
            params = (await resp.json())["kv_transfer_params"]
        assert params["remote_host"] == "10.1.2.3" and params["remote_port"] == side_port
        assert params["remote_engine_id"] == "prefill-abc" and params["tp_size"] == 2
        assert len(params["remote_block_ids"][0]) == 3  # 40 tokens in blocks of 16
        logged = "".join(stderr)
        assert "--enforce-eager --gpu-memory-utilization 0.9 --disable-log-requests" in logged


async def test_image_style_arguments_without_serve(http: aiohttp.ClientSession) -> None:
    # The vllm/vllm-openai image's entrypoint is `vllm serve`, so pod args start with the model.
    ktc = '{"kv_connector":"NixlConnector","kv_role":"kv_consumer"}'
    async with pdserve("sim", "my-model", "--port", "0", "--host", "127.0.0.1", "--kv-transfer-config", ktc,
                       env={"VLLM_NIXL_SIDE_CHANNEL_PORT": "0"}) as (ready, _):  # fmt: skip
        url = f"http://127.0.0.1:{ready['http_port']}"
        await wait_healthy(url)
        st = await state(http, url)
        assert st["role"] == "decode" and st["model"] == "my-model"


async def test_bind_host_env_moves_both_listeners(http: aiohttp.ClientSession) -> None:
    env = {"PDSERVE_BIND_HOST": "127.0.0.7"}
    async with sim_process(role="prefill", fast=True, host="0.0.0.0", env=env) as sim:
        assert sim.host == "127.0.0.7"
        body = {"prompt": "x y z", "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        async with http.post(sim.url + "/v1/completions", json=body) as resp:
            params = (await resp.json())["kv_transfer_params"]
        assert params["remote_host"] == "127.0.0.7"
        _reader, writer = await asyncio.open_connection("127.0.0.7", sim.side_channel_port)
        writer.close()
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", sim.side_channel_port)


async def test_bad_flags_fail_clearly() -> None:
    proc = await asyncio.create_subprocess_exec(
        PDSERVE, "sim", "--preset", "nope", "--port", "0", stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    assert proc.returncode == 2 and b"unknown preset" in err


async def test_startup_delay_keeps_the_port_closed_while_loading() -> None:
    import time

    started = time.monotonic()
    async with sim_process(fast=True, startup_delay=0.5) as sim:
        assert time.monotonic() - started >= 0.5
        assert sim.http_port > 0


async def test_serve_help_prints_instead_of_serving() -> None:
    proc = await asyncio.create_subprocess_exec(PDSERVE, "sim", "serve", "--help", stdout=asyncio.subprocess.PIPE)
    out, _ = await asyncio.wait_for(proc.communicate(), 20)
    assert proc.returncode == 0 and b"Drop-in for `vllm serve`" in out


@pytest.mark.parametrize("shutdown_timeout", [0, 30])
async def test_sigterm_aborts_or_drains_in_flight_requests(http: aiohttp.ClientSession, shutdown_timeout: int) -> None:
    import signal

    async with sim_process(preset="cpu-tiny-shared", shutdown_timeout=shutdown_timeout) as sim:
        if shutdown_timeout:
            # Both requests hold after 3 tokens until the test lets them go, so the drain lasts as long as the checks
            # below take, however loaded the machine (a drain of ~0.5 s of tokens could end, and the process exit,
            # before a busy test sent its refused request).
            await set_faults(sim.url, stall_after_tokens=3)
        body = {"prompt": "drain me", "max_tokens": 40, "stream": True}
        unary = asyncio.create_task(http.post(sim.url + "/v1/completions", json=dict(body, stream=False)))
        async with http.post(sim.url + "/v1/completions", json=body) as resp:
            await resp.content.readuntil(b"\n\n")
            sim.process.send_signal(signal.SIGTERM)
            if shutdown_timeout:
                # Draining starts when the signal is handled, which /health shows: then new work is refused.
                async def draining() -> bool:
                    async with http.get(sim.url + "/health") as health:
                        return health.status == 503

                await wait_for_async(draining, within=10, message="the simulator to start draining")
                async with http.post(sim.url + "/v1/completions", json=body) as refused:
                    assert refused.status == 503
                assert not unary.done() and sim.process.returncode is None
                await set_faults(sim.url, stall_after_tokens=None)  # /sim/ paths answer while draining
            raw = (await resp.read()).decode()
        assert raw.endswith("data: [DONE]\n\n")
        reason = '"finish_reason":"length"' if shutdown_timeout else '"finish_reason":"abort"'
        assert reason in raw
        finished = await unary
        data = await finished.json()
        assert data["choices"][0]["finish_reason"] == ("length" if shutdown_timeout else "abort")
        assert await asyncio.wait_for(sim.process.wait(), 10) == 0
