"""Content codings between client, router and engines.

- Compressed request bodies are refused (415) before any engine sees them: inflating them would cost the router
  CPU a client controls (a 1 MB gzip bomb took 1.4 s before its 413), and forwarding the header with a body the
  router decoded once made engines answer 500, which ejected healthy engines.
- Engines are asked for identity answers: the router parses prefill answers and relays decode bytes as they are,
  so a compressing engine's bytes must never reach the client undecodable.
"""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from pdserve.api.router_config import RouterConfig
from pdserve_dev.testing.metrics import metric_value
from pdserve_dev.testing.sim import requests_seen, sim_in_process

pytestmark = pytest.mark.timeout(60)

LONG = "The history of the river valley settlements began with small farms. " * 30  # ~ 360 tokens
SHORT = "Say hi."
KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p", "remote_block_ids": [[1]]}


@asynccontextmanager
async def compressing_engine(seen: list[dict[str, Any]]) -> AsyncIterator[str]:
    """A minimal OpenAI-ish engine that compresses every answer whenever the request allows it (aiohttp's
    `enable_compression` honours Accept-Encoding), and records each request's headers and body."""

    async def completions(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        seen.append({"headers": dict(request.headers), "body": body})
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):
            answer: dict[str, Any] = {"choices": [{"text": "x"}], "kv_transfer_params": KV}
        else:
            answer = {"choices": [{"text": "hello " * 40}], "kv_transfer_params": None}
        response = web.json_response(answer)
        response.enable_compression()
        return response

    async def models(_request: web.Request) -> web.StreamResponse:
        response = web.json_response({"object": "list", "data": [{"id": "m" * 200, "object": "model"}]})
        response.enable_compression()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("coding", ["gzip", "deflate", "br", "gzip, identity"])
@pytest.mark.parametrize("body", ["valid", "not actually compressed"])
async def test_a_compressed_request_body_is_refused_before_any_engine_sees_it(
    router_server: Any, make_config: Callable[..., RouterConfig], coding: str, body: str
) -> None:
    async with sim_in_process(role="prefill") as p, sim_in_process(role="decode") as d:
        async with router_server(make_config([p.url], [d.url])) as (url, router), aiohttp.ClientSession() as session:
            plain = orjson.dumps({"model": "sim-model", "prompt": LONG, "max_tokens": 2})
            raw = gzip.compress(plain) if body == "valid" else plain
            headers = {"Content-Encoding": coding, "Content-Type": "application/json"}
            async with session.post(url + "/v1/completions", data=raw, headers=headers) as response:
                assert response.status == 415
                error = (await response.json())["error"]
            async with session.get(router.metrics_url + "/metrics") as response:
                exposition = await response.text()
        assert error["type"] == "UnsupportedMediaTypeError"
        assert "identity" in error["message"]
        assert await requests_seen(p.url) == await requests_seen(d.url) == 0
        assert metric_value(exposition, "pdserve_router_endpoint_errors_total") == 0


async def test_compressing_engines_do_not_reach_the_client_compressed(
    router_server: Any, make_config: Callable[..., RouterConfig]
) -> None:
    seen: list[dict[str, Any]] = []
    async with compressing_engine(seen) as p, compressing_engine(seen) as d:
        # No configured model name: /v1/models is relayed from a decode engine.
        config = make_config([p], [d], disaggregation_threshold_tokens=0).model_copy(update={"served_model_name": ""})
        async with router_server(config) as (url, _), aiohttp.ClientSession(auto_decompress=False) as session:
            body = {"model": "m", "prompt": SHORT, "max_tokens": 2}
            async with session.post(url + "/v1/completions", json=body) as response:
                raw = await response.read()
                assert response.status == 200
                assert response.headers["X-Pdserve-Route"] == "pd"  # the prefill answer was readable
                assert "Content-Encoding" not in response.headers
            assert orjson.loads(raw)["choices"][0]["text"].startswith("hello")
            async with session.get(url + "/v1/models") as response:
                raw = await response.read()
                assert response.status == 200
            assert orjson.loads(raw)["data"][0]["id"] == "m" * 200
    prefill, decode = seen
    assert prefill["body"]["kv_transfer_params"]["do_remote_decode"] is True
    assert decode["body"]["kv_transfer_params"] == KV
    for request in seen:
        assert request["headers"].get("Accept-Encoding", "identity") == "identity"
